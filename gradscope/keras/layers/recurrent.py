"""GRU, LSTM and SimpleRNN: the algebra of gradscope's Keras-layout cells, with the layer's own
options (activations, ``use_bias``, ``reset_after``, ``unit_forget_bias``) stated."""

from __future__ import annotations

import re
from typing import ClassVar

from gradscope.cells import CELLS, Cell
from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    StateNote,
    WeightNote,
    activation_note,
    register,
)

DEFAULT_ACTIVATIONS = {"activation": "tanh", "recurrent_activation": "sigmoid"}


class RecurrentExplainer(LayerExplainer):
    cell_kind: ClassVar[str]
    formula: ClassVar[str]

    def cell(self, facts: LayerFacts) -> Cell:
        """gradscope's own cell for this layer (keras layout): the algebra and the witness."""
        options = {}
        if facts.class_name == "GRU":
            options["reset_after"] = bool(facts.option("reset_after", True))
        return CELLS[f"{self.cell_kind}_keras"](
            name=facts.name, units=int(facts.config["units"]), input_size=facts.features,
            input_label=facts.input_label, options=options)

    def summary(self, facts: LayerFacts) -> str:
        units = facts.config["units"]
        sequences = ("every step's h_t" if facts.option("return_sequences") else "the last h_T")
        if facts.option("return_state"):
            # Found tried as a new user would: an encoder's summary said "returns the last
            # h_T", its final states, which its decoder starts from, unsaid.
            sequences += (", then its final states h_T and c_T" if self.cell_kind == "lstm"
                          else ", then its final state h_T")
        activation = str(facts.option("activation", "tanh"))
        # The formula with the layer's own activation (found tried as a new user would: a
        # relu SimpleRNN was written "h_t = tanh(…)", "(activation='relu')" after it).
        formula = (self.formula if "tanh" not in self.formula or activation == "tanh"
                   else self.formula.replace("tanh", activation))
        extras = [f"{key}={facts.option(key)!r}" for key, default in
                  {**DEFAULT_ACTIVATIONS, "go_backwards": False, "dropout": 0.0,
                   "recurrent_dropout": 0.0, "stateful": False}.items()
                  if facts.option(key, default) != default
                  and not (key == "activation" and formula != self.formula)]
        if not facts.option("use_bias", True):
            extras.append("use_bias=False")
        elif self.cell_kind == "lstm" and facts.option("unit_forget_bias", True) is False:
            extras.append("unit_forget_bias=False")
        tail = f" ({', '.join(extras)})" if extras else ""
        return (f"{facts.class_name} of {units} units on {facts.features} features: "
                f"{formula}; returns {sequences}{tail}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        notes = []
        activation = facts.option("activation", "tanh")
        recurrent = facts.option("recurrent_activation", "sigmoid")
        changed = []
        if activation != "tanh":
            changed.append(f"activation {activation} in place of tanh")
        if self.cell_kind != "simple_rnn" and recurrent != "sigmoid":
            changed.append(f"recurrent activation {recurrent} in place of σ")
        for info in self.cell(facts).weights():
            if info.short == "bias" and not facts.option("use_bias", True):
                continue
            note = "; ".join(changed)
            if (info.short == "bias" and self.cell_kind == "lstm"
                    and facts.option("unit_forget_bias", True) is False):
                note = "; ".join([*changed, "unit_forget_bias=False: the f block starts at 0"])
            notes.append(WeightNote.from_tensor(info, note=note))
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        parts = ["∂L/∂h_t arrives from above at every returned step and flows back through the "
                 "recurrence to t−1, …, 0 and into the initial state"]
        if not facts.option("return_sequences"):
            parts[0] = ("only the last state h_T is returned: ∂L/∂h_T flows back through the "
                        "recurrence to every earlier step and the initial state")
        if facts.option("return_state"):
            final = "h_T and c_T" if self.cell_kind == "lstm" else "h_T"
            parts[0] += (f"; the final states returned ({final}) bring their own ∂L, "
                         "added at the last step")
        activation = facts.option("activation", "tanh")
        parts.append(self.activation_path(activation))
        if facts.option("go_backwards"):
            parts.append("go_backwards: the steps are read from the last to the first")
        return "; ".join(parts)

    def activation_path(self, activation: str) -> str:
        """Where the cell's activation meets the gradient, and what it does there (its
        argument ``a``: found tried as a new user would, a GRU's "output activation tanh
        multiplies it by 1−tanh²(z)" named a tanh its output has not, with the update gate's
        letter)."""
        note = re.sub(r"\bz\b", "a", activation_note(activation))
        if self.cell_kind == "gru":
            return (f"on the path through the candidate ĥ = {activation}(a) the activation "
                    f"{note}; the path through z∘h_(t−1) meets no activation, only the "
                    "update gate")
        if self.cell_kind == "lstm":
            return (f"the activation {activation}, on the candidate c̃ and on c_t in "
                    f"h_t = o∘{activation}(c_t), {note} (a its argument)")
        return f"the activation {activation} {note} at every step (a = x_t·W + h_(t−1)·U + b)"

    def states(self, facts: LayerFacts) -> list[StateNote]:
        units = int(facts.config["units"])
        labels = {"h0": "initial hidden state h", "c0": "initial cell state c"}
        return [StateNote(key=state, units=units, role=labels[state])
                for state in CELLS[f"{self.cell_kind}_keras"].state_names]


@register
class GRUExplainer(RecurrentExplainer):
    class_names = ("GRU",)
    cell_kind = "gru"
    formula = "h_t = z∘h_{t−1} + (1−z)∘ĥ"


@register
class LSTMExplainer(RecurrentExplainer):
    class_names = ("LSTM",)
    cell_kind = "lstm"
    formula = "c_t = f∘c_{t−1} + i∘c̃, h_t = o∘tanh(c_t)"


@register
class SimpleRNNExplainer(RecurrentExplainer):
    class_names = ("SimpleRNN",)
    cell_kind = "simple_rnn"
    formula = "h_t = tanh(x_t·W + h_{t−1}·U + b)"
