"""Numbers and shapes as every report writes them, in words and in tables (no rich, no
numpy): one format for each."""

from __future__ import annotations

from collections.abc import Iterable


def percent(share: float) -> str:
    """A carried share as the text shows it: 0.18 → '18.0%', 1.2e-7 → '1.20e-05%', 0 → '0',
    1.013 → '101%' (three figures, and no point left dangling)."""
    return "0" if share == 0 else f"{100 * share:#.3g}".rstrip(".") + "%"


def share(value: float) -> str:
    """A share of values, as :func:`percent` gives it, but "0%" for none."""
    return "0%" if value == 0 else percent(value)


def number(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    return f"{value:.2e}"


def shape_text(shape: Iterable[int]) -> str:
    dims = list(shape)
    return f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(str(d) for d in dims) + ")"


def read_on(examples: Iterable[int]) -> str:
    """A carried ratio read on some of the examples: ``examples`` is (how many it rests on,
    how many ran)."""
    reached, ran = examples
    return f"read on {reached} of the {ran} examples"
