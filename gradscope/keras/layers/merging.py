"""The merge layers: Concatenate, Add, Subtract, Multiply, Average, Maximum, Minimum and Dot
(``keras/src/layers/merging/``). Each takes a list of tensors; the gradient goes back to every
one of them."""

from __future__ import annotations

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, Shape, register
from gradscope.keras.layers.shapes import axis_index, shape_text, size


def _label(facts: LayerFacts, k: int) -> str:
    if k < len(facts.input_labels):
        return facts.input_labels[k]
    return f"input {k}"


def _inputs(facts: LayerFacts) -> str:
    return " and ".join(f"{_label(facts, k)} {shape_text(shape)}"
                        for k, shape in enumerate(facts.input_shapes)) or "its inputs"


def _broadcast(facts: LayerFacts) -> str:
    """Which inputs Keras broadcasts (an axis of 1, or fewer axes, against a longer one)."""
    shapes = facts.input_shapes
    if len(shapes) < 2:
        return ""
    rank = max(len(shape) for shape in shapes)
    notes = []
    for k, shape in enumerate(shapes):
        padded: Shape = (*shape[:1], *(1,) * (rank - len(shape)), *shape[1:])
        axes = [axis for axis in range(1, rank)
                if padded[axis] == 1 and any(len(other) == rank and other[axis] not in (1, None)
                                              for other in shapes)]
        if axes:
            notes.append(f"{_label(facts, k)} is broadcast along axis "
                         f"{', '.join(str(a) for a in axes)}: its gradient is summed over "
                         "that axis")
    return "; " + "; ".join(notes) if notes else ""


@register
class ConcatenateExplainer(LayerExplainer):
    class_names = ("Concatenate",)

    def widths(self, facts: LayerFacts) -> list[int | None]:
        axis = int(facts.option("axis", -1))
        return [shape[axis_index(shape, axis)] if shape else None
                for shape in facts.input_shapes]

    def summary(self, facts: LayerFacts) -> str:
        axis = int(facts.option("axis", -1))
        widths = self.widths(facts)
        total = "?" if None in widths else str(sum(w for w in widths if w is not None))
        return (f"Concatenate on axis {axis}: {' + '.join(size(w) for w in widths)} = {total} "
                f"from {_inputs(facts)}")

    def gradient_note(self, facts: LayerFacts) -> str:
        axis = int(facts.option("axis", -1))
        widths = self.widths(facts)
        if None in widths:
            return (f"split back along axis {axis}: each input receives the slice of the "
                    "gradient at its own positions")
        parts, start = [], 0
        for k, width in enumerate(widths):
            stop = start + int(width or 0)
            span = f"{start}" if stop - start == 1 else f"{start}–{stop - 1}"
            parts.append(f"{span} to {_label(facts, k)} ({width})")
            start = stop
        return f"split back along axis {axis} by the inputs' widths: " + ", ".join(parts)


@register
class AddExplainer(LayerExplainer):
    class_names = ("Add",)

    def summary(self, facts: LayerFacts) -> str:
        return f"Add: the elementwise sum of {_inputs(facts)}"

    def gradient_note(self, facts: LayerFacts) -> str:
        return (f"every one of the {len(facts.input_shapes)} inputs receives ∂L/∂y unchanged"
                f"{_broadcast(facts)}")


@register
class SubtractExplainer(LayerExplainer):
    class_names = ("Subtract",)

    def summary(self, facts: LayerFacts) -> str:
        return f"Subtract: {_label(facts, 0)} − {_label(facts, 1)}, elementwise ({_inputs(facts)})"

    def gradient_note(self, facts: LayerFacts) -> str:
        return (f"{_label(facts, 0)} receives ∂L/∂y, {_label(facts, 1)} receives −∂L/∂y"
                f"{_broadcast(facts)}")


@register
class MultiplyExplainer(LayerExplainer):
    class_names = ("Multiply",)

    def summary(self, facts: LayerFacts) -> str:
        return f"Multiply: the elementwise product of {_inputs(facts)}"

    def gradient_note(self, facts: LayerFacts) -> str:
        return ("each input receives ∂L/∂y times the product of the other inputs, element by "
                "element (an input that is zero somewhere zeroes the others' gradient there); "
                "with masked inputs, Keras counts a masked input as 1 and zeroes the output "
                f"where every input is masked{_broadcast(facts)}")


@register
class AverageExplainer(LayerExplainer):
    class_names = ("Average",)

    def summary(self, facts: LayerFacts) -> str:
        n = len(facts.input_shapes)
        return f"Average: the elementwise sum of {_inputs(facts)} divided by {n}"

    def gradient_note(self, facts: LayerFacts) -> str:
        n = len(facts.input_shapes)
        return f"every one of the {n} inputs receives ∂L/∂y / {n}{_broadcast(facts)}"


class ExtremumExplainer(LayerExplainer):
    word = ""

    def summary(self, facts: LayerFacts) -> str:
        return f"{facts.class_name}: the elementwise {self.word} of {_inputs(facts)}"

    def gradient_note(self, facts: LayerFacts) -> str:
        return (f"each element's gradient goes to the input that held the {self.word} there "
                "(the earliest in the list if tied); the others get zero there"
                f"{_broadcast(facts)}")


@register
class MaximumExplainer(ExtremumExplainer):
    class_names = ("Maximum",)
    word = "maximum"


@register
class MinimumExplainer(ExtremumExplainer):
    class_names = ("Minimum",)
    word = "minimum"


@register
class DotExplainer(LayerExplainer):
    class_names = ("Dot",)

    def axes(self, facts: LayerFacts) -> tuple[int, int]:
        axes = facts.config["axes"]
        shapes = facts.input_shapes
        if isinstance(axes, int):
            axes = [axes, axes]
        return (axis_index(shapes[0], int(axes[0])) if shapes else int(axes[0]),
                axis_index(shapes[1], int(axes[1])) if len(shapes) > 1 else int(axes[1]))

    def summary(self, facts: LayerFacts) -> str:
        a, b = self.axes(facts)
        shapes = facts.input_shapes
        length = size(shapes[0][a]) if shapes and a < len(shapes[0]) else "?"
        normalized = (" after dividing each by its L2 norm along those axes (cosine similarity)"
                      if facts.option("normalize") else "")
        return (f"Dot: for each example, the sum of products of {_label(facts, 0)} axis {a} and "
                f"{_label(facts, 1)} axis {b} ({length} terms){normalized}; {_inputs(facts)}")

    def gradient_note(self, facts: LayerFacts) -> str:
        note = (f"{_label(facts, 0)} receives ∂L/∂y contracted with {_label(facts, 1)}, and "
                f"{_label(facts, 1)} receives ∂L/∂y contracted with {_label(facts, 0)} (as for a "
                "matrix product: ∂A = ∂L/∂y·Bᵀ, ∂B = Aᵀ·∂L/∂y)")
        if facts.option("normalize"):
            note += ("; with normalize=True the gradient then goes through the L2 "
                     "normalization: (I − x̂x̂ᵀ)/‖x‖ removes its component along each input "
                     "vector and divides it by that vector's norm")
        return note
