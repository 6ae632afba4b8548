"""Activations as layers: Activation, Softmax, ReLU, LeakyReLU, ELU and PReLU
(``keras/src/layers/activations/``). All act value by value except Softmax, which couples the
values along its axis; only PReLU has a weight (its slope ``alpha``)."""

from __future__ import annotations

from math import prod
from typing import Any

from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    WeightNote,
    activation_note,
    register,
)
from gradscope.keras.layers.shapes import dim, number, shape_text, size


def _name(activation: Any) -> str:
    if isinstance(activation, dict):  # a serialized function: {"config": "tanh", ...}
        return str(activation.get("config") or activation.get("class_name") or activation)
    return str(activation or "linear")


@register
class ActivationExplainer(LayerExplainer):
    class_names = ("Activation",)

    def summary(self, facts: LayerFacts) -> str:
        activation = _name(facts.option("activation"))
        if activation == "softmax":
            return (f"Activation softmax on {shape_text(facts.input_shape)}: y = softmax(x) over "
                    f"the last axis ({size(dim(facts.input_shape, -1))} values)")
        if activation == "linear":
            return f"Activation linear on {shape_text(facts.input_shape)}: y = x (the identity)"
        return (f"Activation {activation} on {shape_text(facts.input_shape)}: y = "
                f"{activation}(x), value by value")

    def gradient_note(self, facts: LayerFacts) -> str:
        activation = _name(facts.option("activation"))
        if activation == "linear":
            return activation_note(activation)
        return f"{activation} {activation_note(activation)}"


def _axis_text(axis: Any) -> str:
    if isinstance(axis, list | tuple):
        return ", ".join(str(a) for a in axis)
    return str(axis)


@register
class SoftmaxExplainer(LayerExplainer):
    class_names = ("Softmax",)

    def _count(self, facts: LayerFacts) -> str:
        axis = facts.option("axis", -1)
        axes = list(axis) if isinstance(axis, list | tuple) else [axis]
        sizes = [dim(facts.input_shape, int(a)) for a in axes]
        if None in sizes or not facts.input_shape:
            return "?"
        return str(prod(int(s or 0) for s in sizes))

    def summary(self, facts: LayerFacts) -> str:
        axis = _axis_text(facts.option("axis", -1))
        masked = (" (the call receives a mask: masked positions are set to −1e9 before and to "
                  "0 after)" if len(facts.input_shapes) > 1 else "")
        return (f"Softmax over axis {axis} of {shape_text(facts.input_shape)}: "
                f"y = exp(x) / Σ exp(x) over its {self._count(facts)} values{masked}")

    def gradient_note(self, facts: LayerFacts) -> str:
        axis = _axis_text(facts.option("axis", -1))
        note = (f"multiplied by the softmax Jacobian diag(y) − y yᵀ along axis {axis}: "
                "∂L/∂x = y∘(∂L/∂y − Σ y∘∂L/∂y), so a gradient that is the same for all "
                f"{self._count(facts)} values cancels out")
        if len(facts.input_shapes) > 1:
            note += "; masked positions receive zero"
        return note


@register
class ReLUExplainer(LayerExplainer):
    """The ReLU layer, and ``keras.activations.relu`` called on a functional model's tensor
    (an operation of the same class name and config)."""

    class_names = ("ReLU",)

    def _options(self, facts: LayerFacts) -> tuple[Any, float, float]:
        return (facts.option("max_value"), float(facts.option("negative_slope", 0.0) or 0.0),
                float(facts.option("threshold", 0.0) or 0.0))

    def summary(self, facts: LayerFacts) -> str:
        max_value, slope, threshold = self._options(facts)
        t = number(threshold)
        shifted = "x" if threshold == 0 else f"(x − {t})"
        below = "0" if slope == 0 else f"{number(slope)}·{shifted}"
        top = f"; capped at max_value {max_value}" if max_value is not None else ""
        return (f"ReLU on {shape_text(facts.input_shape)}: y = x where x > {t}, {below} "
                f"elsewhere{top}")

    def gradient_note(self, facts: LayerFacts) -> str:
        max_value, slope, threshold = self._options(facts)
        t = number(threshold)
        upper = f" < {max_value}" if max_value is not None else ""
        below = ("zeroed" if slope == 0 else f"scaled by {number(slope)}")
        cap = (f", zeroed above max_value {max_value}" if max_value is not None else "")
        return (f"passes it where {t} < x{upper}, {below} where x < {t}{cap}")


@register
class LeakyReLUExplainer(LayerExplainer):
    class_names = ("LeakyReLU",)

    def summary(self, facts: LayerFacts) -> str:
        slope = number(float(facts.option("negative_slope", 0.3)))
        return (f"LeakyReLU negative_slope {slope} on {shape_text(facts.input_shape)}: y = x "
                f"where x > 0, {slope}·x elsewhere")

    def gradient_note(self, facts: LayerFacts) -> str:
        slope = number(float(facts.option("negative_slope", 0.3)))
        return f"passes it where x > 0 and scales it by {slope} elsewhere"


@register
class ELUExplainer(LayerExplainer):
    class_names = ("ELU",)

    def summary(self, facts: LayerFacts) -> str:
        alpha = number(float(facts.option("alpha", 1.0)))
        return (f"ELU alpha {alpha} on {shape_text(facts.input_shape)}: y = x where x > 0, "
                f"{alpha}·(exp(x) − 1) elsewhere")

    def gradient_note(self, facts: LayerFacts) -> str:
        alpha = number(float(facts.option("alpha", 1.0)))
        return (f"passes it where x > 0 and multiplies it by {alpha}·exp(x) = y + {alpha} "
                "elsewhere (it fades as x → −∞)")


@register
class PReLUExplainer(LayerExplainer):
    class_names = ("PReLU",)

    def shared(self, facts: LayerFacts) -> list[int]:
        axes = facts.option("shared_axes")
        if axes is None:
            return []
        return [int(a) for a in (axes if isinstance(axes, list | tuple) else [axes])]

    def alpha_shape(self, facts: LayerFacts) -> tuple[int, ...]:
        shape = list(facts.input_shape[1:])
        for axis in self.shared(facts):
            shape[axis - 1] = 1
        if any(d is None for d in shape):
            raise ValueError(f"layer {facts.name}: PReLU's alpha needs every non-shared axis "
                             f"of its input known, got {shape_text(facts.input_shape)}")
        return tuple(int(d) for d in shape if d is not None)

    def summary(self, facts: LayerFacts) -> str:
        shared = self.shared(facts)
        sharing = f", one slope shared along axis {', '.join(map(str, shared))}" if shared else ""
        return (f"PReLU on {shape_text(facts.input_shape)}: y = x where x > 0, α·x elsewhere, "
                f"with a learned slope α of shape {self.alpha_shape(facts)}{sharing}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        shape = self.alpha_shape(facts)
        shared = self.shared(facts)
        input_dims = " × ".join(size(d) for d in facts.input_shape[1:])
        formula = (f"input {input_dims}" if not shared else
                   f"input {input_dims} with axis {', '.join(map(str, shared))} set to 1")
        over = "the batch" + (f" and axis {', '.join(map(str, shared))}" if shared else "")
        return [WeightNote(
            key="alpha", shape=shape, formula=formula,
            role="the slope for negative inputs, one per position it is not shared across",
            note=f"∂L/∂α = Σ ∂L/∂y · min(x, 0), summed over {over}")]

    def gradient_note(self, facts: LayerFacts) -> str:
        return ("passes it where x > 0 and scales it by α elsewhere; α itself receives "
                "Σ ∂L/∂y · min(x, 0)")
