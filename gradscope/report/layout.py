"""The layout engine of the text reports: columns that fit the terminal's width (a name too
long for its column takes a line of its own), packed lines that never split an item, section
titles and sparklines, and lines drawn without trailing spaces. It knows nothing of the
reports themselves."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.table import Table
from rich.text import Text


def atom(text: str | Text, style: str = "") -> Text:
    """Text that is never wrapped: a number, a shape, a name, or lines already packed."""
    atom_text = Text(text, style=style) if isinstance(text, str) else text
    atom_text.no_wrap = True
    return atom_text


def pack(items: Sequence[str | Text], width: int, separator: str = " · ") -> Text:
    """Join ``items`` with ``separator``, starting a new line before an item that would pass
    ``width``; the items themselves are never split."""
    packed = Text()
    line_width = 0
    for index, item in enumerate(items):
        piece = Text(item) if isinstance(item, str) else item
        # Room for the separator that ends the line if another item follows.
        tail = 0 if index == len(items) - 1 else cell_len(separator.rstrip())
        if index == 0:
            pass
        elif line_width + cell_len(separator) + piece.cell_len + tail <= width:
            packed.append(separator)
            line_width += cell_len(separator)
        else:
            packed.append(separator.rstrip() + "\n")
            line_width = 0
        packed.append_text(piece)
        line_width += piece.cell_len
    return packed


#: Cell padding is one space each side, none at the table's edges, plus a one-space divider.
GAP = 3


@dataclass
class Column:
    title: str
    justify: str = "left"
    #: The whole column, header included, never wraps (otherwise only its atom cells do not).
    no_wrap: bool = False
    #: Never narrower than this: e.g. the longest alias line, which must stay on one line.
    min_width: int = 0


@dataclass
class Layout:
    columns: list[Column]
    rows: list[list[Text]] = field(default_factory=list)
    #: May be drawn narrower than its natural width, wrapping free text and headers at spaces.
    #: Otherwise the layout is used only where everything fits on its natural lines.
    squeeze: bool = True

    def add_row(self, *cells: str | Text) -> None:
        self.rows.append([Text(cell) if isinstance(cell, str) else cell for cell in cells])

    def measure(self) -> list[tuple[int, int]]:
        """(narrowest, natural) content width of each column."""
        ranges = []
        for index, column in enumerate(self.columns):
            cells = [(Text(column.title), column.no_wrap)]
            cells += [(row[index], column.no_wrap or bool(row[index].no_wrap))
                      for row in self.rows]
            natural = narrowest = 1
            for cell, whole in cells:
                lines = cell.plain.split("\n")
                longest_line = max(cell_len(line) for line in lines)
                natural = max(natural, longest_line)
                words = [cell_len(word) for word in cell.plain.split()]
                narrowest = max(narrowest, longest_line if whole else max(words, default=0))
            narrowest = max(narrowest, column.min_width)
            ranges.append((narrowest, max(natural, narrowest)))
        return ranges


def _padding(index: int, count: int) -> int:
    return (index > 0) + (index < count - 1)


def _squeeze(ranges: list[tuple[int, int]], width: int) -> list[int] | None:
    """Content widths that fit ``width``, narrowing the widest columns first (as rich does)
    but never below a column's narrowest width; None if that is still too wide."""
    count = len(ranges)
    # Work on padded widths, as rich does, so that the result matches rich wherever rich's own
    # narrowing keeps every word whole.
    pads = [_padding(i, count) for i in range(count)]
    widths = [natural + pad for (_, natural), pad in zip(ranges, pads, strict=True)]
    floors = [narrowest + pad for (narrowest, _), pad in zip(ranges, pads, strict=True)]
    available = width - (count - 1)
    while sum(widths) > available:
        excess = sum(widths) - available
        shrinkable = [i for i in range(count) if widths[i] > floors[i]]
        if not shrinkable:
            return None
        widest = max(widths[i] for i in shrinkable)
        next_widest = max((widths[i] for i in shrinkable if widths[i] != widest), default=0)
        step = min(excess, widest - next_widest)
        targets = [i for i in shrinkable if widths[i] == widest]
        remaining, shares = step, len(targets)
        for i in targets:
            cut = min(widths[i] - floors[i], round(remaining / shares))
            widths[i] -= cut
            remaining -= cut
            shares -= 1
    return [w - pad for w, pad in zip(widths, pads, strict=True)]


def _draw(layout: Layout, widths: list[int] | None) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for index, column in enumerate(layout.columns):
        table.add_column(column.title, justify=column.justify,  # type: ignore[arg-type]
                         no_wrap=column.no_wrap, overflow="fold",
                         width=None if widths is None else widths[index])
    for row in layout.rows:
        table.add_row(*row)
    return table


def fit(width: int, *layouts: Layout) -> Table:
    """The first layout that fits ``width``, on its natural lines or, where it may be squeezed
    (the last one always may), narrower; else the last one, as narrow as it goes."""
    for layout in layouts:
        ranges = layout.measure()
        natural = sum(n for _, n in ranges) + GAP * (len(ranges) - 1)
        if natural <= width:
            return _draw(layout, None)
        if layout.squeeze or layout is layouts[-1]:
            widths = _squeeze(ranges, width)
            if widths is not None:
                return _draw(layout, widths)
    last = layouts[-1]
    return _draw(last, [narrowest for narrowest, _ in last.measure()])


def column_width(cells: Iterable[Text], title: str = "") -> int:
    return max([cell_len(title), *(cell_len(line) for cell in cells
                                    for line in cell.plain.split("\n"))])


#: Below this width the statistics move into the formula column, and the errata are stacked.
WIDE = 110


def section(title: str) -> Text:
    return Text("\n" + title, style="bold underline")


def title(what: str, subject: str) -> Text:
    """A report's first line: what it is in bold, then what it is about in bold cyan."""
    return Text.assemble((what, "bold"), "  ", (subject, "bold cyan"))


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """Log-scale sparkline of positive values, averaged down to ``width`` characters."""
    if not values:
        return ""
    array = np.asarray(values, dtype=np.float64)
    chunks = np.array_split(array, min(width, len(array)))
    means = np.array([chunk.mean() for chunk in chunks])
    logs = np.log10(np.maximum(means, 1e-300))
    positive = means > 0
    if not positive.any():
        return SPARKS[0] * len(means)
    low, high = logs[positive].min(), logs[positive].max()
    if high == low:
        # One level (a single value, or all alike): drawn at mid height, not as the lowest
        # mark (found tried as a new user would: the only value, the largest, drawn "▁").
        level = SPARKS[(len(SPARKS) - 1) // 2]
        return "".join(level if ok else " " for ok in positive)
    span = high - low
    return "".join(
        SPARKS[int(round((value - low) / span * (len(SPARKS) - 1)))] if ok else " "
        for value, ok in zip(logs, positive, strict=True)
    )


#: The longest sparkline, and the shortest worth keeping the labels on one line for.
SPARK_WIDTH, SPARK_MIN = 60, 16


def hanging(mark: str, text: str, style: str = "") -> Table:
    """``mark text`` with the text's wrapped lines indented under its first word (a hanging
    indent), as ``⚠ …`` and ``✓ …`` lines are drawn."""
    grid = Table.grid(padding=(0, 1, 0, 0))
    grid.add_column(no_wrap=True)
    grid.add_column()
    grid.add_row(Text(mark, style=style), Text(text, style=style))
    return grid


def wrapped(text: str, width: int) -> str:
    """``text`` (an error or a refusal: one line, or lines of their own) wrapped at ``width``
    columns between words, never inside one (a number, a path or a name stays whole, longer
    than the line if it must), each line's continuation indented two more than the line:
    what stderr gets on a terminal (found tried as a new user would: an .npz's problems on
    lines of 104–109 columns)."""
    out: list[str] = []
    for line in text.splitlines() or [""]:
        indent = " " * (len(line) - len(line.lstrip(" ")))
        out += textwrap.wrap(line, width=max(width, 20), subsequent_indent=indent + "  ",
                             break_long_words=False, break_on_hyphens=False) or [line]
    return "\n".join(out)


def warning(text: str) -> Table:
    """A ``⚠ …`` line in bold yellow, with a hanging indent."""
    return hanging("⚠", text, "bold yellow")


@dataclass
class Trimmed:
    """A renderable drawn without the spaces that end its lines: rich pads every cell of a
    table, and every wrapped line, to its full width, which a file or a diff then keeps."""

    renderable: RenderableType

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Any]:
        for line in console.render_lines(self.renderable, options, pad=False):
            yield from trimmed(line)
            yield Segment.line()


def trimmed(line: list[Segment]) -> list[Segment]:
    """``line`` without its trailing spaces (the styles of what remains kept)."""
    kept = list(line)
    while kept and not kept[-1].control and not kept[-1].text.rstrip(" "):
        kept.pop()
    if kept and not kept[-1].control:
        last = kept[-1]
        kept[-1] = Segment(last.text.rstrip(" "), last.style)
    return kept
