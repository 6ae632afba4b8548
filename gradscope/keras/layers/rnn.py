"""RNN around one GRUCell, LSTMCell or SimpleRNNCell: the same algebra as the GRU, LSTM and
SimpleRNN layers (which wrap these very cells), with the variables under the cell's name."""

from __future__ import annotations

from gradscope.keras.layers.base import (
    CELL_SCOPE,
    LayerExplainer,
    LayerFacts,
    StateNote,
    WeightNote,
    register,
)

#: The cell class and the layer that runs the same cell.
CELL_LAYERS = {"GRUCell": "GRU", "LSTMCell": "LSTM", "SimpleRNNCell": "SimpleRNN"}

#: The RNN wrapper's own options, which the equivalent layer takes too.
RNN_OPTIONS = ("return_sequences", "return_state", "go_backwards", "stateful", "unroll")


def cell_of(facts: LayerFacts) -> dict | None:
    cell = facts.config.get("cell")
    return cell if isinstance(cell, dict) else None


@register
class RNNExplainer(LayerExplainer):
    class_names = ("RNN",)

    def equivalent(self, facts: LayerFacts) -> tuple[LayerFacts, LayerExplainer] | None:
        """The GRU / LSTM / SimpleRNN layer that computes what this RNN computes, or None for
        a cell gradscope does not derive (a custom cell, a list of cells)."""
        from gradscope.keras.layers import explainer_for

        cell = cell_of(facts)
        if cell is None or cell.get("class_name") not in CELL_LAYERS:
            return None
        layer = CELL_LAYERS[str(cell["class_name"])]
        explainer = explainer_for(layer)
        if explainer is None:
            return None
        config = {**cell.get("config", {}),
                  **{key: facts.config[key] for key in RNN_OPTIONS if key in facts.config}}
        return LayerFacts(name=facts.name, class_name=layer, config=config,
                          input_shapes=facts.input_shapes, input_labels=facts.input_labels,
                          output_shapes=facts.output_shapes), explainer

    def derives(self, facts: LayerFacts) -> bool:
        return self.equivalent(facts) is not None

    def _cell_scope(self, facts: LayerFacts) -> str:
        """The cell's part of its variables' keys: none for "gru_cell" or "gru_cell_1"
        (``variable_key`` drops a cell's scope, numbered or not), the name itself for a
        chosen one."""
        cell = cell_of(facts) or {}
        name = str(cell.get("config", {}).get("name", ""))
        return "" if not name or CELL_SCOPE.fullmatch(name) else name

    def summary(self, facts: LayerFacts) -> str:
        cell = cell_of(facts) or {}
        found = self.equivalent(facts)
        if found is None:
            return (f"RNN over a {cell.get('class_name', 'custom')} cell: gradscope does not "
                    "derive its algebra")
        inner, explainer = found
        return (f"RNN({cell['class_name']}) computes what the {inner.class_name} layer "
                f"computes: {explainer.summary(inner)}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        found = self.equivalent(facts)
        if found is None:
            return []
        inner, explainer = found
        scope = self._cell_scope(facts)
        notes = explainer.weights(inner)
        return [note.prefixed(scope) for note in notes] if scope else notes

    def gradient_note(self, facts: LayerFacts) -> str:
        found = self.equivalent(facts)
        if found is None:
            return ""
        inner, explainer = found
        units = inner.config.get("units")
        return f"∂L/∂h_t has {units} entries (units); " + explainer.gradient_note(inner)

    def states(self, facts: LayerFacts) -> list[StateNote]:
        found = self.equivalent(facts)
        if found is None:
            return []
        inner, explainer = found
        return explainer.states(inner)
