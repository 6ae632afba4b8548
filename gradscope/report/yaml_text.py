"""The text renderers of a YAML config's reports: shapes, explain, check, check --layer, and
the inference of ``gradscope spec``."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gradscope.formats import (
    number,
    shape_text,
)
from gradscope.report.layout import (
    GAP,
    WIDE,
    Column,
    Layout,
    Trimmed,
    atom,
    column_width,
    fit,
    hanging,
    pack,
    section,
    title,
    warning,
)
from gradscope.report.models import (
    CarryEntry,
    CheckReport,
    ErratumEntry,
    ExplainReport,
    FlowSection,
    GradientEntry,
    LayerCheckReport,
    ModelEntry,
    ShapesReport,
    SpecInference,
    StateGradientEntry,
    TensorEntry,
    WeightsEntry,
)
from gradscope.report.tables import (
    CARRIED_COLUMNS,
    WITNESS_TITLES,
    all_agree,
    carried_tables,
    carry_check_section,
    checked_section,
    failed_line,
    failures_section,
    flag_warnings,
    jacobian_table,
    norm_table,
    stats_items,
    timings_lines,
    tolerances_text,
)


def header(command: str, model: ModelEntry, loss_line: str, width: int) -> Group:
    heading = title(f"gradscope {command}", model.chain)
    details = pack([f"batch {model.batch_size} × time {model.time_steps}", loss_line,
                    model.dtype, f"{model.weight_count:,} weights"], width)
    details.stylize("dim")
    # The recurrent layers' own layouts (found tried as a new user would: "layout block" of a
    # model whose one recurrent layer says layout: keras).
    kinds = list(dict.fromkeys(layer.layout or model.layout for layer in model.layers
                               if layer.type != "dense")) or [model.layout]
    layout = f"layout {kinds[0]}" if len(kinds) == 1 else f"layouts {', '.join(kinds)}"
    source = pack([layout, f"data {model.data}"], width)
    source.stylize("dim")
    return Group(heading, details, source)


def _name_cell(name: str, shape: list[int]) -> Text:
    return atom(Text.assemble((name, "bold"), "\n", (shape_text(shape), "cyan")))


#: What each alias is, as the line under the formula says it.
#: "stored as": the name the weights were read under, a checkpoint's variable or an .npz's
#: array (found tried as a new user would: an .npz's arrays were said to be a checkpoint's).
ALIAS_LABELS = {"tf1": "TF1", "keras": "Keras", "checkpoint": "stored as"}


def alias_line(entry: TensorEntry, width: int | None = None) -> Text:
    """"TF1 rnn/multi_rnn_cell/cell_0/gru_cell/gates/kernel". Kept on one line; only a name
    longer than ``width`` (a checkpoint's, say) is folded, after a '/'."""
    label = f"{ALIAS_LABELS[entry.alias_source]} "
    text = label + entry.alias
    if width is not None and cell_len(text) > width:
        lines, line = [], label
        for part in re.findall(r"[^/]+/?", entry.alias):
            if cell_len(line) + cell_len(part) > width and line.strip():
                lines.append(line)
                line = ""
            line += part
        text = "\n".join([*lines, line])
    return atom(text, "dim")


def _formula_cell(entry: TensorEntry, stats: Text | None = None,
                  alias: Text | None = None) -> Text:
    text = Text.assemble((f"= {entry.formula}", "cyan"), "\n", (entry.meaning, ""))
    if alias is not None:
        text.append("\n")
        text.append_text(alias)
    if stats is not None:
        stats.stylize("bold")
        text.append("\n")
        text.append_text(stats)
    return text


def _stacked_cell(entry: TensorEntry, width: int, stats: Text | None = None) -> Text:
    """Everything about one tensor in one column: name and shape, alias, formula, meaning."""
    head = pack([Text(entry.name, "bold"), Text(shape_text(entry.shape), "cyan")], width, "  ")
    return Text.assemble(atom(head), "\n", _formula_cell(entry, stats, alias_line(entry, width)))


def tensor_layouts(entries: Sequence[TensorEntry], width: int, title: str,
                   stats: Sequence[Sequence[str]] | None = None) -> list[Layout]:
    """The name and shape in one column, then the formula, meaning, alias (and the statistics
    packed under them); or, narrower, all of it stacked in one column."""
    names = [_name_cell(e.name, e.shape) for e in entries]
    aliases = [alias_line(e) for e in entries]
    alias_width = max((a.cell_len for a in aliases), default=0)
    text_width = width - column_width(names, title) - GAP
    beside = Layout([Column(title, no_wrap=True),
                     Column("formula · meaning · alias", min_width=alias_width)])
    stacked = Layout([Column(f"{title} · formula · meaning · alias")])
    for index, (name, entry) in enumerate(zip(names, entries, strict=True)):
        items = None if stats is None else stats[index]
        beside.add_row(name, _formula_cell(entry, None if items is None else
                                           pack(items, text_width), aliases[index]))
        cell = _stacked_cell(entry, width, None if items is None else pack(items, width))
        if index < len(entries) - 1:
            cell.append("\n")  # one column: a blank line tells the tensors apart
        stacked.add_row(cell)
    return [beside, stacked]


def gradient_table(gradients: list[GradientEntry], width: int) -> Table:
    tensor_title = "tensor · shape"
    layouts = []
    if width >= WIDE:
        names = [_name_cell(e.name, e.shape) for e in gradients]
        aliases = [alias_line(e) for e in gradients]
        wide = Layout([Column(tensor_title, no_wrap=True),
                       Column("formula · meaning · alias",
                              min_width=max(a.cell_len for a in aliases)),
                       Column("‖g‖₂", "right"), Column("mean|g|", "right"),
                       Column("max|g|", "right"), Column("NaN/Inf", "right")])
        for name, alias, entry in zip(names, aliases, gradients, strict=True):
            s = entry.stats
            wide.add_row(name, _formula_cell(entry, alias=alias), atom(number(s.l2)),
                         atom(number(s.mean_abs)), atom(number(s.max_abs)),
                         atom(str(s.nonfinite), "bold red" if s.nonfinite else ""))
        layouts.append(wide)
    stats = [stats_items(e.stats) for e in gradients]
    layouts += tensor_layouts(gradients, width, tensor_title, stats)
    return fit(width, *layouts)


def state_table(states: list[StateGradientEntry], width: int) -> Table:
    name_title = "∂L/∂ initial state"
    # The argument each state is passed as, said so (found tried as a new user would: a bare
    # "initial_state" under the name read as a row of its own).
    names = [atom(Text.assemble((e.name, "bold"), "\n", (f"as {e.alias}", "dim")))
             for e in states]
    wide = Layout([Column(name_title), Column("shape = formula"), Column("‖g‖₂", "right"),
                   Column("per-example ‖g‖ min", "right"), Column("median", "right"),
                   Column("max", "right"), Column("NaN/Inf", "right")], squeeze=False)
    for name, entry in zip(names, states, strict=True):
        norms = entry.per_example_norm
        wide.add_row(name, atom(f"{shape_text(entry.shape)} = {entry.formula}", "cyan"),
                     atom(number(entry.stats.l2)), atom(number(norms.min)),
                     atom(number(norms.median)), atom(number(norms.max)),
                     atom(str(entry.stats.nonfinite)))
    text_width = width - column_width(names, name_title) - GAP
    stacked = Layout([Column(name_title), Column("shape = formula · statistics")])
    for name, entry in zip(names, states, strict=True):
        norms = entry.per_example_norm
        formula = pack([f"{shape_text(entry.shape)} =", *entry.formula.split()], text_width, " ")
        formula.stylize("cyan")
        stats = pack([f"‖g‖₂ {number(entry.stats.l2)}",
                      f"per-example ‖g‖ min {number(norms.min)}",
                      f"median {number(norms.median)}", f"max {number(norms.max)}",
                      f"NaN/Inf {entry.stats.nonfinite}"], text_width)
        stacked.add_row(name, atom(Text.assemble(formula, "\n", stats)))
    return fit(width, wide, stacked)


def carry_section(carry: CarryEntry, width: int) -> Group:
    layout = Layout([Column("y: previous batch's final state"), Column("shape"),
                     Column("grad_y: this batch's gradient"), Column("shape")])
    for pair in carry.pairs:
        layout.add_row(atom(pair.y), atom(shape_text(pair.y_shape)), atom(f"∂L/∂{pair.grad_y}"),
                       atom(shape_text(pair.grad_y_shape)))
    lines = [Text("• " + line) for line in carry.explanation]
    return Group(fit(width, layout), *lines)


def carried_section(carry: CarryEntry, width: int) -> list[RenderableType]:
    """``explain --chunks``: per weight, full vs truncated BPTT; per chunk, the seed's product;
    and one line: does carrying matter here?"""
    assert carry.weights is not None and carry.products is not None
    lengths = " + ".join(str(n) for n in carry.chunk_lengths or [])
    return carried_tables(
        f"The batch cut into {carry.chunks} chunks of {lengths} steps, in float64. "
        f"{CARRIED_COLUMNS}", carry.weights, carry.products, carry.threshold or 0.0,
        bool(carry.matters), carry.verdict or "", width)


def render_explain(report: ExplainReport, width: int) -> list[RenderableType]:
    loss = report.loss
    parts: list[RenderableType] = [
        header("explain", report.model,
               f"loss {loss.name} = {'n/a' if loss.value is None else f'{loss.value:.6g}'}",
               width),
        section(
            f"Gradients of the mean loss ({len(report.gradients)} tensors; shapes are the real TF "
            "gradient shapes, checked against the shape algebra)"
        ),
        gradient_table(report.gradients, width),
        section("Initial-state gradients ∂L/∂h0 (what flows into the previous batch)"),
        state_table(report.initial_state_gradients, width),
        section("Carrying gradients into the previous truncated batch"),
        carry_section(report.carry, width),
    ]
    if report.weights is not None:
        parts[1:1] = weights_section(report.weights, width)
    if report.not_finite is not None:  # under the header, before anything else
        parts[1:1] = [warning(f"{report.not_finite}: this run's gradients are not usable "
                              "(exit 1)")]
    if report.carry.weights is not None:
        parts += [section(f"The carry in numbers: truncated BPTT in {report.carry.chunks} "
                          "chunks, with and without the carry"),
                  *carried_section(report.carry, width)]
    if report.state_jacobians is not None:
        parts += [section("State Jacobians ∂h_T^(j)/∂h_0^(i): how much of the initial state "
                          "survives to the end (medians over the batch)"),
                  jacobian_table(report.state_jacobians, width)]
    if report.gradient_flow is not None:
        parts += [section("Gradient flow over time (log-scale sparklines, t = 0 … T−1)"),
                  *flow_lines(report.gradient_flow, width)]
    parts += timings_lines(report.timings, "\n")
    return parts


def flow_lines(flow: FlowSection, width: int) -> list[RenderableType]:
    rows = {f"‖∂L/∂{name}_t‖": norms for name, norms in flow.state_gradient_norms.items()}
    rows["‖∂L/∂x_t‖"] = flow.input_gradient_norms
    rows[f"‖∂{flow.influence_layer}/h_{flow.influence_step}/∂x_s‖ median (s = 0 … T−1)"] = \
        flow.influence
    return [norm_table(rows, width), *flag_warnings(flow.flags)]


def render_shapes(report: ShapesReport, width: int) -> list[RenderableType]:
    return [
        header("shapes", report.model, f"loss {report.loss.name}", width),
        section(f"Weights ({len(report.tensors)} tensors; each gradient has the same shape)"),
        fit(width, *tensor_layouts(report.tensors, width, "tensor · shape")),
        section("Initial states (their gradients ∂L/∂h0 have these shapes)"),
        fit(width, *tensor_layouts(report.initial_states, width, "initial state · shape")),
    ]


def errata_section(errata: list[ErratumEntry], width: int) -> Table:
    layouts = []
    if width >= WIDE:
        wide = Layout([Column("#", "right"), Column("the documentation says"),
                       Column("the kernel does"), Column("evidence on this model"), Column("")])
        for erratum in errata:
            wide.add_row(str(erratum.number), Text(erratum.documented), Text(erratum.actual),
                         Text(erratum.evidence), _confirmed(erratum))
        layouts.append(wide)
    stacked = Layout([Column("#", "right"), Column("erratum")])
    for erratum in errata:
        stacked.add_row(str(erratum.number), Text.assemble(
            ("the documentation says: ", "dim"), erratum.documented, "\n",
            ("the kernel does: ", "dim"), erratum.actual, "\n",
            ("evidence on this model: ", "dim"), erratum.evidence, "\n", _confirmed(erratum)))
    layouts.append(stacked)
    return fit(width, *layouts)


def _confirmed(erratum: ErratumEntry) -> Text:
    return atom("confirmed" if erratum.confirmed else "not confirmed",
                "yellow" if erratum.confirmed else "dim")


#: An equation line: the formula, two or more spaces, then a remark.
REMARK = re.compile(r"^(\s*)(\S.*\S)\s{2,}(\S.*)$")


def equation_lines(equations: str, width: int) -> Text:
    """The equations as written; where a line is too wide, its remark goes on the next line."""
    lines = []
    for line in equations.split("\n"):
        match = REMARK.match(line)
        if cell_len(line) > width and match:
            indent, formula, remark = match.groups()
            lines += [indent + formula, indent + "    " + remark]
        else:
            lines.append(line)
    return Text("\n".join(lines))


def render_check(report: CheckReport, width: int) -> list[RenderableType]:
    """A YAML model's check; ``report.equations`` (when asked for) is drawn at the end."""
    parts: list[RenderableType] = [
        header("check", report.model, f"loss {report.loss.name} = {number(report.loss.value)}",
               width),
        Text(f"every witness compares with TF autodiff on a float64 copy of the model; "
             f"relative tolerances: {tolerances_text(report)}", style="dim"),
        *checked_section(report, width),
    ]
    if report.weights is not None:
        parts[2:2] = weights_section(report.weights, width)
    if report.not_finite is not None:
        parts[1:1] = [warning(f"in {report.model.dtype}: {report.not_finite}")]
    if report.against_not_returned:
        parts.append(Text(f"not returned by --against (not checked by it): "
                          f"{', '.join(report.against_not_returned)}", style="yellow"))
    parts += failures_section(report) + held_lines(report)
    if report.carry is not None:
        parts += [section("Truncated BPTT: carrying gradients across chunk boundaries"),
                  carry_check_section(report.carry, width)]
    if report.errata:
        confirmed = sum(e.confirmed for e in report.errata)
        if report.equations is not None:
            parts += [section("GRUBlockCellGrad: the corrected backward equations"),
                      equation_lines(report.equations, width),
                      section("Errata in the public GRUBlockCellGrad documentation"),
                      errata_section(report.errata, width)]
        else:
            parts.append(Text(
                f"\nGRUBlockCellGrad documentation: {confirmed} of {len(report.errata)} errata "
                "confirmed on this model (gradscope check --equations shows them)", style="dim"))
    if report.not_finite is not None and not report.summary.failed_tensors:
        parts.append(Text(f"\nFAILED: all {report.summary.checked_tensors} tensors agree with "
                          f"every witness in float64, but in {report.model.dtype}, as the "
                          "config runs, the loss or a gradient is not finite",
                          style="bold red"))
    else:
        parts.append(all_agree(report))
    return parts + timings_lines(report.timings)


def held_lines(report: CheckReport) -> list[RenderableType]:
    """The tensors a witness passed at a wider tolerance than its own, or left unwitnessed,
    and why (the NumPy reference's, where rounding grows along the model): a line for each
    reason, the tensors and the tolerances they were held to."""
    held: dict[tuple[str, str, bool], list[tuple[str, float]]] = {}
    for tensor in report.tensors:
        for entry in tensor.witnesses:
            if entry.passed and entry.detail and (
                    entry.unresolved
                    or entry.tolerance > report.tolerances.get(entry.witness, entry.tolerance)):
                held.setdefault((entry.witness, entry.detail, entry.unresolved), []).append(
                    (tensor.name, entry.tolerance))
    lines: list[RenderableType] = []
    for (witness, detail, unresolved), tensors in held.items():
        names = ", ".join(name for name, _ in tensors)
        if unresolved:
            lines.append(Text(f"{WITNESS_TITLES[witness]} on {names}: {detail}", style="dim"))
            continue
        low, high = min(t for _, t in tensors), max(t for _, t in tensors)
        span = f"{low:.1e}" if low == high else f"between {low:.1e} and {high:.1e}"
        lines.append(Text(f"{WITNESS_TITLES[witness]} held {names} to {span}, not "
                          f"{report.tolerances[witness]:.0e}: {detail}", style="dim"))
    return lines


def render_layer_check(report: LayerCheckReport, width: int) -> list[RenderableType]:
    """``check --against FUNC --layer NAME``: what FUNC received, then the usual table."""
    summary = report.summary
    layout = "(features, batch, time), --time-last" if report.time_last else \
        "(batch, time, features)"
    received = [f"{a.name} {shape_text(a.shape)}" for a in report.arguments]
    received[0] = f"it received {received[0]}"
    parts: list[RenderableType] = [
        header("check", report.model, f"loss {report.loss.name} = {number(report.loss.value)}",
               width),
        Text(f"layer {report.layer} ({report.cell}) alone: {report.against}(x, h0, params, "
             f"dh) given dh = ∂L/∂h_t from above, without the carry; arrays {layout}"),
        pack(received, width),
        Text(f"TF autodiff on a float64 copy of the model, read at {report.layer}, is the "
             f"truth; relative tolerances: {tolerances_text(report)}", style="dim"),
        *checked_section(report, width),
    ]
    if report.weights is not None:
        parts[1:1] = weights_section(report.weights, width)
    if report.against_not_returned:
        parts.append(Text(f"not returned (not checked): {', '.join(report.against_not_returned)}",
                          style="yellow"))
    parts += failures_section(report)
    parts.append(
        Text(f"\nPASSED: your backward of {report.layer} agrees with TF and the NumPy "
             f"reference on all {summary.checked_tensors} tensors", style="bold green")
        if summary.passed else failed_line(report))
    return parts + timings_lines(report.timings)


def weights_section(entry: WeightsEntry, width: int) -> list[RenderableType]:
    """Where each weight came from: the file's own name beside gradscope's. The title names
    the file, not its folder path (a long path cannot fit 60 columns; the JSON keeps it)."""
    name = entry.source.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    title = section(f"Weights read from {name} ({entry.format}; layers matched by "
                    f"{entry.matched_by})")
    wide = Layout([Column("weight"), Column("from the file's variable"), Column("shape")])
    stacked = Layout([Column("weight · shape ← the file's variable")])
    for item in entry.mapping:
        source = Text("\n".join(item.variables))
        if item.conversion:
            source.append("\n" + item.conversion, style="dim")
        wide.add_row(atom(item.name, "bold"), source, atom(shape_text(item.shape), "cyan"))
        stacked.add_row(Text.assemble((item.name, "bold"), " ", (shape_text(item.shape), "cyan"),
                                      " ←\n", source))
    parts: list[RenderableType] = [title, fit(width, wide, stacked)]
    if entry.ignored:
        ignored = ", ".join(f"{i.variable} ({i.reason})" for i in entry.ignored)
        parts.append(Text(f"ignored, not model weights: {ignored}", style="dim"))
    return parts


def inference_lines(report: SpecInference) -> Trimmed:
    """Why each value of an inferred spec is what it is (gradscope spec prints it on stderr):
    each item's wrapped lines hang under its first word (found tried as a new user would:
    "features" and "x" alone at the first column)."""
    lines: list[RenderableType] = [hanging("gradscope spec:",
                                           f"{report.source} ({report.format})")]
    for item in report.inferences:
        mark = "" if item.known else " (default)"
        lines.append(hanging(" ", f"{item.key}{mark}: {item.reason}"))
    if report.ignored:
        lines.append(hanging(" ", "ignored, not model weights: " + ", ".join(
            f"{i.variable} ({i.reason})" for i in report.ignored)))
    return Trimmed(Group(*lines))
