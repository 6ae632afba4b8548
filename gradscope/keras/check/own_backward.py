"""Which layer's backward is wrong: each layer call on its own, named even where it has no
weights.

A wrong gradient inside a layer without weights (a layer of your own with a
``tf.custom_gradient``, say) shows in check at the tensors below it: the weights of the layers
that feed it, the input. So where check finds a gradient wrong, it also takes every layer call
of one float tensor on its own, and names a call whose backward disagrees (``layer NAME``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.gradcheck import (
    Probe,
    WitnessResult,
    directional_error,
    factor_text,
    not_settling,
    probe_scales,
    retakes_for,
    rounding_of,
    step_for,
)
from gradscope.keras.check.probing import Probing, Witnessed
from gradscope.keras.engine import CapturedCall, call_label

WITNESS = "own_backward"


def witness(probing: Probing, stopping: list[str]) -> Witnessed:
    """``layer LABEL``, with the shape of its input, for every call whose own backward
    disagrees with its finite differences. A layer that stops a gradient (``stopping``: its
    place, ``layer 'NAME'``) is left out: its tape and its differences differ by design."""
    engine = probing.engine
    tf = engine.tf
    rng = np.random.default_rng([probing.seed, 11])
    found = Witnessed()
    for call in probing.autodiff.calls:
        if f"layer '{call.layer}'" in stopping:
            continue
        tensors = [a for a in call.args if tf.is_tensor(a)]
        if (len(call.args) != 1 or len(tensors) != 1 or len(call.outputs) != 1
                or not tensors[0].dtype.is_floating
                or not tf.is_tensor(call.outputs[0])
                or not call.outputs[0].dtype.is_floating):
            continue
        layer = engine.operation(call.layer)
        if not isinstance(layer, engine.keras.layers.Layer):
            continue
        name = f"layer {call_label(call.layer, call.index)}"
        result = _one(probing, layer, call, tensors[0], rng, name)
        if result is not None:
            found.shapes[name] = [int(d) for d in tensors[0].shape]
            found.results.append(result)
    return found


def _not_settled(gradient: np.ndarray, probe: Probe, differences: list[float], value: float,
                 rtol: float, dtype: str) -> bool:
    """Whether the differences at the step and its retakes do not settle as the step shrinks
    (:func:`~gradscope.gradcheck.not_settling`, as settle_kinks leaves a probe out): along a
    trajectory that amplifies every perturbation they witness nothing (found tried as a new
    user would: Keras' own SimpleRNN at 4× an orthogonal kernel, "the tape's is -205 times
    the differences'")."""
    steps = (step_for(dtype), *retakes_for(dtype))
    if len(differences) < 3:
        return False
    first, at_larger, at_smaller = differences[-3:]
    analytic = np.array([float(np.sum(gradient * probe.direction))])
    scale = float(probe_scales(gradient, [probe], analytic)[0])
    return not_settling(first, at_larger, at_smaller, scale, value, rtol, steps[-2],
                        steps[-1], rounding_of(dtype))


def _one(probing: Probing, layer: Any, call: CapturedCall, x: Any, rng: np.random.Generator,
         name: str) -> WitnessResult | None:
    """The tape's vector-Jacobian product of the layer, at the input the call received and
    for a random cotangent on its output, against central differences of the layer alone
    along a random direction of that input: where they disagree, both numbers and the factor
    between them. Non-trainable state (dropout seeds, batch-norm statistics) is restored
    before every evaluation, so each sees the same layer; a disagreement that fades at a 100×
    smaller step (a kink) is not reported."""
    tf, rtol, reset = probing.tf, probing.rtol, probing.restore
    kwargs: dict[str, Any] = {}
    if "training" in getattr(layer, "_call_context_args", {}):
        kwargs["training"] = probing.engine.training
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
    errors: list[float] = []
    differences: list[float] = []
    for step in (step_for(dtype), *retakes_for(dtype)):
        shift = tf.constant(step * probe.direction, x.dtype)
        plus, minus = at(x + shift), at(x - shift)
        differences.append((plus - minus) / (2 * step))
        error, passed, _ = directional_error(gradient, [probe], np.array([plus]),
                                             np.array([minus]), float(value), rtol, None, step,
                                             rounding_of(dtype))
        if passed:
            return None
        errors.append(error)
    if _not_settled(gradient, probe, differences, float(value), rtol, dtype):
        return None
    # What is said is the first step's: a smaller step's rounding, which the error allows
    # for, would make its error smaller than the numbers beside it show.
    error, numerical = errors[0], differences[0]
    factor = (f"; the tape's is {factor_text(analytic / numerical)} times the differences'"
              if numerical != 0 else "")
    typical = float(np.linalg.norm(gradient)) / np.sqrt(max(gradient.size, 1))
    if typical > abs(analytic):  # as directional_error measures it
        factor += (f" (the error is of ‖g‖/√n = {typical:.3e}, the typical size of such a "
                   "derivative, larger than the tape's here)")
    return WitnessResult(
        WITNESS, name, error, rtol, False,
        f"this layer's own backward, on the input the call received and a random cotangent: "
        f"along a random direction of its input the tape gives {analytic:.6e}, central "
        f"differences of the layer alone {numerical:.6e}{factor}")
