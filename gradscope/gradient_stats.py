"""Statistics of a gradient, shared by both wings (a YAML spec's and a Keras model's): its
norms, and the vanishing/exploding flag of a profile over time."""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.dynamics import FLOW_FACTOR, flow_kind
from gradscope.report.models import FlowFlag, PerExampleNorms, Stats

__all__ = ["FLOW_FACTOR", "flow_flags", "per_example_norms", "stats"]


def stats(values: np.ndarray) -> Stats:
    """L2 norm, mean |g| and max |g| over the finite entries, and the count of the others."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    finite = np.isfinite(flat)
    kept = np.abs(flat[finite])
    return Stats(
        l2=float(np.sqrt(np.sum(kept * kept))),
        mean_abs=float(kept.mean()) if kept.size else 0.0,
        max_abs=float(kept.max()) if kept.size else 0.0,
        nonfinite=int(flat.size - kept.size),
    )


def per_example_norms(gradient: np.ndarray) -> PerExampleNorms:
    """Min, median and max over the batch (axis 0) of each example's L2 norm."""
    flat = np.asarray(gradient, np.float64).reshape(len(gradient), -1)
    norms = np.sqrt(np.sum(flat * flat, axis=1))
    return PerExampleNorms(min=float(np.min(norms)), median=float(np.median(norms)),
                           max=float(np.max(norms)))


def flow_flags(sequences: dict[str, Any]) -> list[FlowFlag]:
    """Vanishing/exploding flags: norm at t=0 over the norm at t=T−1 beyond FLOW_FACTOR
    (:func:`gradscope.dynamics.flow_kind`)."""
    flags = []
    for what, norms in sequences.items():
        if len(norms) < 2 or norms[-1] == 0:
            continue
        ratio = float(norms[0] / norms[-1])
        kind = flow_kind(ratio)
        if kind is not None:
            flags.append(FlowFlag(
                what=what, kind=kind, ratio=ratio,
                message=f"{what} is {ratio:.2e} × as large at t=0 as at t={len(norms) - 1}: "
                        f"{kind} gradients (flagged beyond a factor {FLOW_FACTOR:g})",
            ))
    return flags
