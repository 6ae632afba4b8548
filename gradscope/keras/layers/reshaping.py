"""Layers that move, copy, crop or pad values without computing new ones: Flatten, Reshape,
Permute, RepeatVector, Cropping1D, ZeroPadding1D and UpSampling1D
(``keras/src/layers/reshaping/``). Their gradient is the same move run backwards: copies sum,
dropped positions get none."""

from __future__ import annotations

from math import prod

from gradscope.keras.layers.base import LayerFacts, Sentences, Shape, explains
from gradscope.keras.layers.shapes import count, pair, shape_text, size, steps_axis, steps_of


def _reshaped(facts: LayerFacts, target: tuple[int, ...]) -> Shape:
    """The target shape with its -1 resolved when the input's size is known."""
    total = count(facts.input_shape)
    if -1 not in target:
        return (None, *target)
    known = prod(d for d in target if d != -1)
    if total is None or known == 0:
        return (None, *(None if d == -1 else d for d in target))
    return (None, *(total // known if d == -1 else d for d in target))


def _reshaped_back(facts: LayerFacts) -> str:
    """The gradient note of a layer that only changes the shape (Flatten, Reshape)."""
    return (f"reshaped back to {shape_text(facts.input_shape)}: every value receives its own "
            "entry's gradient unchanged")


@explains("Flatten")
def flatten(facts: LayerFacts) -> Sentences:
    shape = facts.input_shape
    order = (" (channels_first: the channel axis is moved to the end before flattening)"
             if facts.option("data_format") == "channels_first" and len(shape) > 2 else "")
    return Sentences(summary=f"Flatten {shape_text(shape)} → (batch, {size(count(shape))}): "
                             f"each example's values in one row{order}",
                     gradient_note=_reshaped_back(facts))


@explains("Reshape")
def reshape(facts: LayerFacts) -> Sentences:
    target = tuple(int(d) for d in facts.config["target_shape"])
    return Sentences(summary=f"Reshape {shape_text(facts.input_shape)} → "
                             f"{shape_text(_reshaped(facts, target))}: the same values, in "
                             "row-major order",
                     gradient_note=_reshaped_back(facts))


@explains("Permute")
def permute(facts: LayerFacts) -> Sentences:
    dims = tuple(int(d) for d in facts.config["dims"])
    shape = facts.input_shape
    out = (None, *(shape[d] for d in dims)) if len(shape) > max(dims) else ()
    moved = f" → {shape_text(out)}" if out else ""
    inverse = tuple(dims.index(axis) + 1 for axis in range(1, len(dims) + 1))
    return Sentences(
        summary=f"Permute dims {dims}: {shape_text(shape)}{moved} (output axis k is input axis "
                "dims[k−1])",
        gradient_note=f"transposed back by the inverse permutation {inverse}: values unchanged, "
                      "only their places")


@explains("RepeatVector")
def repeat_vector(facts: LayerFacts) -> Sentences:
    n = int(facts.config["n"])
    features = size(facts.input_shape[-1]) if facts.input_shape else "?"
    return Sentences(
        summary=f"RepeatVector n={n}: (batch, {features}) → (batch, {n}, {features}), the same "
                f"vector at each of {n} steps",
        gradient_note=f"the vector's gradient is the sum of the gradients of its {n} copies "
                      f"(Σ over the {n} steps)")


@explains("Cropping1D")
def cropping_1d(facts: LayerFacts) -> Sentences:
    before, after = pair(facts.option("cropping"), (1, 1))
    steps = steps_of(facts)
    kept = "?" if steps is None else str(steps - before - after)
    last = "" if steps is None else f" (steps {before}–{steps - after - 1} of 0–{steps - 1})"
    return Sentences(
        summary=f"Cropping1D ({before}, {after}) on {size(steps)} steps: drops the first "
                f"{before} and the last {after}, keeping {kept}{last}",
        gradient_note=f"the kept steps receive theirs unchanged; the {before} first and {after} "
                      "last steps receive zero (they reach no output)")


@explains("ZeroPadding1D")
def zero_padding_1d(facts: LayerFacts) -> Sentences:
    before, after = pair(facts.option("padding"), (1, 1))
    steps = steps_of(facts, steps_axis(facts))
    total = "?" if steps is None else str(steps + before + after)
    return Sentences(
        summary=f"ZeroPadding1D ({before}, {after}): {before} zero step(s) before and {after} "
                f"after the {size(steps)} steps → {total} steps",
        gradient_note=f"the gradient at the {before} + {after} padded steps is dropped (they "
                      "are constants); each real step receives its own unchanged")


@explains("UpSampling1D")
def up_sampling_1d(facts: LayerFacts) -> Sentences:
    repeats = int(facts.option("size", 2))
    steps = steps_of(facts)
    total = "?" if steps is None else str(steps * repeats)
    return Sentences(
        summary=f"UpSampling1D size {repeats}: each of the {size(steps)} steps repeated "
                f"{repeats} times in place → {total} steps",
        gradient_note=f"each step receives the sum of the gradients of its {repeats} "
                      "consecutive copies")
