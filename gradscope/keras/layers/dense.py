"""Dense: ``y = activation(x·kernel + bias)`` on the last axis; every other axis is a position
its weight gradient sums over."""

from __future__ import annotations

from gradscope.cells.base import Block
from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    WeightNote,
    activation_note,
    batch_positions,
    register,
)


def positions_note(facts: LayerFacts) -> str:
    """Over what the weight gradient sums: the batch and every axis before the last."""
    last = len(facts.input_shape) - 1
    return f"its gradient is a sum over {batch_positions(facts, {last})}"


@register
class DenseExplainer(LayerExplainer):
    class_names = ("Dense",)

    def summary(self, facts: LayerFacts) -> str:
        activation = facts.option("activation", "linear")
        applied = "" if activation == "linear" else f"{activation}("
        close = "" if activation == "linear" else ")"
        bias = " + b" if facts.option("use_bias", True) else ""
        return (f"Dense {facts.features} → {facts.config['units']}: "
                f"y = {applied}x·W{bias}{close}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        F, u = facts.features, int(facts.config["units"])
        source = facts.input_label.replace(" units", " output")
        note = positions_note(facts)
        columns = (Block(0, u, "outputs" if u != 1 else "output"),)
        notes = [WeightNote(
            key="kernel", shape=(F, u), formula=f"{source} {F} × units {u}",
            role=f"maps each {source} vector to {u} output{'s' if u != 1 else ''}",
            rows=(Block(0, F, source),), columns=columns, note=note)]
        if facts.option("use_bias", True):
            notes.append(WeightNote(key="bias", shape=(u,), formula=f"units {u}",
                                    role="bias of the outputs", columns=columns, note=note))
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        activation = facts.option("activation", "linear")
        return (f"the activation {activation} {activation_note(activation)}; then ∂L/∂x = "
                "∂L/∂z·Wᵀ")
