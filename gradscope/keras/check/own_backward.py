"""Which layer's backward is wrong: each layer call on its own, named even where it has no
weights.

A wrong gradient inside a layer without weights (a layer of your own with a
``tf.custom_gradient``, say) shows in check at the tensors below it: the weights of the layers
that feed it, the input. So when check finds a gradient wrong, it also takes every layer call
of one float tensor on its own: the tape's vector-Jacobian product of the layer, at the input
the call received and for a random cotangent on its output, against central differences of
the layer alone along a random direction of that input. A call whose backward disagrees is
named (``layer NAME``), with both numbers and the factor between them. Non-trainable state
(dropout seeds, batch-norm statistics) is restored before every evaluation, so each sees the
same layer; a disagreement that fades at a 100× smaller step (a kink) is not reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope.gradcheck import Probe, directional_error, retake_for, rounding_of, step_for
from gradscope.keras.engine import CapturedCall, call_label
from gradscope.report.models import WitnessEntry

WITNESS = "own_backward"


def witness(engine: Any, calls: list[CapturedCall], training: bool, seed: int, rtol: float,
            reset: Callable[[], None]) -> dict[str, tuple[list[int], WitnessEntry]]:
    """``layer LABEL`` → (the input's shape, the entry), for every call whose own backward
    disagrees with its finite differences."""
    tf = engine.tf
    rng = np.random.default_rng([seed, 11])
    found = {}
    for call in calls:
        tensors = [a for a in call.args if tf.is_tensor(a)]
        if (len(call.args) != 1 or len(tensors) != 1 or len(call.outputs) != 1
                or not tensors[0].dtype.is_floating
                or not tf.is_tensor(call.outputs[0])
                or not call.outputs[0].dtype.is_floating):
            continue
        layer = engine.operation(call.layer)
        if not isinstance(layer, engine.keras.layers.Layer):
            continue
        entry = _one(tf, layer, call, tensors[0], training, rng, rtol, reset)
        if entry is not None:
            found[f"layer {call_label(call.layer, call.index)}"] = (
                [int(d) for d in tensors[0].shape], entry)
    return found


def _one(tf: Any, layer: Any, call: CapturedCall, x: Any, training: bool,
         rng: np.random.Generator, rtol: float, reset: Callable[[], None]
         ) -> WitnessEntry | None:
    kwargs: dict[str, Any] = {}
    if "training" in getattr(layer, "_call_context_args", {}):
        kwargs["training"] = training
    if call.mask is not None and getattr(layer, "supports_masking", False):
        kwargs["mask"] = call.mask
    cotangent = tf.constant(rng.standard_normal(call.outputs[0].shape))

    @tf.function(autograph=False, reduce_retracing=True)
    def projected(x: Any) -> Any:
        return tf.reduce_sum(tf.cast(layer(x, **kwargs), cotangent.dtype) * cotangent)

    @tf.function(autograph=False)
    def backward(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = projected(x)
        return value, tape.gradient(value, x)

    def at(point: Any) -> float:
        reset()
        return float(projected(point).numpy())

    reset()
    value, gradient = backward(x)
    gradient = np.zeros(x.shape) if gradient is None else gradient.numpy()
    direction = rng.standard_normal(x.shape)
    mask_value = getattr(layer, "mask_value", None)
    if mask_value is not None and np.ndim(x) >= 2:
        # Masking: moving a masked step off mask_value unmasks it, a jump no derivative
        # describes; the masked steps are held fixed, as check's input probes hold them.
        kept = ~np.all(np.asarray(x) == mask_value, axis=-1, keepdims=True)
        direction = direction * kept
        if not np.any(direction):
            return None
    probe = Probe("input", "a random direction", direction / np.linalg.norm(direction))
    analytic = float(np.sum(gradient * probe.direction))
    dtype = x.dtype.name
    for step in (step_for(dtype), retake_for(dtype)):
        shift = tf.constant(step * probe.direction, x.dtype)
        plus, minus = at(x + shift), at(x - shift)
        error, passed, _ = directional_error(gradient, [probe], np.array([plus]),
                                             np.array([minus]), float(value), rtol, None, step,
                                             rounding_of(dtype))
        if passed:
            return None
    numerical = (plus - minus) / (2 * step)
    factor = (f"; the tape's is {analytic / numerical:.3g} times the differences'"
              if numerical != 0 else "")
    return WitnessEntry(
        witness=WITNESS, error=error, tolerance=rtol, passed=False,
        detail=(f"this layer's own backward, on the input the call received and a random "
                f"cotangent: along a random direction of its input the tape gives "
                f"{analytic:.6e}, central differences of the layer alone {numerical:.6e}"
                f"{factor}"))
