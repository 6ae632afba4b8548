"""Shapes in words, for the summaries of the weightless layers (no explainer lives here)."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from gradscope.keras.layers.base import LayerFacts, Shape


def shape_text(shape: Shape) -> str:
    """``(None, 7, 4)`` → ``(batch, 7, 4)``; an unknown axis other than the batch is ``?``."""
    if not shape:
        return "(batch)"
    rest = ", ".join("?" if d is None else str(d) for d in shape[1:])
    return f"(batch, {rest})" if rest else "(batch)"


def size(dim: int | None) -> str:
    return "?" if dim is None else str(dim)


def axis_index(shape: Shape, axis: int) -> int:
    """A Keras axis (negative counts from the end) as an index into ``shape``."""
    return axis % len(shape) if shape else axis


def dim(shape: Shape, axis: int) -> int | None:
    if not shape:
        return None
    index = axis_index(shape, axis)
    return shape[index] if 0 <= index < len(shape) else None


def count(shape: Shape) -> int | None:
    """The number of values per example (every axis but the batch), None if one is unknown."""
    rest = shape[1:]
    if any(d is None for d in rest):
        return None
    return prod(int(d) for d in rest if d is not None)


def steps_axis(facts: LayerFacts) -> int:
    """The time axis of a 1D (sequence) layer: 1 for channels_last, 2 for channels_first."""
    return 2 if facts.option("data_format", "channels_last") == "channels_first" else 1


def spans(widths: Sequence[int], labels: Sequence[str]) -> str:
    """Where each of the concatenated inputs stands along the joined axis, as its gradient is
    split back: "0–3 to input (4), 4–7 to dense output (4)"."""
    parts, start = [], 0
    for width, label in zip(widths, labels, strict=True):
        span = f"{start}" if width == 1 else f"{start}–{start + width - 1}"
        parts.append(f"{span} to {label} ({width})")
        start += width
    return ", ".join(parts)


def steps_of(facts: LayerFacts, axis: int = 1) -> int | None:
    """The length of the first input's time axis (``axis``), None if unknown or absent."""
    shape = facts.input_shape
    return shape[axis] if len(shape) > axis else None


def feature_axis(facts: LayerFacts) -> int:
    return 1 if facts.option("data_format", "channels_last") == "channels_first" else -1


def pair(value: object, default: tuple[int, int]) -> tuple[int, int]:
    """A Keras (before, after) argument saved as a list, a tuple or one int."""
    if value is None:
        return default
    if isinstance(value, int):
        return value, value
    items = list(value)  # type: ignore[call-overload]
    return int(items[0]), int(items[1])


def first(value: object, default: int) -> int:
    """A 1D pool size or stride saved as ``[2]``, ``(2,)`` or ``2``."""
    if value is None:
        return default
    if isinstance(value, int):
        return value
    return int(list(value)[0])  # type: ignore[call-overload]


def number(value: float) -> str:
    """A rate or scale as the user would write it: 0.3, 1.4286."""
    return f"{value:.5g}"


def setting(facts: LayerFacts, key: str, default: float) -> tuple[str, str]:
    """A layer's one number and the head of its summary, both as the user would write them:
    ("0.3", "LeakyReLU negative_slope 0.3 on (batch, 7, 4)")."""
    value = number(float(facts.option(key, default)))
    return value, f"{facts.class_name} {key} {value} on {shape_text(facts.input_shape)}"
