"""LayerNormalization: each position's vector is normalised over ``axis`` (its own mean and
variance, no batch statistics), then scaled by gamma and shifted by beta."""

from __future__ import annotations

from math import prod

from gradscope.cells.base import Block
from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    WeightNote,
    batch_positions,
    register,
)


def normalised_axes(facts: LayerFacts) -> list[int]:
    """``axis`` as Keras keeps it after build: a sorted list (negative values included)."""
    axis = facts.config.get("axis", -1)
    return sorted(int(a) for a in axis) if isinstance(axis, list | tuple) else [int(axis)]


def normalised_shape(facts: LayerFacts) -> tuple[int, ...]:
    """gamma's and beta's shape: the input's size along each normalised axis."""
    shape = facts.input_shape
    sizes = []
    for axis in normalised_axes(facts):
        size = shape[axis] if -len(shape) <= axis < len(shape) else None
        if size is None:
            raise ValueError(f"layer {facts.name}: the size of normalised axis {axis} of its "
                             f"input {shape} is unknown")
        sizes.append(int(size))
    return tuple(sizes)


def _axes_text(facts: LayerFacts) -> str:
    axes = normalised_axes(facts)
    if axes == [-1] or axes == [len(facts.input_shape) - 1]:
        return "the last axis"
    return "axis " + ", ".join(str(a) for a in axes)


def positions(facts: LayerFacts) -> str:
    """Over what gamma's and beta's gradients sum: the batch and every axis not normalised."""
    rank = len(facts.input_shape)
    return batch_positions(facts, {a % rank for a in normalised_axes(facts)})


@register
class LayerNormalizationExplainer(LayerExplainer):
    class_names = ("LayerNormalization",)

    def summary(self, facts: LayerFacts) -> str:
        n = prod(normalised_shape(facts))
        epsilon = facts.option("epsilon", 1e-3)
        scale = facts.option("scale", True) or facts.option("rms_scaling", False)
        center = facts.option("center", True) and not facts.option("rms_scaling", False)
        if facts.option("rms_scaling"):
            formula = f"y = {'γ∘' if scale else ''}x / √(var(x) + ε)"
            what = "rms_scaling (deprecated): divided by the standard deviation, not centred"
        else:
            formula = (f"y = {'γ∘' if scale else ''}(x − mean(x)) / √(var(x) + ε)"
                       f"{' + β' if center else ''}")
            what = "mean and variance of each vector alone, no batch statistics"
        return (f"LayerNormalization over {_axes_text(facts)} ({n} values per vector): "
                f"{formula}, ε = {epsilon}; {what}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        shape = normalised_shape(facts)
        n = prod(shape)
        formula = " × ".join(f"axis {a} size {s}" for a, s in
                             zip(normalised_axes(facts), shape, strict=True))
        entries = (Block(0, shape[0], "normalised features"),) if len(shape) == 1 else ()
        sums = f"its gradient sums over {positions(facts)}"
        notes = []
        if facts.option("scale", True) or facts.option("rms_scaling", False):
            notes.append(WeightNote(
                key="gamma", shape=shape, formula=formula,
                role=f"scale of each of the {n} normalised values (starts at 1)",
                columns=entries, note=f"{sums} of ∂L/∂y∘x̂"))
        if facts.option("center", True) and not facts.option("rms_scaling", False):
            notes.append(WeightNote(
                key="beta", shape=shape, formula=formula,
                role=f"shift of each of the {n} normalised values (starts at 0)",
                columns=entries, note=f"{sums} of ∂L/∂y"))
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        n = prod(normalised_shape(facts))
        g = "g = γ∘∂L/∂y" if (facts.option("scale", True)
                              or facts.option("rms_scaling", False)) else "g = ∂L/∂y"
        if facts.option("rms_scaling"):
            return (f"with {g}, x̂ = (x − mean)/σ and σ = √(var + ε) over the {n} values: "
                    "∂L/∂x = (g − x̂·mean(g∘x/σ)) / σ: the gradient loses a component along "
                    "the centred input but keeps its mean")
        return (f"with {g}, x̂ = (x − mean)/σ and σ = √(var + ε) over the {n} values of each "
                "vector: ∂L/∂x = (g − mean(g) − x̂·mean(g∘x̂)) / σ. Normalisation removes the "
                "gradient's mean and its component along the normalised vector x̂ (an exact "
                "projection when ε ≪ var), then divides by σ: shifting a vector changes "
                "nothing after the layer and scaling it almost nothing, so these directions "
                "get no gradient; each vector is handled alone, the examples stay independent")
