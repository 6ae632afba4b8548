"""Layers that move, copy, crop or pad values without computing new ones: Flatten, Reshape,
Permute, RepeatVector, Cropping1D, ZeroPadding1D and UpSampling1D
(``keras/src/layers/reshaping/``). Their gradient is the same move run backwards: copies sum,
dropped positions get none."""

from __future__ import annotations

from math import prod

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, Shape, register
from gradscope.keras.layers.shapes import count, pair, shape_text, size, steps_axis


def _reshaped(facts: LayerFacts, target: tuple[int, ...]) -> Shape:
    """The target shape with its -1 resolved when the input's size is known."""
    total = count(facts.input_shape)
    if -1 not in target:
        return (None, *target)
    known = prod(d for d in target if d != -1)
    if total is None or known == 0:
        return (None, *(None if d == -1 else d for d in target))
    return (None, *(total // known if d == -1 else d for d in target))


@register
class FlattenExplainer(LayerExplainer):
    class_names = ("Flatten",)

    def summary(self, facts: LayerFacts) -> str:
        shape = facts.input_shape
        total = count(shape)
        order = (" (channels_first: the channel axis is moved to the end before flattening)"
                 if facts.option("data_format") == "channels_first" and len(shape) > 2 else "")
        return (f"Flatten {shape_text(shape)} → (batch, {size(total)}): each example's values "
                f"in one row{order}")

    def gradient_note(self, facts: LayerFacts) -> str:
        return (f"reshaped back to {shape_text(facts.input_shape)}: every value receives its own "
                "entry's gradient unchanged")


@register
class ReshapeExplainer(LayerExplainer):
    class_names = ("Reshape",)

    def summary(self, facts: LayerFacts) -> str:
        target = tuple(int(d) for d in facts.config["target_shape"])
        return (f"Reshape {shape_text(facts.input_shape)} → "
                f"{shape_text(_reshaped(facts, target))}: the same values, in row-major order")

    def gradient_note(self, facts: LayerFacts) -> str:
        return (f"reshaped back to {shape_text(facts.input_shape)}: every value receives its own "
                "entry's gradient unchanged")


@register
class PermuteExplainer(LayerExplainer):
    class_names = ("Permute",)

    def summary(self, facts: LayerFacts) -> str:
        dims = tuple(int(d) for d in facts.config["dims"])
        shape = facts.input_shape
        out = (None, *(shape[d] for d in dims)) if len(shape) > max(dims) else ()
        moved = f" → {shape_text(out)}" if out else ""
        return (f"Permute dims {dims}: {shape_text(shape)}{moved} (output axis k is input axis "
                "dims[k−1])")

    def gradient_note(self, facts: LayerFacts) -> str:
        dims = [int(d) for d in facts.config["dims"]]
        inverse = tuple(dims.index(axis) + 1 for axis in range(1, len(dims) + 1))
        return (f"transposed back by the inverse permutation {inverse}: values unchanged, only "
                "their places")


@register
class RepeatVectorExplainer(LayerExplainer):
    class_names = ("RepeatVector",)

    def summary(self, facts: LayerFacts) -> str:
        n = int(facts.config["n"])
        features = size(facts.input_shape[-1]) if facts.input_shape else "?"
        return (f"RepeatVector n={n}: (batch, {features}) → (batch, {n}, {features}), the same "
                f"vector at each of {n} steps")

    def gradient_note(self, facts: LayerFacts) -> str:
        n = int(facts.config["n"])
        return (f"the vector's gradient is the sum of the gradients of its {n} copies "
                f"(Σ over the {n} steps)")


@register
class Cropping1DExplainer(LayerExplainer):
    class_names = ("Cropping1D",)

    def summary(self, facts: LayerFacts) -> str:
        before, after = pair(facts.option("cropping"), (1, 1))
        steps = facts.input_shape[1] if len(facts.input_shape) > 1 else None
        kept = "?" if steps is None else str(steps - before - after)
        last = "" if steps is None else f" (steps {before}–{steps - after - 1} of 0–{steps - 1})"
        return (f"Cropping1D ({before}, {after}) on {size(steps)} steps: drops the first "
                f"{before} and the last {after}, keeping {kept}{last}")

    def gradient_note(self, facts: LayerFacts) -> str:
        before, after = pair(facts.option("cropping"), (1, 1))
        return (f"the kept steps receive theirs unchanged; the {before} first and {after} last "
                "steps receive zero (they reach no output)")


@register
class ZeroPadding1DExplainer(LayerExplainer):
    class_names = ("ZeroPadding1D",)

    def summary(self, facts: LayerFacts) -> str:
        before, after = pair(facts.option("padding"), (1, 1))
        axis = steps_axis(facts)
        steps = facts.input_shape[axis] if len(facts.input_shape) > axis else None
        total = "?" if steps is None else str(steps + before + after)
        return (f"ZeroPadding1D ({before}, {after}): {before} zero step(s) before and {after} "
                f"after the {size(steps)} steps → {total} steps")

    def gradient_note(self, facts: LayerFacts) -> str:
        before, after = pair(facts.option("padding"), (1, 1))
        return (f"the gradient at the {before} + {after} padded steps is dropped (they are "
                "constants); each real step receives its own unchanged")


@register
class UpSampling1DExplainer(LayerExplainer):
    class_names = ("UpSampling1D",)

    def summary(self, facts: LayerFacts) -> str:
        repeats = int(facts.option("size", 2))
        steps = facts.input_shape[1] if len(facts.input_shape) > 1 else None
        total = "?" if steps is None else str(steps * repeats)
        return (f"UpSampling1D size {repeats}: each of the {size(steps)} steps repeated "
                f"{repeats} times in place → {total} steps")

    def gradient_note(self, facts: LayerFacts) -> str:
        repeats = int(facts.option("size", 2))
        return (f"each step receives the sum of the gradients of its {repeats} consecutive "
                "copies")
