"""The whole loss, term by term, as Keras adds it up in ``Trainer.compute_loss``: each output's
compiled loss (its Keras loss object, with its settings and its loss weight), each weight's
regularization penalty, and what each layer added during the call (activity regularizers,
``add_loss``). The terms are read right after Keras' own call of the model, so that they add
up to the loss it returned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Settings of Keras' loss objects worth saying (the rest are Keras' defaults or names).
SETTINGS = ("from_logits", "reduction", "label_smoothing", "delta", "axis", "alpha", "gamma",
            "ignore_class")


@dataclass(frozen=True)
class LossTerm:
    kind: str  # "output", "regularizer" or "added"
    name: str  # the output, the variable's path or the layer
    detail: str
    value: float
    settings: dict[str, Any] | None = None
    weight: float | None = None
    counted: str | None = None  # how much of the batch a mask or sample weights count


def output_terms(compile_loss: Any, names: list[str], y: Any, y_pred: Any,
                 sample_weight: Any = None) -> list[LossTerm]:
    """Each output's share of the compiled loss, from the loss objects Keras built
    (``CompileLoss._flat_losses``: path, loss, loss weight)."""
    from keras.src.backend.common.masking import get_keras_mask

    flat = getattr(compile_loss, "_flat_losses", None) or []
    terms = []
    for index, (path, loss, weight, _) in enumerate(flat):
        y_t, y_p = _at(path, y), _at(path, y_pred)
        sw = _at(path, sample_weight) if isinstance(sample_weight, dict | list) else sample_weight
        value = float(np.asarray(loss(y_t, y_p, sw))) * (1.0 if weight is None else
                                                            float(weight))
        # A loss written as a function (Huber, a compiled function) keeps its arguments in
        # _fn_kwargs, which its config leaves out.
        config = {**(getattr(loss, "_fn_kwargs", None) or {}),
                  **(loss.get_config() if hasattr(loss, "get_config") else {})}
        settings = {key: config[key] for key in SETTINGS if key in config
                    and config[key] is not None}
        name = _name(path, names, index)
        counted = []
        mask = get_keras_mask(y_p)
        if mask is not None:
            kept = np.asarray(mask, dtype=bool)
            counted.append(f"the mask keeps {int(kept.sum())} of {kept.size} positions, and "
                           "the loss averages over those")
        if sw is not None:
            weights = np.asarray(sw, np.float64)
            counted.append(f"sample weights sum to {weights.sum():.6g} over {weights.size} "
                           "entries")
        terms.append(LossTerm(kind="output", name=name, detail=_loss_name(loss, config),
                              value=value, settings=settings,
                              weight=None if weight is None else float(weight),
                              counted="; ".join(counted) or None))
    return terms


def added_terms(model: Any, added: dict[int, list[Any]]) -> list[LossTerm]:
    """The weights' regularization penalties and what each layer added during the call
    (``added``: by ``id(layer)``, as the call left them)."""
    terms = []
    for variable in model.weights:
        regularizer = getattr(variable, "regularizer", None)
        if regularizer is None:
            continue
        kind = variable.path.rsplit("/", 1)[-1]
        terms.append(LossTerm(kind="regularizer", name=variable.path,
                              detail=f"{kind} regularizer {_described(regularizer)}",
                              value=float(np.asarray(regularizer(variable.value)))))
    for layer in model._flatten_layers(include_self=True, recursive=True):
        own = added.get(id(layer), [])
        if not own:
            continue
        activity = getattr(layer, "activity_regularizer", None)
        what = (f"activity regularizer {_described(activity)}" if activity is not None
                else "add_loss")
        terms.append(LossTerm(kind="added", name=layer.name,
                              detail=f"{what}, {len(own)} term{'s' if len(own) > 1 else ''} "
                                     "added during the call",
                              value=float(sum(float(np.sum(np.asarray(t))) for t in own))))
    return terms


def _at(path: Any, value: Any) -> Any:
    for key in path or ():
        value = value[key]
    return value


def _name(path: Any, names: list[str], index: int) -> str:
    if path and isinstance(path[-1], str):
        return str(path[-1])
    if path and isinstance(path[-1], int) and path[-1] < len(names):
        return names[path[-1]]
    return names[index] if index < len(names) else f"output {index}"


def _loss_name(loss: Any, config: dict[str, Any]) -> str:
    fn = getattr(loss, "fn", None)
    if fn is not None and hasattr(fn, "__name__"):
        return str(fn.__name__)
    return str(config.get("name") or type(loss).__name__)


def _described(regularizer: Any) -> str:
    try:
        config = regularizer.get_config()
    except Exception:  # a user's regularizer may not implement it
        config = {}
    inside = ", ".join(f"{key}={float(value):g}" if isinstance(value, int | float)
                       else f"{key}={value}" for key, value in config.items())
    return f"{type(regularizer).__name__}({inside})"
