"""Tables that several renderers draw: the check verdicts per tensor and witness, what failed,
the state Jacobians and the per-weight norms."""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gradscope.formats import (
    number,
    percent,
    shape_text,
)
from gradscope.report.layout import (
    GAP,
    SPARK_MIN,
    SPARK_WIDTH,
    Column,
    Layout,
    atom,
    column_width,
    fit,
    hanging,
    pack,
    section,
    sparkline,
    warning,
)
from gradscope.report.models import (
    CarryCheck,
    CarryProductEntry,
    CarryWeightEntry,
    CheckedTensor,
    CheckReport,
    FlowFlag,
    JacobianEntry,
    KerasCheckReport,
    LayerCheckReport,
    Stats,
    WitnessEntry,
)


def jacobian_table(entries: list[JacobianEntry], width: int) -> Table:
    wide = Layout([Column("∂ final state"), Column("/ ∂ initial state"), Column("block"),
                   Column("‖J‖_F median", "right"), Column("(min … max)", "right"),
                   Column("σ_max", "right"), Column("σ_min", "right")])
    pair_title = "∂ final\n/ ∂ initial"
    middle = Layout([Column(pair_title), Column("block"),
                     Column("‖J‖_F median", "right"), Column("(min … max)", "right"),
                     Column("σ_max", "right"), Column("σ_min", "right")])
    narrow = Layout([Column(pair_title), Column("block"),
                     Column("‖J‖_F median\n(min … max)", "right"),
                     Column("σ_max\nσ_min", "right")])
    narrowest = Layout([Column(pair_title + "\n· block"),
                        Column("‖J‖_F median\n(min … max)", "right"),
                        Column("σ_max\nσ_min", "right")])
    # Names too long for any columns beside them (found tried as a new user would: a stack
    # of cells' "[states[0]_T, states[1]_T, states[2]_T]" cut its own name and the numbers
    # at 80 columns): each entry on lines of its own.
    stacked = Layout([Column("∂ final / ∂ initial\n  block · ‖J‖_F median (min … max)\n"
                             "  σ_max · σ_min")])
    for entry in entries:
        block = atom(shape_text(entry.shape))
        median = atom(number(entry.frobenius_median))
        spread = f"{number(entry.frobenius_min)} … {number(entry.frobenius_max)}"
        largest = number(entry.largest_singular_median)
        smallest = ("< " if entry.smallest_singular_below else "") + number(
            entry.smallest_singular_median)
        pair = atom(f"{entry.target}\n/ {entry.source}")
        wide.add_row(atom(entry.target), atom(entry.source), block, median, atom(spread),
                     atom(largest), atom(smallest))
        middle.add_row(pair, block, median, atom(spread), atom(largest), atom(smallest))
        spread_under = atom(f"{median.plain}\n({spread})")
        singular = atom(f"{largest}\n{smallest}")
        narrow.add_row(pair, block, spread_under, singular)
        narrowest.add_row(atom(f"{pair.plain}\n{block.plain}"), spread_under, singular)
        stacked.add_row(atom(f"{entry.target}\n/ {entry.source}\n  {block.plain} · "
                             f"{median.plain} ({spread})\n  {largest} · {smallest}"))
    layouts = [wide, middle, narrow, narrowest]
    ranges = narrowest.measure()
    if sum(n for n, _ in ranges) + GAP * (len(ranges) - 1) > width:
        layouts.append(stacked)  # not even the narrowest columns fit
    return fit(width, *layouts)


#: A sparkline row: the values drawn, and the first and the last number shown beside them
#: (or a word in place of one).
SparkRow = tuple[list[float], float | str | None, float | str | None]


def _shown(value: float | str | None) -> str:
    return value if isinstance(value, str) else number(value)


def spark_table(rows: dict[str, SparkRow], width: int,
                titles: tuple[str, str, str, str]) -> Table:
    """One row per label: the label, a log-scale sparkline of its values, then two numbers;
    ``titles`` head the four columns."""
    label_title, spark_title, first_title, last_title = titles
    # What is left for the sparkline once the label and both numbers have their room.
    numbers = max([len(_shown(value)) for _, *ends in rows.values() for value in ends]
                  + [len(first_title), len(last_title)])
    fixed = 2 * numbers + 3 * GAP
    # A label with no room beside the numbers and a short sparkline is folded after a "/"
    # (a weight's path has no space to wrap at): the numbers are never cut. A sparkline of
    # fewer values than SPARK_MIN needs only a mark each (and its title its width).
    marks = max([len(values) for values, *_ in rows.values()] + [1])
    least = min(SPARK_MIN, max(marks, cell_len(spark_title)))
    limit = max(cell_len(label_title), width - fixed - least)
    shown = {label: folded(label, limit) for label in rows}
    room = width - fixed - max(cell_len(label_title),
                               *(cell_len(line) for text in shown.values()
                                 for line in text.split("\n")))
    if room < least:
        # The label column is never narrower than its longest word, its title's included.
        longest_word = max(cell_len(word) for text in [label_title, *shown.values()]
                           for word in text.split())
        room = min(least, width - fixed - longest_word)
    spark_width = max(1, min(SPARK_WIDTH, room))
    layout = Layout([Column(label_title), Column(spark_title), Column(first_title, "right"),
                     Column(last_title, "right")])
    # Narrower still: each sparkline under its label, in one column, beside the numbers.
    under = Layout([Column(f"{label_title} · {spark_title}"), Column(first_title, "right"),
                    Column(last_title, "right")])
    below = max(1, min(SPARK_MIN, width - fixed + GAP))
    for label, (values, first, last) in rows.items():
        layout.add_row(Text(shown[label]), atom(sparkline(values, spark_width), "cyan"),
                       atom(_shown(first)), atom(_shown(last)))
        stacked = Text(shown[label] + "\n")
        stacked.append(atom(sparkline(values, below), "cyan"))
        under.add_row(stacked, atom(_shown(first)), atom(_shown(last)))
    return fit(width, layout, under)


def folded(label: str, limit: int) -> str:
    """``label`` in lines of at most ``limit`` cells where it has a word longer than that,
    broken after a "/" (else after its last "_" that fits, else at the limit); a label that
    fits is left as it is."""
    if all(cell_len(word) <= limit for word in label.split()):
        return label
    lines: list[str] = []
    line = ""
    for part in label.replace("/", "/\0").split("\0"):
        while cell_len(part) > limit:  # one part too long: broken where the line ends
            room = limit - cell_len(line)
            # After a "_" of a layer's name where one fits (found tried as a new user would:
            # "…_number_t" and "wo_long" on the next line).
            cut = part.rfind("_", 0, room) + 1 or room
            lines.append(line + part[:cut])
            line, part = "", part[cut:]
        if cell_len(line + part) > limit:
            lines.append(line)
            line = ""
        line += part
    return "\n".join(lines + ([line] if line else []))


#: In place of a norm at a step no example ran (every example's masked there).
NOT_RUN = "–"


def norm_table(rows: dict[str, list[float]], width: int,
               ran: dict[str, list[int] | None] | None = None) -> Table:
    """One row per sequence of norms over time: its label, a sparkline, the values at the
    first and the last step; :data:`NOT_RUN` at one that no example ran (``ran``: per label,
    how many examples ran each step, or None where every one ran every step)."""
    def end(label: str, norms: list[float], at: int) -> float | str:
        counts = (ran or {}).get(label)
        return NOT_RUN if counts is not None and counts[at] == 0 else norms[at]

    return spark_table({label: (norms, end(label, norms, 0), end(label, norms, -1))
                        for label, norms in rows.items()},
                       width, ("sequence", "t = 0 … T−1", "at t=0", "at t=T−1"))


#: What a flow section says where it flags nothing.
NO_FLAGS = "no vanishing or exploding gradients flagged"


def flag_warnings(flags: list[FlowFlag], drawn: bool = True) -> list[RenderableType]:
    """Each flag of a flow section as a ⚠ line; where there is none, a dim line that says so
    (if anything was ``drawn`` that could have been flagged)."""
    if flags:
        return [warning(flag.message) for flag in flags]
    return [Text(NO_FLAGS, style="dim")] if drawn else []


WITNESS_TITLES = {
    "finite_differences": "finite diff.",
    "numpy_reference": "NumPy ref.",
    "gru_block_kernel": "GRUBlockCellGrad",
    "tbptt_carry": "TBPTT carry",
    "against": "--against",
    "cell_steps": "cell steps",
    "own_backward": "own backward",
}


def _verdict(entry: WitnessEntry, title: str = "") -> Text:
    value = "no value" if entry.error is None else f"{entry.error:.1e}"
    if entry.at_kink:
        return atom(f"{title} at a kink" if title else "at a kink", "yellow")
    if entry.unresolved:
        return atom(f"{title} not resolved" if title else "not resolved", "yellow")
    label = f"{title} {value}" if title else value
    if entry.passed:
        return atom(f"✓ {label}", "green")
    return atom(f"✗ {label}", "bold red")


def _worst(tensor_witnesses: list[WitnessEntry], witness: str) -> WitnessEntry | None:
    entries = [e for e in tensor_witnesses if e.witness == witness]
    return max(entries, key=lambda e: (not e.passed, e.error or 0.0)) if entries else None


def check_table(report: CheckReport | KerasCheckReport | LayerCheckReport,
                width: int) -> Table:
    witnesses = report.summary.witnesses
    titles = [Column(WITNESS_TITLES[w], "right") for w in witnesses]
    # One column per witness; with the shape beside the name, or under it; or, narrowest,
    # every witness's verdict in one column.
    beside = Layout([Column("tensor", no_wrap=True), Column("shape"), *titles], squeeze=False)
    under = Layout([Column("tensor · shape", no_wrap=True), *titles])
    names = []
    for tensor in report.tensors:
        style = "bold" if tensor.passed else "bold red"
        shape = shape_text(tensor.shape) if tensor.shape else ""
        names.append(atom(Text.assemble((tensor.name, style), *(
            ("\n", (shape, "cyan")) if shape else ()))))
        verdicts: list[Text] = []
        for witness in witnesses:
            worst = _worst(tensor.witnesses, witness)
            verdicts.append(atom("–", "dim") if worst is None else _verdict(worst))
        beside.add_row(atom(tensor.name, style), atom(shape), *verdicts)
        under.add_row(names[-1], *verdicts)
    packed = [[_verdict(entry, WITNESS_TITLES[entry.witness])
               for entry in (_worst(tensor.witnesses, w) for w in witnesses)
               if entry is not None] for tensor in report.tensors]
    # Narrowest: a long name folds after a "/" where the widest verdict would not fit beside
    # it, so that no verdict's number is cut.
    widest = max((cell_len(item.plain) for items in packed for item in items), default=0)
    room = max(width - GAP - widest, len("tensor · shape"))
    if column_width(names, "tensor · shape") > room:
        names = [_folded(name, room) for name in names]
    verdict_width = width - column_width(names, "tensor · shape") - GAP
    one_column = Layout([Column("tensor · shape", no_wrap=True),
                         Column("witness: relative error")])
    for name, items in zip(names, packed, strict=True):
        one_column.add_row(name, atom(pack(items, verdict_width)))
    return fit(width, beside, under, one_column)


def _folded(cell: Text, room: int) -> Text:
    """``cell``'s lines, each longer than ``room`` folded after a "/" (the style kept)."""
    lines = cell.split("\n")
    out = Text()
    for index, line in enumerate(lines):
        pieces: list[Text] = []
        while cell_len(line.plain) > room and "/" in line.plain[:room]:
            cut = line.plain.rindex("/", 0, room) + 1
            pieces.append(line[:cut])
            line = line[cut:]
        pieces.append(line)
        for k, piece in enumerate(pieces):
            if index or k:
                out.append("\n")
            out.append_text(piece)
    return out


def failure_lines(tensor: CheckedTensor) -> list[tuple[str, str]]:
    """What each witness that disagrees with ``tensor`` says, as (the disagreement, its
    detail line or ""): the witness, its relative error against its tolerance, the first
    wrong step. The terminal, JUnit XML and ``gradscope.testing`` all say it so."""
    lines = []
    for entry in tensor.witnesses:
        if entry.passed:
            continue
        where = f" (first wrong step counting back: t={entry.first_bad_step})" if (
            entry.first_bad_step is not None) else ""
        value = "" if entry.error is None else (
            f": relative error {entry.error:.2e} > {entry.tolerance:.0e}")
        said = [entry.detail] if entry.detail else []
        if entry.left_out and entry.left_out != entry.detail:
            said.append(entry.left_out)  # the probes the error leaves out
        lines.append((f"{tensor.name} · {WITNESS_TITLES[entry.witness]}{value}{where}",
                      "; ".join(said)))
    return lines


def check_failures(report: CheckReport | KerasCheckReport | LayerCheckReport
                   ) -> list[RenderableType]:
    """Each disagreement, and its detail indented under it (wrapped lines too)."""
    lines: list[RenderableType] = []
    for tensor in report.tensors:
        for disagreement, detail in failure_lines(tensor):
            lines.append(hanging("✗", disagreement, "red"))
            if detail:
                lines.append(hanging("   ", detail))
    return lines


def stats_items(stats: Stats | None) -> list[str]:
    """A gradient's statistics as label–number items, to be packed where they are no table's
    columns."""
    if stats is None:
        return ["no gradient"]
    return [f"‖g‖₂ {number(stats.l2)}", f"mean|g| {number(stats.mean_abs)}",
            f"max|g| {number(stats.max_abs)}", f"NaN/Inf {stats.nonfinite}"]


# -- what every check report says ------------------------------------------------------------


def tolerances_text(report: CheckReport | KerasCheckReport | LayerCheckReport) -> str:
    """Each witness's relative tolerance, as the check header lists them: those of the
    witnesses that compared a tensor (the NumPy reference listed where it ran on no layer,
    every one masked, read as if it had; the JSON keeps them all)."""
    ran = set(report.summary.witnesses)
    return " · ".join(f"{WITNESS_TITLES[w]} {t:.0e}" for w, t in report.tolerances.items()
                      if w in ran or not ran)


def checked_section(report: CheckReport | KerasCheckReport | LayerCheckReport,
                    width: int) -> list[RenderableType]:
    """The verdict per tensor and witness, under its title."""
    summary = report.summary
    layers = _own_backwards(report)
    also = ("" if not layers else " and 1 layer call's own backward" if len(layers) == 1
            else f" and {len(layers)} layer calls' own backwards")
    return [section(f"Gradients checked ({summary.checked_tensors - len(layers)} tensors"
                    f"{also}, {summary.comparisons} comparisons)"), check_table(report, width)]


def _own_backwards(report: CheckReport | KerasCheckReport | LayerCheckReport) -> list[str]:
    """The rows that are a layer call's own backward (``layer NAME``), not a tensor."""
    return [t.name for t in report.tensors if t.name.startswith("layer ")]


def failures_section(report: CheckReport | KerasCheckReport | LayerCheckReport
                     ) -> list[RenderableType]:
    failures = check_failures(report)
    return [section("What failed"), *failures] if failures else []


def all_agree(report: CheckReport | KerasCheckReport) -> Text:
    """The last line of a check that found nothing, or of one that did."""
    summary = report.summary
    if summary.passed:
        return Text(f"\nPASSED: all {summary.checked_tensors} tensors agree with every "
                    f"witness ({', '.join(summary.witnesses)})", style="bold green")
    return failed_line(report)


def failed_line(report: CheckReport | KerasCheckReport | LayerCheckReport) -> Text:
    return Text(f"\nFAILED: {disagreements(report)}", style="bold red")


def disagreements(report: CheckReport | KerasCheckReport | LayerCheckReport,
                  named: bool = True) -> str:
    """How many tensors disagree (``named``: which), and the layer calls whose own backward
    does: a layer call is not counted as a tensor."""
    summary = report.summary
    layers = _own_backwards(report)
    tensors = [name for name in summary.failed_tensors if name not in layers]
    wrong = [name for name in summary.failed_tensors if name in layers]
    said = ([f"{len(tensors)} of {summary.checked_tensors - len(layers)} tensors disagree"
             + (f": {', '.join(tensors)}" if named else "")] if tensors else [])
    too = " too" if tensors else ""
    if len(wrong) == 1:
        said.append(f"{wrong[0]}'s own backward disagrees{too}")
    elif wrong:
        said.append(f"the own backwards of {', '.join(wrong)} disagree{too}")
    return "; ".join(said)


def timings_lines(timings: dict[str, float] | None, lead: str = "") -> list[RenderableType]:
    """The seconds each phase took (``--timings``)."""
    if not timings:
        return []
    laps = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in timings.items())
    return [Text(f"{lead}timings: {laps}", style="dim")]


#: What the columns of the carried tables mean (``--chunks``), for both wings' intros.
CARRIED_COLUMNS = ("‖g_full‖: full BPTT; ‖g_truncated‖: each chunk backpropagated from zero at "
                   "its end (no carry); ‖g_carried‖ = ‖g_full − g_truncated‖, what the carry "
                   "adds; carried share = ‖g_carried‖ / ‖g_full‖.")


def carried_tables(intro: str, weights: list[CarryWeightEntry],
                   products: list[CarryProductEntry], threshold: float, matters: bool,
                   verdict: str, width: int) -> list[RenderableType]:
    """``explain --chunks``, either wing: per weight, full vs truncated BPTT; per chunk, the
    seed's product; and one line: does carrying matter here?"""
    weights_wide = Layout([Column("weight", no_wrap=True), Column("‖g_full‖", "right"),
                           Column("‖g_truncated‖", "right"), Column("‖g_carried‖", "right"),
                           Column("carried share", "right")], squeeze=False)
    weights_narrow = Layout([Column("weight", no_wrap=True),
                             Column("‖g_full‖\n‖g_truncated‖", "right"),
                             Column("‖g_carried‖\nshare", "right")])
    # Narrow: a long weight path folded after a "/" beside the numbers, which are never cut
    # (found tried as a new user would: a Bidirectional LSTM's paths at 60 columns cut
    # "8.61e-" and split the headers mid-word).
    numbers = max([cell_len(number(v)) for e in weights
                   for v in (e.l2_full, e.l2_truncated, e.l2_carried)] + [0])
    limit = max(cell_len("weight"), width - max(numbers, cell_len("‖g_truncated‖"))
                - max(numbers, cell_len("‖g_carried‖")) - 2 * GAP)
    for entry in weights:
        share = percent(entry.carried_share)
        name = atom(entry.name, "bold" if entry.carried_share >= threshold else "")
        weights_wide.add_row(name, atom(number(entry.l2_full)), atom(number(entry.l2_truncated)),
                             atom(number(entry.l2_carried)), atom(share))
        weights_narrow.add_row(atom(folded(entry.name, limit),
                                    "bold" if entry.carried_share >= threshold else ""),
                               atom(f"{number(entry.l2_full)}\n"
                                          f"{number(entry.l2_truncated)}"),
                               atom(f"{number(entry.l2_carried)}\n{share}"))
    products_wide = Layout([Column("chunk"), Column("xs ← ys"), Column("‖grad_y‖", "right"),
                            Column("‖product‖", "right")], squeeze=False)
    products_narrow = Layout([Column("chunk · xs ← ys"),
                              Column("‖grad_y‖\n‖product‖", "right")])
    for product in products:
        chunk = f"{product.chunk} (t {product.start}–{product.stop - 1})"
        pair = f"{product.x} ← {product.y}"
        products_wide.add_row(atom(chunk), atom(pair), atom(number(product.l2_grad_y)),
                              atom(number(product.l2_product)))
        products_narrow.add_row(atom(f"{chunk}\n{folded(product.x, limit)}\n  ← "
                                     f"{folded(product.y, limit - 4)}"),
                                atom(f"{number(product.l2_grad_y)}\n{number(product.l2_product)}"))
    products_intro = Text(
        "The carry itself: tf.gradients(ys=a chunk's final states, xs=its initial states, "
        "grad_ys=the next chunk's ∂L/∂(initial states)); ‖product‖ is its result for x, "
        "summed over every y: every call's final states, not the row's y alone (a call "
        "above reads this one's outputs within the chunk)."
    )
    style = "bold yellow" if matters else "bold green"
    return [Text(intro), fit(width, weights_wide, weights_narrow), Text(""), products_intro,
            fit(width, products_wide, products_narrow),
            hanging("⚠" if matters else "✓", verdict, style)]


def carry_check_section(carry: CarryCheck, width: int) -> Group:
    ys_title, grad_ys_title = ("ys: earlier chunk's final states",
                               "grad_ys: later chunk's ∂L/∂(initial states)")
    one_line = Layout([Column("boundary"), Column(ys_title), Column(grad_ys_title)],
                      squeeze=False)
    two_lines = Layout([Column("boundary"), Column(ys_title), Column(grad_ys_title)])
    # Found tried as a new user would: long state names (a Bidirectional layer's) cut the
    # two-column table at 80 columns ("bound" / "ary", "(8," without its close): where its
    # lines do not fit whole, stacked, each y over its grad_y.
    stacked = Layout([Column("boundary · ys (earlier chunk's final states)\n"
                             "  grad_ys (later chunk's ∂L/∂(initial states))")])
    columns: list[list[Text]] = [[Text("boundary")], [], []]  # each column's lines, whole
    for boundary in carry.boundaries:
        ys = [f"{y.name} {shape_text(y.shape)}" for y in boundary.ys]
        grad_ys = [(f"{g.name} {shape_text(g.shape)}", f"‖·‖ {number(g.norm)}")
                   for g in boundary.grad_ys]
        columns[0].append(Text(f"t = {boundary.step}"))
        columns[1] += [Text(y) for y in ys]
        columns[2] += [Text(name) for name, _ in grad_ys]
        step = atom(f"t = {boundary.step}")
        one_line.add_row(step, atom("\n".join(ys)),
                         atom("\n".join(f"{name} {norm}" for name, norm in grad_ys)))
        two_lines.add_row(step, atom("\n\n".join(ys)),
                          atom("\n".join(f"{name}\n  {norm}" for name, norm in grad_ys)))
        stacked.add_row(atom("\n".join(
            [f"t = {boundary.step}"]
            + [f"{y}\n  {name}\n    {norm}" for y, (name, norm) in zip(ys, grad_ys,
                                                                       strict=False)])))
    lengths = " + ".join(str(n) for n in carry.chunk_lengths)
    intro = Text(
        f"{carry.chunks} chunks of {lengths} steps, backpropagated last to first; each "
        "chunk's initial-state gradients are the output_gradients (grad_ys) of the earlier "
        "chunk's final states, one per y. The summed weight gradients are compared with "
        "full BPTT in the table above. They come from the same autodiff as the tape's (a "
        "custom gradient's error is in both): this witness shows that the carry adds the "
        "chunks up to full BPTT, not that the backward is right; the other witnesses show "
        "that."
    )
    longest = [column_width(cells) for cells in columns]
    whole = sum(longest) + GAP * (len(longest) - 1) <= width
    return Group(intro, fit(width, one_line, two_lines) if whole else fit(width, stacked))
