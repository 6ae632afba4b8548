"""The numbers a run works on: initial weights and the (synthetic) batch.

Everything is drawn with NumPy from the spec's seed, so the TF engine, the NumPy reference and
repeated runs all see exactly the same values. Weights are rounded to the model's dtype once,
here: a float64 copy of a float32 model then has *the same* weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradscope.cells.base import glorot_uniform
from gradscope.shapes import ModelShapes


@dataclass(frozen=True)
class Batch:
    """Inputs ``x`` (B, T, F), targets ``y`` (B, T, L) or (B, L), and initial states by name."""

    x: np.ndarray
    y: np.ndarray
    initial_states: dict[str, np.ndarray] = field(default_factory=dict)
    source: str = "synthetic"

    def astype(self, dtype: str) -> Batch:
        return Batch(
            x=self.x.astype(dtype),
            y=self.y.astype(dtype),
            initial_states={k: v.astype(dtype) for k, v in self.initial_states.items()},
            source=self.source,
        )


def initial_params(shapes: ModelShapes) -> dict[str, np.ndarray]:
    """Deterministic initial weights keyed by gradscope name (``gru_1/w_ru``), in the spec dtype."""
    spec = shapes.spec
    rng = np.random.default_rng([spec.seed, 0])
    params: dict[str, np.ndarray] = {}
    for cell in shapes.cells:
        for short, value in cell.init_params(rng).items():
            params[f"{cell.name}/{short}"] = value
    for layer in shapes.dense:
        params[f"{layer.name}/kernel"] = glorot_uniform(rng, (layer.input_size, layer.units))
        params[f"{layer.name}/bias"] = np.zeros(layer.units)
    return {name: value.astype(spec.dtype) for name, value in params.items()}


def synthetic_batch(shapes: ModelShapes) -> Batch:
    """x standard normal; targets one-hot random classes (softmax CE) or standard normal (mse);
    initial states zeros."""
    spec = shapes.spec
    rng = np.random.default_rng([spec.seed, 1])
    x = rng.standard_normal((spec.batch_size, spec.time_steps, spec.input_size))
    target_shape = shapes.output_shape
    if spec.loss == "softmax_cross_entropy":
        classes = rng.integers(0, spec.output_size, size=target_shape[:-1])
        y = np.eye(spec.output_size)[classes]
    else:
        y = rng.standard_normal(target_shape)
    states = {info.name: np.zeros(info.shape) for info in shapes.states}
    return Batch(x=x, y=y, initial_states=states, source=f"synthetic (seed {spec.seed})").astype(
        spec.dtype
    )
