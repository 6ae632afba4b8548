"""The numbers a run works on: initial weights and the (synthetic) batch.

Everything is drawn with NumPy from the spec's seed, so the TF engine, the NumPy reference and
repeated runs all see exactly the same values. Weights are rounded to the model's dtype once,
here: a float64 copy of a float32 model then has *the same* weights.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gradscope.arrays import check_data_files, check_numeric, load_npy, read_npz
from gradscope.cells.base import glorot_uniform
from gradscope.errors import DataError
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.config import Spec


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


# -- supplied batches -------------------------------------------------------------------------


def load_batch(spec: Spec, data: str | os.PathLike[str] | None = None,
               x: str | os.PathLike[str] | None = None,
               y: str | os.PathLike[str] | None = None) -> tuple[Spec, Batch]:
    """A user's batch: ``data`` (an .npz with x, y and optionally initial states such as
    ``gru_1/h0``) or ``x`` and ``y`` (.npy files).

    The batch and time sizes come from the data: the returned spec carries them. Every
    mismatch is a one-line :class:`DataError` in the user's terms. Arrays are loaded with
    ``allow_pickle=False``.
    """
    check_data_files(data, x, y)
    if data is not None:
        arrays = read_npz(data)
        origin = str(data)
    else:
        assert x is not None and y is not None
        arrays = {"x": load_npy(Path(x), "x"), "y": load_npy(Path(y), "y")}
        origin = f"{x} and {y}"
    return validate_batch(spec, arrays, origin)




def validate_batch(spec: Spec, arrays: dict[str, np.ndarray],
                   origin: str = "the data") -> tuple[Spec, Batch]:
    """Check supplied arrays against the spec; return the spec resized to them and the batch.
    Each error names where the arrays came from (found tried as a new user would: "x has 4
    features per step…" named no file, where a missing array's error did)."""
    try:
        return _validated(spec, arrays, origin)
    except DataError as error:
        if origin == "the data" or error.message.startswith(f"{origin}:"):
            raise
        raise DataError(f"{origin}: {error.message}", where=error.where) from None


def _validated(spec: Spec, arrays: dict[str, np.ndarray],
               origin: str) -> tuple[Spec, Batch]:
    for name in ("x", "y"):
        if name not in arrays:
            found = ", ".join(sorted(arrays)) or "no arrays"
            raise DataError(
                f"{origin}: has no array '{name}' (found {found}); expected x, y and optionally "
                "initial states such as gru_1/h0",
                where=name,
            )
    for name, value in arrays.items():
        check_numeric(name, value)
    x = arrays["x"]
    if x.ndim != 3:
        raise DataError(
            f"x has {x.ndim} dimensions {x.shape}; expected 3: (batch, time, features) with "
            f"features = input_size {spec.input_size}",
            where="x",
        )
    batch_size, time_steps, features = x.shape
    if features != spec.input_size:
        raise DataError(
            f"x has {features} features per step but the config says input_size "
            f"{spec.input_size}",
            where="x",
        )
    if batch_size == 0 or time_steps == 0:
        raise DataError(f"x has shape {x.shape}; expected at least one example and one step",
                        where="x")
    resized = spec.model_copy(update={"batch_size": batch_size, "time_steps": time_steps})
    from gradscope.yaml.algebra import model_shapes

    shapes = model_shapes(resized)
    y = arrays["y"]
    expected_y = shapes.output_shape
    last = spec.layers[-1]
    if y.shape != expected_y:
        axes = ["batch", "time", "outputs"] if len(expected_y) == 3 else ["batch", "outputs"]
        if y.ndim != len(expected_y):
            raise DataError(
                f"y has {y.ndim} dimensions {y.shape}; expected {len(expected_y)}: "
                f"({', '.join(axes)}) = {expected_y}"
                + ("" if spec.sequence_output else " (return_sequences is false)"),
                where="y",
            )
        for axis, (found, wanted) in enumerate(zip(y.shape, expected_y, strict=True)):
            if found != wanted:
                source = (f"{last.name} has {wanted} units" if axis == len(expected_y) - 1
                          else f"x has {wanted}")
                raise DataError(
                    f"y has {found} along its {axes[axis]} axis (dimension {axis}) but "
                    f"{source}; expected y of shape {expected_y}",
                    where="y",
                )
    if spec.loss == "softmax_cross_entropy":
        _check_targets(y)
    states: dict[str, np.ndarray] = {}
    known = {info.name: info for info in shapes.states}
    for name, value in arrays.items():
        if name in ("x", "y"):
            continue
        info = known.get(name)
        if info is None:
            hint = difflib.get_close_matches(name, list(known), n=1)
            did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise DataError(
                f"{origin}: unknown array '{name}'{did_you_mean}; expected x, y and initial "
                f"states among {', '.join(known)}",
                where=name,
            )
        if value.shape != info.shape:
            raise DataError(
                f"{name} has shape {value.shape}; expected {info.shape} = {info.formula}",
                where=name,
            )
        states[name] = value
    for info in shapes.states:
        states.setdefault(info.name, np.zeros(info.shape))
    batch = Batch(x=x, y=y, initial_states=states, source=f"supplied ({origin})")
    return resized, batch.astype(spec.dtype)




def _check_targets(y: np.ndarray) -> None:
    """softmax_cross_entropy needs one-hot or probability rows (TF's gradient assumes it)."""
    if (y < 0).any():
        index = tuple(int(i) for i in np.argwhere(y < 0)[0])
        raise DataError(
            f"y has a negative value ({y[index]}) at index {index}; softmax_cross_entropy "
            "expects one-hot or probability targets",
            where="y",
        )
    sums = y.sum(axis=-1)
    off = np.abs(sums - 1.0) > 1e-6
    if off.any():
        index = tuple(int(i) for i in np.argwhere(off)[0])
        raise DataError(
            f"y at {index} sums to {sums[index]:.6g}; softmax_cross_entropy expects each "
            "target row to sum to 1 (one-hot or probabilities)",
            where="y",
        )







