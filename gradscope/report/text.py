"""Render reports for a terminal with rich. Colour only where rich finds a terminal that wants it
(NO_COLOR and a non-TTY stdout both give plain text)."""

from __future__ import annotations

from collections.abc import Iterable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from gradscope.report.models import (
    CarryEntry,
    ExplainReport,
    GradientEntry,
    ModelEntry,
    ShapesReport,
    StateGradientEntry,
    TensorEntry,
)


def number(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    return f"{value:.2e}"


def shape_text(shape: Iterable[int]) -> str:
    dims = list(shape)
    return f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(str(d) for d in dims) + ")"


def header(command: str, model: ModelEntry, loss_line: str) -> Group:
    title = Text.assemble((f"gradscope {command}", "bold"), "  ", (model.chain, "bold cyan"))
    details = Text(
        f"batch {model.batch_size} × time {model.time_steps} · {loss_line} · {model.dtype} · "
        f"{model.weight_count:,} weights",
        style="dim",
    )
    source = Text(f"layout {model.layout} · data {model.data}", style="dim")
    return Group(title, details, source)


def _tensor_cell(name: str, alias: str, shape: list[int]) -> Text:
    return Text.assemble((name, "bold"), "\n", (alias, "dim"), "\n", (shape_text(shape), "cyan"))


def _formula_cell(entry: TensorEntry, stats_line: str = "") -> Text:
    text = Text.assemble((f"= {entry.formula}", "cyan"), "\n", (entry.meaning, ""))
    if stats_line:
        text.append("\n" + stats_line, style="bold")
    return text


def _table(*columns: tuple[str, str]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for title, justify in columns:
        table.add_column(title, justify=justify, overflow="fold")  # type: ignore[arg-type]
    return table


#: Below this width the statistics move into the formula column, as one line.
WIDE = 110


def gradient_table(gradients: list[GradientEntry], width: int) -> Table:
    wide = width >= WIDE
    columns = [("tensor · alias · shape", "left"), ("formula · meaning", "left")]
    if wide:
        columns += [("‖g‖₂", "right"), ("mean|g|", "right"), ("max|g|", "right"),
                    ("NaN/Inf", "right")]
    table = _table(*columns)
    for entry in gradients:
        s = entry.stats
        name = _tensor_cell(entry.name, entry.alias, entry.shape)
        if wide:
            nonfinite = Text(str(s.nonfinite), style="bold red" if s.nonfinite else "")
            table.add_row(name, _formula_cell(entry), number(s.l2), number(s.mean_abs),
                          number(s.max_abs), nonfinite)
        else:
            line = (f"‖g‖₂ {number(s.l2)} · mean|g| {number(s.mean_abs)} · "
                    f"max|g| {number(s.max_abs)} · NaN/Inf {s.nonfinite}")
            table.add_row(name, _formula_cell(entry, line))
    table.columns[0].no_wrap = True
    return table


def state_table(states: list[StateGradientEntry]) -> Table:
    table = _table(
        ("∂L/∂ initial state", "left"), ("shape = formula", "left"), ("‖g‖₂", "right"),
        ("per-example ‖g‖ min", "right"), ("median", "right"), ("max", "right"),
        ("NaN/Inf", "right"),
    )
    for entry in states:
        table.add_row(
            Text.assemble((entry.name, "bold"), "\n", (entry.alias, "dim")),
            Text(f"{shape_text(entry.shape)} = {entry.formula}", style="cyan"),
            number(entry.stats.l2), number(entry.per_example_norm.min),
            number(entry.per_example_norm.median), number(entry.per_example_norm.max),
            str(entry.stats.nonfinite),
        )
    return table


def carry_section(carry: CarryEntry) -> Group:
    table = _table(("y: previous batch's final state", "left"), ("shape", "left"),
                   ("grad_y: this batch's gradient", "left"), ("shape", "left"))
    for pair in carry.pairs:
        table.add_row(pair.y, shape_text(pair.y_shape), f"∂L/∂{pair.grad_y}",
                      shape_text(pair.grad_y_shape))
    lines = [Text("• " + line) for line in carry.explanation]
    return Group(table, *lines)


def section(title: str) -> Text:
    return Text("\n" + title, style="bold underline")


def render_explain(report: ExplainReport, width: int) -> list[RenderableType]:
    loss = report.loss
    parts: list[RenderableType] = [
        header("explain", report.model,
               f"loss {loss.name} = {'n/a' if loss.value is None else f'{loss.value:.6g}'}"),
        section(
            f"Gradients of the mean loss ({len(report.gradients)} tensors; shapes are the real TF "
            "gradient shapes, checked against the shape algebra)"
        ),
        gradient_table(report.gradients, width),
        section("Initial-state gradients ∂L/∂h0 (what flows into the previous batch)"),
        state_table(report.initial_state_gradients),
        section("Carrying gradients into the previous truncated batch"),
        carry_section(report.carry),
    ]
    if report.timings:
        laps = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in report.timings.items())
        parts.append(Text(f"\ntimings: {laps}", style="dim"))
    return parts


def render_shapes(report: ShapesReport) -> list[RenderableType]:
    table = _table(("tensor · alias · shape", "left"), ("formula · meaning", "left"))
    for entry in report.tensors:
        table.add_row(_tensor_cell(entry.name, entry.alias, entry.shape), _formula_cell(entry))
    states = _table(("initial state · shape", "left"), ("formula · meaning", "left"))
    for entry in report.initial_states:
        states.add_row(_tensor_cell(entry.name, entry.alias, entry.shape), _formula_cell(entry))
    return [
        header("shapes", report.model, f"loss {report.loss.name}"),
        section(f"Weights ({len(report.tensors)} tensors; each gradient has the same shape)"),
        table,
        section("Initial states (their gradients ∂L/∂h0 have these shapes)"),
        states,
    ]


def print_report(console: Console, report: ExplainReport | ShapesReport) -> None:
    if isinstance(report, ExplainReport):
        parts = render_explain(report, console.width)
    else:
        parts = render_shapes(report)
    for part in parts:
        console.print(part)
