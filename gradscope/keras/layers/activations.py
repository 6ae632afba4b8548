"""Activations as layers: Activation, Softmax, ReLU, LeakyReLU, ELU and PReLU
(``keras/src/layers/activations/``). All act value by value except Softmax, which couples the
values along its axis; only PReLU has a weight (its slope ``alpha``)."""

from __future__ import annotations

from math import prod
from typing import Any

from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    Sentences,
    WeightNote,
    activation_note,
    explains,
    register,
)
from gradscope.keras.layers.shapes import dim, number, setting, shape_text, size


def _name(activation: Any) -> str:
    if isinstance(activation, dict):  # a serialized function: {"config": "tanh", ...}
        return str(activation.get("config") or activation.get("class_name") or activation)
    return str(activation or "linear")


@explains("Activation")
def activation(facts: LayerFacts) -> Sentences:
    name = _name(facts.option("activation"))
    on = f"Activation {name} on {shape_text(facts.input_shape)}"
    if name == "softmax":
        return Sentences(f"{on}: y = softmax(x) over the last axis "
                         f"({size(dim(facts.input_shape, -1))} values)",
                         f"{name} {activation_note(name)}")
    if name == "linear":
        return Sentences(f"{on}: y = x (the identity)", activation_note(name))
    return Sentences(f"{on}: y = {name}(x), value by value", f"{name} {activation_note(name)}")


def _axis_text(axis: Any) -> str:
    if isinstance(axis, list | tuple):
        return ", ".join(str(a) for a in axis)
    return str(axis)


def _softmax_count(facts: LayerFacts) -> str:
    axis = facts.option("axis", -1)
    axes = list(axis) if isinstance(axis, list | tuple) else [axis]
    sizes = [dim(facts.input_shape, int(a)) for a in axes]
    if None in sizes or not facts.input_shape:
        return "?"
    return str(prod(int(s or 0) for s in sizes))


@explains("Softmax")
def softmax(facts: LayerFacts) -> Sentences:
    axis = _axis_text(facts.option("axis", -1))
    values = _softmax_count(facts)
    masked = len(facts.input_shapes) > 1
    summary = (f"Softmax over axis {axis} of {shape_text(facts.input_shape)}: "
               f"y = exp(x) / Σ exp(x) over its {values} values")
    note = (f"multiplied by the softmax Jacobian diag(y) − y yᵀ along axis {axis}: "
            "∂L/∂x = y∘(∂L/∂y − Σ y∘∂L/∂y), so a gradient that is the same for all "
            f"{values} values cancels out")
    if masked:
        summary += (" (the call receives a mask: masked positions are set to −1e9 before and "
                    "to 0 after)")
        note += "; masked positions receive zero"
    return Sentences(summary, note)


@explains("ReLU")
def relu(facts: LayerFacts) -> Sentences:
    """The ReLU layer, and ``keras.activations.relu`` called on a functional model's tensor
    (an operation of the same class name and config)."""
    max_value = facts.option("max_value")
    slope = float(facts.option("negative_slope", 0.0) or 0.0)
    threshold = float(facts.option("threshold", 0.0) or 0.0)
    t = number(threshold)
    shifted = "x" if threshold == 0 else f"(x − {t})"
    below = "0" if slope == 0 else f"{number(slope)}·{shifted}"
    top = f"; capped at max_value {max_value}" if max_value is not None else ""
    upper = f" < {max_value}" if max_value is not None else ""
    scaled = "zeroed" if slope == 0 else f"scaled by {number(slope)}"
    cap = f", zeroed above max_value {max_value}" if max_value is not None else ""
    return Sentences(
        summary=f"ReLU on {shape_text(facts.input_shape)}: y = x where x > {t}, {below} "
                f"elsewhere{top}",
        gradient_note=f"passes it where {t} < x{upper}, {scaled} where x < {t}{cap}")


@explains("LeakyReLU")
def leaky_relu(facts: LayerFacts) -> Sentences:
    slope, on = setting(facts, "negative_slope", 0.3)
    return Sentences(f"{on}: y = x where x > 0, {slope}·x elsewhere",
                     f"passes it where x > 0 and scales it by {slope} elsewhere")


@explains("ELU")
def elu(facts: LayerFacts) -> Sentences:
    alpha, on = setting(facts, "alpha", 1.0)
    return Sentences(f"{on}: y = x where x > 0, {alpha}·(exp(x) − 1) elsewhere",
                     f"passes it where x > 0 and multiplies it by {alpha}·exp(x) = y + {alpha} "
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
