"""Masking: a step whose features all equal ``mask_value`` is set to zeros and masked for the
layers after it (``keras/src/layers/core/masking.py``: ``any(x != mask_value, axis=-1)``)."""

from __future__ import annotations

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, register
from gradscope.keras.layers.shapes import shape_text, size


@register
class MaskingExplainer(LayerExplainer):
    class_names = ("Masking",)

    def summary(self, facts: LayerFacts) -> str:
        value = facts.option("mask_value", 0.0)
        shape = facts.input_shape
        steps = size(shape[1]) if len(shape) > 2 else "?"
        features = size(shape[-1]) if len(shape) > 1 else "?"
        return (f"Masking mask_value={value} on {shape_text(shape)}: a step of the {steps} "
                f"whose {features} features all equal {value} is masked: its output is set to "
                "zeros and the layers after it are told to skip it (a GRU/LSTM/SimpleRNN "
                "carries its state over that step)")

    def gradient_note(self, facts: LayerFacts) -> str:
        value = facts.option("mask_value", 0.0)
        return (f"the masked steps (all features == {value}) receive zero gradient: their output "
                "is the constant zero and a recurrent layer after it skips them, carrying the "
                "state; every other step passes its gradient unchanged")
