"""``keras.ops`` calls in a functional model: each is a graph node of its own whose config.json
entry has module ``keras.src.ops.*`` and the operation's class name. ``x + 1.0`` is ``Add``,
``x / 2`` ``TrueDivide``, ``x[:, 0]`` ``GetItem``; an Embedding with ``mask_zero`` or a
Masking layer puts ``NotEqual`` (and ``Any``) nodes in the graph for the mask it passes on.

Several class names are also layer names (``Add``, ``Concatenate``, ``Reshape``, ``Softmax``…),
so these explainers are registered under ``ops.<ClassName>``: see :func:`op_key`. Only the
tensors of a call reach :class:`LayerFacts`; a constant operand (the 1.0 of ``x + 1.0``) does
not, so a binary operation with one tensor input says "a constant".
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from gradscope.keras.layers.base import ACTIVATION_NOTES, LayerExplainer, LayerFacts, register
from gradscope.keras.layers.shapes import axis_index, count, dim, shape_text, spans

PREFIX = "ops."


def op_key(class_name: str) -> str:
    """The registry key of a keras.ops operation, apart from the layer of the same name."""
    return PREFIX + class_name


NO_GRADIENT = "none: the output is {what}, so no gradient flows back through it to its input"


@dataclass(frozen=True)
class Op:
    function: str  # keras.ops.<function>
    computes: str  # what it computes, may name {axis}, {keepdims}, {x}, {y}, {dtype}, {n}…
    gradient: str


def _activation(function: str, computes: str) -> Op:
    """An activation called as an operation: it does to the gradient what the activation of a
    layer does (:data:`~gradscope.keras.layers.base.ACTIVATION_NOTES`)."""
    return Op(function, computes, ACTIVATION_NOTES[function])


OPS: dict[str, Op] = {
    # arithmetic, elementwise with broadcasting
    "Add": Op("add", "{x} + {y}", "{a} and {b} each receive ∂L/∂y unchanged"),
    "Subtract": Op("subtract", "{x} − {y}", "{a} receives ∂L/∂y, {b} receives −∂L/∂y"),
    "Multiply": Op("multiply", "{x} · {y}",
                   "{a} receives ∂L/∂y · {b}, {b} receives ∂L/∂y · {a}"),
    "TrueDivide": Op("true_divide", "{x} / {y}",
                     "{a} receives ∂L/∂y / {b}, {b} receives −∂L/∂y · {a} / {b}²"),
    "Divide": Op("divide", "{x} / {y}",
                 "{a} receives ∂L/∂y / {b}, {b} receives −∂L/∂y · {a} / {b}²"),
    "Power": Op("power", "{x} ** {y}",
                "the base {a} receives ∂L/∂y · p·{a}^(p−1) with p = {b}; a tensor exponent "
                "receives ∂L/∂y · {a}^p · log {a}"),
    "Maximum": Op("maximum", "max({x}, {y})",
                  "goes to whichever of {a}, {b} is larger at each element ({a} if tied), "
                  "zero to the other"),
    "Minimum": Op("minimum", "min({x}, {y})",
                  "goes to whichever of {a}, {b} is smaller at each element ({a} if tied), "
                  "zero to the other"),
    "Matmul": Op("matmul", "{x} · {y} (matrix product over the last two axes)",
                 "{a} receives ∂L/∂y · ({b})ᵀ, {b} receives ({a})ᵀ · ∂L/∂y (ᵀ: the last two "
                 "axes swapped)"),
    "Dot": Op("dot", "the dot product of {x} and {y}",
              "{a} receives ∂L/∂y · ({b})ᵀ, {b} receives ({a})ᵀ · ∂L/∂y"),
    "Einsum": Op("einsum", "einsum('{subscripts}') of {operands}",
                 "each operand receives ∂L/∂y contracted with the other operands"),
    # elementwise, one operand
    "Negative": Op("negative", "−x", "negated"),
    "Square": Op("square", "x²", "multiplied by 2x"),
    "Sqrt": Op("sqrt", "√x", "multiplied by 1/(2√x) (infinite at 0)"),
    "Absolute": Op("absolute", "|x|", "multiplied by sign(x) (0 at x = 0)"),
    "Exp": Op("exp", "exp(x)", "multiplied by exp(x)"),
    "Log": Op("log", "log x", "divided by x"),
    "Log1p": Op("log1p", "log(1 + x)", "divided by 1 + x"),
    "Reciprocal": Op("reciprocal", "1/x", "multiplied by −1/x²"),
    "Rsqrt": Op("rsqrt", "1/√x", "multiplied by −1/(2·x^1.5)"),
    "Sign": Op("sign", "sign(x)", "zero: sign is flat wherever it is differentiable"),
    "Tanh": _activation("tanh", "tanh(x)"),
    "Sigmoid": _activation("sigmoid", "σ(x)"),
    "Relu": _activation("relu", "max(x, 0)"),
    "Relu6": Op("relu6", "min(max(x, 0), 6)", "passes it where 0 < x < 6, zero elsewhere"),
    "LeakyRelu": Op("leaky_relu", "x where x > 0, {negative_slope}·x elsewhere",
                    "passes it where x > 0, scales it by {negative_slope} elsewhere"),
    "Elu": Op("elu", "x where x > 0, {alpha}·(exp(x) − 1) elsewhere",
              "passes it where x > 0, multiplies it by {alpha}·exp(x) elsewhere"),
    "Selu": _activation("selu", "selu(x)"),
    "Gelu": _activation("gelu", "gelu(x)"),
    "Silu": _activation("silu", "x·σ(x)"),
    "Softplus": _activation("softplus", "log(1 + exp(x))"),
    "Erf": Op("erf", "erf(x)", "multiplied by 2/√π · exp(−x²)"),
    "Clip": Op("clip", "x clipped to [{x_min}, {x_max}]",
               "passes it where {x_min} ≤ x ≤ {x_max}, zero outside"),
    "Softmax": Op("softmax", "exp(x)/Σ exp(x) along axis {axis}",
                  "multiplied by the softmax Jacobian diag(y) − y yᵀ along axis {axis}"),
    "LogSoftmax": Op("log_softmax", "x − logsumexp(x) along axis {axis}",
                     "∂L/∂x = ∂L/∂y − softmax(x)·Σ ∂L/∂y along axis {axis}"),
    # reductions
    "Mean": Op("mean", "the mean over {over}{keepdims}",
               "divided evenly: each reduced element receives ∂L/∂y / {n}"),
    "Sum": Op("sum", "the sum over {over}{keepdims}",
              "copied: each of the {n} summed elements receives ∂L/∂y"),
    "Max": Op("max", "the maximum over {over}{keepdims}",
              "goes to the element holding the maximum (shared evenly among ties), zero to the "
              "other {n_less}"),
    "Min": Op("min", "the minimum over {over}{keepdims}",
              "goes to the element holding the minimum (shared evenly among ties), zero to the "
              "other {n_less}"),
    "Logsumexp": Op("logsumexp", "log Σ exp(x) over {over}{keepdims}",
                    "each element receives ∂L/∂y · softmax(x) over that axis"),
    "Cumsum": Op("cumsum", "the running sum along axis {axis}",
                 "each element receives the sum of ∂L/∂y over its own and every later position "
                 "along axis {axis}"),
    # no gradient: boolean or integer results
    "NotEqual": Op("not_equal", "{x} != {y} (boolean)", NO_GRADIENT.format(what="boolean")),
    "Equal": Op("equal", "{x} == {y} (boolean)", NO_GRADIENT.format(what="boolean")),
    "Greater": Op("greater", "{x} > {y} (boolean)", NO_GRADIENT.format(what="boolean")),
    "GreaterEqual": Op("greater_equal", "{x} >= {y} (boolean)",
                       NO_GRADIENT.format(what="boolean")),
    "Less": Op("less", "{x} < {y} (boolean)", NO_GRADIENT.format(what="boolean")),
    "LessEqual": Op("less_equal", "{x} <= {y} (boolean)", NO_GRADIENT.format(what="boolean")),
    "LogicalAnd": Op("logical_and", "{x} and {y}", NO_GRADIENT.format(what="boolean")),
    "LogicalOr": Op("logical_or", "{x} or {y}", NO_GRADIENT.format(what="boolean")),
    "LogicalNot": Op("logical_not", "not x", NO_GRADIENT.format(what="boolean")),
    "Any": Op("any", "whether any value is true over {over}{keepdims} (boolean)",
              NO_GRADIENT.format(what="boolean")),
    "All": Op("all", "whether every value is true over {over}{keepdims} (boolean)",
              NO_GRADIENT.format(what="boolean")),
    "Argmax": Op("argmax", "the index of the maximum along axis {axis} (integer)",
                 NO_GRADIENT.format(what="an integer index")),
    "Argmin": Op("argmin", "the index of the minimum along axis {axis} (integer)",
                 NO_GRADIENT.format(what="an integer index")),
    "OneHot": Op("one_hot", "one-hot vectors of {num_classes} classes from integer indices",
                 NO_GRADIENT.format(what="made from integer indices")),
    "StopGradient": Op("stop_gradient", "x, unchanged, as a constant for differentiation",
                       "none: stop_gradient blocks it on purpose"),
    # moving values
    "Reshape": Op("reshape", "x reshaped to {newshape}",
                  "reshaped back; every value receives its own entry's gradient"),
    "Transpose": Op("transpose", "x with its axes permuted to {axes}",
                    "transposed back by the inverse permutation"),
    "ExpandDims": Op("expand_dims", "x with a new axis of size 1 at {axis}",
                     "the size-1 axis is squeezed out again"),
    "Squeeze": Op("squeeze", "x without its size-1 axis {axis}",
                  "the removed axis is put back"),
    "Concatenate": Op("concatenate", "{operands} joined along axis {axis}",
                      "split back along axis {axis} by the inputs' widths: {widths}"),
    "Stack": Op("stack", "{operands} stacked on a new axis {axis}",
                "unstacked: each input receives its slice along axis {axis}"),
    "GetItem": Op("get_item", "a slice or index of x (x[…])",
                  "the selected elements receive their gradient, the others zero"),
    "Slice": Op("slice", "a slice of x", "the sliced elements receive their gradient, the others "
                "zero"),
    "Take": Op("take", "elements of x picked by integer indices along axis {axis}",
               "scattered back and summed at the picked positions; the indices receive none"),
    "Tile": Op("tile", "x tiled {repeats} times", "each element receives the sum over its copies"),
    "Repeat": Op("repeat", "each element of x repeated {repeats} times along axis {axis}",
                 "each element receives the sum over its {repeats} copies"),
    "BroadcastTo": Op("broadcast_to", "x broadcast to {shape}",
                      "summed over the broadcast axes"),
    "Pad": Op("pad", "x padded with constants by {pad_width} (before, after) per axis",
              "cropped back: the padding receives nothing and every real element its own "
              "gradient"),
    "Where": Op("where", "where(condition, a, b): a where the condition holds, b elsewhere, "
                "from {operands}",
                "goes to a where the condition holds and to b elsewhere (a constant a or b "
                "receives none); the condition receives none"),
    "Cast": Op("cast", "x converted to {dtype}",
               "passes unchanged from a float x to a float {dtype}; none otherwise"),
}


def _label(facts: LayerFacts, k: int) -> str:
    return facts.label(k, "tensor") if k < len(facts.input_shapes) else "a constant"


def _operand(facts: LayerFacts, k: int) -> str:
    if k < len(facts.input_shapes):
        return f"{_label(facts, k)} {shape_text(facts.input_shapes[k])}"
    return "a constant"


def _reduced(facts: LayerFacts) -> tuple[str, str]:
    """How many elements a reduction over the config's axis combines, and that number less one."""
    shape = facts.input_shape
    axis = facts.option("axis")
    if not shape:
        return "the number reduced", "elements"
    if axis is None:  # every axis, the batch too
        rest = count(shape)
        every = "batch" if rest is None else f"(batch × {rest})"
        return every, f"{every} − 1 elements"
    axes = [axis_index(shape, int(a)) for a in
            (axis if isinstance(axis, list | tuple) else [axis])]
    dims = [shape[a] for a in axes if 0 <= a < len(shape)]
    if not dims or 0 in axes or any(d is None for d in dims):
        return "the number reduced", "elements"
    reduced = prod(int(d or 0) for d in dims)
    return str(reduced), f"{reduced - 1} elements"


def _widths(facts: LayerFacts) -> str:
    axis = int(facts.option("axis", 0) or 0)
    widths = [dim(shape, axis) for shape in facts.input_shapes]
    known = [width for width in widths if width is not None]
    if len(known) < len(widths):
        return "each input its own positions"
    return spans(known, [facts.label(k, "tensor") for k in range(len(known))])


class _Fields(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "?"


def _fields(facts: LayerFacts) -> _Fields:
    fields = _Fields({key: value for key, value in facts.config.items() if key != "name"})
    axis = facts.option("axis")
    fields["axis"] = "all" if axis is None else axis
    if axis is None:
        fields["over"] = "every axis, the batch too"
    elif isinstance(axis, list | tuple):
        fields["over"] = "axes " + ", ".join(str(a) for a in axis)
    else:
        fields["over"] = f"axis {axis}"
    fields["keepdims"] = " (axes kept)" if facts.option("keepdims") else ""
    fields["x"], fields["y"] = _operand(facts, 0), _operand(facts, 1)
    fields["a"], fields["b"] = _label(facts, 0), _label(facts, 1)
    fields["operands"] = ", ".join(_operand(facts, k) for k in range(len(facts.input_shapes)))
    fields["n"], fields["n_less"] = _reduced(facts)
    fields["widths"] = _widths(facts)
    dtype = facts.option("dtype")
    fields["dtype"] = dtype if isinstance(dtype, str) else "?"
    for key in ("negative_slope", "alpha"):
        if key not in fields:
            fields[key] = {"negative_slope": 0.2, "alpha": 1.0}[key]
    return fields


def _spec(facts: LayerFacts) -> Op:
    return OPS[facts.class_name.removeprefix(PREFIX)]


def _binary(op: Op) -> bool:
    return "{x}" in op.computes and "{y}" in op.computes


#: Elementwise operations that broadcast their operands.
BROADCASTING = {"Add", "Subtract", "Multiply", "TrueDivide", "Divide", "Power", "Maximum",
                "Minimum", "Where"}


def _operand_fields(facts: LayerFacts, op: Op) -> _Fields:
    fields = _fields(facts)
    if _binary(op) and len(facts.input_shapes) < 2:
        # Which operand the constant was is not in LayerFacts (x − 2 or 2 − x).
        fields["x"] = fields["a"] = "a"
        fields["y"] = fields["b"] = "b"
    return fields


@register
class OpExplainer(LayerExplainer):
    """Every operation of :data:`OPS`, registered as ``ops.<ClassName>``; the facts may carry
    either that key or the bare class name."""

    class_names = tuple(op_key(name) for name in OPS)

    def summary(self, facts: LayerFacts) -> str:
        op = _spec(facts)
        text = op.computes.format_map(_operand_fields(facts, op))
        if _binary(op) and len(facts.input_shapes) < 2:
            return (f"keras.ops.{op.function}: {text}, one of a, b being {_operand(facts, 0)} "
                    "and the other a constant")
        shapes = ", ".join(shape_text(shape) for shape in facts.input_shapes)
        mentioned = "{x}" in op.computes or "{operands}" in op.computes
        return f"keras.ops.{op.function}: {text}" + (f" on {shapes}" if shapes and not mentioned
                                                      else "")

    def gradient_note(self, facts: LayerFacts) -> str:
        op = _spec(facts)
        name = facts.class_name.removeprefix(PREFIX)
        if name == "Cast":
            dtype = str(facts.option("dtype", ""))
            if dtype.startswith(("float", "bfloat")):
                return (f"passes unchanged from a float input (cast to {dtype}); a boolean or "
                        "integer input receives none")
            return NO_GRADIENT.format(what=dtype or "not a float")
        note = op.gradient.format_map(_operand_fields(facts, op))
        if _binary(op) and len(facts.input_shapes) < 2:
            note += "; the constant operand receives none"
        if name in BROADCASTING:
            note += ("; an operand broadcast to a larger shape has its gradient summed over the "
                     "broadcast axes")
        return note
