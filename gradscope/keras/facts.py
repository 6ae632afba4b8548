"""What a layer's explainer is told about one layer of the graph: its config and the shapes and
labels of its inputs, read from config.json (or captured in a run). Light: no TensorFlow, no
data loading, so that ``shapes MODEL.keras`` imports only what it needs."""

from __future__ import annotations

from typing import Any

from gradscope.keras.graph import LayerNode, ModelGraph, Ref
from gradscope.keras.layers import LayerFacts
from gradscope.keras.live import is_builtin

NO_DERIVATION = "no derivation for this layer type"
#: The same for a class of the user's own (a layer not from Keras): its code is theirs.
NO_DERIVATION_YOURS = f"your layer: {NO_DERIVATION} (gradscope does not read your code)"


def no_derivation(layer: LayerNode, weight: bool = False) -> str:
    """What a layer without a derivation says (of one of its weights, with ``weight``):
    "your layer" for the user's own class, whose weights' shapes are those its build made."""
    if (not layer.module or is_builtin(layer.module)) and not _wraps_yours(layer.config):
        return NO_DERIVATION
    return f"{NO_DERIVATION_YOURS}; the shape its build made" if weight else NO_DERIVATION_YOURS


def _wraps_yours(config: Any) -> bool:
    """Whether a layer's config holds a class of the user's own: the layer or cell a Keras
    wrapper runs (``Bidirectional(RNN(MyCell))``, ``TimeDistributed(MyLayer)``)."""
    if isinstance(config, dict):
        module = config.get("module")
        if "class_name" in config and isinstance(module, str) and not is_builtin(module):
            return True
        return any(_wraps_yours(value) for value in config.values())
    if isinstance(config, list | tuple):
        return any(_wraps_yours(item) for item in config)
    return False


def layer_facts(graph: ModelGraph, layer: LayerNode, shapes: list[tuple[int | None, ...]] | None
                = None, output_shapes: list[tuple[int | None, ...]] | None = None) -> LayerFacts:
    """The facts of a layer's first call; ``shapes`` (captured in a run) replace the saved ones.
    """
    call = layer.calls[0] if layer.calls else None
    positional = call.input_refs() if call is not None else []
    saved = [ref.shape or () for ref in positional]
    input_shapes = shapes if shapes is not None else saved
    labels = tuple(_label(graph, ref) for ref in positional)
    return LayerFacts(name=layer.name, class_name=layer.class_name, config=layer.config,
                      input_shapes=tuple(tuple(s) for s in input_shapes), input_labels=labels,
                      output_shapes=tuple(tuple(s) for s in (output_shapes or [])))


def _label(graph: ModelGraph, ref: Ref) -> str:
    producer = graph.layer(ref.layer)
    if producer.is_input:
        return "input" if len(graph.inputs) == 1 else f"input {producer.name}"
    if producer.class_name in {"GRU", "LSTM", "SimpleRNN"}:
        return f"{producer.name} units"
    return f"{producer.name} output"


