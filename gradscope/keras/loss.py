"""Which loss a Keras model is explained with, decided from its config alone (no TensorFlow):
the loss ``fit`` minimises, so that the gradients shown are the ones training follows.

``--loss NAME`` always wins. Otherwise the loss saved with the compiled model, with its loss
weights (a model compiled with no loss trains on its ``add_loss`` terms alone). Only for a
model never compiled does a rule read each output's activation (:func:`_inferred`). The rule
as a user reads it: docs/keras.md, "The loss the model is trained with".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from gradscope.errors import ConfigError
from gradscope.keras.graph import LayerNode, ModelGraph, Ref

TargetKind = Literal["one_hot", "classes", "binary", "real"]

#: Loss names gradscope knows the targets of (aliases map to the canonical name).
ALIASES = {
    "mse": "mean_squared_error", "mae": "mean_absolute_error",
    "mape": "mean_absolute_percentage_error", "msle": "mean_squared_logarithmic_error",
    "kld": "kl_divergence", "kullback_leibler_divergence": "kl_divergence",
    "huber_loss": "huber", "logcosh": "log_cosh",
}
CROSS_ENTROPIES = {"categorical_crossentropy", "sparse_categorical_crossentropy",
                   "binary_crossentropy", "binary_focal_crossentropy",
                   "categorical_focal_crossentropy"}
KNOWN = CROSS_ENTROPIES | {
    "mean_squared_error", "mean_absolute_error", "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error", "kl_divergence", "huber", "log_cosh", "poisson",
    "cosine_similarity", "hinge", "squared_hinge", "categorical_hinge",
}


@dataclass(frozen=True)
class OutputLoss:
    output: str
    loss: str
    from_logits: bool
    weight: float
    target: TargetKind
    rule: str
    #: The compiled loss object's other settings (label_smoothing, reduction, axis…), as saved.
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        logits = " (from logits)" if self.from_logits else ""
        weight = f" × {self.weight:g}" if self.weight != 1 else ""
        return f"{self.loss}{logits}{weight}"


@dataclass(frozen=True)
class LossPlan:
    source: Literal["option", "compiled", "inferred"]
    outputs: tuple[OutputLoss, ...]
    #: Where a compiled loss came from: a saved file, or a model object compiled in memory.
    compiled_how: str = "saved with the compiled model"
    #: The model's class, where it overrides ``compute_loss``: the loss is its own.
    custom_compute_loss: str | None = None

    @property
    def added_only(self) -> bool:
        """Compiled with no loss: what ``fit`` minimises is the added losses alone."""
        return self.source == "compiled" and not self.outputs

    @property
    def description(self) -> str:
        if self.custom_compute_loss:
            return (f"{self.custom_compute_loss}.compute_loss, the model's own (as fit calls it; "
                    "every target is passed to it)")
        if self.added_only:
            return ("the added losses alone (add_loss, regularizers): compiled with no loss, "
                    "so targets are not read")
        if self.source == "compiled":
            how = self.compiled_how
        elif self.source == "option":
            how = "--loss"
        else:
            how = "; ".join(f"{o.output}: {o.rule}" for o in self.outputs)
        losses = " + ".join(o.label if len(self.outputs) == 1 else f"{o.output} {o.label}"
                            for o in self.outputs)
        return f"{losses} ({how})"


def output_names(graph: ModelGraph) -> list[str]:
    """A name per model output: its key when the model's outputs are a dict (the name the
    user gave it, and the one ``compile`` and ``fit`` use), else the producing layer's, with
    the output index where needed."""
    if graph.output_keys is not None:
        return list(graph.output_keys)
    names = []
    for ref in graph.outputs:
        # A layer (or shared sub-model) called more than once may give several outputs: the
        # call is named where the calls differ, the tensor where one call gives several.
        calls = {other.node for other in graph.outputs if other.layer == ref.layer}
        tensors = sum(1 for other in graph.outputs
                      if (other.layer, other.node) == (ref.layer, ref.node))
        name = ref.layer + (f"[{ref.node}]" if len(calls) > 1 and ref.node else "")
        names.append(f"{name}_{ref.index}" if tensors > 1 or ref.index else name)
    return names


def output_aliases(graph: ModelGraph) -> dict[str, str]:
    """Other names an output may be given by (its layer's name, where the outputs are a dict
    keyed otherwise) → its name."""
    if graph.output_keys is None:
        return {}
    layers = [ref.layer for ref in graph.outputs]
    return {layer: key for layer, key in zip(layers, graph.output_keys, strict=True)
            if layer != key and layers.count(layer) == 1 and layer not in graph.output_keys}


def canonical(name: str) -> str:
    """'CategoricalCrossentropy' / 'categorical_crossentropy' / 'mse' → one spelling."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
    snake = snake.replace("cross_entropy", "crossentropy").replace("k_l_", "kl_")
    return ALIASES.get(snake, snake)


def target_kind(loss: str) -> TargetKind:
    if loss.startswith("sparse_"):
        return "classes"
    if loss.startswith("binary") or loss in {"hinge", "squared_hinge"}:
        return "binary"
    if loss in {"categorical_crossentropy", "categorical_focal_crossentropy",
                "kl_divergence", "categorical_hinge"}:
        return "one_hot"
    return "real"


def plan_loss(graph: ModelGraph, override: str | None = None) -> LossPlan:
    names = output_names(graph)
    if override is not None:
        loss = canonical(override)
        if loss not in KNOWN:
            raise ConfigError(f"--loss {override!r}: not a Keras loss gradscope knows; expected "
                              f"one of {', '.join(sorted(KNOWN))}", where="--loss")
        return LossPlan("option", tuple(
            OutputLoss(name, loss, _from_logits(loss, _activation(graph, ref)), 1.0,
                       target_kind(loss), "--loss")
            for name, ref in zip(names, graph.outputs, strict=True)))
    if graph.compile_config:  # an uncompiled model saves {}
        compiled = graph.compile_config.get("loss")
        if compiled is None:  # compile(optimizer=…): fit minimises the added losses alone
            return LossPlan("compiled", ())
        return _compiled(graph, names, compiled, graph.compile_config.get("loss_weights"))
    return LossPlan("inferred", tuple(_inferred(graph, name, ref)
                                      for name, ref in zip(names, graph.outputs, strict=True)))


def _compiled(graph: ModelGraph, names: list[str], loss: Any, weights: Any) -> LossPlan:
    per_output: list[Any]
    if isinstance(loss, dict) and "class_name" not in loss:
        layers = {name: ref.layer for name, ref in zip(names, graph.outputs, strict=True)}
        per_output = [loss.get(name, loss.get(layers[name])) for name in names]
    elif isinstance(loss, list):
        per_output = list(loss)
    else:
        per_output = [loss] * len(names)
    if isinstance(weights, dict):
        weight_list = [float(weights[name] if name in weights else weights.get(ref.layer, 1.0))
                       for name, ref in zip(names, graph.outputs, strict=True)]
    elif isinstance(weights, list):
        weight_list = [float(w) for w in weights]
    elif isinstance(weights, int | float) and not isinstance(weights, bool):
        # One number: Keras weighs the one loss with it (compile_utils.CompileLoss.build).
        weight_list = [float(weights)] * len(names)
    else:
        weight_list = [1.0] * len(names)
    outputs = []
    for name, entry, weight in zip(names, per_output, weight_list, strict=False):
        if entry is None:
            continue
        if isinstance(entry, dict) and entry.get("class_name") == "function":
            # A loss function object (loss=keras.losses.binary_crossentropy): its name is the
            # config, and it takes Keras' defaults (no logits).
            loss_name, from_logits = canonical(str(entry.get("config", ""))), False
        elif isinstance(entry, dict) and ">" in str(entry.get("registered_name") or ""):
            # A loss class of the user's own, by the name it was registered with.
            loss_name = str(entry["registered_name"])
            settings = entry.get("config")
            from_logits = bool(settings.get("from_logits", False)
                               if isinstance(settings, dict) else False)
        elif isinstance(entry, dict):
            loss_name = canonical(str(entry.get("class_name", "")))
            settings = entry.get("config")
            from_logits = bool(settings.get("from_logits", False)
                               if isinstance(settings, dict) else False)
        else:
            loss_name, from_logits = canonical(str(entry)), False
        saved = entry.get("config") if isinstance(entry, dict) else None
        outputs.append(OutputLoss(name, loss_name, from_logits, weight, target_kind(loss_name),
                                  "saved with the compiled model",
                                  dict(saved) if isinstance(saved, dict) else {}))
    return LossPlan("compiled", tuple(outputs))


def _inferred(graph: ModelGraph, name: str, ref: Ref) -> OutputLoss:
    activation = _activation(graph, ref)
    units = _units(graph.layer(ref.layer))
    if activation == "softmax":
        loss, rule = "categorical_crossentropy", "softmax output → categorical cross-entropy"
    elif activation == "sigmoid":
        loss, rule = "binary_crossentropy", "sigmoid output → binary cross-entropy"
    elif activation == "linear" and units == 1:
        loss, rule = "mean_squared_error", "linear output of one unit → mean squared error"
    elif activation == "linear":
        loss = "categorical_crossentropy"
        rule = "linear output of several units → softmax cross-entropy on logits"
    else:
        loss = "mean_squared_error"
        rule = f"{activation or 'unknown'} output → mean squared error (no other rule applies)"
    return OutputLoss(name, loss, _from_logits(loss, activation), 1.0, target_kind(loss), rule)


def _from_logits(loss: str, activation: str | None) -> bool:
    return loss in CROSS_ENTROPIES and activation not in {"softmax", "sigmoid"}


def _activation(graph: ModelGraph, ref: Ref) -> str | None:
    """The activation that produced an output, read from the producing layer's config."""
    layer: LayerNode | None = graph.layer(ref.layer)
    while layer is not None and layer.class_name in {"TimeDistributed", "Bidirectional"}:
        layer = layer.inner
    if layer is None:
        return None
    if layer.class_name == "Softmax":
        return "softmax"
    if layer.class_name in {"GRU", "LSTM", "SimpleRNN"} and ref.index > 0:
        return "state"
    activation = layer.config.get("activation")
    return activation if isinstance(activation, str) else None


def _units(layer: LayerNode) -> int | None:
    inner = layer.inner if layer.class_name == "TimeDistributed" else layer
    units = (inner or layer).config.get("units")
    return int(units) if isinstance(units, int) else None
