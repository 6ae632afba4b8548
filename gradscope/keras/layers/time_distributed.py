"""TimeDistributed: the wrapped layer applied to every step with the same weights."""

from __future__ import annotations

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, WeightNote, register


@register
class TimeDistributedExplainer(LayerExplainer):
    class_names = ("TimeDistributed",)

    def _inner(self, facts: LayerFacts) -> tuple[LayerFacts, LayerExplainer | None]:
        from gradscope.keras.layers import explainer_for

        inner = facts.inner()
        return inner, explainer_for(inner.class_name)

    def derives(self, facts: LayerFacts) -> bool:
        inner, explainer = self._inner(facts)
        return explainer is not None and explainer.derives(inner)

    def summary(self, facts: LayerFacts) -> str:
        inner, explainer = self._inner(facts)
        steps = facts.input_shape[1] if len(facts.input_shape) > 1 else None
        what = explainer.summary(inner) if explainer else inner.class_name
        return f"TimeDistributed over {steps if steps is not None else 'every'} steps: {what}"

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        inner, explainer = self._inner(facts)
        if explainer is None:
            return []
        steps = facts.input_shape[1] if len(facts.input_shape) > 1 else None
        shared = (f"shared by all {steps} steps: its gradient sums over batch × {steps}"
                  if steps is not None else "shared by every step: its gradient sums over "
                  "batch × time")
        return [WeightNote(key=f"{inner.name}/{note.key}", shape=note.shape,
                           formula=note.formula, role=note.role, rows=note.rows,
                           columns=note.columns, note=shared)
                for note in explainer.weights(inner)]

    def gradient_note(self, facts: LayerFacts) -> str:
        inner, explainer = self._inner(facts)
        inside = explainer.gradient_note(inner) if explainer else ""
        return "each step independently" + (f": {inside}" if inside else "")

