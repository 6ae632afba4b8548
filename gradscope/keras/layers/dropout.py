"""The dropout and noise family: Dropout, SpatialDropout1D, GaussianNoise, GaussianDropout and
AlphaDropout. Each is the identity at inference; in training it draws one random mask or noise
per call, and the gradient goes back through that same draw
(``keras/src/layers/regularization/``)."""

from __future__ import annotations

from math import sqrt
from typing import ClassVar

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, Sentences, explains, register
from gradscope.keras.layers.shapes import number, setting, size, steps_of

#: SELU's constants, as ``alpha_dropout.py`` writes them.
SELU_ALPHA = 1.6732632423543772
SELU_SCALE = 1.0507009873554805

INFERENCE = "at inference the identity (the gradient passes unchanged)"
UNCHANGED = "passes it unchanged (rate 0)"


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


def _kept(rate: float) -> str:
    """The scale of the values dropout keeps."""
    return f"1/(1−{number(rate)}) = {number(1 / (1 - rate))}"


def _mask(rate: float, kept: str) -> str:
    """What the gradient is multiplied by where a mask drops values and scales the rest."""
    return (f"mask: zero where a value was dropped (probability {number(rate)}), {kept} where "
            "it was kept")


class RateExplainer(LayerExplainer):
    """A layer that draws a mask or noise from its ``rate`` in training and is the identity at
    inference: a subclass says what one draw does (``training``) and what the gradient is
    multiplied by (``multiplied``); a rate that is a case of its own says ``summaries`` and
    ``gradient_notes`` instead."""

    #: What the summary says at a rate that is a case of its own, after "<layer> rate r on x: ".
    summaries: ClassVar[dict[float, str]] = {}
    gradient_notes: ClassVar[dict[float, str]] = {0: UNCHANGED}

    def training(self, facts: LayerFacts, rate: float) -> str:
        raise NotImplementedError

    def multiplied(self, facts: LayerFacts, rate: float) -> str:
        raise NotImplementedError

    def summary(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        _, on = setting(facts, "rate", 0.0)
        if rate in self.summaries:
            return f"{on}: {self.summaries[rate]}"
        return f"{on}: in training {self.training(facts, rate)}; {INFERENCE}"

    def gradient_note(self, facts: LayerFacts) -> str:
        rate = _rate(facts)
        if rate in self.gradient_notes:
            return self.gradient_notes[rate]
        return (f"in training multiplied by the same {self.multiplied(facts, rate)}; unchanged "
                "at inference")


@register
class DropoutExplainer(RateExplainer):
    class_names = ("Dropout",)
    summaries = {0: "the identity", 1: "zeros in training, the identity at inference"}
    gradient_notes = {0: UNCHANGED, 1: "zero in training (rate 1: every value is dropped); "
                                       "unchanged at inference"}

    def training(self, facts: LayerFacts, rate: float) -> str:
        return (f"each value is zeroed with probability {number(rate)} and the rest scaled by "
                f"{_kept(rate)}{_noise_shape_text(facts)}")

    def multiplied(self, facts: LayerFacts, rate: float) -> str:
        return _mask(rate, _kept(rate))


@register
class SpatialDropout1DExplainer(RateExplainer):
    class_names = ("SpatialDropout1D",)
    gradient_notes = {0: UNCHANGED, 1: "zero in training (rate 1: every channel is dropped); "
                                       "unchanged at inference"}

    def training(self, facts: LayerFacts, rate: float) -> str:
        shape = facts.input_shape
        features = size(shape[2]) if len(shape) > 2 else "?"
        return (f"each of the {features} feature channels is zeroed for all "
                f"{size(steps_of(facts))} steps at once (noise shape batch × 1 × {features}) "
                f"with probability {number(rate)}, the kept channels scaled by "
                f"{_kept(rate) if rate < 1 else '0'}")

    def multiplied(self, facts: LayerFacts, rate: float) -> str:
        return (f"per-channel mask: a dropped channel gets zero gradient at every step, a kept "
                f"one is scaled by {number(1 / (1 - rate))}")


@explains("GaussianNoise")
def gaussian_noise(facts: LayerFacts) -> Sentences:
    stddev, on = setting(facts, "stddev", 0.0)
    return Sentences(f"{on}: in training adds noise drawn from N(0, {stddev}²) to each value; "
                     f"{INFERENCE}",
                     "passes it unchanged, in training too: the noise is added, so "
                     "∂(x + noise)/∂x = 1")


@register
class GaussianDropoutExplainer(RateExplainer):
    class_names = ("GaussianDropout",)

    def _stddev(self, rate: float) -> str:
        if rate >= 1:
            return "∞"
        return f"√({number(rate)}/(1−{number(rate)})) = {number(sqrt(rate / (1 - rate)))}"

    def training(self, facts: LayerFacts, rate: float) -> str:
        return f"multiplies each value by noise drawn from N(1, σ²), σ = {self._stddev(rate)}"

    def multiplied(self, facts: LayerFacts, rate: float) -> str:
        return f"noise (mean 1, σ = {self._stddev(rate)}), value by value"


@register
class AlphaDropoutExplainer(RateExplainer):
    class_names = ("AlphaDropout",)
    summaries = {0: "the identity", 1: "in training Keras' formula divides by zero "
                                       "(1 − rate = 0); the identity at inference"}
    gradient_notes = {0: UNCHANGED, 1: "undefined in training (rate 1); unchanged at inference"}

    @staticmethod
    def affine(rate: float) -> tuple[float, float, float]:
        """α′, a and b of ``alpha_dropout.py``: y = a·(x·kept + α′·(1 − kept)) + b."""
        alpha_p = -SELU_ALPHA * SELU_SCALE
        a = ((1 - rate) * (1 + rate * alpha_p**2)) ** -0.5
        b = -a * alpha_p * rate
        return alpha_p, a, b

    def training(self, facts: LayerFacts, rate: float) -> str:
        alpha_p, a, b = self.affine(rate)
        return (f"each value is set to α′ = {number(alpha_p)} with probability {number(rate)}, "
                f"then y = {number(a)}·x + {number(b)} (keeping SELU's mean and variance)"
                f"{_noise_shape_text(facts)}")

    def multiplied(self, facts: LayerFacts, rate: float) -> str:
        return _mask(rate, f"a = {number(self.affine(rate)[1])}")
