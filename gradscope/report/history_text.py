"""Render what the GradientFlow callback recorded during training (``callback.report()``,
``gradscope watch``) for a terminal: one sparkline per quantity across training, readable over
SSH, at any width from 60 columns."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rich.cells import cell_len
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from gradscope.formats import number, share
from gradscope.report.layout import hanging, pack, section, title, warning
from gradscope.report.models import (
    DiagnosisSeries,
    FlowHistoryReport,
    KerasMixedPrecision,
    KerasPerExample,
    RecurrentFlowSeries,
)
from gradscope.report.tables import NO_FLAGS, norm_table, spark_table


def _values(series: list[float | None]) -> list[float]:
    """Sparkline input: a missing value (not finite, not analysed) is a blank mark."""
    return [math.nan if v is None else float(v) for v in series]


def _first_last(series: list[float | None]) -> tuple[float | None, float | None]:
    """The first and the last observation's values (None, shown "n/a": not finite, or not
    analysed there). Found tried as a new user would: a kernel's norm NaN at the last
    observation read "last 0", the value of the one before."""
    return (series[0], series[-1]) if series else (None, None)


def _steps(report: FlowHistoryReport) -> str:
    steps = [o.step for o in report.observations]
    if not steps:
        return "no observations" + _none_taken(report.batches, report.every, "every")
    count = f"{len(steps)} observation{'s' if len(steps) != 1 else ''}"
    return f"{count}, step {steps[0]}" if len(steps) == 1 else \
        f"{count}, steps {steps[0]}–{steps[-1]}"


def _none_taken(batches: int | None, every: int | None, name: str) -> str:
    """Why nothing was taken, said as what happened (found tried as a new user would: "yet",
    and "the first is at batch 100", read after fit as if one were to come): ": 4 batches
    trained, fewer than every=100"; "" where fit's batches are not known (watch)."""
    if batches is None or not every:
        return ""
    return f": {batches} batches trained" + (f", fewer than {name}={every}"
                                             if batches < every else "")


def header(report: FlowHistoryReport, width: int) -> list[RenderableType]:
    every: list[str] = []
    if report.every:
        cadence = ("every batch" if report.every == 1
                   else f"every {report.every} batches")
        # Found tried as a new user would: every=3 at 2 steps per execution, unsaid.
        taken = _taken_at([o.step for o in report.observations], report.every, True)
        every = [f"one pass asked {cadence}", taken] if taken else [f"one pass {cadence}"]
    # "each pass in": found tried as a new user would, a bare "inference mode" read as the
    # training's mode.
    details = pack([_steps(report), *every, f"loss {report.loss}",
                    f"each pass in {report.mode} mode"], width)
    details.stylize("dim")
    return [title("gradient flow during training", report.source), details]


def series_table(rows: dict[str, list[float | None]], width: int, title: str) -> Table:
    """One row per quantity: its label, a sparkline across the observations, the first and the
    last value."""
    return spark_table({label: (_values(values), *_first_last(values))
                        for label, values in rows.items()}, width,
                       (title, "trend", "first", "last"))


def _recurrent_rows(series: list[RecurrentFlowSeries]) -> dict[str, list[float | None]]:
    rows: dict[str, list[float | None]] = {}
    for entry in series:
        for state, norms in entry.initial_state_norms.items():
            rows[f"{entry.layer} ‖∂L/∂{state}‖"] = norms
        rows[f"{entry.layer} ∂L/∂s carried back"] = entry.ratios
    return rows


def flag_lines(report: FlowHistoryReport) -> list[RenderableType]:
    lines: list[RenderableType] = []
    steps = [o.step for o in report.observations]
    for entry in report.recurrent:
        for kind in ("vanishing", "exploding"):
            hits = [i for i, flag in enumerate(entry.flags) if flag == kind]
            if not hits:
                continue
            last = hits[-1]
            lines.append(warning(
                f"{entry.layer}: {kind} gradients at {len(hits)} of {len(entry.flags)} "
                f"observations, the last at step {steps[last]} (carried back from each "
                f"example's last step that ran to its first, ∂L/∂s, every state and example "
                f"joined, keeps "
                f"{number(entry.ratios[last])} × the norm it started with; flagged beyond "
                f"a factor "
                f"{report.flag_factor:g})" + _nearest_diagnosis(report, entry, last, kind)))
    if report.recurrent and not lines:
        lines.append(Text(f"{NO_FLAGS} (factor {report.flag_factor:g})", style="dim"))
    return lines


def _nearest_diagnosis(report: FlowHistoryReport, entry: RecurrentFlowSeries, flagged: int,
                       kind: str) -> str:
    """The flagged layer as the diagnosis nearest the flag's observation (``flagged``) read it:
    λ₁ and the horizon predicted from it; where that horizon reaches past the sequence while
    the flag says vanishing, why the two part, with both numbers, as ``diagnose`` says it
    (:func:`~gradscope.dynamics.flow_note`; found tried as a new user would: an LSTM flagged
    vanishing at step 50 beside a horizon of 66.8 steps predicted at step 96, unreconciled).
    "" where the layer was not diagnosed."""
    from gradscope.dynamics import apart

    series = next((s for s in report.diagnoses if s.call == entry.layer), None)
    if series is None:
        return ""
    step = report.observations[flagged].step
    read = [(abs(at - step), at, index, exponents[0])
            for index, (at, exponents) in enumerate(zip(report.diagnosis_steps,
                                                        series.lyapunov, strict=False))
            if exponents and math.isfinite(exponents[0])]
    if not read:
        return ""
    _, at, index, largest = min(read)
    predicted = series.horizon_predicted[index]
    said = f"; the diagnosis nearest it, at step {at}, reads λ₁ {largest:+.3g} per step"
    if predicted is not None:
        said += f", a horizon predicted at {predicted:.3g} steps"
    notes = series.lyapunov_note
    note = notes[index] if index < len(notes) else None
    if note is not None:
        # Found tried as a new user would: a reconciliation resting on a λ₁ of −0.00934 whose
        # second half read −0.00255, unsaid here (the dynamics section below said it).
        said += f" ({note})"
    profile = entry.profiles[flagged]
    ratio = entry.ratios[flagged]
    if (kind != "vanishing" or profile is None or ratio is None or not ratio > 0
            or (predicted is not None and predicted < len(profile))):
        return said
    back = len(profile) - 1
    kept = math.exp(back * largest)
    said += (f", past the {len(profile)} steps: λ₁'s rate keeps ×{number(kept)} over the "
             f"{back} steps carried back")
    if apart(ratio, kept):
        return (f"{said}, and the loss reads the state along directions that fade faster "
                "than its most lasting one, which carries an input's influence")
    return f"{said}, about the flag's: one fading, read two ways on either side of 10³"


def profile_section(report: FlowHistoryReport, width: int) -> list[RenderableType]:
    """‖∂L/∂h_t‖ over t at the last observation that analysed each layer."""
    rows: dict[str, list[float]] = {}
    steps = [o.step for o in report.observations]
    for entry in report.recurrent:
        analysed = [i for i, p in enumerate(entry.profiles) if p]
        if analysed:
            last = analysed[-1]
            profile = entry.profiles[last]
            assert profile is not None
            rows[f"{entry.layer} (step {steps[last]})"] = profile
    if not rows:
        return []
    # Found tried as a new user would: "‖∂L/∂h0‖ 1.72e-01" above beside "at t=0 1.66e-01"
    # here read as one quantity twice.
    said = Text("h_t: the state after step t (‖∂L/∂h0‖ above: the initial state, before "
                "t=0)", style="dim")
    return [section("‖∂L/∂h_t‖ over the time steps, at the last observation"), said,
            norm_table(rows, width)]


def _last(values: list[Any], steps: list[int]) -> tuple[Any, int | None]:
    """The last value that is not None, and its step."""
    for value, step in zip(reversed(values), reversed(steps), strict=True):
        if value is not None:
            return value, step
    return None, None


def _diagnosis_lines(entry: DiagnosisSeries, steps: list[int],
                     width: int) -> list[tuple[str | None, str]]:
    """One call's last diagnosis in words, each number with its unit, λ₁'s first beside it:
    (what the line hangs from, or None for a line of its own, the line), so that a wrapped
    line hangs under its words; the gates' line breaks between gates, never inside one's
    pair of shares."""
    lyapunov, at = _last(entry.lyapunov, steps)
    if lyapunov is None or at is None:
        return [(f"{entry.call}:", "not diagnosed")]
    first, first_at = next(((v, s) for v, s in zip(entry.lyapunov, steps, strict=True) if v),
                           (None, None))
    # Phrases that a wrap never splits: a number stays with its words.
    lead = [f"at step {at}:", f"λ₁ {lyapunov[0]:+.3g} nats/step"]
    if len(lyapunov) > 1:
        others = [f"λ{_subscript(i + 2)} {v:+.3g}" for i, v in enumerate(lyapunov[1:])]
        lead += [f"{'(' if i == 0 else ''}{phrase}{',' if i < len(others) - 1 else ')'}"
                 for i, phrase in enumerate(others)]
    if first is not None and first_at != at:
        lead[-1] += ";"
        lead.append(f"at step {first_at} λ₁ was {first[0]:+.3g}")
    index = steps.index(at)
    predicted = entry.horizon_predicted[index]
    measured, window = entry.horizon_measured[index], entry.horizon_window[index]
    horizon = ("horizon predicted from λ₁: " + (f"{predicted:.3g} steps" if predicted is not None
                                                else "none (λ₁ ≥ 0)"))
    note = entry.lyapunov_note[index] if index < len(entry.lyapunov_note) else None
    if note is not None:
        horizon += f" ({note})"
    if window is not None:
        horizon += "; measured: " + (f"{measured} steps" if measured is not None
                                     else f"beyond {window} steps")
    gates = entry.gates[index]
    # As diagnose's text words them; the hanging mark and its gap take 2 columns.
    gate_text = (pack([f"{'gates (share < 0.1 / > 0.9): ' if k == 0 else ''}{name} "
                       f"{share(shares.below_0_1)} / {share(shares.above_0_9)}"
                       for k, (name, shares) in enumerate(gates.items())], width - 2).plain
                 if gates is not None
                 else f"gates: {(entry.gates_note or 'not known').removeprefix('gates ')}")
    label = f"{entry.call} ({entry.cell})"
    if cell_len(label) > width // 2:
        # A long label on a line of its own (found tried as a new user would: the words hung
        # under it in a column of 20, a number alone on its last line).
        return [(None, label + ":"), (" ", pack(lead, width - 2, " ").plain), (" ", horizon),
                (" ", gate_text)]
    return [(label, pack(lead, width - cell_len(label) - 1, " ").plain), (" ", horizon),
            (" ", gate_text)]


def _subscript(number: int) -> str:
    return str(number).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))


def _taken_at(steps: list[int], every: int, in_fit: bool) -> str | None:
    """Where the observations or diagnoses were taken, when not at the multiples of ``every``
    from the first to the last (``in_fit``: by fit, which with steps_per_execution above 1
    shows the callback the last batch of each execution; else by a custom loop's
    ``observe``, at the steps it gave that ``every`` divides); None when they were."""
    if not steps:
        return None
    # The steps themselves, not their count (found tried as a new user would: at 2 steps per
    # execution and every 3, diagnoses at 4, 6, 10, 12 were as many as 3, 6, 9, 12).
    first = -(-steps[0] // every) * every
    if sorted(set(steps)) == list(range(first, steps[-1] + 1, every)):
        return None
    shown = ", ".join(str(s) for s in steps[:3]) + (", …" if len(steps) > 3 else "")
    # Found tried as a new user would: fit's reason was given for a custom loop's steps.
    why = ("with steps_per_execution above 1, fit shows the callback the last batch of each "
           "execution" if in_fit else "the steps observe() was given")
    return f"taken at steps {shown} ({why})"


def diagnosis_section(report: FlowHistoryReport, width: int) -> list[RenderableType]:
    """Each recurrent call as its last diagnosis read it (``diagnose_every``)."""
    if not report.diagnose_every:
        return []
    steps = report.diagnosis_steps
    count = f"{len(steps)} diagnos{'es' if len(steps) != 1 else 'is'}"
    every = ("every batch" if report.diagnose_every == 1
             else f"one every {report.diagnose_every} batches")
    taken = _taken_at(steps, report.diagnose_every, bool(report.every))
    if taken:  # found tried as a new user would: "every batch" of diagnoses at 2, 4, 6
        every = f"asked {every}"
    # The exponents diagnose gives for these weights and this batch with as many columns:
    # with fewer than the state's numbers, they start from random columns, and its default
    # (8, or all where the state has 32 numbers or fewer) may read otherwise.
    asked = (f" --exponents {report.diagnose_exponents}" if report.diagnose_exponents
             else "")
    # The command on a line of its own: a wrapped title split it at 80 columns.
    examples = (f", on up to {report.diagnose_examples} examples of each batch, evenly "
                "spaced" if report.diagnose_examples
                else ", on every example of each batch" if report.diagnose_every else "")
    parts: list[RenderableType] = [
        section(f"Dynamics across training ({count}, {every})"),
        Text(f"as gradscope diagnose{asked} reads them{examples}", style="dim")]
    if taken:
        parts.append(Text(taken, style="dim"))
    if not steps:  # found tried as a new user would: a bare title said nothing of why
        parts.append(Text("no diagnoses" + _none_taken(report.batches, report.diagnose_every,
                                                       "diagnose_every"), style="dim"))
    for entry in report.diagnoses:
        # Wrapped lines hang under their first words, never at the first column.
        parts += [Text(line) if mark is None else hanging(mark, line)
                  for mark, line in _diagnosis_lines(entry, steps, width)]
    for skipped in report.not_diagnosed:
        parts.append(Text(f"not diagnosed: {skipped.layer}: {skipped.reason} (at "
                          f"{len(skipped.steps)} of {len(steps)} diagnoses)", style="dim"))
    return parts


def mixed_precision_section(report: FlowHistoryReport, width: int) -> list[RenderableType]:
    """Under a mixed policy: the loss scale and the safe range across training, each tensor's
    shares lost where any observation lost some, every warning with how often it was given;
    then the table of the last observation, as explain draws it."""
    from gradscope.report.keras_text import mixed_precision_lines

    steps = [o.step for o in report.observations]
    taken = [(step, m) for step, m in zip(steps, report.mixed_precision or [], strict=False)
             if m is not None]
    if not taken:
        return []
    sections = [m for _, m in taken]

    def series(value: Callable[[KerasMixedPrecision], float | None]) -> list[float | None]:
        return [None if m is None else value(m) for m in report.mixed_precision or []]

    rows: dict[str, list[float | None]] = {
        "loss scale": series(lambda m: m.loss_scale),
        "safe range: low": series(lambda m: m.scale_range[0] if m.scale_range else None),
        "safe range: high": series(lambda m: m.scale_range[1] if m.scale_range else None)}
    for tensor in sections[-1].tensors:
        for kind, label in (("underflow", "to 0"), ("subnormal", "subn."),
                            ("overflow", "inf")):
            shares = [None if m is None else _share_of(m, tensor.path, kind)
                      for m in report.mixed_precision or []]
            if any(shares):
                rows[f"{tensor.label} {label}"] = shares
    parts: list[RenderableType] = [
        section(f"Mixed precision across training ({sections[-1].policy}; log sparklines, "
                "blank = 0)"),
        series_table(rows, width, "quantity")]
    outside = [step for step, m in taken if m.in_range is False]
    if outside:
        parts.append(warning(f"the loss scale was outside the safe range at {len(outside)} "
                             f"of {len(taken)} observations, the last at step {outside[-1]}"))
    said: dict[str, list[int]] = {}
    for step, m in taken:
        for text in m.warnings:
            said.setdefault(text, []).append(step)
    for text, at in said.items():
        parts.append(warning(f"{text} (at {len(at)} of {len(taken)} observations, the last "
                             f"at step {at[-1]})"))
    last_step, last = taken[-1]
    parts.append(Text(f"\nAt the last observation (step {last_step}):", style="bold"))
    parts += mixed_precision_lines(last.model_copy(update={"warnings": []}), width)
    return parts


def per_example_section(report: FlowHistoryReport, width: int) -> list[RenderableType]:
    """With ``per_example=True``: the gradient noise scale B_simple, the top share and the
    largest ‖g_i‖ over the median across training, each layer's median ‖g_i‖; then the table
    of the last observation, as explain draws it."""
    from gradscope.report.keras_text import per_example_lines

    steps = [o.step for o in report.observations]
    sections = report.per_example or []
    taken = [(step, p) for step, p in zip(steps, sections, strict=False) if p is not None]
    if not taken:
        return []

    def series(value: Callable[[KerasPerExample], float | None]) -> list[float | None]:
        return [None if p is None else value(p) for p in sections]

    last_step, last = taken[-1]
    rows: dict[str, list[float | None]] = {
        "noise scale B_simple": series(lambda p: p.noise_scale),
        "top-10% share of Σ‖g_i‖²": series(lambda p: p.top_share),
        "largest ‖g_i‖ / median": series(lambda p: p.max_over_median())}
    for layer in last.layers:
        rows[f"{layer} median ‖g_i‖"] = [
            None if p is None or layer not in p.layers else _middle(p.layers[layer])
            for p in sections]
    parts: list[RenderableType] = [
        section(f"Per-example gradients across training ({len(taken)} of {len(steps)} "
                "observations; log sparklines)"),
        series_table(rows, width, "quantity")]
    flagged = [step for step, p in taken if p.outliers]
    if flagged:
        parts.append(warning(f"outliers (‖g_i‖ beyond the median + 3.5 scaled MADs) at "
                             f"{len(flagged)} of {len(taken)} observations, the last at step "
                             f"{flagged[-1]}"))
    parts.append(Text(f"\nAt the last observation (step {last_step}):", style="bold"))
    parts += per_example_lines(last, width)
    return parts


def _middle(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return (ordered[middle] if len(ordered) % 2 else
            (ordered[middle - 1] + ordered[middle]) / 2)


def _share_of(section: KerasMixedPrecision, path: str, kind: str) -> float | None:
    """The share of one kind ("underflow", "subnormal", "overflow") of the tensor at ``path``
    in one observation's section; None where it lists no such tensor."""
    for tensor in section.tensors:
        if tensor.path == path:
            return float(getattr(tensor, kind))
    return None


def render_history(report: FlowHistoryReport, width: int) -> list[RenderableType]:
    parts = header(report, width)
    if report.nonfinite is not None:
        from gradscope.report.keras_text import nonfinite_lines

        parts.append(Text(f"\ntraining stopped at step {report.nonfinite_step}: its loss is "
                          "not finite", style="bold red"))
        parts += nonfinite_lines(report.nonfinite)
    if report.recurrent:
        parts += [section("Recurrent layers across training (sparklines: log "
                                    "scale, one mark per pass)"),
                  series_table(_recurrent_rows(report.recurrent), width, "layer · quantity")]
        parts += flag_lines(report)
        parts += profile_section(report, width)
    parts += diagnosis_section(report, width)
    if report.mixed_precision is not None:
        parts += mixed_precision_section(report, width)
    if report.per_example is not None:
        parts += per_example_section(report, width)
    if report.weights:
        parts += [section("Weight gradients ‖∂L/∂w‖ across training"),
                  series_table({w.weight: w.norms for w in report.weights}, width, "weight")]
    for entry in report.not_analysed:
        parts.append(Text(f"not analysed: {entry.layer}: {entry.reason} (at "
                          f"{len(entry.steps)} of {len(report.observations)} observations)",
                          style="dim"))
    return parts
