"""What every witness of ``gradscope check`` works from, and what it returns.

A witness is an independent way of knowing a gradient: finite differences, the NumPy
reference, TF's GRUBlockCellGrad kernel, the truncated-BPTT carry, the user's own backward.
Each one compares its evidence with TF autodiff and returns one :class:`WitnessResult` per
tensor it looked at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope.report.models import CheckedTensor, WitnessEntry
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.data import Batch
from gradscope.yaml.engine import Engine, Pass

Progress = Callable[[str], None]

#: Relative tolerances by witness and by the dtype the witness computes in. The float64
#: witnesses compare two float64 computations; the kernel witness is float32 by nature
#: (GRUBlockCellGrad has no float64 kernel). jax's check_grads uses 1e-5 (float64) and 2e-3
#: (float32) for finite differences; exact-arithmetic witnesses can be held much tighter.
TOLERANCES: dict[str, dict[str, float]] = {
    "finite_differences": {"float64": 1e-5, "float32": 2e-3},
    "numpy_reference": {"float64": 1e-9, "float32": 1e-4},
    "gru_block_kernel": {"float64": 1e-9, "float32": 2e-3},
    "tbptt_carry": {"float64": 1e-9, "float32": 1e-4},
    "against": {"float64": 1e-6, "float32": 1e-4},
}


@dataclass(frozen=True)
class WitnessResult:
    """One witness's verdict on one tensor.

    ``error`` is a relative error (the witness says how it normalises); ``passed`` is
    ``error <= tolerance`` unless the witness found something worse (a wrong shape, a missing
    tensor), in which case ``error`` may be ``None`` and ``detail`` says what.
    """

    witness: str
    tensor: str
    error: float | None
    tolerance: float
    passed: bool
    detail: str = ""
    #: For time-indexed tensors: the first step, counting back from the end, that diverges.
    first_bad_step: int | None = None


@dataclass
class CheckContext:
    """Everything a witness needs. Built once by :func:`gradscope.witnesses.check`.

    - ``params`` and ``batch`` are the float64 copy of the model's weights and batch (the same
      values as the model's own dtype, widened).
    - ``autodiff`` is TF autodiff on that float64 copy, with per-step sequences and total
      ∂L/∂h_t (``autodiff.sequences``, ``autodiff.sequence_gradients``).
    - ``engine`` is the float64 TF engine (``engine.tf`` is TensorFlow).
    """

    shapes: ModelShapes
    params: dict[str, np.ndarray]
    batch: Batch
    engine: Engine
    autodiff: Pass
    rtol: dict[str, float] = field(default_factory=dict)
    atol: float | None = None
    directions: int = 3
    progress: Progress = field(default=lambda message: None)
    #: What a witness computes once per check and keeps (e.g. the known wrong gradients).
    memo: dict[str, Any] = field(default_factory=dict)

    def tolerance(self, witness: str, dtype: str = "float64") -> float:
        if witness in self.rtol:
            return self.rtol[witness]
        return TOLERANCES[witness][dtype]

    def autodiff_gradients(self) -> dict[str, np.ndarray]:
        """Every autodiff gradient by name: the weights, the initial states and ``x``."""
        out: dict[str, np.ndarray] = {}
        for source in (self.autodiff.weight_gradients, self.autodiff.state_gradients):
            out.update({name: value for name, value in source.items() if value is not None})
        if self.autodiff.input_gradient is not None:
            out["x"] = self.autodiff.input_gradient
        return out

    @property
    def tf(self) -> Any:
        return self.engine.tf


def relative_error(value: np.ndarray, expected: np.ndarray) -> float:
    """‖value − expected‖₂ / ‖expected‖₂ (or the absolute norm when ``expected`` is zero)."""
    value = np.asarray(value, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = float(np.linalg.norm(expected))
    difference = float(np.linalg.norm(value - expected))
    return difference / scale if scale > 0 else difference


def checked_tensors(results: list[WitnessResult], order: list[str],
                    shapes: dict[str, list[int]], prefix: str = "") -> list[CheckedTensor]:
    """One report row per tensor: those named in ``order`` first, in that order, then any
    others, each with its witnesses. A non-finite error is reported as none (JSON has no
    NaN). ``prefix`` goes before each name (a layer's, for ``check --layer``)."""
    by_name: dict[str, list[WitnessResult]] = {}
    for result in results:
        by_name.setdefault(result.tensor, []).append(result)
    names = [n for n in order if n in by_name] + [n for n in by_name if n not in order]
    return [
        CheckedTensor(
            name=f"{prefix}{name}", shape=shapes.get(name),
            passed=all(r.passed for r in by_name[name]),
            witnesses=[
                WitnessEntry(witness=r.witness, error=_finite(r.error), tolerance=r.tolerance,
                             passed=r.passed, detail=r.detail, first_bad_step=r.first_bad_step)
                for r in by_name[name]
            ],
        )
        for name in names
    ]


def _finite(value: float | None) -> float | None:
    return None if value is None or not np.isfinite(value) else float(value)
