"""The merge layers: Concatenate, Add, Subtract, Multiply, Average, Maximum, Minimum and Dot
(``keras/src/layers/merging/``). Each takes a list of tensors; the gradient goes back to every
one of them."""

from __future__ import annotations

from gradscope.keras.layers.base import LayerFacts, Sentences, Shape, explains
from gradscope.keras.layers.shapes import axis_index, dim, shape_text, size, spans


def _inputs(facts: LayerFacts) -> str:
    return " and ".join(f"{facts.label(k)} {shape_text(shape)}"
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
            notes.append(f"{facts.label(k)} is broadcast along axis "
                         f"{', '.join(str(a) for a in axes)}: its gradient is summed over "
                         "that axis")
    return "; " + "; ".join(notes) if notes else ""


@explains("Concatenate")
def concatenate(facts: LayerFacts) -> Sentences:
    axis = int(facts.option("axis", -1))
    widths = [dim(shape, axis) for shape in facts.input_shapes]
    known = [w for w in widths if w is not None]
    total = str(sum(known)) if len(known) == len(widths) else "?"
    summary = (f"Concatenate on axis {axis}: {' + '.join(size(w) for w in widths)} = {total} "
               f"from {_inputs(facts)}")
    if len(known) < len(widths):
        return Sentences(summary, f"split back along axis {axis}: each input receives the slice "
                                  "of the gradient at its own positions")
    labels = [facts.label(k) for k in range(len(known))]
    return Sentences(summary, f"split back along axis {axis} by the inputs' widths: "
                              f"{spans(known, labels)}")


@explains("Add")
def add(facts: LayerFacts) -> Sentences:
    return Sentences(f"Add: the elementwise sum of {_inputs(facts)}",
                     f"every one of the {len(facts.input_shapes)} inputs receives ∂L/∂y "
                     f"unchanged{_broadcast(facts)}")


@explains("Subtract")
def subtract(facts: LayerFacts) -> Sentences:
    a, b = facts.label(0), facts.label(1)
    return Sentences(f"Subtract: {a} − {b}, elementwise ({_inputs(facts)})",
                     f"{a} receives ∂L/∂y, {b} receives −∂L/∂y{_broadcast(facts)}")


@explains("Multiply")
def multiply(facts: LayerFacts) -> Sentences:
    return Sentences(f"Multiply: the elementwise product of {_inputs(facts)}",
                     "each input receives ∂L/∂y times the product of the other inputs, element "
                     "by element (an input that is zero somewhere zeroes the others' gradient "
                     "there); with masked inputs, Keras counts a masked input as 1 and zeroes "
                     f"the output where every input is masked{_broadcast(facts)}")


@explains("Average")
def average(facts: LayerFacts) -> Sentences:
    n = len(facts.input_shapes)
    return Sentences(f"Average: the elementwise sum of {_inputs(facts)} divided by {n}",
                     f"every one of the {n} inputs receives ∂L/∂y / {n}{_broadcast(facts)}")


@explains("Maximum", "Minimum")
def extremum(facts: LayerFacts) -> Sentences:
    word = facts.class_name.lower()  # maximum, minimum
    return Sentences(f"{facts.class_name}: the elementwise {word} of {_inputs(facts)}",
                     f"each element's gradient goes to the input that held the {word} there "
                     "(the earliest in the list if tied); the others get zero there"
                     f"{_broadcast(facts)}")


def _dot_axes(facts: LayerFacts) -> tuple[int, int]:
    axes = facts.config["axes"]
    shapes = facts.input_shapes
    if isinstance(axes, int):
        axes = [axes, axes]
    return (axis_index(shapes[0], int(axes[0])) if shapes else int(axes[0]),
            axis_index(shapes[1], int(axes[1])) if len(shapes) > 1 else int(axes[1]))


@explains("Dot")
def dot(facts: LayerFacts) -> Sentences:
    a, b = facts.label(0), facts.label(1)
    i, j = _dot_axes(facts)
    shapes = facts.input_shapes
    length = size(shapes[0][i]) if shapes and i < len(shapes[0]) else "?"
    normalize = facts.option("normalize")
    normalized = (" after dividing each by its L2 norm along those axes (cosine similarity)"
                  if normalize else "")
    note = (f"{a} receives ∂L/∂y contracted with {b}, and {b} receives ∂L/∂y contracted with "
            f"{a} (as for a matrix product: ∂A = ∂L/∂y·Bᵀ, ∂B = Aᵀ·∂L/∂y)")
    if normalize:
        note += ("; with normalize=True the gradient then goes through the L2 normalization: "
                 "(I − x̂x̂ᵀ)/‖x‖ removes its component along each input vector and divides it "
                 "by that vector's norm")
    return Sentences(f"Dot: for each example, the sum of products of {a} axis {i} and {b} axis "
                     f"{j} ({length} terms){normalized}; {_inputs(facts)}", note)
