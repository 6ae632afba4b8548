"""Statistics of a gradient, shared by both wings (a YAML spec's and a Keras model's): its
norms, and the vanishing/exploding flag of a profile over time."""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.dynamics import FLOW_FACTOR, flow_kind
from gradscope.report.models import FlowFlag, PerExampleNorms, Stats

__all__ = ["FLOW_FACTOR", "MAP_ROWS", "carried_flag", "flow_flags", "map_rows",
           "per_example_norms", "stats"]

#: Rows t of the influence map (``--plot``): at most this many evenly spaced, beside ``--at``
#: (a YAML spec's takes one backward pass per row and unit of its last layer).
MAP_ROWS = 16


def map_rows(steps: int, at: int | None = None) -> list[int]:
    """The steps t whose ‖∂h_t/∂x_s‖ the influence map shows: up to :data:`MAP_ROWS` evenly
    spaced from the first step to the last, and the step ``--at`` names among them (the
    influence the text shows is then a row of the map)."""
    rows = {int(r) for r in np.linspace(0, steps - 1, min(MAP_ROWS, steps))}
    if at is not None:
        rows.add(int(at))
    return sorted(rows)


def stats(values: np.ndarray) -> Stats:
    """L2 norm, mean |g| and max |g| over the finite entries, and the count of the others;
    None where no entry is finite (found tried as a new user would: a gradient all NaN read
    ‖g‖₂ 0, as if it were zero)."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    finite = np.isfinite(flat)
    kept = np.abs(flat[finite])
    if flat.size and not kept.size:
        return Stats(l2=None, mean_abs=None, max_abs=None, nonfinite=int(flat.size))
    return Stats(
        l2=float(np.sqrt(np.sum(kept * kept))),
        mean_abs=float(kept.mean()) if kept.size else 0.0,
        max_abs=float(kept.max()) if kept.size else 0.0,
        nonfinite=int(flat.size - kept.size),
    )


def per_example_norms(gradient: np.ndarray) -> PerExampleNorms:
    """Min, median and max over the batch (axis 0) of each example's L2 norm, over its finite
    entries (as :func:`stats` counts them: a NaN made the three NaN, which JSON cannot
    hold)."""
    flat = np.asarray(gradient, np.float64).reshape(len(gradient), -1)
    flat = np.where(np.isfinite(flat), flat, 0.0)
    norms = np.sqrt(np.sum(flat * flat, axis=1))
    return PerExampleNorms(min=float(np.min(norms)), median=float(np.median(norms)),
                           max=float(np.max(norms)))


def carried_flag(what: str, ratio: float | None, span: str, states: list[str] | None = None,
                 note: str = "") -> FlowFlag | None:
    """A recurrent layer's flag, by how much of ∂L/∂h its recurrence carries back
    (``ratio``) beyond FLOW_FACTOR either way (:func:`gradscope.dynamics.flow_kind`, the rule
    diagnose reads its own flow by), as both wings say it: ``span`` the steps it is carried
    over, ``states`` the names of the states the ratio joins (said where more than one: an
    LSTM's h and c), ``note`` what the ratio rests on; None where it is within the factor
    (or there is none)."""
    kind = flow_kind(ratio)
    if kind is None:
        return None
    assert ratio is not None
    joined = ("" if not states or len(states) < 2 else
              f" on {', '.join(states[:-1])} and {states[-1]} together")
    kept = (f"keeps {ratio:.2e} × the norm it started with" if ratio > 0 else
            "keeps nothing of the norm it started with (it rounds to 0 on the way, below the "
            "smallest number the layer's dtype holds)")
    return FlowFlag(what=what, kind=kind, ratio=ratio,
                    message=f"{what}: carried back through the recurrence {span}, the "
                            f"gradient{joined} {kept}{note}: {kind} gradients (flagged beyond "
                            f"a factor {FLOW_FACTOR:g}); gradscope diagnose says why")


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
