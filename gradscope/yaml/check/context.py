"""What every witness of a YAML spec's check works from.

A witness is an independent way of knowing a gradient: finite differences, the NumPy
reference, TF's GRUBlockCellGrad kernel, the truncated-BPTT carry, the user's own backward.
Each one compares its evidence with TF autodiff and returns one
:class:`~gradscope.gradcheck.WitnessResult` per tensor it looked at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope.gradcheck import tolerance
from gradscope.timing import Progress
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.data import Batch
from gradscope.yaml.engine import Engine, Pass


@dataclass
class CheckContext:
    """Everything a witness needs. Built once by :func:`gradscope.yaml.check.check`.

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
        return tolerance(witness, dtype).rtol

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
