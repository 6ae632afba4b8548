"""The dropout and noise family: Dropout, SpatialDropout1D, GaussianNoise, GaussianDropout and
AlphaDropout. Each is the identity at inference; in training it draws one random mask or noise
per call, and the gradient goes back through that same draw
(``keras/src/layers/regularization/``)."""

from __future__ import annotations

from math import sqrt

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, register
from gradscope.keras.layers.shapes import number, shape_text, size

#: SELU's constants, as ``alpha_dropout.py`` writes them.
SELU_ALPHA = 1.6732632423543772
SELU_SCALE = 1.0507009873554805

INFERENCE = "at inference the identity (the gradient passes unchanged)"


def _rate(facts: LayerFacts) -> float:
    return float(facts.option("rate", 0.0))


def _noise_shape_text(facts: LayerFacts) -> str:
    noise_shape = facts.option("noise_shape")
    if not noise_shape:
        return ""
    shared = [str(axis) for axis, d in enumerate(noise_shape) if d == 1]
    where = f"; one mask value shared along axis {', '.join(shared)}" if shared else ""
    drawn = ", ".join("batch" if d is None else str(d) for d in noise_shape)
    return f" (noise_shape ({drawn}){where})"


@register
class DropoutExplainer(LayerExplainer):
    class_names = ("Dropout",)

    def summary(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        if rate == 0:
            return f"Dropout rate 0 on {shape_text(facts.input_shape)}: the identity"
        if rate == 1:
            return (f"Dropout rate 1 on {shape_text(facts.input_shape)}: zeros in training, "
                    "the identity at inference")
        return (f"Dropout rate {number(rate)} on {shape_text(facts.input_shape)}: in training "
                f"each value is zeroed with probability {number(rate)} and the rest scaled by "
                f"1/(1−{number(rate)}) = {number(1 / (1 - rate))}{_noise_shape_text(facts)}; "
                f"{INFERENCE}")

    def gradient_note(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        if rate == 0:
            return "passes it unchanged (rate 0)"
        if rate == 1:
            return "zero in training (rate 1: every value is dropped); unchanged at inference"
        return (f"in training multiplied by the same mask: zero where a value was dropped "
                f"(probability {number(rate)}), 1/(1−{number(rate)}) = "
                f"{number(1 / (1 - rate))} where it was kept; unchanged at inference")


@register
class SpatialDropout1DExplainer(LayerExplainer):
    class_names = ("SpatialDropout1D",)

    def summary(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        shape = facts.input_shape
        steps = size(shape[1]) if len(shape) > 1 else "?"
        features = size(shape[2]) if len(shape) > 2 else "?"
        scale = f"1/(1−{number(rate)}) = {number(1 / (1 - rate))}" if rate < 1 else "0"
        return (f"SpatialDropout1D rate {number(rate)} on {shape_text(shape)}: in training "
                f"each of the {features} feature channels is zeroed for all {steps} steps at "
                f"once (noise shape batch × 1 × {features}) with probability {number(rate)}, "
                f"the kept channels scaled by {scale}; {INFERENCE}")

    def gradient_note(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        if rate == 0:
            return "passes it unchanged (rate 0)"
        if rate == 1:
            return "zero in training (rate 1: every channel is dropped); unchanged at inference"
        return (f"in training multiplied by the same per-channel mask: a dropped channel gets "
                f"zero gradient at every step, a kept one is scaled by {number(1 / (1 - rate))}; "
                "unchanged at inference")


@register
class GaussianNoiseExplainer(LayerExplainer):
    class_names = ("GaussianNoise",)

    def summary(self, facts: LayerFacts) -> str:
        stddev = float(facts.option("stddev", 0.0))
        return (f"GaussianNoise stddev {number(stddev)} on {shape_text(facts.input_shape)}: in "
                f"training adds noise drawn from N(0, {number(stddev)}²) to each value; "
                f"{INFERENCE}")

    def gradient_note(self, facts: LayerFacts) -> str:
        return ("passes it unchanged, in training too: the noise is added, so "
                "∂(x + noise)/∂x = 1")


@register
class GaussianDropoutExplainer(LayerExplainer):
    class_names = ("GaussianDropout",)

    def _stddev(self, rate: float) -> str:
        if rate >= 1:
            return "∞"
        return f"√({number(rate)}/(1−{number(rate)})) = {number(sqrt(rate / (1 - rate)))}"

    def summary(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        return (f"GaussianDropout rate {number(rate)} on {shape_text(facts.input_shape)}: in "
                f"training multiplies each value by noise drawn from N(1, σ²), σ = "
                f"{self._stddev(rate)}; {INFERENCE}")

    def gradient_note(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        if rate == 0:
            return "passes it unchanged (rate 0)"
        return (f"in training multiplied by the same noise (mean 1, σ = {self._stddev(rate)}), "
                "value by value; unchanged at inference")


@register
class AlphaDropoutExplainer(LayerExplainer):
    class_names = ("AlphaDropout",)

    @staticmethod
    def affine(rate: float) -> tuple[float, float, float]:
        """α′, a and b of ``alpha_dropout.py``: y = a·(x·kept + α′·(1 − kept)) + b."""
        alpha_p = -SELU_ALPHA * SELU_SCALE
        a = ((1 - rate) * (1 + rate * alpha_p**2)) ** -0.5
        b = -a * alpha_p * rate
        return alpha_p, a, b

    def summary(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        if rate == 0 or rate == 1:
            return (f"AlphaDropout rate {number(rate)} on {shape_text(facts.input_shape)}: "
                    + ("the identity" if rate == 0 else "in training Keras' formula divides by "
                       "zero (1 − rate = 0); the identity at inference"))
        alpha_p, a, b = self.affine(rate)
        return (f"AlphaDropout rate {number(rate)} on {shape_text(facts.input_shape)}: in "
                f"training each value is set to α′ = {number(alpha_p)} with probability "
                f"{number(rate)}, then y = {number(a)}·x + {number(b)} (keeping SELU's mean and "
                f"variance){_noise_shape_text(facts)}; {INFERENCE}")

    def gradient_note(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        if rate == 0:
            return "passes it unchanged (rate 0)"
        if rate == 1:
            return "undefined in training (rate 1); unchanged at inference"
        _, a, _ = self.affine(rate)
        return (f"in training multiplied by the same mask: zero where a value was dropped "
                f"(probability {number(rate)}), a = {number(a)} where it was kept; unchanged at "
                "inference")
