"""Render the explanation of a user's Keras model for a terminal (rich), at any width from 60
columns: two columns, the name and shape never wrapped, the words folded between words."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from gradscope.formats import number, read_on, shape_text
from gradscope.report.layout import (
    GAP,
    Column,
    Layout,
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
    EVERY_WITNESS,
    DiagnoseReport,
    KerasCarry,
    KerasCheckReport,
    KerasExplainReport,
    KerasFlowSection,
    KerasGradientEntry,
    KerasLayerEntry,
    KerasLossEntry,
    KerasMixedPrecision,
    KerasModelEntry,
    KerasNotAnalysed,
    KerasPerExample,
    KerasShapesReport,
    KerasStateEntry,
    KerasStateJacobians,
    KerasTensorSpec,
    NonFiniteEntry,
)
from gradscope.report.tables import (
    CARRIED_COLUMNS,
    NO_FLAGS,
    NOT_RUN,
    WITNESS_TITLES,
    all_agree,
    carried_tables,
    carry_check_section,
    checked_section,
    failures_section,
    flag_warnings,
    jacobian_table,
    norm_table,
    stats_items,
    timings_lines,
    tolerances_text,
)


def _file_name(path: str) -> str:
    """The model file's name: a long folder path would not fit a narrow terminal (the JSON
    report keeps the whole path)."""
    return PurePath(path).name


def _dims(shape: list[int | None]) -> str:
    return "(" + ", ".join("batch" if i == 0 and d is None else ("?" if d is None else str(d))
                           for i, d in enumerate(shape)) + ")"


#: The text beside a name keeps at least this many columns; otherwise every name of the table
#: goes on a line of its own, with its text under it at the full width.
MIN_TEXT = 44


@dataclass(frozen=True)
class _Row:
    label: list[Text]  # the name, then its shape or class: one line each beside the text
    text: list[tuple[str, str]]  # (paragraph, style), one under the other
    items: list[str] = field(default_factory=list)  # packed under the text, never split


def _named_table(width: int, left: str, right: str, rows: list[_Row]) -> Table:
    """Names beside their text where the text keeps :data:`MIN_TEXT` columns; else each name
    on its own line (with its shape or class) and the text under it at full width."""
    labels = [Text("\n").join(row.label) for row in rows]
    text_width = width - column_width(labels, left) - GAP
    layouts = []
    if text_width >= MIN_TEXT:
        beside = Layout([Column(left, no_wrap=True), Column(right)])
        for label, row in zip(labels, rows, strict=True):
            beside.add_row(label, _with_items(row, text_width))
        layouts.append(beside)
    stacked = Layout([Column(f"{left} · {right}")])
    for index, row in enumerate(rows):
        cell = Text.assemble(atom(pack(row.label, width, "  ")), "\n", _with_items(row, width))
        if index < len(rows) - 1:
            cell.append("\n")  # one column: a blank line tells the rows apart
        stacked.add_row(cell)
    layouts.append(stacked)
    return fit(width, *layouts)


#: An operator stays with what follows it (``≤ 1``, ``× 2``): a label never parts from its
#: number.
_GLUE = re.compile(r"([≤≥=×]) (?=\S)")

#: A short bracket is one word too (a shape ``(batch, Tq 1, dim 8)``, an index ``p[i, k]``),
#: found tried as a new user would: "(batch, Tq 1," then "dim 8)".
_SHORT_GROUP = re.compile(r"\([^()\n]{1,20}\)|\[[^\[\]\n]{1,20}\]")


def _wrapped(paragraph: str, width: int, whole: re.Pattern[str] | None = None) -> str:
    """``paragraph`` wrapped at ``width`` here, where glued words are kept whole: textwrap
    breaks at ASCII spaces only, so a glue is a no-break space while it wraps, and a plain
    space again in the text shown (its lines fit, so rich does not wrap them again); so is
    every space of a short bracket (:data:`_SHORT_GROUP`). ``whole``: every match is kept
    whole too, never broken even where wider than ``width``."""
    def glued(line: str) -> str:
        line = _GLUE.sub("\\1\u00a0", line)
        for pattern in (_SHORT_GROUP, *([whole] if whole is not None else [])):
            line = pattern.sub(lambda m: m.group(0).replace(" ", "\u00a0"), line)
        return line

    return "\n".join(textwrap.fill(glued(line), width, break_on_hyphens=False,
                                    break_long_words=whole is None).replace("\u00a0", " ")
                      or line for line in paragraph.split("\n"))


def _with_items(row: _Row, width: int) -> Text:
    text = Text()
    for index, (paragraph, style) in enumerate(row.text):
        if index:
            text.append("\n")
        text.append(_wrapped(paragraph, width), style=style)
    if row.items:
        text.append("\n")
        text.append_text(pack([atom(item, "bold") for item in row.items], width))
    return text


def _model_title(command: str, model: KerasModelEntry | KerasShapesReport) -> Text:
    # A model object's label names the model already ("model 'x' (in memory)", "m.keras
    # (model 'x', loaded with your code)", as shapes' file gives it): the title names it once
    # (found tried as a new user would: "m.keras (model 'x', loaded with your code)
    # (Subclassed 'x')"), as explain's does.
    shown = "in memory" if model.file == f"model '{model.name}' (in memory)" else model.file
    loaded = f" (model '{model.name}', loaded with your code)"
    if shown.endswith(loaded):
        shown = shown[:-len(loaded)]
    return title(f"gradscope {command}", f"{_file_name(shown)} ({model.kind} "
                                         f"'{model.name}')")


def _inputs(inputs: list[KerasTensorSpec]) -> str:
    return ", ".join(f"{i.name} {_dims(i.shape)} {i.dtype}" for i in inputs)


@dataclass
class _ShapesWhole:
    """``hanging(mark, text, style)``, its text wrapped at the width it is drawn in with
    every parenthesis kept whole (found tried as a new user would: "outputs
    time_distributed (batch, 30," then "1)")."""

    mark: str
    text: str
    style: str = ""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Any:
        room = max(1, options.max_width - cell_len(self.mark) - 1)
        yield hanging(self.mark, _wrapped(self.text, room, _PARENTHESIS), self.style)


#: A parenthesis and what it holds (a shape).
_PARENTHESIS = re.compile(r"\([^()]*\)")


def _inference(effects: list[str] | None) -> str:
    """What inference mode changes, as the header says it: what the model's layers do
    (nothing said where none changes); where code of the user's may change anything, that
    its layers are called with training=False (found tried as a new user would: "dropout
    off, batch norm uses its moving statistics" of a model with neither)."""
    if effects is None:
        return " (your layers get training=False)"
    return f" ({', '.join(effects)})" if effects else ""


def header(report: KerasExplainReport | KerasCheckReport | DiagnoseReport,
           command: str = "explain") -> list[RenderableType]:
    model, loss = report.model, report.loss
    value = "n/a" if loss.value is None else f"{loss.value:.6g}"
    outputs = ", ".join(f"{o.name} {_dims(o.shape)}" for o in model.outputs)
    return [
        _model_title(command, model),
        # Each line's wrapped lines hang under its first word's value.
        hanging("batch", f"{model.batch_size} · {model.mode} mode"
                + (_inference(model.mode_effects) if model.mode == "inference"
                   else f" (seed {model.seed})")
                + f" · {model.weight_count:,} trainable parameters"
                + (f" · dtype policy {model.dtype_policy} (computes in {model.compute_dtype})"
                   if model.dtype_policy else ""), "dim"),
        hanging("loss", f"= {value}: {loss.name}{_added(loss)}", "dim"),
        *loss_terms(loss),
        # Wrapped lines hang under the first input's name, not at the first column, and a
        # shape is never parted.
        _ShapesWhole("inputs", f"{_inputs(model.inputs)} · outputs {outputs}", "dim"),
        Text(f"data {model.data}", style="dim"),
    ]


def _added(loss: KerasLossEntry) -> str:
    """' + 3 added terms (below)': what the loss line's value holds beyond the output losses
    it names (found tried as a new user would: "loss = 2.24196: mean_squared_error", the
    value the sum of it, two regularizers and an add_loss)."""
    added = sum(1 for term in loss.terms if term.kind != "output")
    if not added or not loss.outputs:
        return ""
    return f" + {added} added term{'s' if added > 1 else ''} (below)"


#: Settings of a loss that are Keras' defaults for every loss, left unsaid.
_DEFAULT_SETTINGS = {"reduction": "sum_over_batch_size", "from_logits": False,
                     "label_smoothing": 0.0, "axis": -1}


def loss_terms(loss: KerasLossEntry) -> list[RenderableType]:
    """The terms of the loss, one per line, where there is more than the one output loss the
    header names (as their sum), or that loss has settings, a weight or a mask worth saying
    (its line alone)."""
    said = [{key: value for key, value in (term.settings or {}).items()
             if _DEFAULT_SETTINGS.get(key, object()) != value} for term in loss.terms]
    plain = (len(loss.terms) == 1 and not said[0] and not loss.terms[0].counted
             and loss.terms[0].weight in (None, 1.0))
    if not loss.terms or plain:
        return []
    table = Table.grid(padding=(0, 2, 0, 0))
    table.add_column(justify="right", no_wrap=True)
    table.add_column()
    for term, settings in zip(loss.terms, said, strict=True):
        parts = [term.detail, *(key if value is True else f"{key}\u00a0{value}"
                                for key, value in settings.items())]
        if term.weight not in (None, 1.0):
            parts.append(f"×\u00a0loss\u00a0weight\u00a0{term.weight:g}")
        if term.counted:
            parts.append(term.counted)
        value = "n/a" if term.value is None else f"{term.value:.6g}"
        table.add_row(Text(value, style="dim"),
                      Text(f"{term.name}: {' · '.join(parts)}", style="dim"))
    # One term is the loss itself: said alone, not as a sum of one.
    return [*([Text("  the sum of:", style="dim")] if len(loss.terms) > 1 else []),
            Padding(table, (0, 0, 0, 2))]


def layer_table(layers: list[KerasLayerEntry], width: int) -> Table:
    rows = []
    for layer in layers:
        ins = " ".join(_dims(s) for s in layer.input_shapes) or "–"
        outs = " ".join(_dims(s) for s in layer.output_shapes)
        flow = f"{ins} → {outs}" if outs else f"input {ins}"
        calls = f" · {layer.calls} calls" if layer.calls > 1 else ""
        text = [(layer.summary, "cyan"), (flow, "dim"), ("∂: " + layer.gradient_note, "")]
        rows.append(_Row([Text(layer.name, "bold"), Text(layer.class_name + calls, "dim")],
                         text))
    return _named_table(width, "layer · type", "what it computes · what it does to the gradient",
                        rows)


def _formula_text(formula: str | None, meaning: str) -> list[tuple[str, str]]:
    return ([(f"= {formula}", "cyan")] if formula else []) + [(meaning, "")]


def gradient_table(gradients: list[KerasGradientEntry], width: int) -> Table:
    rows = []
    for entry in gradients:
        text = _formula_text(entry.formula, entry.meaning)
        if entry.sparse is not None:
            sparse = entry.sparse
            # A row indexed but masked (mask_zero's 0) gets zeros (found tried as a new user
            # would: "50 of 50 rows received a gradient", the padding row's all 0).
            zero = ("" if sparse.rows_nonzero in (None, sparse.rows_with_gradient) else
                    f", {sparse.rows_nonzero} of them a gradient other than 0")
            text.append((f"IndexedSlices: {sparse.rows_with_gradient} of {sparse.rows} rows "
                         f"indexed by the batch's token ids{zero}", ""))
        rows.append(_Row([Text(entry.name, "bold"), Text(shape_text(entry.shape), "cyan")],
                         text, stats_items(entry.stats)))
    return _named_table(width, "tensor · shape", "formula · meaning · statistics", rows)


def state_table(states: list[KerasStateEntry], width: int) -> Table:
    rows = []
    for entry in states:
        norms = entry.per_example_norm
        items = stats_items(entry.stats)
        if norms is not None:
            items += [f"per-example ‖g‖ min {number(norms.min)}",
                      f"median {number(norms.median)}", f"max {number(norms.max)}"]
        rows.append(_Row([Text(entry.name, "bold"), Text(shape_text(entry.shape), "cyan")],
                         [(entry.source, ""), (f"→ {entry.flows_to}", "")], items))
    return _named_table(width, "∂L/∂ initial state",
                        "where it comes from · where its gradient goes", rows)


def _not_analysed(entries: list[KerasNotAnalysed]) -> list[RenderableType]:
    return [Text(f"· {entry.layer}: not analysed: {entry.reason}", style="yellow")
            for entry in entries]


def jacobian_lines(jacobians: KerasStateJacobians, width: int) -> list[RenderableType]:
    parts: list[RenderableType] = [
        section("State Jacobians ∂h_T/∂h_0 of every recurrent call: how much of the initial "
                "state survives to the end (medians over the batch)")]
    if jacobians.entries:
        parts.append(jacobian_table(jacobians.entries, width))
    else:
        parts.append(Text("no recurrent call could be analysed", style="dim"))
    parts += _not_analysed(jacobians.not_analysed)
    parts.append(Text(jacobians.method, style="dim"))
    return parts


def _norm_label(what: str) -> str:
    """‖what‖, a qualifier that ends ``what`` kept outside the bars: ``‖∂L/∂rnn/states[1]_t‖
    (as step t+1 reads it)``."""
    head, bracket, qualifier = what.partition(" (")
    return f"‖{head}‖" + (f" ({qualifier}" if bracket else "")


def flow_lines(flow: KerasFlowSection, width: int) -> list[RenderableType]:
    parts: list[RenderableType] = [
        section("Gradient flow over time (log-scale sparklines, t = 0 … T−1; ∂L/∂h_t is the "
                "total: from above at t plus what flows back from t+1"
                + ("; a row marked (as step t+1 reads it) holds only that part"
                   if any("(as step t+1 reads it)" in s.what for s in flow.sequences) else "")
                + ")")]
    # A call that reads its input backwards says so in one word, Keras' own argument (found
    # tried as a new user would: "(read backwards)" wrapped after "(read" at 80 columns).
    # A Bidirectional's backward direction says it in its label already (found tried as a
    # new user would: "(go_backwards)" wrapped onto a line of its own beside it).
    labels = {id(s): _norm_label(s.what) + (" (go_backwards)" if s.backwards
                                            and "/backward/" not in s.what else "")
              for s in flow.sequences if s.norms}
    rows = {labels[id(s)]: s.norms for s in flow.sequences if s.norms}
    ran = {labels[id(s)]: s.examples_ran for s in flow.sequences if s.norms}
    for found in flow.influence:
        rows[f"‖∂{found.source}/h_{found.step}/∂x_s‖ median (s = 0 … T−1)"] = found.influence
    if rows:
        parts.append(norm_table(rows, width, ran))
        skipped = [counts for counts in ran.values() if counts is not None]
        if skipped:
            # Found tried as a new user would: "at t=T−1 0" under a padded batch, whose
            # loss reads each example's last state that ran.
            parts.append(Text(
                "a mask skips some examples' steps: a step's norm is over the examples that "
                "ran it" + (f", and {NOT_RUN} marks one that none ran"
                            if any(0 in (c[0], c[-1]) for c in skipped) else ""),
                style="dim"))
    else:
        parts.append(Text("no recurrent call or float sequence input to show", style="dim"))
    if not flow.flags and flow.not_analysed and rows:
        # Nothing flagged is no all-clear for a call that was not read.
        count = len(flow.not_analysed)
        parts.append(Text(f"{NO_FLAGS} in what was analysed; {count} recurrent call"
                          f"{'' if count == 1 else 's'} not analysed (below)", style="dim"))
    else:
        parts += flag_warnings(flow.flags, drawn=bool(rows))
    flagged = {flag.what for flag in flow.flags}
    kept = [f"{s.source} ×{s.carried:.2e}" + (
        f" ({read_on(s.carried_examples)})" if s.carried_examples else "")
        for s in flow.sequences if s.carried is not None and s.what not in flagged]
    if kept:
        # Not flagged is not nothing: the ratio the flag reads, for each call it did not flag.
        parts.append(Text("carried back, every state joined, from each example's last step to "
                          f"its first (not flagged): {', '.join(kept)}", style="dim"))
    parts += _not_analysed(flow.not_analysed)
    parts.append(Text(flow.method, style="dim"))
    return parts


def nonfinite_lines(found: NonFiniteEntry | None) -> list[RenderableType]:
    """Where the first NaN or Inf was born: the pass, the place, the op and the cause."""
    if found is None:
        return []
    place = [found.layer or "not found"]
    if found.step is not None:
        place.append(f"step {found.step}")
    if found.examples:
        shown = ", ".join(map(str, found.examples[:8])) + (", …" if len(found.examples) > 8
                                                            else "")
        place.append(f"example{'s' if len(found.examples) > 1 else ''} {shown}")
    lines: list[RenderableType] = [
        section(f"Where the first NaN or Inf was born ({found.pass_} pass)"),
        hanging("✗", ", ".join(place) if place[0].startswith(found.origin)
                else f"{found.origin} {', '.join(place)}", "bold red")]
    if found.operation is not None:
        sizes = ", ".join(f"{number(m)}" for m in found.operation_inputs)
        lines.append(hanging(" ", f"op {found.operation}" + (f" (its inputs' max |x|: "
                                                               f"{sizes})" if sizes else "")))
    lines.append(hanging(" ", f"cause: {found.cause}", "bold"))
    return lines


def render_keras_explain(report: KerasExplainReport, width: int = 80) -> list[RenderableType]:
    parts: list[RenderableType] = [*header(report), *map(warning, report.warnings),
                                   *nonfinite_lines(report.nonfinite)]
    parts += [
        section(f"Layers ({len(report.layers)})"),
        layer_table(report.layers, width),
        section(f"Gradients of the loss ({len(report.gradients)} tensors; every value is "
                f"Keras' own{_shapes_checked(report.gradients)})"),
        gradient_table(report.gradients, width),
    ]
    if report.initial_state_gradients:
        parts += [section("Initial-state gradients ∂L/∂(initial state)"),
                  state_table(report.initial_state_gradients, width)]
    if report.witnesses:
        parts.append(section("Witnesses: gradscope's own cells rerun each recurrent layer"))
        for witness in report.witnesses:
            mark = "✓" if witness.passed else "·"
            why = witness.detail.removeprefix("not witnessed: ")
            said = (f"not witnessed by {witness.witness}: {why}" if why != witness.detail
                    else f"{witness.witness} {witness.detail}")
            parts.append(hanging(mark, f"{witness.layer}: {said}",
                                 "green" if witness.passed else "dim"))
    if report.state_jacobians is not None:
        parts += jacobian_lines(report.state_jacobians, width)
    if report.gradient_flow is not None:
        parts += flow_lines(report.gradient_flow, width)
    if report.carry is not None:
        parts += carry_lines(report.carry, width)
    if report.per_example is not None:
        parts += per_example_lines(report.per_example, width)
    if report.mixed_precision is not None:
        parts += mixed_precision_lines(report.mixed_precision, width)
    parts += timings_lines(report.timings, "\n")
    return parts


def _shapes_checked(gradients: list[KerasGradientEntry]) -> str:
    """Which shapes explain checked against the algebra: those of the weights of a layer with
    a derivation (a formula); a layer of the user's has none."""
    derived = sum(entry.formula is not None for entry in gradients)
    if derived == len(gradients):
        return ", every shape checked against gradscope's algebra"
    if derived == 0:
        return "; no layer has a derivation, so no shape was checked against gradscope's algebra"
    return (f"; the shapes of the {derived} with a derivation checked against gradscope's "
            "algebra")


def per_example_lines(found: KerasPerExample, width: int) -> list[RenderableType]:
    """``explain --per-example``: the spread of ‖g_i‖ per layer and in total, then the top
    share, the outliers and the noise scale."""
    layout = Layout([Column("layer", no_wrap=True), Column("min", "right", True),
                     Column("median", "right", True), Column("max", "right", True),
                     Column("largest", "right", True)])
    for name, norms in [*found.layers.items(), ("all weights", found.l2)]:
        biggest = max(range(len(norms)), key=norms.__getitem__)
        layout.add_row(atom(name, "bold" if name == "all weights" else ""),
                       *(atom(number(v)) for v in (min(norms), float(_median(norms)),
                                                   max(norms))),
                       atom(f"#{biggest}"))
    count = len(found.l2)
    lines: list[RenderableType] = [
        section(f"Per-example gradients ‖∂L_i/∂θ‖ ({count} examples, {found.dtype})"),
        Text("L_i is example i's share of the batch loss (its sample weight times e_i); the "
             "examples' gradients add up to the batch gradient" + (
                 f", less that of the added terms ({number(found.added_terms)}: "
                 "regularizers, add_loss), which are no example's" if found.added_terms
                 is not None else "") + ". largest: the example with the largest norm."),
        fit(width, layout)]
    if found.top_share is not None:
        top = ("the example with the largest norm carries" if found.top_examples == 1 else
               f"the top {found.top_examples} of {count} examples by norm carry")
        lines.append(hanging("·", f"{top} {found.top_share:.0%} of Σ_i ‖g_i‖²"
                                  + (f" (of {count} examples)" if found.top_examples == 1
                                     else "")))
    if found.outliers:
        shown = ", ".join(f"#{i}" for i in found.outliers[:10])
        more = f" and {len(found.outliers) - 10} more" if len(found.outliers) > 10 else ""
        lines.append(warning(f"outliers (‖g_i‖ beyond the median + 3.5 scaled MADs): "
                             f"{shown}{more}"))
    else:
        lines.append(Text("no outliers (‖g_i‖ beyond the median + 3.5 scaled MADs)",
                          style="dim"))
    if found.noise_scale is not None:
        lines.append(hanging("·", f"gradient noise scale B_simple = tr(Σ)/|G|² ≈ "
                                  f"{number(found.noise_scale)} (batch {count}): a hint from "
                                  "one batch; a batch much larger than it gains little per "
                                  "example"))
    lines.append(Text(found.method, style="dim"))
    return lines


def mixed_precision_lines(found: KerasMixedPrecision, width: int) -> list[RenderableType]:
    """Under a mixed policy: per tensor, the shares lost at the loss scale (the float32
    shadow's, then the model's own), the safe range of scales, the warnings."""
    layout = Layout([Column("tensor"), Column("to 0", "right", True),
                     Column("subn.", "right", True), Column("inf", "right", True),
                     Column("mixed", "right", True)])
    for tensor in found.tensors:
        mixed = "/".join(_share(v) for v in tensor.mixed)
        layout.add_row(atom(tensor.label), *(atom(_share(v)) for v in (
            tensor.underflow, tensor.subnormal, tensor.overflow)),
            atom(mixed if tensor.agrees else f"{mixed} ≠", "" if tensor.agrees else "bold"))
    lines: list[RenderableType] = [
        section(f"Mixed precision ({found.policy}, loss scale {found.loss_scale:g}, "
                f"{found.optimizer})"),
        Text("The share of each tensor's entries that the loss scale times the float32 "
             f"shadow's gradient makes 0 (underflow), subnormal or inf (overflow) in "
             f"{found.compute_dtype}; mixed: the same three (to 0/subn./inf) on the model's "
             "own scaled backward (≠: more than 1% of the entries apart)."),
        fit(width, layout)]
    if found.scale_range is not None:
        low, high = found.scale_range
        where = ("no scale keeps both at zero" if low > high else
                 "the current scale is in it" if found.in_range else
                 "the current scale is outside it")
        lines.append(hanging("·", f"scales that keep both at zero, over the whole model: "
                                  f"[{number(low)}, {number(high)}] (|g| from "
                                  f"{number(found.smallest or 0)} to "
                                  f"{number(found.largest or 0)}): {where}"))
    lines += [warning(text) for text in found.warnings]
    lines.append(Text(found.method, style="dim"))
    return lines


def _share(value: float) -> str:
    return "0" if value == 0 else f"{value:.1%}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return (ordered[middle] if len(ordered) % 2 else
            (ordered[middle - 1] + ordered[middle]) / 2)


def carry_lines(carry: KerasCarry, width: int) -> list[RenderableType]:
    """``explain --chunks`` on a Keras model: full against truncated BPTT, per weight and
    chunk, as the YAML wing shows them, and how they were found."""
    # In time order, as the JSON has them; a go_backwards call runs the last chunk first
    # (found tried as a new user would: "4 + 3 + 3" read as the order it runs them).
    cut = "; ".join(f"{call.layer} {' + '.join(str(n) for n in call.chunk_lengths)}"
                    + (" in time order, run from the last" if call.backwards else "")
                    for call in carry.calls)
    agree = ("bitwise" if carry.carried_error == 0 else
             f"to a relative {number(carry.carried_error)}")
    intro = (f"Each recurrent call cut into {carry.chunks} chunks of its own steps ({cut}), in "
             f"{carry.dtype}; ‖g_full‖ is Keras' own tape, which the chunks, carried, give "
             f"back {agree}. {CARRIED_COLUMNS}")
    return [section(f"Truncated BPTT in {carry.chunks} chunks, with and without the carry"),
            *carried_tables(intro, carry.weights, carry.products, carry.threshold,
                            carry.matters, carry.verdict, width),
            Text(carry.method, style="dim")]


def render_keras_shapes(report: KerasShapesReport, width: int) -> list[RenderableType]:
    parts: list[RenderableType] = [
        _model_title("shapes", report),
        Text(f"inputs {_inputs(report.inputs)} · outputs {', '.join(report.outputs)} · "
             f"{report.weight_count:,} weights derived", style="dim"),
        Text(f"loss: {report.loss}", style="dim"),
        section(f"Layers ({len(report.layers)}; read from the model's config, nothing is run)"),
        layer_table(report.layers, width),
        section(f"Weights ({len(report.weights)} tensors; each gradient has the same shape)"),
    ]
    parts.append(_named_table(width, "tensor · shape", "formula · meaning", [
        _Row([Text(entry.name, "bold"), Text(shape_text(entry.shape), "cyan")],
             _formula_text(entry.formula, entry.meaning)) for entry in report.weights]))
    if report.underived:
        parts.append(Text(f"{NO_DERIVATION_SHAPES}: {', '.join(report.underived)}",
                          style="yellow"))
    return parts


NO_DERIVATION_SHAPES = ("no derivation for these layer types; their weights are listed with "
                        "the shapes the model stores")


def examples_lines(report: KerasCheckReport) -> list[RenderableType]:
    """Which examples were checked, where not every one of the batch was (or why a batch over
    the limit was checked whole)."""
    examples = report.examples
    if examples is None:
        return []
    if examples.whole_because:
        return [Text(f"all {examples.of} examples checked: {examples.whole_because}",
                     style="dim")]
    if examples.indices is None:
        return []
    drawn = examples.checked - len(examples.picked)
    # "example 7 (…)", "14 others drawn": found tried as a new user would, "7 (the fewest
    # kept steps …); 14 (the most …); 14 drawn with the seed" mixed indices with a count.
    chosen = [*(f"example {picked}" for picked in examples.picked),
              *([f"{drawn} {'others' if examples.picked else 'examples'} drawn with the "
                 "seed"] if drawn else [])]
    return [Text(f"checked on {examples.checked} of the {examples.of} examples (the loss above "
                 f"is theirs; every one: --examples all, or examples=\"all\" in Python): "
                 f"{'; '.join(chosen)}",
                 style="dim"),
            Text(f"examples {_ranges(examples.indices)}", style="dim")]


def _ranges(indices: list[int]) -> str:
    """0-3, 7, 9-10: sorted indices, runs joined."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def render_keras_check(report: KerasCheckReport, width: int) -> list[RenderableType]:
    summary = report.summary
    parts: list[RenderableType] = [*header(report, "check"), *examples_lines(report)]
    if report.nonfinite is not None:
        return [*parts, *nonfinite_lines(report.nonfinite),
                Text("\nFAILED: a number is not finite, so no gradient was compared",
                     style="bold red"), *timings_lines(report.timings)]
    if report.dtype_reason is None:
        computed = Text("a float64 copy of the model with the same weights; every witness "
                        "compares with TF autodiff on it; relative tolerances: "
                        f"{tolerances_text(report)}", style="dim")
    else:
        computed = Text(f"checked in the model's own {report.dtype}, not a float64 copy: "
                        f"{report.dtype_reason}; relative tolerances: "
                        f"{tolerances_text(report)}", style="yellow")
    parts += [
        computed,
        *(Text(line, style="dim") for line in report.held_fixed),
        *checked_section(report, width),
        *_joint_note(report),
        *failures_section(report),
    ]
    for tensor in report.tensors:
        # A tensor that passed on some probes, others left out (at a kink, not resolved):
        # what was left out is said, as for one that failed.
        for entry in tensor.witnesses:
            if entry.passed and not (entry.at_kink or entry.unresolved) and entry.left_out:
                parts.append(Text(f"{tensor.name}: {entry.left_out}", style="dim"))
    unwitnessed = [t.name for t in report.tensors if t.witnesses
                   and all(e.at_kink for e in t.witnesses)]
    if unwitnessed:
        parts.append(Text(f"not witnessed, every probe at a kink: {', '.join(unwitnessed)} "
                          "(the loss has no derivative there; autodiff takes one side)",
                          style="yellow"))
    unresolved = [t.name for t in report.tensors if t.witnesses
                  and all(e.at_kink or e.unresolved for e in t.witnesses)
                  and any(e.unresolved for e in t.witnesses)]
    if unresolved:
        parts.append(Text(f"not witnessed, the finite differences not resolved: "
                          f"{', '.join(unresolved)} (they do not settle as the step shrinks: "
                          "the trajectory amplifies every perturbation)", style="yellow"))
    for skipped in report.not_witnessed:
        who = ("not checked:" if skipped.witness == EVERY_WITNESS else
               f"{WITNESS_TITLES.get(skipped.witness, skipped.witness)} not run on")
        parts.append(Text(f"{who} {skipped.layer}: {skipped.reason}", style="dim"))
    if report.carry is not None:
        parts += [section("Truncated BPTT: carrying gradients across chunk boundaries"),
                  carry_check_section(report.carry, width)]
    if summary.passed and (unwitnessed or unresolved):
        # Found tried as a new user would: a bias gradient 1.5× too large in a chaotic cell,
        # its finite differences not resolved, read "PASSED: all 7 tensors agree".
        why = ([f"{len(unwitnessed)} at a kink"] if unwitnessed else []) + (
            [f"{len(unresolved)} not witnessed (finite differences not resolved): nothing "
             "contradicts them, nothing confirms them"] if unresolved else [])
        agree = summary.checked_tensors - len(unwitnessed) - len(unresolved)
        parts.append(Text(f"\nPASSED: {agree} of {summary.checked_tensors} tensors agree "
                          f"with every witness ({', '.join(summary.witnesses)}); "
                          + "; ".join(why), style="bold green"))
    else:
        parts.append(all_agree(report))
    return parts + timings_lines(report.timings)


def _joint_note(report: KerasCheckReport) -> list[RenderableType]:
    """Where finite differences moved several tensors at once and agreed, the one error in
    their column is those joint directions', the same for each: said under the table."""
    joint = [e for t in report.tensors for e in t.witnesses
             if e.witness == "finite_differences" and e.detail.startswith("jointly with")]
    if len(joint) < 2:
        return []
    said = joint[0].detail.split(": ", 1)[1].split(";", 1)[0]
    return [hanging("·", f"finite diff.: {len(joint)} tensors checked together, by {said}: "
                         "each shows that one error; a tensor is probed on its own only "
                         "where they disagree", "dim")]
