"""Render reports for a terminal with rich. Colour only where rich finds a terminal that wants it
(NO_COLOR and a non-TTY stdout both give plain text)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from gradscope.report.models import (
    CarryCheck,
    CarryEntry,
    CheckReport,
    ErratumEntry,
    ExplainReport,
    GradientEntry,
    GradientFlow,
    JacobianEntry,
    KerasExplainReport,
    KerasShapesReport,
    ModelEntry,
    ShapesReport,
    StateGradientEntry,
    TensorEntry,
    WitnessEntry,
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
        table.add_row(Text(pair.y), shape_text(pair.y_shape), Text(f"∂L/∂{pair.grad_y}"),
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
    if report.state_jacobians is not None:
        parts += [section("State Jacobians ∂h_T^(j)/∂h_0^(i): how much of the initial state "
                          "survives to the end (medians over the batch)"),
                  jacobian_table(report.state_jacobians)]
    if report.gradient_flow is not None:
        parts += [section("Gradient flow over time (log-scale sparklines, t = 0 … T−1)"),
                  *flow_lines(report.gradient_flow)]
    if report.timings:
        laps = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in report.timings.items())
        parts.append(Text(f"\ntimings: {laps}", style="dim"))
    return parts


def jacobian_table(entries: list[JacobianEntry]) -> Table:
    table = _table(("∂ final state", "left"), ("/ ∂ initial state", "left"), ("block", "left"),
                   ("‖J‖_F median", "right"), ("(min … max)", "right"), ("σ_max", "right"),
                   ("σ_min", "right"))
    for entry in entries:
        table.add_row(Text(entry.target), Text(entry.source), shape_text(entry.shape),
                      number(entry.frobenius_median),
                      f"{number(entry.frobenius_min)} … {number(entry.frobenius_max)}",
                      number(entry.largest_singular_median), number(entry.smallest_singular_median))
    return table


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
    span = high - low if high > low else 1.0
    return "".join(
        SPARKS[int(round((value - low) / span * (len(SPARKS) - 1)))] if ok else " "
        for value, ok in zip(logs, positive, strict=True)
    )


def flow_lines(flow: GradientFlow) -> list[RenderableType]:
    table = _table(("sequence", "left"), ("t = 0 … T−1", "left"), ("at t=0", "right"),
                   ("at t=T−1", "right"))
    rows = {f"‖∂L/∂{name}_t‖": norms for name, norms in flow.state_gradient_norms.items()}
    rows["‖∂L/∂x_t‖"] = flow.input_gradient_norms
    rows[f"‖∂{flow.influence_layer}/h_{flow.influence_step}/∂x_s‖ (s = 0 … T−1)"] = \
        flow.influence
    for label, norms in rows.items():
        table.add_row(Text(label), Text(sparkline(norms), style="cyan"), number(norms[0]),
                      number(norms[-1]))
    lines: list[RenderableType] = [table]
    for flag in flow.flags:
        lines.append(Text(f"⚠ {flag.message}", style="bold yellow"))
    if not flow.flags:
        lines.append(Text("no vanishing or exploding gradients flagged", style="dim"))
    return lines


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


def print_report(console: Console,
                 report: ExplainReport | ShapesReport | CheckReport | KerasExplainReport
                 | KerasShapesReport,
                 equations: str | None = None) -> None:
    if isinstance(report, KerasExplainReport | KerasShapesReport):
        from gradscope.report.keras_text import render_keras

        parts = render_keras(report)
    elif isinstance(report, ExplainReport):
        parts = render_explain(report, console.width)
    elif isinstance(report, CheckReport):
        parts = render_check(report, equations)
    else:
        parts = render_shapes(report)
    for part in parts:
        console.print(part)


WITNESS_TITLES = {
    "finite_differences": "finite diff.",
    "numpy_reference": "NumPy ref.",
    "gru_block_kernel": "GRUBlockCellGrad",
    "tbptt_carry": "TBPTT carry",
    "against": "--against",
}


def _verdict(entry: WitnessEntry) -> Text:
    value = "no value" if entry.error is None else f"{entry.error:.1e}"
    if entry.passed:
        return Text(f"✓ {value}", style="green")
    return Text(f"✗ {value}", style="bold red")


def check_table(report: CheckReport) -> Table:
    witnesses = report.summary.witnesses
    table = _table(("tensor", "left"), ("shape", "left"),
                   *((WITNESS_TITLES[w], "right") for w in witnesses))
    table.columns[0].no_wrap = True
    for tensor in report.tensors:
        cells: list[Text | str] = [
            Text(tensor.name, style="bold" if tensor.passed else "bold red"),
            shape_text(tensor.shape) if tensor.shape else "",
        ]
        for witness in witnesses:
            entries = [e for e in tensor.witnesses if e.witness == witness]
            if not entries:
                cells.append(Text("–", style="dim"))
            else:
                worst = max(entries, key=lambda e: (not e.passed, e.error or 0.0))
                cells.append(_verdict(worst))
        table.add_row(*cells)
    return table


def check_failures(report: CheckReport) -> list[Text]:
    lines = []
    for tensor in report.tensors:
        for entry in tensor.witnesses:
            if entry.passed:
                continue
            where = f" (first wrong step counting back: t={entry.first_bad_step})" if (
                entry.first_bad_step is not None) else ""
            value = "" if entry.error is None else (
                f": relative error {entry.error:.2e} > {entry.tolerance:.0e}")
            lines.append(Text(f"✗ {tensor.name} · {WITNESS_TITLES[entry.witness]}{value}{where}",
                              style="red"))
            if entry.detail:
                lines.append(Text(f"    {entry.detail}"))
    return lines


def carry_check_section(carry: CarryCheck) -> Group:
    table = _table(("boundary", "left"), ("ys: earlier chunk's final states", "left"),
                   ("grad_ys: later chunk's ∂L/∂(initial states)", "left"))
    for boundary in carry.boundaries:
        ys = "\n".join(f"{y.name} {shape_text(y.shape)}" for y in boundary.ys)
        grad_ys = "\n".join(f"{g.name} {shape_text(g.shape)} ‖·‖ {number(g.norm)}"
                            for g in boundary.grad_ys)
        table.add_row(f"t = {boundary.step}", Text(ys), Text(grad_ys))
    lengths = " + ".join(str(n) for n in carry.chunk_lengths)
    intro = Text(
        f"{carry.chunks} chunks of {lengths} steps, backpropagated last to first; each "
        "chunk's initial-state gradients are the output_gradients (grad_ys) of the earlier "
        "chunk's final states, one per y. The summed weight gradients are compared with "
        "full BPTT in the table above."
    )
    return Group(intro, table)


def errata_section(errata: list[ErratumEntry]) -> Table:
    table = _table(("#", "right"), ("the documentation says", "left"), ("the kernel does", "left"),
                   ("evidence on this model", "left"), ("", "left"))
    for erratum in errata:
        table.add_row(str(erratum.number), Text(erratum.documented), Text(erratum.actual),
                      Text(erratum.evidence),
                      Text("confirmed" if erratum.confirmed else "not confirmed",
                           style="yellow" if erratum.confirmed else "dim"))
    return table


def render_check(report: CheckReport, equations: str | None = None) -> list[RenderableType]:
    summary = report.summary
    tolerances = " · ".join(f"{WITNESS_TITLES[w]} {t:.0e}" for w, t in report.tolerances.items())
    parts: list[RenderableType] = [
        header("check", report.model, f"loss {report.loss.name} = {number(report.loss.value)}"),
        Text(f"every witness compares with TF autodiff on a float64 copy of the model; "
             f"relative tolerances: {tolerances}", style="dim"),
        section(f"Gradients checked ({summary.checked_tensors} tensors, "
                f"{summary.comparisons} comparisons)"),
        check_table(report),
    ]
    if report.against_not_returned:
        parts.append(Text(f"not returned by --against (not checked by it): "
                          f"{', '.join(report.against_not_returned)}", style="yellow"))
    failures = check_failures(report)
    if failures:
        parts += [section("What failed"), *failures]
    if report.carry is not None:
        parts += [section("Truncated BPTT: carrying gradients across chunk boundaries"),
                  carry_check_section(report.carry)]
    if report.errata:
        confirmed = sum(e.confirmed for e in report.errata)
        if equations is not None:
            parts += [section("GRUBlockCellGrad: the corrected backward equations"),
                      Text(equations),
                      section("Errata in the public GRUBlockCellGrad documentation"),
                      errata_section(report.errata)]
        else:
            parts.append(Text(
                f"\nGRUBlockCellGrad documentation: {confirmed} of {len(report.errata)} errata "
                "confirmed on this model (gradscope check --equations shows them)", style="dim"))
    verdict = (Text(f"\nPASSED: all {summary.checked_tensors} tensors agree with every witness "
                    f"({', '.join(summary.witnesses)})", style="bold green")
               if summary.passed else
               Text(f"\nFAILED: {len(summary.failed_tensors)} of {summary.checked_tensors} "
                    f"tensors disagree: {', '.join(summary.failed_tensors)}", style="bold red"))
    parts.append(verdict)
    if report.timings:
        laps = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in report.timings.items())
        parts.append(Text(f"timings: {laps}", style="dim"))
    return parts
