"""The precision check works in: the float64 copy of the model, or the model's own dtype where
the user's code does not really run in float64 (a sub-layer left in float32, a loss that
computes in float32, a copy Keras cannot rebuild). Each dtype has its step for the central
differences and its tolerances (:mod:`gradscope.gradcheck`):
in float32 the loss's rounding, amplified by 1/step, is what a difference can resolve, so the
step is larger and the tolerance looser, and the report says which it could afford.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope.gradcheck import rounding_noise, step_for
from gradscope.keras.check.probing import Probing


def not_in_dtype(model: Any, calls: list[Any], dtype: str) -> str | None:
    """Where a copy of the model rebuilt in ``dtype`` does not compute in it: weights left in
    another float dtype (a sub-layer the user's code makes with ``dtype="float32"``), and layer
    calls that return another float dtype. None where everything is ``dtype``."""
    weights = [v.path for v in model.weights if _is_other_float(v.dtype, dtype)]
    outputs = sorted({call.layer for call in calls for tensor in call.outputs
                      if _is_other_float(getattr(tensor, "dtype", None), dtype)})
    found = []
    if weights:
        found.append(f"the weight{'s' if len(weights) > 1 else ''} {_listed(weights)} "
                     f"{'stay' if len(weights) > 1 else 'stays'} in another dtype (a sub-layer "
                     "your code makes with a dtype of its own)")
    if outputs:
        found.append(f"layer{'s' if len(outputs) > 1 else ''} {_listed(outputs)} "
                     f"return{'' if len(outputs) > 1 else 's'} another dtype")
    return f"in its {dtype} copy, {' and '.join(found)}" if found else None


def coarse_loss(loss_along: Callable[[float], float], loss: float) -> str | None:
    """Whether the loss of a float64 copy really resolves float64 steps. Central differences
    of the loss along one random direction of the weights, at steps 1e-4 and 1e-8, agree to
    ~1e-6 in float64 (rounding ~1e-16 of the loss, over 1e-8), kinks and all: both straddle
    the same corner. Where the loss curves within 1e-4 (a chaotic trajectory, whose gradient
    is large), the slope at 1e-6 stands in for 1e-4's: still far above float32's rounding
    (~6e-8 of the loss, over 1e-6: 3e-2 of it), it is the tangent's there. Where code inside
    the model or its loss computes in float32, the loss moves in steps of ~6e-8 of itself,
    and the slope at 1e-8 is that rounding (3 times the loss), which neither larger step
    shares. No gradient enters the comparison, so a wrong one cannot pass for low precision.
    ``loss_along(h)``: the loss with the weights moved by ``h`` along the direction."""

    def slope(step: float) -> float:
        return (loss_along(step) - loss_along(-step)) / (2 * step)

    small = 1e-8
    slope_small = slope(small)
    slopes = []
    for large in (1e-4, 1e-6):
        slopes.append(slope(large))
        allowed = 1e-2 * abs(slopes[-1]) + 100 * float(rounding_noise(loss, small))
        if abs(slope_small - slopes[-1]) <= allowed:
            return None
    # Curved within 1e-6 too: float64 resolves the slope if a tenth of the small step gives
    # the same, nonzero (float32's rounding would be ten times as large there, 30 times the
    # loss: only a slope above 3000 times the loss could hide it, which the finite
    # differences then resolve in float64 too).
    smaller = slope(small / 10)
    if slope_small != 0 and abs(smaller - slope_small) <= 1e-2 * abs(slope_small):
        return None
    # Slopes far above what float32's rounding makes at these steps (about 3 times the loss
    # at 1e-8, 30 at 1e-9) are no rounding: the loss curves at every step (a chaotic
    # trajectory), and the finite differences say which of their probes do not settle.
    # Found tried as a new user would: a cell at 6× an orthogonal kernel was checked in
    # float32, "computes in a lower precision", its slopes 1e3, 9e5 and 1e7.
    if min(abs(slope_small), abs(smaller)) > 3e4 * max(abs(loss), 1.0):
        return None
    return (f"its float64 copy's loss does not resolve float64 steps (along a random direction "
            f"of the weights its slope is {slopes[0]:.6e} at a step of 1e-4, {slopes[1]:.6e} at "
            f"1e-6 and {slope_small:.6e} at 1e-8), so code inside the model or its loss "
            "computes in a lower precision (a float32 constant or cast, keras.ops.ctc_loss)")


def measured_rounding(loss_along: Callable[[float], float], dtype: str) -> float:
    """The rounding of the loss in the model's own dtype, relative to max(|loss|, 1), as
    :func:`~gradscope.gradcheck.rounding_noise` takes it: measured, not
    assumed. The loss is taken at six points within 1e-4 along one direction of the weights,
    where its change is linear to far below its rounding; what is left once the line through
    the central difference at the check's step is taken away is rounding, and twice the
    largest of it is what a difference may lose to it. A fixed bound (64 epsilons, right for
    float64) would in float32 allow errors of several times the gradient on a loss of 25 (a
    CTC loss): a wrong gradient would pass."""
    step = step_for(dtype)
    base = loss_along(0.0)
    slope = (loss_along(step) - loss_along(-step)) / (2 * step)
    residues = [abs(loss_along(h) - base - h * slope)
                for h in (-1e-4, -5e-5, -2.5e-5, 2.5e-5, 5e-5, 1e-4)]
    scale = max(abs(base), 1.0)
    return max(2 * max(residues) / scale, 4 * float(np.finfo(dtype).eps))


def loss_along(probing: Probing) -> Callable[[float], float]:
    """The loss of Keras' own call with every trainable weight moved by ``h`` along one
    random unit direction (for :func:`coarse_loss`, :func:`measured_rounding` and
    :func:`~gradscope.gradcheck.small_loss_rounding`)."""
    tf, model = probing.tf, probing.engine.model
    feed, y = probing.tensors()
    variables = list(model.trainable_variables)
    bases = [np.array(v.numpy()) for v in variables]
    rng = np.random.default_rng([probing.seed, 5])
    draws = [rng.standard_normal(base.shape) for base in bases]
    norm = float(np.sqrt(sum(float(np.sum(d * d)) for d in draws))) or 1.0

    @tf.function(reduce_retracing=True)
    def evaluate(feed: list[Any]) -> Any:
        return probing.keras_loss(feed, y)

    def along(h: float) -> float:
        probing.restore()
        try:
            for variable, base, draw in zip(variables, bases, draws, strict=True):
                variable.assign(base + h * draw / norm)
            return float(evaluate(feed).numpy())
        finally:
            for variable, base in zip(variables, bases, strict=True):
                variable.assign(base)

    return along


def _is_other_float(found: Any, dtype: str) -> bool:
    name = str(getattr(found, "name", found))
    return "float" in name and name != dtype


def _listed(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
