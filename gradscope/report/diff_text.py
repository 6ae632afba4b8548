"""Render ``gradscope diff`` for a terminal: one row per tensor that changed, and a verdict."""

from __future__ import annotations

from collections import Counter

from rich.console import RenderableType
from rich.text import Text

from gradscope.formats import number
from gradscope.report.layout import Column, Layout, atom, fit, pack, section
from gradscope.report.models import DiffReport
from gradscope.report.tables import folded


def render_diff(report: DiffReport, width: int) -> list[RenderableType]:
    title = Text.assemble(("gradscope diff", "bold"), "  ", (report.base, "bold cyan"), " → ",
                          (report.new, "bold cyan"))
    loss = (f"loss {number(report.loss_base)} → {number(report.loss_new)}"
            if report.loss_base is not None or report.loss_new is not None else "")
    details = pack([f"{report.compared_tensors} tensors in both", *([loss] if loss else []),
                    f"rtol {report.rtol:g}"], width)
    details.stylize("dim")
    parts: list[RenderableType] = [title, details]
    if not report.changes:
        parts.append(Text(f"NO DRIFT: every gradient, its shape and the loss agree within rtol "
                          f"{report.rtol:g}", style="bold green"))
        return parts
    wide = Layout([Column("tensor"), Column("change"), Column("base", "right"),
                   Column("new", "right"), Column("detail")], squeeze=False)
    # Narrower: the values join the detail, on lines of their own; a long name folds after a
    # "/" and the kind never wraps (found tried as a new user would: "ch/an/ge", "re" for
    # both removed and renamed, "…recurrent_k" / "ernel").
    narrow = Layout([Column("tensor"), Column("change", no_wrap=True), Column("detail")])
    limit = max(12, (width - len("nonfinite") - 6) // 2)
    for change in report.changes:
        base = number(change.base) if change.base is not None else "–"
        new = number(change.new) if change.new is not None else "–"
        wide.add_row(Text(change.tensor), atom(change.kind, "yellow"), atom(base), atom(new),
                     Text(change.detail))
        # Labelled: under a shape's detail the values are its ‖g‖, not the shapes' numbers.
        values = (f"\n{'loss' if change.kind == 'loss' else '‖g‖'} {base} → {new}"
                  if change.base is not None or change.new is not None else "")
        narrow.add_row(atom(folded(change.tensor, limit)), atom(change.kind, "yellow"),
                       Text(" ".join(folded(word, limit) for word in change.detail.split(" "))
                            + values))
    count = len(report.changes)
    parts += [section(f"What changed ({count} change{'s' if count != 1 else ''})"),
              fit(width, wide, narrow)]
    if report.drifted:
        parts.append(Text(f"DRIFT: {_counted(report)} (exit 1)", style="bold red"))
    else:  # names alone changed (Keras' numbering): each compared under its new name
        parts.append(Text(f"NO DRIFT: every gradient, its shape and the loss agree within rtol "
                          f"{report.rtol:g}; {count} tensor{'s' if count != 1 else ''} under "
                          "another name, compared as one", style="bold green"))
    return parts


def _counted(report: DiffReport) -> str:
    """The changes by kind: "13 changes: 5 of another shape; 7 ‖g‖ and the loss beyond rtol
    0.0001" (a shape change was counted as a change beyond rtol)."""
    kinds: Counter[str] = Counter(str(change.kind) for change in report.changes)
    count = len(report.changes)
    said = [f"{kinds[kind]} {words}" for kind, words in (
        ("added", "added"), ("removed", "removed"), ("renamed", "renamed"),
        ("shape", "of another shape"), ("nonfinite", "no longer finite"),
        ("flag", "flag" + ("s" if kinds["flag"] != 1 else "") + " changed")) if kinds[kind]]
    moved = ([f"{kinds['norm']} ‖g‖"] if kinds["norm"] else []) + (
        ["the loss"] if kinds["loss"] else [])
    if moved:
        said.append(" and ".join(moved) + f" beyond rtol {report.rtol:g}")
    return f"{count} change{'s' if count != 1 else ''}: " + "; ".join(said)
