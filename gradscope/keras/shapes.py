"""``gradscope shapes MODEL.keras``: the algebra of every layer from the file's config.json,
without TensorFlow (it answers in well under a second)."""

from __future__ import annotations

from math import prod
from typing import Any

from gradscope.keras.facts import NO_DERIVATION, layer_facts
from gradscope.keras.layers import deriving_explainer, sized_weights
from gradscope.keras.live import read_model
from gradscope.keras.loss import output_names
from gradscope.report.models import (
    BlockEntry,
    KerasGradientEntry,
    KerasLayerEntry,
    KerasShapesReport,
    KerasTensorSpec,
)

#: Layers known to hold no weights even without an explainer (Keras ops in the graph).
WEIGHTLESS_MODULE_PREFIX = "keras.src.ops"


def keras_shapes(source: Any, loss: str | None = None) -> KerasShapesReport:
    """The algebra of a saved model (``source`` a path) or of a model object, from its
    config: no TensorFlow is imported for a file, and no weight's value is read for either.
    A layer the algebra does not derive has its weights listed with the shapes the file
    stores (or the model object holds)."""
    graph, plan, label, _ = read_model(source, loss)
    layers, weights, underived = [], [], []
    for node in graph.computing_layers:
        facts = layer_facts(graph, node)
        explainer = deriving_explainer(node.class_name, node.module, facts)
        notes = sized_weights(explainer, facts)
        if notes is None or (explainer is None and not (node.module or "").startswith(
                WEIGHTLESS_MODULE_PREFIX)):
            underived.append(node.name)
        layers.append(KerasLayerEntry(
            name=node.name, class_name=node.class_name, calls=len(node.calls),
            input_shapes=[list(s) for s in facts.input_shapes], output_shapes=[],
            summary=explainer.summary(facts) if explainer else node.class_name,
            gradient_note=explainer.gradient_note(facts) if explainer else NO_DERIVATION,
            derivation=explainer is not None))
        for note in notes or []:
            weights.append(KerasGradientEntry(
                name=f"{node.name}/{note.key}", path=f"{node.name}/{note.key}", layer=node.name,
                class_name=node.class_name, shape=list(note.shape), formula=note.formula,
                meaning=note.meaning,
                rows=[BlockEntry(start=b.start, stop=b.stop, label=b.label) for b in note.rows],
                columns=[BlockEntry(start=b.start, stop=b.stop, label=b.label)
                         for b in note.columns],
                trainable=note.trainable, stats=None))
    weights += _underived_weights(source, graph, underived)
    inputs = []
    for ref in graph.inputs:
        config = graph.layer(ref.layer).config
        inputs.append(KerasTensorSpec(name=ref.layer, shape=list(config.get("batch_shape") or []),
                                      dtype=config.get("dtype")))
    return KerasShapesReport(
        file=label, name=graph.name, kind=graph.kind, inputs=inputs,
        outputs=output_names(graph), loss=plan.description, layers=layers, weights=weights,
        weight_count=sum(prod(w.shape) for w in weights), underived=underived)


def _underived_weights(source: Any, graph: Any, underived: list[str]) -> list[KerasGradientEntry]:
    from gradscope.keras.live import is_live_model

    if not underived:
        return []
    live = is_live_model(source)
    found: dict[str, list[tuple[str, tuple[int, ...], bool | None]]]
    if live:
        found = {name: [(v.path, tuple(int(d) for d in v.shape), bool(v.trainable))
                        for v in source.get_layer(name).weights] for name in underived}
    else:
        from gradscope.keras.stored_weights import stored_weights

        found = {name: [(w.name, w.shape, None) for w in weights]
                 for name, weights in stored_weights(str(source), underived).items()}
    entries = []
    for name in underived:
        node = graph.layer(name)
        for path, shape, trainable in found.get(name, []):
            # The file stores shapes, not whether each weight trains: the layer's own flag
            # stands for it, and the meaning says so.
            known = trainable if trainable is not None else bool(
                node.config.get("trainable", True))
            meaning = (f"{NO_DERIVATION}; the shape the model holds" if live else
                       f"{NO_DERIVATION}; the shape the file stores (weight {path.split('/')[-1]}"
                       " of its layer, in Keras' order; whether it trains is known once "
                       "explain runs)")
            entries.append(KerasGradientEntry(
                name=path, path=path, layer=name, class_name=node.class_name,
                shape=list(shape), formula=None, meaning=meaning, trainable=known, stats=None))
    return entries
