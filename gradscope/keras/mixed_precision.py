"""What mixed precision loses: per gradient tensor, the shares of entries that underflow to 0,
turn subnormal or overflow in the compute dtype (float16 or bfloat16) at the optimizer's loss
scale, and the range of scales that keeps both at zero. The truth is a float32 shadow of the
step (a float32 copy, same weights, Keras' own call): each unscaled gradient g, times the
scale, cast to the compute dtype. It is compared with the mixed model's own backward, the loss
scaled as fit scales it (within 1% of a tensor's entries, or one). Weights are read where their
layer computes in the half dtype (Keras casts the float32 variable down for the call, so the
gradient is made there); states from the probes: what step t+1 sends back to the state after
step t (for h_t with what its output receives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.report.models import KerasMixedPrecision, MixedPrecisionTensor

#: How far the mixed model's own shares may be from the shadow's: a share of the entries, or
#: one entry of a small tensor, whichever is more.
AGREEMENT = 0.01


@dataclass(frozen=True)
class Limits:
    """A compute dtype's range: largest finite, smallest normal, smallest subnormal."""

    name: str
    largest: float
    normal: float
    subnormal: float


def limits(dtype: str) -> Limits:
    """The range of ``dtype`` ("float16" or "bfloat16").

    Args:
        dtype: The compute dtype of a mixed policy.

    Returns:
        Its :class:`Limits`.
    """
    import ml_dtypes

    info = ml_dtypes.finfo(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    return Limits(dtype, float(info.max), float(info.smallest_normal),
                  float(info.smallest_subnormal))


def compute_dtype(model: Any) -> str | None:
    """The half-precision compute dtype of a model under a mixed policy (any of its layers'),
    float16 before bfloat16; None when no layer has a mixed policy."""
    found = {getattr(getattr(layer, "dtype_policy", None), "name", "")
             for layer in model._flatten_layers(include_self=True, recursive=True)}
    for name in ("mixed_float16", "mixed_bfloat16"):
        if name in found:
            return name.removeprefix("mixed_")
    return None


def current_scale(model: Any) -> tuple[float, str]:
    """The loss scale fit's train step multiplies the loss by (``optimizer.scale_loss``), and
    the optimizer's name in words: a LossScaleOptimizer's ``dynamic_scale`` (its
    ``initial_scale`` until it is built), another optimizer's ``loss_scale_factor``, else 1."""
    from keras.optimizers import LossScaleOptimizer

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return 1.0, "none (the model is not compiled with one)"
    name = type(optimizer).__name__
    if isinstance(optimizer, LossScaleOptimizer):
        scale = optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
        inner = type(optimizer.inner_optimizer).__name__
        return float(np.asarray(scale)), f"LossScaleOptimizer({inner})"
    return float(getattr(optimizer, "loss_scale_factor", None) or 1.0), name


def classify(values: np.ndarray, scale: float, dtype: str) -> tuple[int, int, int]:
    """How many of ``values`` (float32 gradients, unscaled), times ``scale`` and cast to
    ``dtype``, become 0 where they were not (underflow), subnormal, or infinite (overflow).

    Args:
        values: The float32 shadow's gradient.
        scale: The loss scale.
        dtype: "float16" or "bfloat16".

    Returns:
        The counts (underflow, subnormal, overflow).
    """
    import ml_dtypes

    half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        product = np.asarray(values, np.float32) * np.float32(scale)  # as Keras scales it
        cast = np.abs(product.astype(half).astype(np.float64))
    return (int(np.sum((cast == 0) & (product != 0))),
            int(np.sum((cast > 0) & (cast < limits(dtype).normal))),
            int(np.sum(np.isinf(cast))))


def observed(values: np.ndarray, shadow: np.ndarray, dtype: str) -> tuple[int, int, int]:
    """The same counts on the mixed model's own scaled gradient: 0 where the shadow's is not,
    subnormal, and not finite (an overflow, or the NaN one makes on its way back)."""
    values = np.asarray(values, np.float64)
    size = np.abs(values)
    return (int(np.sum((values == 0) & (np.asarray(shadow) != 0))),
            int(np.sum((size > 0) & (size < limits(dtype).normal))),
            int(np.sum(~np.isfinite(values))))


def mixed_precision(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                    sample_weight: Any) -> KerasMixedPrecision:
    """The ``mixed_precision`` section of explain on a model under a mixed policy.

    Args:
        engine: The :class:`~gradscope.keras.engine.KerasEngine` of the mixed model.
        inputs: The batch's inputs.
        targets: Its targets, as the engine runs them.
        sample_weight: Its sample weights, or None.

    Returns:
        Per tensor, the shares lost at the current scale; the safe range; the warnings.
    """
    model = engine.model
    dtype = compute_dtype(model)
    if dtype is None:
        raise ValueError("the model has no mixed dtype policy")
    scale, optimizer = current_scale(engine.user_model)
    shadow = shadow_engine(engine).run(inputs, targets, sample_weight=sample_weight,
                                       probe_states=True)
    engine.loss_scale = scale
    try:
        scaled = engine.run(inputs, targets, sample_weight=sample_weight, probe_states=True)
    finally:
        engine.loss_scale = 1.0
    from gradscope.keras.weight_names import live_names

    return section(engine, dtype, scale, optimizer, scaled, shadow, live_names(engine))


def shadow_engine(engine: Any) -> Any:
    """The float32 shadow of ``engine``'s model: a float32 copy with the same weights, run by
    Keras' own call (:class:`~gradscope.keras.engine.KerasEngine` with ``dtype="float32"``)."""
    from gradscope.keras.engine import KerasEngine

    return KerasEngine(engine.user_model if engine.live else engine.path, engine.output_names,
                       engine.plan, training=engine.training, seed=engine.seed,
                       dtype="float32")


def section(engine: Any, dtype: str, scale: float, optimizer: str, scaled: Any,
            shadow: Any, names: dict[str, str] | None = None) -> KerasMixedPrecision:
    """The section from the two passes of one batch: ``scaled``, the mixed model's own with the
    loss times ``scale``, and ``shadow``, the float32 copy's (both KerasPass, their recurrent
    loops probed). explain runs them with the engine; GradientFlow with its traced passes
    (:mod:`~gradscope.keras.mixed_precision_fit`). ``names``: each weight's name by its
    Keras path, as explain names it (:func:`~gradscope.keras.weight_names.live_names`)."""
    names = names or {}
    half = _half_weights(engine.model, dtype)
    pairs: list[tuple[str, str, np.ndarray, np.ndarray]] = []
    for path, value in shadow.gradients.items():
        mine = scaled.gradients.get(path)
        if path in half and value is not None and mine is not None:
            pairs.append((path, "weight", value, mine))
    pairs += _state_pairs(engine, scaled, shadow)
    tensors = [_tensor(path, names.get(path, path), kind, value, mine, scale, dtype)
               for path, kind, value, mine in pairs]
    sizes = np.concatenate([np.abs(value).ravel() for _, _, value, _ in pairs]
                           or [np.zeros(0)]).astype(np.float64)
    nonzero = sizes[sizes > 0]
    bounds = limits(dtype)
    scale_range = (None if nonzero.size == 0 else
                   [bounds.normal / float(nonzero.min()), bounds.largest / float(nonzero.max())])
    return KerasMixedPrecision(
        policy=f"mixed_{dtype}", compute_dtype=dtype, optimizer=optimizer, loss_scale=scale,
        scale_range=scale_range,
        in_range=None if scale_range is None else bool(
            scale_range[0] <= scale <= scale_range[1]),
        smallest=None if nonzero.size == 0 else float(nonzero.min()),
        largest=None if nonzero.size == 0 else float(nonzero.max()),
        tensors=tensors, warnings=_warnings(dtype, scale, optimizer, tensors, scale_range),
        method=("the float32 shadow (a copy of the model in float32, same weights, Keras' own "
                f"call) gives each gradient g; g × {scale:g} cast to {dtype} is counted: 0 "
                f"where g ≠ 0 (underflow), below {bounds.normal:.3g} (subnormal), inf "
                "(overflow). 'mixed' counts the same on the model's own backward with the "
                "loss scaled (0 where the shadow's is not, subnormal, not finite). The range "
                f"is over every tensor shown: [{bounds.normal:.3g} / min |g|, "
                f"{bounds.largest:g} / max |g|]."))


def _half_weights(model: Any, dtype: str) -> set[str]:
    """The paths of the weights whose innermost layer computes in ``dtype``: Keras casts them
    to it for the call, so their gradients are made (and rounded) there."""
    owner: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for variable in getattr(layer, "_trainable_variables", []):
            owner[id(variable)] = layer
    return {variable.path for variable in model.trainable_variables
            if getattr(owner.get(id(variable)), "compute_dtype", None) == dtype}


def _state_pairs(engine: Any, scaled: Any, shadow: Any,
                 ) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """Each recurrent call's total ∂L/∂s_t of each state after each step, the shadow's beside
    the mixed model's (the probes': what the backward carries through time)."""
    from gradscope.keras.engine import call_label, state_names

    pairs = []
    for call in scaled.calls:
        label = call_label(call.layer, call.index)
        mine, theirs = scaled.state_totals.get(label), shadow.state_totals.get(label)
        if not mine or not theirs:
            continue
        names = state_names(engine.operation(call.layer))
        values = [(a, b) for m, t in zip(mine, theirs, strict=True)
                  for a, b in zip(m.totals, t.totals, strict=True)]
        for name, (half, single) in zip(names, values, strict=False):
            state = name[:-1] + "_t" if name.endswith("0") else name
            pairs.append((f"{label}/{state}", "state", single, half))
    return pairs


def _tensor(path: str, name: str, kind: str, shadow: np.ndarray, mine: np.ndarray,
            scale: float, dtype: str) -> MixedPrecisionTensor:
    size = max(shadow.size, 1)
    predicted = classify(shadow, scale, dtype)
    seen = observed(mine, shadow, dtype)
    allowed = max(AGREEMENT * size, 1)
    return MixedPrecisionTensor(
        path=path, name=name, kind=kind, entries=int(shadow.size),
        underflow=predicted[0] / size, subnormal=predicted[1] / size,
        overflow=predicted[2] / size,
        mixed=[count / size for count in seen],
        agrees=all(abs(a - b) <= allowed for a, b in zip(predicted, seen, strict=True)))


def _warnings(dtype: str, scale: float, optimizer: str, tensors: list[MixedPrecisionTensor],
              scale_range: list[float] | None) -> list[str]:
    warnings = []
    if dtype == "bfloat16":
        warnings.append("bfloat16 keeps float32's exponent range: underflow is not the "
                        "concern there (its 8-bit mantissa rounds coarsely instead)")
    else:
        if not optimizer.startswith("LossScaleOptimizer"):
            warnings.append(f"the optimizer as compiled is {optimizer}, not a "
                            "LossScaleOptimizer (Keras wraps one at compile only where the "
                            "model's own dtype policy is mixed_float16; a saved model loaded "
                            "under another global policy is compiled without it), under "
                            "float16: fit does not scale the loss, and gradients below "
                            "6e-8 are lost to 0 and below 6.1e-5 keep few bits")
        elif scale == 1:  # a LossScaleOptimizer at 1 (the unscaled case is said above)
            warnings.append("the loss scale is 1: float16 gradients below 6e-8 are lost to 0 "
                            "and below 6.1e-5 keep few bits")
    if scale_range is not None and scale_range[0] > scale_range[1]:
        warnings.append("no loss scale keeps both at zero: the gradients span more than "
                        f"{dtype}'s normal range")
    if any(t.overflow or t.mixed[2] for t in tensors) and optimizer.startswith("LossScale"):
        warnings.append(f"at this scale a gradient is not finite: the LossScaleOptimizer "
                        f"skips this step and halves the scale to {scale / 2:g}")
    # Not finite at more entries than the shadow's scaled values overflow: an inf made inside
    # the backward spread (found tried as a new user would: 100% of a GRU's kernel not
    # finite where the shadow overflowed 24%, said to be rounding).
    spread = [t for t in tensors if not t.agrees and t.mixed[2] - t.overflow > AGREEMENT]
    if spread:
        worst = max(spread, key=lambda t: t.mixed[2] - t.overflow)
        others = [t.label for t in spread if t is not worst]
        also = f"; also at {', '.join(others)}" if others else ""
        warnings.append(f"the model's own {dtype} backward is not finite at more entries than "
                        "the float32 shadow's gradients overflow when scaled: "
                        f"{worst.mixed[2]:.1%} against {worst.overflow:.1%} at {worst.label}"
                        f"{also}. An inf made inside the backward spreads to every gradient "
                        "it reaches (in a recurrent layer, to each earlier step)")
    differ = [t.label for t in tensors if not t.agrees and t not in spread]
    if differ:
        warnings.append(f"the model's own {dtype} backward differs from the float32 shadow by "
                        f"more than 1% of the entries at {', '.join(differ)}: rounding on the "
                        "way back moved values across the limits")
    return warnings
