"""Bidirectional: two recurrent layers over the same sequence, one reading steps 1→T and one
T→1, whose outputs are merged (``merge_mode``: concat, sum, mul, ave, or None for both)."""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    StateNote,
    WeightNote,
    register,
)

MERGES = {
    "concat": "[forward | backward] side by side",
    "sum": "forward + backward",
    "ave": "(forward + backward) / 2",
    "mul": "forward ∘ backward (elementwise)",
}


def _units(facts: LayerFacts) -> int | None:
    units = facts.config.get("units")
    if units is None and isinstance(facts.config.get("cell"), dict):
        units = facts.config["cell"].get("config", {}).get("units")
    return int(units) if units is not None else None


@register
class BidirectionalExplainer(LayerExplainer):
    class_names = ("Bidirectional",)

    def directions(self, facts: LayerFacts) -> tuple[LayerFacts, LayerFacts]:
        """The forward and the backward layer, named as Keras names them (their names are the
        scopes of their variables: "forward_gru", "backward_gru")."""
        forward = facts.inner()
        saved = facts.config.get("backward_layer")
        if isinstance(saved, dict):
            backward = LayerFacts(
                name=str(saved["config"].get("name", saved["class_name"])),
                class_name=str(saved["class_name"]), config=saved["config"],
                input_shapes=facts.input_shapes, input_labels=facts.input_labels)
        else:
            # Keras builds the backward layer from the forward layer's config (bidirectional.py).
            name = "backward_" + forward.name.removeprefix("forward_")
            backward = LayerFacts(
                name=name, class_name=forward.class_name,
                config={**forward.config, "name": name, "go_backwards": True},
                input_shapes=facts.input_shapes, input_labels=facts.input_labels)
        return forward, backward

    def derives(self, facts: LayerFacts) -> bool:
        """Only where both directions are layers gradscope derives: a Bidirectional over the
        user's own cell (``RNN(MyCell)``) is listed with its real gradients as the user's."""
        for direction in self.directions(facts):
            explainer = self._explainer(direction)
            if explainer is None or not explainer.derives(direction):
                return False
            stacked = getattr(explainer, "stacked", None)
            if stacked is not None and stacked(direction) is not None:
                # A stack of cells in each direction: its weights keep Keras' own scopes
                # there (forward_rnn/stacked_rnn_cells/gru_cell/kernel), not the places a
                # stack of its own is named by; listed with its real gradients.
                return False
        return True

    def _explainer(self, facts: LayerFacts) -> LayerExplainer | None:
        from gradscope.keras.layers import explainer_for

        return explainer_for(facts.class_name)

    def _explained(self, facts: LayerFacts) -> Iterator[tuple[LayerFacts, str, LayerExplainer]]:
        """Each direction with an explainer, forward first: its facts, "forward" or
        "backward", and its explainer."""
        for direction, label in zip(self.directions(facts), ("forward", "backward"),
                                    strict=True):
            explainer = self._explainer(direction)
            if explainer is not None:
                yield direction, label, explainer

    def _merged_width(self, facts: LayerFacts) -> str:
        forward, backward = self.directions(facts)
        uf, ub = _units(forward), _units(backward)
        mode = facts.option("merge_mode", "concat")
        if uf is None or ub is None:
            return ""
        if mode == "concat":
            return (f"the next layer sees {uf} + {ub} = {uf + ub} features: "
                    f"0–{uf - 1} from {forward.name}, {uf}–{uf + ub - 1} from {backward.name}")
        if mode is None:
            return f"two outputs, {uf} and {ub} features, returned as a list"
        return f"the next layer sees {uf} features"

    def summary(self, facts: LayerFacts) -> str:
        forward, backward = self.directions(facts)
        mode = facts.option("merge_mode", "concat")
        inner = forward.class_name
        uf, ub = _units(forward), _units(backward)
        sequences = bool(forward.option("return_sequences"))
        steps = facts.input_shape[1] if len(facts.input_shape) > 2 else None
        count = f"the {steps} steps" if steps is not None else "the steps"
        reading = (f"{forward.name} ({uf} units) reads {count} first to last, "
                   f"{backward.name} ({ub} units) last to first")
        if sequences:
            returned = ("every step's outputs, the backward ones flipped back into time order "
                        "so that step t holds both directions' h at t")
        else:
            returned = ("the forward state after the last step and the backward state after "
                        "the first step (each has read the whole sequence)")
        merge = (f"merge_mode {mode!r}: {MERGES[mode]}" if mode in MERGES
                 else "merge_mode None: both outputs are returned")
        width = self._merged_width(facts)
        tail = "; return_state: the 2 directions' final states follow the output" if (
            forward.option("return_state")) else ""
        return (f"Bidirectional {inner} on {facts.features} features: {reading}; returns "
                f"{returned}; {merge}" + (f"; {width}" if width else "") + tail)

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        notes: list[WeightNote] = []
        for direction, label, explainer in self._explained(facts):
            for note in explainer.weights(direction):
                reads = "reads the steps last to first" if label == "backward" else (
                    "reads the steps first to last")
                own = f"the {label} direction's own weight ({reads})"
                notes.append(WeightNote(
                    key=f"{direction.name}/{note.key}", shape=note.shape,
                    formula=note.formula, role=note.role, rows=note.rows,
                    columns=note.columns,
                    note="; ".join(part for part in (note.note, own) if part)))
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        forward, backward = self.directions(facts)
        mode = facts.option("merge_mode", "concat")
        uf, ub = _units(forward), _units(backward)
        if mode == "concat":
            split = (f"the gradient of the {uf} + {ub} = {(uf or 0) + (ub or 0)} merged "
                     f"features splits: columns 0–{(uf or 1) - 1} go to {forward.name}, "
                     f"{uf}–{(uf or 0) + (ub or 0) - 1} to {backward.name}"
                     if uf is not None and ub is not None else
                     "the gradient of the concatenated features splits between the directions")
        elif mode == "sum":
            split = f"both directions receive the same ∂L/∂y of the {uf} summed features"
        elif mode == "ave":
            split = f"each direction receives ½·∂L/∂y of the {uf} averaged features"
        elif mode == "mul":
            split = (f"{forward.name} receives ∂L/∂y ∘ (backward output) and {backward.name} "
                     f"∂L/∂y ∘ (forward output), over the {uf} features: each scaled by the "
                     "other direction")
        else:
            split = (f"each direction receives the gradient of its own output ({uf} and {ub} "
                     "features)")
        parts = [split]
        explainer = self._explainer(forward)
        if explainer is not None:
            parts.append(f"inside {forward.name}: {explainer.gradient_note(forward)}")
        if forward.option("return_sequences"):
            parts.append(f"{backward.name} runs from the last step to the first, so its "
                         "gradient flows back the other way: from the first step towards the "
                         "last")
        else:
            parts.append(f"{backward.name}'s returned state is the one after the first step, "
                         "so its gradient flows from the first step towards the last")
        return "; ".join(parts)

    def states(self, facts: LayerFacts) -> list[StateNote]:
        """Forward states, then backward states: Keras gives the first half of
        ``initial_state`` to the forward layer and the second half to the backward one."""
        notes: list[StateNote] = []
        for direction, label, explainer in self._explained(facts):
            notes.extend(StateNote(key=f"{label}/{state.key}", units=state.units,
                                   role=f"{state.role} of {direction.name} ({label})")
                         for state in explainer.states(direction))
        return notes
