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

    def stacked(self, facts: LayerFacts) -> list[tuple[LayerFacts, LayerExplainer]] | None:
        """A StackedRNNCells of GRU, LSTM and SimpleRNN cells: each cell as the layer that
        computes what it computes, reading the input (the first) or the cell below's h (each
        after it, as Keras' stack passes it on); None for any other cell, or a stack with a
        cell gradscope does not derive. Found tried as a new user would: a stack of Keras'
        own cells (``RNN([GRUCell, LSTMCell])``, as TF1's MultiRNNCell is written in Keras)
        had no weight derived."""
        from gradscope.keras.layers import explainer_for

        cell = cell_of(facts)
        if cell is None or cell.get("class_name") != "StackedRNNCells":
            return None
        cells = cell.get("config", {}).get("cells")
        if not isinstance(cells, list) or not cells:
            return None
        shape = facts.input_shape
        width, label = facts.features, facts.input_label
        found = []
        for index, entry in enumerate(cells):
            if not isinstance(entry, dict) or entry.get("class_name") not in CELL_LAYERS:
                return None
            layer = CELL_LAYERS[str(entry["class_name"])]
            explainer = explainer_for(layer)
            config = dict(entry.get("config", {}))
            if explainer is None or "units" not in config:
                return None
            found.append((LayerFacts(name=facts.name, class_name=layer, config=config,
                                     input_shapes=((*shape[:-1], width),) if shape else (),
                                     input_labels=(label,)), explainer))
            width, label = int(config["units"]), f"cells[{index}] h"
        return found

    def derives(self, facts: LayerFacts) -> bool:
        return self.equivalent(facts) is not None or self.stacked(facts) is not None

    def _cell_scope(self, facts: LayerFacts) -> str:
        """The cell's part of its variables' keys: none for "gru_cell" or "gru_cell_1"
        (``variable_key`` drops a cell's scope, numbered or not), the name itself for a
        chosen one."""
        cell = cell_of(facts) or {}
        name = str(cell.get("config", {}).get("name", ""))
        return "" if not name or CELL_SCOPE.fullmatch(name) else name

    def summary(self, facts: LayerFacts) -> str:
        cell = cell_of(facts) or {}
        stack = self.stacked(facts)
        if stack is not None:
            cells = "; ".join(f"cells[{index}] {inner.class_name}Cell of "
                              f"{inner.config['units']} units on {inner.input_label} "
                              f"({inner.features})" for index, (inner, _) in enumerate(stack))
            sequences = ("h_t at every step" if facts.option("return_sequences")
                         else "h_T")
            return (f"RNN over StackedRNNCells, each step running the cells in turn, each "
                    f"cell's h_t the next one's input: {cells}; returns the last cell's "
                    f"{sequences}")
        found = self.equivalent(facts)
        if found is None:
            return (f"RNN over a {cell.get('class_name', 'custom')} cell: gradscope does not "
                    "derive its algebra")
        inner, explainer = found
        return (f"RNN({cell['class_name']}) computes what the {inner.class_name} layer "
                f"computes: {explainer.summary(inner)}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        stack = self.stacked(facts)
        if stack is not None:  # each cell's weights by its place: cells[0]/kernel, …
            return [note.prefixed(f"cells[{index}]") for index, (inner, explainer)
                    in enumerate(stack) for note in explainer.weights(inner)]
        found = self.equivalent(facts)
        if found is None:
            return []
        inner, explainer = found
        scope = self._cell_scope(facts)
        notes = explainer.weights(inner)
        return [note.prefixed(scope) for note in notes] if scope else notes

    def gradient_note(self, facts: LayerFacts) -> str:
        stack = self.stacked(facts)
        if stack is not None:
            arrives = ("at every returned step" if facts.option("return_sequences")
                       else "at the last step")
            return (f"∂L/∂h_t of the last cell arrives from above {arrives}; within a step "
                    "it flows down the stack, each cell's input gradient the h_t gradient "
                    "of the cell below, and back through every cell's own recurrence to "
                    "t−1, …, 0 and into its initial states")
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
