"""``gradscope diagnose MODEL.keras``: why the gradients of each recurrent call vanish or
explode, measured on the batch's own trajectory through the cell the model holds.

Keras runs the model once under its tape (the loss, the gradients, each call's input, mask and
initial state); each recurrent call is stepped through its own cell
(:mod:`~gradscope.keras.stepped`, held to Keras' outputs), then read: the Lyapunov spectrum
and the step Jacobians (:mod:`.trajectory`), the gates (:mod:`.gates`), the memory horizon
(:mod:`.horizon`), where ∂L/∂s_t grows, the clipping (:mod:`.clipping`) and what one change
would do (:mod:`.counterfactuals`). The numbers become words in :mod:`gradscope.dynamics`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from gradscope import dynamics
from gradscope.errors import ConfigError
from gradscope.keras.diagnose.counterfactuals import Before
from gradscope.keras.engine import call_label, class_label
from gradscope.report.models import (
    Counterfactual,
    DiagnosedLayer,
    DiagnoseReport,
    Exploding,
    GrowingExample,
    Horizon,
    JacobianNorm,
    KerasNotAnalysed,
    SaturatedUnit,
    Timescales,
)
from gradscope.timing import Clock, Progress

#: Top exponents by default; every one when the state has at most this many numbers.
EXPONENTS, ALL_EXPONENTS = 8, 32

METHOD = [
    "every recurrent call is stepped through the cell the model holds, along the batch's own "
    "trajectory, after its outputs are held to Keras' own; s is every state joined ([h, c] "
    "for an LSTM)",
    "Lyapunov exponents: QR re-orthonormalisation along the trajectory (Benettin's method): "
    "Q_0 = I (k orthonormal columns from a fixed seed where k is below the state's size, "
    "column i the same whatever k), "
    "J_t·Q_(t−1) = Q_t·R_t, λ_i the mean of log|R_t[i, i]| over the steps each "
    "example ran, then over the examples, listed largest first (over a finite run a later "
    "column's mean may exceed the first's); J_t·Q by forward mode through one step of the "
    "cell (a Keras GRU, LSTM or SimpleRNN: its step linearised by hand, held to the "
    "layer's own states at 16 steps)",
    "horizon measured: the smallest lag k at which the median over steps t and examples of "
    "‖∂h_t/∂x_(t−k)‖ / ‖∂h_t/∂x_t‖ is below 10⁻³, exactly, through the cell (a Keras "
    "GRU, LSTM or SimpleRNN: back through its step linearised by hand; a masked step's lag "
    "left out: it reads no input); predicted: "
    "ln(10³)/|λ₁| when λ₁ < 0",
    "growing: the carried part of ∂L/∂s_t (the total less what arrives from above at t) "
    "against ∂L/∂s_(t+1), per example and step, where step t+1 ran",
]

#: Added to :data:`METHOD` where the counterfactuals ran.
COUNTERFACTUAL_METHOD = (
    "counterfactuals: a copy of the model (gradscope's own load of the file, or the object "
    "rebuilt by Keras from its config), one change at a time (keep-gate bias +1; an LSTM's "
    "forget or a GRU's update biases below 1 raised to 1; each gate's block of the "
    "recurrent kernel made its polar factor times its spectral norm; a SimpleRNN's kernel of "
    "norm other than 1 made its polar factor, at norm 1), run again "
    "on the batch and diagnosed as the layer, its call stepped on the examples the horizon "
    "reads (in inference mode, where the batch has more; the copy's pass of them alone where "
    "it gives the whole batch's ∂L/∂(the call's outputs) there times one number, scaled to "
    "the whole batch's loss, else of the whole batch): the "
    "horizon, the flow and λ₁ from the layer's own start (every column where the layer "
    "carries every exponent; else its first, random, column alone, Benettin's λ₁), each "
    "beside the layer's own, read alike on the same examples as before; clipping "
    "at √n × the median tensor norm changes the gradient, not the dynamics: not rerun")


def on_model_method(why: str) -> str:
    """Added to :data:`METHOD` where the counterfactuals ran on the user's model itself."""
    return ("the changes ran on the model itself, each undone after its run (the weights "
            f"given back bit for bit, so the model is as it was), not on a copy: {why}")


#: Added to :data:`METHOD` where a diagnosed call ran with dropout in training mode.
DROPOUT_METHOD = (
    "training mode with dropout: each step holds the masks the call drew (drawn again from "
    "where its seed generator started; the stepped outputs equal Keras' own), and every row "
    "folded into a batch (a tangent column, an (example, step) pair, an output unit) holds "
    "its own example's; J_t by forward mode through the cell itself (the step linearised "
    "by hand has no masks); the gates with x_t and h_(t−1) multiplied by each gate's mask; "
    "where recurrent dropout makes every J_t singular (units dropped by an LSTM's "
    "output-gate mask, by a SimpleRNN's), that many exponents are −∞ and the finite ones "
    "are given, from random start columns")


#: Keras' own layer classes besides flow's ``RECURRENT_CLASSES`` whose calls may be
#: recurrent calls (a model's run says which).
MAY_RECUR = frozenset({"RNN", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D"})


def nothing_recurrent(path: str) -> ConfigError:
    """The refusal of a model with no recurrent layer call (exit 2)."""
    return ConfigError(f"{path}: the model has no recurrent layer call, so there is nothing "
                       "to diagnose (diagnose reads the dynamics of recurrent layers: RNN, "
                       "LSTM, GRU and their cells); explain and check read any model",
                       where=path)


def refuse_without_recurrent(graph: Any, path: str) -> None:
    """Before TensorFlow loads: a model whose config holds only Keras' own layers, none of
    them recurrent (nested models and wrapped layers included), is refused
    (:func:`nothing_recurrent`). A layer of the user's own class (it may be an ``RNN``) or a
    subclassed model's own call leaves it to the run."""
    from gradscope.keras.flow import RECURRENT_CLASSES
    from gradscope.keras.graph import YOUR_CALL

    recurrent = RECURRENT_CLASSES | MAY_RECUR
    for layer in graph.walk():
        module = layer.module or ""
        if (layer.class_name in recurrent or layer.class_name == YOUR_CALL
                or not (module == "keras" or module.startswith("keras."))):
            return
    raise nothing_recurrent(path)


def is_recurrent(engine: Any, call: Any) -> bool:
    """Whether ``call`` is a recurrent call (Keras' own layers, an ``RNN`` over a cell, a
    ConvLSTM, a subclass of Keras' recurrent layers), as ``--flow`` counts them."""
    from gradscope.keras.flow import RECURRENT_CLASSES, stepped_only

    return call.class_name in RECURRENT_CLASSES or stepped_only(engine.operation(call.layer))


def diagnose(job: Any, progress: Progress | None = None, timings: bool = False,
             exponents: int | None = None, counterfactuals: bool = True) -> DiagnoseReport:
    """Every recurrent call of ``job``'s model, diagnosed on its batch.

    Args:
        job: A :class:`~gradscope.keras.explain.KerasJob`.
        progress: Hears each phase as it starts.
        timings: Add the seconds each phase took.
        exponents: How many Lyapunov exponents (default 8; all when the state has at most 32
            numbers).
        counterfactuals: Run each change on a copy of the model
            (:mod:`~gradscope.keras.diagnose.counterfactuals`); False leaves every list empty.

    Returns:
        The report.
    """
    from gradscope._blas import blas_beside_tensorflow

    # NumPy's share (the Lanczos bookkeeping, the SVDs of a changed kernel, the per-step
    # norms) on one BLAS thread: with one per core it fights TensorFlow's spinning pools
    # (gradscope/_blas.py): one kernel's SVDs took up to 11.6 s instead of about 0.1 s.
    with blas_beside_tensorflow():
        return _diagnose(job, progress, timings, exponents, counterfactuals)


def _diagnose(job: Any, progress: Progress | None, timings: bool, exponents: int | None,
              counterfactuals: bool) -> DiagnoseReport:
    from gradscope._heap import give_back_freed_memory
    from gradscope.keras.data import drawn_targets
    from gradscope.keras.diagnose.clipping import clipping, global_norm
    from gradscope.keras.explain import loaded, loss_entry, model_entry
    from gradscope.keras.state_probes import SQUARES
    from gradscope.keras.stepped import last_totals, step_call, with_probed

    say = progress or (lambda message: None)
    clock = Clock()
    engine, targets = loaded(job, say, clock)
    say("running the model forward and backward under the tape")
    # Probed for the squares alone: the pass's own backward gives what diagnose reads of every
    # call's ∂L/∂s_t, so that each call is then stepped forward only
    # (:func:`~gradscope.keras.stepped.with_probed`; a loop behind a mask keeps its probes).
    result = engine.run(job.batch.inputs, targets, watch_outputs=True,
                        sample_weight=job.batch.sample_weight, probe_states=SQUARES,
                        carry_back=False)
    clock.lap("forward_backward")
    layers: list[DiagnosedLayer] = []
    skipped: list[KerasNotAnalysed] = []
    drawn = drawn_targets(job.plan, job.batch)
    warnings: list[str] = [f"{drawn}; the dynamics (λ, the step Jacobians, the gates, the "
                           "horizon) read no target: they stand"] if drawn else []
    if not any(is_recurrent(engine, c) for c in result.calls):
        # Nothing to read: a usage error (exit 2), not a report that passes in CI.
        raise nothing_recurrent(job.path)
    trained = trained_of(result)
    from gradscope.keras.nonfinite import all_finite
    from gradscope.keras.nonfinite import diagnose as where_born

    if not all_finite(result):
        # Dynamics read from NaN or Inf mean nothing: where the first was born instead.
        say("a number is not finite: where it was born, on this batch")
        nonfinite = where_born(engine, job.batch.inputs, targets, job.batch.sample_weight,
                               result)
        clock.lap("nonfinite")
        skipped = [KerasNotAnalysed(layer=call_label(c.layer, c.index), reason=(
            "the loss or a gradient is not finite on this batch (where the first NaN or "
            "Inf was born is above)")) for c in result.calls
            if is_recurrent(engine, c)]
        report = DiagnoseReport(
            model=model_entry(job, engine, result), loss=loss_entry(job, result), layers=[],
            not_diagnosed=skipped, gradient_norm=global_norm(trained),
            clipping=clipping(job.graph.compile_config, trained, job.model),
            method=[],
            warnings=[*warnings, "the loss or a gradient is not finite on this batch: no call "
                      "is diagnosed; a diagnosis needs a batch on which every number is "
                      "finite"],
            nonfinite=nonfinite)
        return report.model_copy(update={"timings": clock.laps()}) if timings else report
    dropped = False  # a call stepped with dropout masks
    whatif = _WhatIf(job, engine, targets, trained) if counterfactuals else None
    for call in result.calls:
        if not is_recurrent(engine, call):
            continue
        label = call_label(call.layer, call.index)
        say(f"{label}: stepping its cell along the batch")
        # The stepping and its backward pass are the peak of a diagnosis: they start on
        # what the phases before freed, given back (gradscope/_heap.py).
        give_back_freed_memory()
        probed = result.state_totals.get(label)
        upstream = None if probed else result.output_gradients.get(label)
        stepped = step_call(engine, call, upstream, engine.training, cell_dtype=True,
                            reuse=True, read_inputs=False, squares=True,
                            at_last=last_totals(probed, call.mask) if probed else None)
        if isinstance(stepped, str):
            skipped.append(KerasNotAnalysed(layer=label, reason=stepped))
            continue
        if probed:
            stepped = with_probed(stepped, probed)
        dropped = dropped or any(m is not None for m in stepped.masks or [])
        carried = carried_state(engine, stepped, changes=counterfactuals)
        if carried is not None:
            warnings.append(carried)
        done = [_direction(engine, stepped, index, exponents, say, warnings)
                for index in range(len(stepped.directions))]
        # The counterfactuals step the call again, changed: this call's sequences and
        # totals are let go before they run.
        stepped = replace(stepped, states=[], totals=None, direct=None)
        for index, found in enumerate(done):
            if isinstance(found, str):
                skipped.append(KerasNotAnalysed(layer=stepped.directions[index].label,
                                                reason=found))
                continue
            entry, evidence, count, before = found
            if whatif is not None:
                say(f"{entry.call}: counterfactuals, each on a changed copy of the model")
                entry = whatif.add(entry, evidence, stepped, index, count, before,
                                   result.output_gradients.get(label))
            layers.append(entry)
        clock.lap(f"diagnose {label}")
    norm = global_norm(trained)
    if norm == 0:
        warnings.append(
            ("the loss is exactly 0 on this batch (every sample weight 0?), so every "
             if result.loss == 0 else "every ")
            + "gradient is exactly 0: no flow, growth or clipping is read (n/a); the "
            "dynamics (λ, the step Jacobians, the gates, the horizon) are the layers' own, "
            "whatever the loss, and stand")
    report = DiagnoseReport(
        model=model_entry(job, engine, result), loss=loss_entry(job, result), layers=layers,
        not_diagnosed=skipped, gradient_norm=norm,
        clipping=clipping(job.graph.compile_config, trained, job.model),
        # Without counterfactuals, their method is not said (found tried as a new user
        # would: "How" described changes that never ran).
        method=[*METHOD, *([COUNTERFACTUAL_METHOD] if counterfactuals else []),
                *([on_model_method(whatif.on_model)]
                  if whatif is not None and whatif.on_model else []),
                *([DROPOUT_METHOD] if dropped else [])],
        warnings=warnings)
    if timings:
        report = report.model_copy(update={"timings": clock.laps()})
    return report


def carried_state(engine: Any, stepped: Any, changes: bool = True) -> str | None:
    """Where a stateful layer's call starts, in words (None: the layer is not stateful): from
    the state it carries, its last call's final state, or from zeros (a saved file keeps none;
    an object reset, or never called). Its dynamics, and each change's (``changes``: the
    counterfactuals run), are read from there."""
    layer = engine.operation(stepped.call.layer)
    if not getattr(layer, "stateful", False):
        return None
    start = [np.asarray(s, np.float64) for s in stepped.call.states]
    norm = float(np.sqrt(sum(np.sum(s * s) for s in start)))
    if norm == 0:
        why = ("a saved file keeps no carried state" if not engine.live else
               "it was reset, or never called")
        return (f"{stepped.label} is stateful: stepped from zeros ({why}), as a call after "
                "reset_state() starts" + ("; each change starts there too" if changes else ""))
    return (f"{stepped.label} is stateful: stepped from the state it carries, its last call's "
            f"final state (norm {norm:.3g} over the batch), as its next call would start"
            + ("; each change starts there too" if changes else ""))


def trained_of(result: Any) -> dict[str, Any]:
    """The pass's gradient of every weight that has one (variable path → array)."""
    return {p: g for p, g in result.gradients.items() if g is not None}


def exponent_room(path: Any, label: str) -> tuple[int, str | None] | str:
    """How many exponents of ``path`` are finite to take (the state's size, less the most
    directions recurrent dropout cuts in any example: those are −∞), with a warning that
    says so where it cuts any; or why none is known to be (:func:`cut_directions`)."""
    from gradscope.keras.diagnose.trajectory import cut_directions

    cut = cut_directions(path)
    if isinstance(cut, str):
        return cut
    size = path.size
    if cut is None or not np.any(cut):
        return size, None
    most = int(np.max(cut))
    if most >= size:
        return ("recurrent_dropout in training mode drops every unit in some example: J_t = 0 "
                "there, every exponent −∞ (not diagnosed)")
    hit = int(np.count_nonzero(cut))
    return size - most, (
        f"{label}: recurrent_dropout in training mode cuts up to {most} of the state's "
        f"{size} directions (J_t singular at every step, in {hit} of {len(cut)} examples): "
        f"those exponents are −∞; "
        + ("only the top one is finite" if size - most == 1
           else f"only the top {size - most} are finite"))


def _direction(engine: Any, stepped: Any, index: int, exponents: int | None,
               say: Progress, warnings: list[str],
               ) -> tuple[DiagnosedLayer, dynamics.Evidence, int, Before] | str:
    """One direction of a stepped call, diagnosed, with what its verdict rests on, how many
    exponents it took and what a counterfactual's numbers are compared with (the layer's
    own, on the examples the changes run on, λ₁ taken as theirs is: :class:`Before`); or why
    it cannot be. What the reader must know of its numbers is added to ``warnings``."""
    from gradscope._heap import give_back_freed_memory
    from gradscope.keras.diagnose.counterfactuals import (
        carry_unread,
        changed_on,
        first_column_only,
        state_flow,
    )
    from gradscope.keras.diagnose.gates import known_gates, read_gates
    from gradscope.keras.diagnose.horizon import measure
    from gradscope.keras.diagnose.trajectory import lyapunov_logs, step_norms, trajectory
    from gradscope.keras.stepped import carried_back, step_squares

    direction = stepped.directions[index]
    layer = direction.layer
    path = trajectory(stepped, index)
    if isinstance(path, str):
        return path
    if path.ran.shape[1] < 2:
        return ("a call of one step carries nothing from step to step: no recurrence to "
                "diagnose")
    size = path.size
    label = direction.label
    room = exponent_room(path, label)
    if isinstance(room, str):
        return room
    live, cut = room
    count = min(live, size if size <= ALL_EXPONENTS and exponents is None else min(
        exponents or EXPONENTS, size))
    if cut is not None:
        warnings.append(cut)
    say(f"{label}: Lyapunov exponents (QR along the trajectory)")
    logs = lyapunov_logs(engine, path, count)
    spectrum, change = dynamics.lyapunov_exponents(logs, path.ran)
    if change is None:
        warnings.append(
            f"{label}: {path.ran.shape[1]} steps are too few to tell how far the exponents "
            "have settled (\"moved\" compares the last quarter of at least 4): they are the "
            "rates of these steps alone, from where the scan started, and a horizon "
            "predicted from λ₁ is no more than that")
    hit = at_floor(logs, path.ran)
    columns_hit = np.asarray(hit.any(axis=(0, 1)))
    floored_at = [i for i, column in enumerate(dynamics.column_order(logs, path.ran))
                  if columns_hit[column]]
    floored = _floored(hit, path.ran, label, floored_at)
    if floored is not None:
        warnings.append(floored)
    later = dynamics.later_half_largest(logs, path.ran)
    if (change is not None and 0 not in floored_at
            and dynamics.unsettled(float(spectrum[0]) if len(spectrum) else None, later)):
        assert later is not None
        apart = dynamics.read_apart(float(spectrum[0]), later)
        warnings.append(
            f"{label}: λ₁ has not settled over these {path.ran.shape[1]} steps: the second "
            f"half of the steps alone reads {later:+.3g} per step, against "
            f"{float(spectrum[0]):+.3g} from all of them (where the scan started still "
            f"weighs, more than \"moved\" {change:.3g} says), and a horizon predicted from "
            "λ₁ is no firmer" + ("" if apart is None else
                                 f"; {apart}, where the verdict reads all of them"))
    say(f"{label}: the norm of every step Jacobian")
    # Each phase starts on what the one before freed, given back: the Lyapunov scan's
    # projected inputs and its XLA buffers (about 0.3 GB on the LSTM 256 × 2 at 1000 steps)
    # would otherwise stay in malloc's arenas under every phase after it (gradscope/_heap.py).
    give_back_freed_memory()
    grid, method, taken = step_norms(engine, path, seed=0)
    norms = JacobianNorm(
        median=float(np.nanmedian(grid)), max=float(np.nanmax(grid)),
        share_above_1=float(np.mean(grid[path.ran & np.isfinite(grid)]
                                    > 1 + above_1_rounding(layer.cell.compute_dtype))),
        steps_median=_per_step(grid, np.nanmedian), steps_max=_per_step(grid, np.nanmax),
        steps_read=taken if taken < grid.shape[1] else None, method=method)
    say(f"{label}: gates")
    give_back_freed_memory()
    why_not = known_gates(layer)
    gates = timescales = None
    saturated: list[SaturatedUnit] = []
    if why_not is None:
        reading = read_gates(engine, path)
        gates = reading.shares()
        taus = dynamics.timescales(reading.mean_keep)
        timescales = Timescales(median=dynamics.quantile(taus, 0.5),
                                p10=dynamics.quantile(taus, 0.1),
                                p90=dynamics.quantile(taus, 0.9), keep_gate=reading.keep)
        order = np.argsort(-reading.saturated, kind="stable")[:5]
        saturated = [SaturatedUnit(unit=int(u), share=float(reading.saturated[u]),
                                   mean_keep=float(reading.mean_keep[u]))
                     for u in order if reading.saturated[u] > 0]
    say(f"{label}: the memory horizon, measured")
    give_back_freed_memory()
    measured = measure(engine, path, stepped.call.mask)
    largest = float(spectrum[0]) if len(spectrum) else None
    predicted = dynamics.predicted_horizon(largest)
    horizon = Horizon(measured=measured.horizon, predicted=predicted,
                      agreement=dynamics.agreement(measured.horizon, predicted),
                      window=measured.window, longest_lag=measured.longest,
                      ratios=[float(v) if np.isfinite(v) else None for v in measured.medians],
                      steps=measured.steps, examples=measured.examples)
    squares = step_squares(stepped, index)
    carry = not carry_unread(stepped, index)
    exploding = _exploding(squares if carry else None, path.ran,
                           GROWTH_ULPS * roundoff(layer.cell.compute_dtype))
    back = carried_back(stepped, index)
    flow = state_flow(squares, path.ran, back, carry)
    if not carry:
        warnings.append(
            f"{label}: its cell's output is not its state, and the call returns its sequence: "
            "the gradient from above enters each step through the cell, onto the state the "
            "next step reads, where it cannot be told apart from what the recurrence carries "
            "back; where ∂L/∂s_t grows and the flow's ratio are not read (n/a), and "
            "∂L/∂s_t is the state's as step t+1 reads it (0 after the last step)")
    # What a change's numbers are compared with: the same rows, λ₁ taken as a change's is.
    examples = changed_on(engine, layer, stepped.call, measured.examples)
    rows = slice(None) if examples is None else np.asarray(examples)
    alone = first_column_only(count, size)
    first, _ = dynamics.lyapunov_exponents(logs[rows][..., :1 if alone else count],
                                           path.ran[rows])
    before = Before(
        examples=examples, lyapunov_1=float(first[0]) if len(first) else None,
        flow=state_flow(None if squares is None else (squares[0][rows], squares[1][rows]),
                        path.ran[rows], None if back is None else back[rows], carry),
        # Whose λ₁ a change's is: said once, for its line and the verdict. Always where it is
        # the first column's (found tried as a new user would: left unsaid where the layer's
        # own first column read as its λ₁, a change's "λ₁ -0.123" was not the changed copy's
        # λ₁, -0.121).
        first_column=alone)
    reached = np.nonzero(np.isfinite(measured.medians))[0]
    steps = int(path.ran.shape[1])
    keep = timescales.keep_gate if timescales is not None else None
    evidence = dynamics.Evidence(
        name=label, steps=steps, largest=largest, measured=measured.horizon,
        window=measured.window, predicted=predicted, share_above_1=norms.share_above_1,
        keep_gate=keep, keep_below=gates[keep].below_0_1 if gates and keep else None,
        keep_above=gates[keep].above_0_9 if gates and keep else None,
        median_tau=timescales.median if timescales is not None else None,
        growing=exploding.growing_share if exploding is not None else None,
        carried=flow.ratio if flow is not None else None,
        reach=float(measured.medians[reached[-1]]) if reached.size else None,
        reach_lag=int(reached[-1]) if reached.size else None,
        per_example=tuple(float(v) for v in dynamics.example_exponents(logs, path.ran)),
        ran=int(np.max(np.sum(path.ran, axis=1), initial=0)), floored=0 in floored_at,
        longest=measured.longest)
    return DiagnosedLayer(
        layer=stepped.call.layer, call=label, class_name=class_label(layer),
        cell=class_label(layer.cell), steps=steps, state_size=size,
        backwards=direction.backwards, lyapunov=[float(v) for v in spectrum],
        lyapunov_change=change, lyapunov_1_later_half=later,
        lyapunov_floored=floored_at, jacobian_norm=norms,
        gates=gates, gates_note=why_not,
        saturated_units=saturated, timescales=timescales, horizon=horizon,
        exploding=exploding, flow=flow,
        mechanism=dynamics.mechanism(evidence),  # type: ignore[arg-type]
        verdict=dynamics.verdict(evidence)), evidence, count, before


#: ‖J_t‖₂ within this many units of the cell dtype's roundoff above 1 does not count as
#: above 1: an orthogonal kernel behind a relu reads 1 + 1.4e-7 in float32 (J = D·W, with
#: D a 0/1 diagonal, has norm at most ‖W‖ = 1), and "> 1 on 100% of steps" misled.
ROUNDING_ULPS = 4
#: A step's gain of the carried ∂L/∂s_t within this many units of roundoff above 1 is no
#: growth: the carried part is the total less what arrives from above, a difference, whose
#: rounding is larger (an orthogonal recurrence read gains up to 1 + 8.4 roundoffs in
#: float32, and "grows on 88.4% of pairs" misled).
GROWTH_ULPS = 32


def above_1_rounding(dtype: Any) -> float:
    """How far above 1 a step Jacobian's norm, computed in ``dtype`` (the cell's), may read
    by rounding alone: :data:`ROUNDING_ULPS` units of its roundoff."""
    return ROUNDING_ULPS * roundoff(dtype)


def roundoff(dtype: Any) -> float:
    """The machine epsilon of ``dtype`` (a name or a dtype)."""
    name = str(getattr(dtype, "name", dtype))
    # NumPy has no bfloat16 of its own: 8 bits of significand, 7 stored.
    return 2.0 ** -7 if name == "bfloat16" else float(np.finfo(np.dtype(name)).eps)


def _floored(hit: np.ndarray, ran: np.ndarray, label: str,
             ranks: list[int]) -> str | None:
    """Where a step took a followed direction to 0 (``hit``: :func:`at_floor`; |R_t[i, i]|
    at the scan's floor, a unit switched off, a zero row of J_t), that step's log is the
    floor's, not a rate (−∞ in truth): how often, in words, and which exponents (``ranks``:
    their places, largest first, from 0) (None: never). Found tried as a new user would:
    "so its exponent is not rates", of λ16, which the text does not show."""
    from gradscope.keras.diagnose.trajectory import SMALLEST_STRETCH

    floor = float(np.log(SMALLEST_STRETCH))
    if not hit.any():
        return None
    columns = int(np.count_nonzero(hit.any(axis=(0, 1))))
    pairs = int(np.count_nonzero(hit.any(axis=2)))
    what = ("1 of the directions followed was" if columns == 1 else
            f"{columns} of the {hit.shape[2]} directions followed were")
    named = ", ".join(f"λ{rank + 1}" for rank in ranks)
    those = (f"its exponent ({named}) is not a rate" if columns == 1 else
             f"those {columns} exponents ({named}) are not rates")
    return (f"{label}: {what} taken to 0 at some step, at {pairs} of the "
            f"{int(np.count_nonzero(ran))} (example, step) pairs that ran (|R_t[i, i]| below "
            f"{SMALLEST_STRETCH:g}: a unit switched off, J_t singular); each such step counts "
            f"ln {SMALLEST_STRETCH:g} = {floor:.1f} (−∞ in truth), so {those}")


def at_floor(logs: np.ndarray, ran: np.ndarray) -> np.ndarray:
    """(B, T, k): where a step that ran took column k's direction to 0 (its log at the
    scan's floor)."""
    from gradscope.keras.diagnose.trajectory import SMALLEST_STRETCH

    floor = float(np.log(SMALLEST_STRETCH))
    return (np.asarray(logs, np.float64) <= floor + 1e-3) & np.asarray(ran, bool)[..., None]


def _per_step(grid: np.ndarray, reduce: Any) -> list[float | None]:
    out: list[float | None] = []
    for column in grid.T:
        present = column[np.isfinite(column)]
        out.append(float(reduce(present)) if present.size else None)
    return out


def _exploding(squares: tuple[np.ndarray, np.ndarray] | None,
               ran: np.ndarray, rounding: float = 0.0) -> Exploding | None:
    """Where the carried ∂L/∂s_t grows going back a step, from a direction's
    :func:`~gradscope.keras.stepped.step_squares` (None: no gradient reached the call) and
    where each example's steps ran (B, T), processing order: over the (example, step) pairs
    whose step t+1 ran (a masked step copies its state, and what reaches an example's last
    step that ran from its later, masked, outputs is not carried:
    :func:`~gradscope.keras.probed_flow.carried_ratio_of`). A step grows where its gain
    passes 1 by more than ``rounding`` (what rounding alone gives: an orthogonal recurrence
    read 1.0000005–1.000001 in float32), an example where its ratio passes 1 by more than
    that per step it carried."""
    if squares is None:
        return None
    whole, carried = squares
    # The pairs whose step t+1 did not run are left out.
    after = np.where(ran[:, 1:], np.sqrt(whole[:, 1:]), 0.0)  # (B, T−1): ‖∂L/∂s_(t+1)‖
    back = np.where(ran[:, 1:], np.sqrt(carried[:, :-1]), 0.0)  # carried part at t
    live = after > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        gains = np.where(live, back / np.where(live, after, 1), np.nan)
    share = float(np.mean(gains[live] > 1 + rounding)) if live.any() else None
    batch_after = np.sqrt(np.sum(after ** 2, axis=0))
    batch_back = np.sqrt(np.sum(back ** 2, axis=0))
    with np.errstate(divide="ignore", invalid="ignore"):
        batch_gain = np.where(batch_after > 0, batch_back / batch_after, np.nan)
    growing = np.nonzero(batch_gain > 1 + rounding)[0]
    growing = growing[np.argsort(-batch_gain[growing], kind="stable")]
    with np.errstate(divide="ignore"):
        logs = np.where(live & (back > 0), np.log(np.where(live & (back > 0), gains, 1)),
                        np.where(live, -np.inf, 0.0))
    ratios = np.exp(np.clip(np.sum(logs, axis=1), -700, 700))
    bound = (1 + rounding) ** np.sum(live, axis=1)
    grown = [int(e) for e in np.argsort(-ratios, kind="stable") if ratios[e] > bound[e]][:10]
    return Exploding(growing_share=share, growing_steps=[int(t) for t in growing[:20]],
                     growing_step_count=int(growing.size),
                     examples=[GrowingExample(example=e, ratio=float(ratios[e]))
                               for e in grown])


class _WhatIf:
    """The counterfactuals of every diagnosed direction: one copy of the model for them all
    (made at the first, each change undone after its run), and the batch's clipping."""

    def __init__(self, job: Any, engine: Any, targets: dict[str, Any],
                 gradients: dict[str, Any]) -> None:
        from gradscope.keras.diagnose.clipping import after_clipping, global_norm

        self.job, self.engine, self.targets, self.gradients = job, engine, targets, gradients
        # Keras takes one clipping setting: one suggested would replace one compiled, whose
        # effect on this batch (the same for every layer) it is weighed against.
        already, setting = after_clipping(job.graph.compile_config, gradients, job.model)
        self.compiled = None if setting is None else (setting, global_norm(already))
        self.copy: Any = None
        #: Why the changes run on the user's model itself, not a copy (None: a copy, or
        #: gradscope's own load of a file).
        self.on_model: str | None = None
        self.cache: dict[Any, Any] = {}  # the copy's traced pass, kept across the changes

    def add(self, entry: DiagnosedLayer, evidence: dynamics.Evidence, stepped: Any,
            index: int, count: int, before: Before,
            upstream: list[Any] | None) -> DiagnosedLayer:
        """``entry`` with its counterfactuals, and its verdict naming the most effective
        (``before``: the layer's own numbers, read as a change's are; ``upstream``: the
        whole batch's ∂L/∂(the call's outputs))."""
        from gradscope.keras.diagnose.counterfactuals import (
            CHANGES,
            LISTED_ONLY_WHERE_APPLICABLE,
            Rerun,
            copy_engine,
            measure_change,
            rows_rerun,
            suggested_clipping,
        )

        if self.copy is None:
            self.copy, self.on_model = copy_engine(self.job, self.engine)
        call = stepped.call
        rerun = Rerun(inputs=self.job.batch.inputs, targets=self.targets,
                      sample_weight=self.job.batch.sample_weight, layer=call.layer,
                      index=call.index, label=stepped.label)
        examples = before.examples
        if examples is not None:
            # The rows alone, where a pass of them is the whole batch's there.
            rows = rows_rerun(self.copy, rerun, examples, upstream, call, self.cache)
            rerun, examples = (rerun, examples) if rows is None else (rows, None)
        found = [measure_change(self.copy, rerun, index, kind, count, self.cache, examples)
                 for kind, _, _ in CHANGES]
        found = [c.model_copy(update={
            "lyapunov_1_before": before.lyapunov_1, "flow_before": before.flow,
            "examples": before.examples, "first_column": before.first_column,
            "on_model": self.on_model})
            if c.applicable else c for c in found
            if c.applicable or c.kind not in LISTED_ONLY_WHERE_APPLICABLE]
        largest = entry.lyapunov[0] if entry.lyapunov else None
        clipped = suggested_clipping(self.gradients, largest, entry.horizon.measured,
                                     entry.horizon.window, self.compiled)
        found += [clipped] if clipped is not None else []
        remedy = _most_effective(entry, found)
        if remedy is None:
            return entry.model_copy(update={"counterfactuals": found})
        evidence = replace(evidence, remedy=remedy)
        return entry.model_copy(update={"counterfactuals": found,
                                        "verdict": dynamics.verdict(evidence)})


def _horizon_number(horizon: int | None, window: int | None) -> float:
    """A measured horizon as a number to compare: beyond its window, half a step past it."""
    return float(horizon) if horizon is not None else float(window or 0) + 0.5


def _none_helps(changed: list[Counterfactual], before: float) -> str | None:
    """Where no change is a remedy for a vanishing layer, why, in the verdict's words: a
    change that would lengthen the horizon by half but make the layer explode, with both;
    else that none tried lengthens it by half (None where no change was run)."""
    exploding = [c for c in changed if _explodes(c)
                 and dynamics.lengthens(_horizon_number(c.horizon, c.horizon_window), before)]
    if exploding:
        best = max(exploding, key=lambda c: _horizon_number(c.horizon, c.horizon_window))
        said = dynamics.remedy("vanishing", best.change, best.horizon, best.horizon_window,
                               best.lyapunov_1).removesuffix(" (measured)")
        why = ([f"λ₁ {best.lyapunov_1:+.3g} per step"]
               if best.lyapunov_1 is not None
               and best.lyapunov_1 > dynamics.EXPLODING_EXPONENT else [])
        if (best.flow is not None and best.flow.flag == "exploding"
                and best.flow.ratio is not None):
            why.append(f"∂L/∂s carried back ×{best.flow.ratio:.3g}")
        return (f"{said} (measured), but the layer would explode"
                + (f" ({', '.join(why)})" if why else ""))
    if not changed:
        return None
    if (dynamics.LONGER - 1) * before < dynamics.LONGER_BY:  # so short, the steps bind
        return (f"no change tried lengthens the horizon by {dynamics.LONGER_BY} steps or more "
                "(each one is below)")
    return "no change tried lengthens the horizon by half or more (each one is below)"


def _explodes(change: Counterfactual) -> bool:
    """Whether a change makes the layer explode: its λ₁ above
    :data:`~gradscope.dynamics.EXPLODING_EXPONENT`, or what its recurrence carries back
    flagged exploding."""
    return ((change.lyapunov_1 is not None
             and change.lyapunov_1 > dynamics.EXPLODING_EXPONENT)
            or (change.flow is not None and change.flow.flag == "exploding"))


def _most_effective(entry: DiagnosedLayer, found: list[Counterfactual]) -> str | None:
    """The counterfactual the verdict names, in words: for a vanishing layer the change that
    lengthens the measured horizon most, enough to be named
    (:func:`~gradscope.dynamics.lengthens`: 1.5 times and 2 steps),
    or, where no measured horizon shows that (a change's lies beyond the lags measured),
    the change whose λ₁ predicts the longest horizon, at least as many times the layer's
    (λ₁ taken alike); never a change that makes the layer explode (λ₁ above
    :data:`~gradscope.dynamics.EXPLODING_EXPONENT`, or its flow flagged exploding). For an
    exploding layer the change that lowers λ₁ most, else the clipping. None when no change
    helps (or the layer holds)."""
    changed = [c for c in found if c.applicable and c.kind != "clipping"]
    if entry.mechanism == "vanishing":
        # A change that trades vanishing for exploding is no remedy.
        calm = [c for c in changed if not _explodes(c)]
        before = _horizon_number(entry.horizon.measured, entry.horizon.window)
        longer = [c for c in calm
                  if dynamics.lengthens(_horizon_number(c.horizon, c.horizon_window), before)]
        if longer:
            best = max(longer, key=lambda c: _horizon_number(c.horizon, c.horizon_window))
            return dynamics.remedy("vanishing", best.change, best.horizon,
                                   best.horizon_window, best.lyapunov_1)
        if not entry.lyapunov:
            return _none_helps(changed, before)
        # Beyond the lags measured, the measured horizons do not tell how much longer: the
        # horizon predicted from each change's λ₁ (against the layer's, taken as the
        # change's is) does.
        slower = []
        for c in calm:
            if c.horizon is not None or c.lyapunov_1 is None:
                continue
            own = entry.lyapunov[0] if c.lyapunov_1_before is None else c.lyapunov_1_before
            factor = dynamics.slower_fading(c.lyapunov_1, own)
            if factor is not None and factor >= dynamics.LONGER:
                slower.append((factor, c, own))
        if not slower:
            return _none_helps(changed, before)
        _, best, own = max(slower, key=lambda found: found[0])
        assert best.lyapunov_1 is not None
        return dynamics.remedy_by_rate(best.change, best.lyapunov_1, own, best.horizon_window,
                                       first_column=best.first_column,
                                       measured=entry.horizon.measured,
                                       examples=len(best.examples) if best.examples else None)
    if entry.mechanism == "exploding" and entry.lyapunov:
        lower = [c for c in changed if c.lyapunov_1 is not None and c.lyapunov_1 < (
            entry.lyapunov[0] if c.lyapunov_1_before is None else c.lyapunov_1_before)]
        if lower:
            best = min(lower, key=lambda c: c.lyapunov_1 or 0.0)
            return dynamics.remedy("exploding", best.change, best.horizon,
                                   best.horizon_window, best.lyapunov_1)
        clip = next((c for c in found if c.kind == "clipping"), None)
        if (clip is not None and clip.clip_scale is not None and clip.clip_scale < 1
                and not clip.looser_than_compiled()):
            return (f"with {clip.change}, this batch's gradient would be "
                    f"scaled by ×{clip.clip_scale:.3g} (the dynamics unchanged)")
    return None
