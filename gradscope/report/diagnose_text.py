"""Render ``gradscope diagnose`` for a terminal (rich), at any width from 60 columns: per
recurrent call its verdict first, then the numbers it rests on, packed so that no number is
ever cut."""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import RenderableType
from rich.text import Text

from gradscope.formats import number, share
from gradscope.report.keras_text import header
from gradscope.report.layout import hanging, section, warning
from gradscope.report.models import DiagnosedLayer, DiagnoseReport
from gradscope.report.tables import timings_lines

MARKS = {"vanishing": ("▼", "bold yellow"), "exploding": ("▲", "bold red"),
         "holds": ("✓", "green")}


def _beyond(window: int, longest: int | None, short: bool = False) -> str:
    """Why a horizon beyond its ``window`` was measured no further: the steps have no longer
    lag (``longest``), or the window stopped at the memory budget ("" where ``longest`` is
    not known); ``short``: the budget in two words, as a change's line says it."""
    if longest is None:
        return ""
    if window >= longest:
        return " (every lag there is)"
    if short:
        return " (the memory budget)"
    return (f" (measured to {window} lags only: a layer this wide reaches the memory "
            "budget there)")


def _signed(value: float) -> str:
    return f"{value:+.3g}"


#: The text shows at most this many exponents (the JSON has them all).
SHOWN = 8


def _steps(value: float | None) -> str:
    return "∞" if value is None else f"{value:.3g}"


def _line(label: str, items: list[str], width: int) -> Text:
    """``label: item · item · …``, wrapped between items where they fit, later lines
    indented; an item wider than a line (a long list of steps, a note) is wrapped at its own
    spaces (:func:`_words`), its first words on the line before it where they fit and the
    next item after its last, so that no line passes ``width``, none is left short in the
    middle, and none is left for the terminal to wrap at its first column."""
    limit = width - 2
    first, *rest = items or [""]
    head = f"{label}: {first}"
    lead = head[:len(head) - len(head.lstrip(" "))]
    entries = [head.lstrip(" "), *rest]
    lines: list[str] = []
    current = ""
    for index, item in enumerate(entries):
        words = [item] if cell_len(item) <= limit - len(lead) else _words(item,
                                                                         limit - len(lead))
        for k, word in enumerate(words):
            joiner = " · " if k == 0 and index else " "
            # Room for the " ·" that ends the line where this word ends an item, and
            # another follows.
            tail = 2 if k == len(words) - 1 and index < len(entries) - 1 else 0
            room = limit - (len(lead) if not lines else 0)
            if not current:
                current = word
            elif cell_len(current) + len(joiner) + cell_len(word) + tail <= room:
                current += joiner + word
            else:
                lines.append(current + joiner.rstrip())
                current = word
    lines.append(current)
    return Text(lead + "\n  ".join(lines))


def _words(item: str, width: int) -> list[str]:
    """``item`` in the pieces a line may break between: after a list's commas where a piece
    is short (at most half of ``width``: an example stays beside its ratio), else at spaces
    (a word wider than ``width`` stays whole, on a line of its own)."""
    pieces = item.split(", ")
    pieces = [piece + "," for piece in pieces[:-1]] + pieces[-1:]
    return [word for piece in pieces
            for word in ([piece] if cell_len(piece) <= width // 2 else piece.split(" "))]


def layer_lines(layer: DiagnosedLayer, width: int) -> list[RenderableType]:
    mark, style = MARKS[layer.mechanism]
    heading = (f"{layer.call} ({layer.class_name}, {layer.steps} steps, state of "
               f"{layer.state_size})")
    if layer.backwards:
        direction = "(processing order: t = 0 is the last input step)"
        # Where both do not fit on a line, the direction goes under it, indented.
        joint = " " if cell_len(heading) + 1 + cell_len(direction) <= width else "\n  "
        heading += joint + direction
    parts: list[RenderableType] = [section(heading), hanging(mark, layer.verdict, style)]
    converged = ("" if layer.lyapunov_change is None
                 else f"moved {number(layer.lyapunov_change)} over the last quarter")
    more = len(layer.lyapunov) - SHOWN
    # An exponent whose direction a step took to 0 is marked: not a rate (the warning says).
    floored = set(layer.lyapunov_floored)
    shown = [_signed(v) + ("*" if i in floored else "")
             for i, v in enumerate(layer.lyapunov[:SHOWN])]
    marks = len(floored & set(range(SHOWN)))
    marked = ([f"* taken to 0 at some step: not {'a rate' if marks == 1 else 'rates'}"]
              if marks else [])
    parts.append(_line(f"Lyapunov exponents λ (nats/step, top {len(layer.lyapunov)})",
                       [*shown, *([f"{more} more in --json"] if more > 0 else []),
                        *marked, *([converged] if converged else [])], width))
    norm = layer.jacobian_norm
    parts.append(_line("step Jacobian ‖J_t‖₂", [
        f"median {number(norm.median)}", f"max {number(norm.max)}",
        f"> 1 on {share(norm.share_above_1)} of steps" + (
            "" if norm.steps_read is None else
            f" (read at {norm.steps_read} of the {layer.steps}, evenly spaced)")], width))
    if layer.gates is None:
        note = _line("gates", [(layer.gates_note or "").removeprefix("gates ")], width)
        note.stylize("dim")
        parts.append(note)
    else:
        parts.append(_line("gates (share < 0.1 / > 0.9)", [
            f"{name} {share(g.below_0_1)} / {share(g.above_0_9)}"
            for name, g in layer.gates.items()], width))
    if layer.timescales is not None:
        tau = layer.timescales
        parts.append(_line(f"timescales τ = −1/ln({tau.keep_gate} gate), steps", [
            f"median {_steps(tau.median)}", f"p10 {_steps(tau.p10)}",
            f"p90 {_steps(tau.p90)}"], width))
    if layer.saturated_units:
        parts.append(_line("most saturated units", [
            f"{u.unit} ({share(u.share)}, mean {u.mean_keep:.3g})"
            for u in layer.saturated_units], width))
    horizon = layer.horizon
    measured = (str(horizon.measured) if horizon.measured is not None
                else f"more than {horizon.window}"
                + _beyond(horizon.window, horizon.longest_lag))
    parts.append(_line("memory horizon (10⁻³), steps", [
        f"measured {measured}",
        "predicted " + ("n/a (λ₁ ≥ 0)" if horizon.predicted is None
                        else f"{horizon.predicted:.3g}"),
        *([horizon.agreement] if horizon.agreement else [])], width))
    flow = layer.flow
    if flow is not None and flow.ratio is not None:
        # The batch's own, as explain --flow reads it (found tried as a new user would: only
        # the changes' before, read on the horizon's examples, was shown: ×5.82e-12 here
        # beside explain's ×9.51e-12 for the same layer).
        parts.append(_line("∂L/∂s carried back, last step to first", [
            f"{_carried(flow.ratio)} over the batch, as explain --flow reads it"
            + (f" ({flow.flag})" if flow.flag else "")], width))
    parts += _counterfactual_lines(layer, width)
    found = layer.exploding
    if found is not None and found.growing_share is not None:
        items = [f"on {share(found.growing_share)} of (example, step) pairs"]
        if found.growing_steps:
            more = found.growing_step_count - len(found.growing_steps)
            items.append("steps " + ", ".join(map(str, found.growing_steps))
                         + (f" and {more} more" if more > 0 else ""))
        if found.examples:
            items.append("examples " + ", ".join(f"{e.example} (×{number(e.ratio)})"
                                                  for e in found.examples))
        parts.append(_line("∂L/∂s_t grows going back", items, width))
    return parts


def _horizon_words(horizon: int | None, window: int | None) -> str:
    return str(horizon) if horizon is not None else f"> {window}"


def _examples(rows: list[int]) -> str:
    """Example indices in words: ``0, 4, 9, 13, 18, 22, 27 and 31``."""
    return ", ".join(str(r) for r in rows[:-1]) + f" and {rows[-1]}" if len(rows) > 1 else (
        str(rows[0]))


def _counterfactual_lines(layer: DiagnosedLayer, width: int) -> list[RenderableType]:
    """Each change, before → after, as measured on the changed copy."""
    if not layer.counterfactuals:
        return []
    rows = next((c.examples for c in layer.counterfactuals if c.examples is not None), None)
    # Where Keras cannot copy the model, the changes ran on it, each undone after its run.
    on = ("the model itself, run again, each change undone after its run"
          if any(c.on_model for c in layer.counterfactuals) else
          "a copy of the model, run again")
    parts: list[RenderableType] = [Text(
        f"with one change ({on}):" if rows is None else
        f"with one change ({on}; stepped on the {len(rows)} "
        f"examples the horizon reads, {_examples(rows)}, and before read on them too, "
        "not on the whole batch as above):")]
    before_h = _horizon_words(layer.horizon.measured, layer.horizon.window)
    before_l = _signed(layer.lyapunov[0]) if layer.lyapunov else "n/a"
    said: set[str] = set()
    for change in layer.counterfactuals:
        if not change.applicable:
            # The changes not run for one reason are said with it once (found tried as a new
            # user would: a model Keras cannot copy gave its reason twice, three lines each).
            note = change.note or ""
            if note in said:
                continue
            said.add(note)
            alike = [c.change for c in layer.counterfactuals
                     if not c.applicable and (c.note or "") == note]
            line = _line(f"  {' · '.join(alike)}", [note], width)
            line.stylize("dim")
            parts.append(line)
        elif change.kind == "clipping":
            calm = layer.mechanism != "exploding" and not (
                layer.exploding is not None and layer.exploding.growing_share)
            scaled = (f"the gradient ×{number(change.clip_scale)} to norm "
                      f"{number(change.gradient_norm)}"
                      if change.clip_scale is None or change.clip_scale < 1 else
                      f"clips nothing on this batch (the gradient's norm "
                      f"{number(change.gradient_norm)} is within it)")
            # Keras takes one clipping setting: the suggested one would replace the compiled.
            instead = ([] if change.compiled is None else
                       [f"in place of the compiled {change.compiled}, which leaves norm "
                        f"{number(change.compiled_norm)}"])
            # Found tried as a new user would: on an exploding layer whose optimizer clips
            # each tensor to 1, a global_clipnorm of 1.24e+08 read as the fix.
            looser = change.looser_than_compiled()
            line = _line(f"  {change.change}", [
                "√n × the median tensor norm", scaled, *instead,
                "the dynamics unchanged (not rerun)",
                *(["looser than the compiled one on this batch: for comparison, not a fix"]
                  if looser else
                  ["nothing grows here: for comparison, not a fix"] if calm else [])],
                width)
            if calm or looser:
                line.stylize("dim")
            parts.append(line)
        else:
            before = (before_l if change.lyapunov_1_before is None
                      else _signed(change.lyapunov_1_before))
            whose = "λ₁ (first column)" if change.first_column else "λ₁"
            after = _horizon_words(change.horizon, change.horizon_window)
            if (change.horizon is None and change.horizon_window is not None
                    and (layer.horizon.measured is not None
                         or change.horizon_window != layer.horizon.window)):
                # Why the change's lags stop there, where the layer's line does not say it.
                after += _beyond(change.horizon_window, layer.horizon.longest_lag,
                                 short=True)
            items = [f"horizon {before_h} → {after}",
                     f"{whose} {before} → " + ("n/a" if change.lyapunov_1 is None
                                                 else _signed(change.lyapunov_1))]
            flow = change.flow_before if change.flow_before is not None else layer.flow
            # n/a both ways (no example's last step that ran gets a gradient) says nothing.
            if (flow is not None and change.flow is not None
                    and (flow.ratio is not None or change.flow.ratio is not None)):
                # Named as the verdict names it (found tried as a new user would: "carried"
                # alone, undefined near it).
                items.append(f"∂L/∂s carried back {_carried(flow.ratio)} → "
                             f"{_carried(change.flow.ratio)}")
            parts.append(_line(f"  {change.change}", items, width))
    return parts


def _carried(ratio: float | None) -> str:
    """A flow's carried ratio; 0 is a gradient rounded to 0 on the way back (below the
    smallest number the layer's dtype holds), said so."""
    if ratio == 0:
        return "×0 (rounds to 0)"
    return f"×{number(ratio)}"


def render_diagnose(report: DiagnoseReport, width: int = 80) -> list[RenderableType]:
    parts: list[RenderableType] = [*header(report, "diagnose"), *map(warning, report.warnings)]
    for layer in report.layers:
        parts += layer_lines(layer, width)
    if report.nonfinite is not None:
        from gradscope.report.keras_text import nonfinite_lines

        parts += nonfinite_lines(report.nonfinite)
    if report.not_diagnosed:
        parts.append(section("Not diagnosed"))
        parts += [hanging("·", f"{entry.layer}: {entry.reason}", "dim")
                  for entry in report.not_diagnosed]
    parts.append(section("The batch's gradient"))
    clip = report.clipping
    parts.append(_line("global norm", [
        number(report.gradient_norm),
        f"optimizer {clip.optimizer or 'none'}",
        clip.setting or "no clipping"], width))
    parts.append(hanging("→", clip.effect))
    if report.method:
        parts.append(section("How"))
        parts += [hanging("·", line, "dim") for line in report.method]
    parts += timings_lines(report.timings, "\n")
    return parts
