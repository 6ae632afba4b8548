"""``gradscope check MODEL.keras``: every gradient of the user's model against independent
witnesses, on a float64 copy of the model with the same weights.

- Finite differences, on every trainable weight, every float input and every initial state,
  against the tape's directional derivative. They first move every tensor at once, along a few
  joint random directions (:mod:`~gradscope.keras.check.joint_differences`); only where one
  disagrees is each tensor probed on its own (random unit directions and single elements: the
  largest |g| and random ones), which names it. The loss of a weight or input probe is Keras'
  own call of the whole model, ``model(x)`` + ``compute_loss``, never gradscope's
  layer-by-layer replay; a zero initial state is shifted as Keras asks its layer for it
  (counted by the witness, apart from the engine's recorder), and a state Keras does not ask
  for (wired in, carried) through the replay, whose unshifted loss must equal Keras' own.
  Weights are perturbed in place and restored, and so are the non-trainable variables
  (batch-norm statistics, dropout seeds) and the states of stateful layers, so that every
  evaluation sees the same model.
- The NumPy reference, for every GRU, LSTM and SimpleRNN layer it models and each direction of
  a Bidirectional one: BPTT written without TensorFlow, fed the layer's captured input, initial
  state and the upstream ∂L/∂outputs taken from the tape, plus the gradients of the layer's
  L1/L2 penalties; its weight and initial-state gradients must equal the tape's. A call it
  cannot stand in for is listed with the reason. It runs on another thread beside the finite
  differences, one call at a time.
- A probe that straddles a kink (relu or a clip at its corner) is taken again at a smaller
  step and, where the one-sided slopes stay apart, left out and said to be at a kink.

On a batch of more than ``examples`` (default 16), the tape and every witness run on that many
of its examples, chosen by :mod:`~gradscope.keras.checked_examples`; the report names them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope._blas import blas_beside_tensorflow
from gradscope._tf import native_stderr_silenced
from gradscope.errors import ConfigError, DataError, InternalError
from gradscope.gradcheck import (
    PER_TENSOR_DIRECTIONS,
    ROUNDING,
    Probe,
    directional_error,
    probes_for,
    rounding_noise,
    settle_kinks,
    step_for,
    tolerance,
)
from gradscope.guard import give_back_freed_memory
from gradscope.keras import stopped
from gradscope.keras.cell_scan import not_run
from gradscope.keras.check.cell_steps import witness as cell_steps_witness
from gradscope.keras.check.cell_steps import your_cells
from gradscope.keras.check.joint_differences import JOINT_DIRECTIONS, Part, joint_check
from gradscope.keras.check.own_backward import witness as own_backward_witness
from gradscope.keras.check.precision import coarse_loss, measured_rounding, not_in_dtype
from gradscope.keras.checked_examples import DEFAULT_EXAMPLES, choose, take
from gradscope.keras.data import batch_targets
from gradscope.keras.engine import (
    CapturedCall,
    CopyFails,
    KerasEngine,
    KerasPass,
    call_label,
    state_layers,
    state_names,
)
from gradscope.keras.explain import KerasJob, loss_entry, model_entry
from gradscope.keras.flow import RecurrentCall, each_recurrent_call, upstream_gradients
from gradscope.keras.observed_call import zero_states_shifted
from gradscope.keras.penalties import activity_gradient, penalty_gradient, unsupported
from gradscope.keras.subclassed import is_subclassed
from gradscope.keras.whole_model import moved_state, restore, whole_model_loss
from gradscope.reference import RECURRENT, Sketch, cell_key
from gradscope.report.models import (
    CheckedExamples,
    CheckedTensor,
    CheckSummary,
    KerasCheckReport,
    KerasNotAnalysed,
    NotWitnessed,
    WitnessEntry,
)
from gradscope.timing import Clock

Progress = Callable[[str], None]


def check(job: KerasJob, directions: int | None = None, rtol: float | None = None,
          atol: float | None = None, progress: Progress | None = None, timings: bool = False,
          after_autodiff: Callable[[Any], None] | None = None,
          examples: int | None = DEFAULT_EXAMPLES) -> KerasCheckReport:
    """``examples``: at most this many examples of the batch, chosen as
    :mod:`~gradscope.keras.checked_examples` says (None: every one). ``directions``: the
    finite differences' random directions, joint and then per tensor (None:
    :data:`JOINT_DIRECTIONS` and :data:`PER_TENSOR_DIRECTIONS`).
    ``after_autodiff(model)`` runs between the tape and the witnesses (tests use it to mutate
    the float64 copy: a check that cannot fail is a defect; where check runs in the model's
    own dtype, it is given the user's model object itself)."""
    say = progress or (lambda message: None)
    chosen = choose(job, examples)
    say("importing TensorFlow, loading the model and its float64 copy")
    try:
        copy = KerasEngine(job.source, job.outputs, job.plan, training=job.training,
                           seed=job.seed, dtype="float64")
        return _check(job, copy, chosen, directions, rtol, atol, say, timings, after_autodiff)
    except CopyFails as exc:
        reason = exc.reason
    say(f"the float64 copy does not run in float64 ({reason}): checking in the model's dtype")
    engine = KerasEngine(job.source, job.outputs, job.plan, training=job.training, seed=job.seed)
    return _check(job, engine, chosen, directions, rtol, atol, say, timings, after_autodiff,
                  reason)


def _check(job: KerasJob, engine: KerasEngine, chosen: CheckedExamples,
           directions: int | None, rtol: float | None, atol: float | None, say: Progress,
           timings: bool, after_autodiff: Callable[[Any], None] | None,
           not_float64: str | None = None) -> KerasCheckReport:
    """Check on ``engine``'s model: the float64 copy (which raises :class:`CopyFails` where
    the user's code turns out not to run in float64), or the model in its own dtype, with
    ``not_float64`` saying why."""
    clock = Clock()
    dtype = engine.dtype_name
    copied = engine.model is not engine.user_model
    # Drawn for the whole batch: the examples keep the targets explain uses.
    targets = batch_targets(job.plan, job.batch.targets, engine.output_shapes(job.batch.inputs),
                            job.seed)
    inputs, targets = ({name: value.astype(dtype) if value.dtype.kind == "f" else value
                        for name, value in take(arrays, chosen.indices, job.batch_size).items()}
                       for arrays in (job.batch.inputs, targets))
    sample_weight = take(job.batch.sample_weight, chosen.indices, job.batch_size)
    clock.lap("load")
    model = engine.model
    frozen = moved_state(model)
    say(f"TF autodiff on the {'float64 copy' if copied else 'model'}")
    with stopped.counted(engine.tf) as stops_met:
        autodiff = engine.run(inputs, targets, watch_outputs=True, watch_inputs=True,
                              sample_weight=sample_weight)
    restore(frozen)
    if copied:
        where = not_in_dtype(model, autodiff.calls, dtype)
        if where:
            raise CopyFails(where, where, engine.path)
    if not np.isfinite(autodiff.loss):
        raise DataError(f"{engine.path}: the loss is not finite ({autodiff.loss}) in Keras' own "
                        f"call of the {'float64 copy' if copied else 'model'} on this batch: no "
                        "witness can compare gradients of it; check the batch (an average over "
                        "fully masked steps, a log of 0) and the loss", where=engine.path)
    if after_autodiff is not None:
        after_autodiff(model)
    give_back_freed_memory()  # the tape's, before the witnesses set the peak
    clock.lap("autodiff")
    fd_rtol = rtol if rtol is not None else tolerance("finite_differences", dtype).rtol
    ref_rtol = rtol if rtol is not None else tolerance("numpy_reference", dtype).rtol
    results: dict[str, list[WitnessEntry]] = {}
    referenced: dict[str, list[WitnessEntry]] = {}
    shapes: dict[str, list[int]] = {}
    # The NumPy reference runs on another thread beside the finite differences (its BLAS and
    # TensorFlow's kernels release the GIL), on the weights as they are now: the differences
    # move the variables meanwhile.
    weights = {v.path: np.array(v.numpy()) for v in model.weights}
    stops = (_stops(engine, inputs, targets, frozen, sample_weight) if stops_met[0]
             else stopped.Stops())
    rounding = ROUNDING
    if dtype != "float64":  # the loss's rounding, measured on the model
        with stopped.held(engine.tf, stops):
            rounding = measured_rounding(_loss_along(engine, inputs, targets, frozen,
                                                     sample_weight, job.seed), dtype)
    say("finite differences, and the NumPy reference for the recurrent layers beside them")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradscope-reference") as pool, \
            stopped.held(engine.tf, stops):
        reference = pool.submit(clock.timed, "numpy_reference", lambda: _numpy_reference(
            engine, autodiff, weights, ref_rtol, referenced, Sketch(job.seed)))
        unshifted = _finite_differences(
            engine, autodiff, inputs, targets, frozen, directions, fd_rtol, atol, job.seed,
            results, shapes, _masked_inputs(job, inputs), weights,
            engine.weight_tensors(sample_weight), rounding)
        clock.lap("finite_differences")
        not_witnessed = unshifted + reference.result()
    clock.lap("numpy_reference_wait")
    for name, entries in referenced.items():
        results.setdefault(name, []).extend(entries)
    if copied and not all(e.passed for entries in results.values() for e in entries):
        say("does the float64 copy really compute in float64?")
        with stopped.held(engine.tf, stops):
            coarse = coarse_loss(_loss_along(engine, inputs, targets, frozen, sample_weight,
                                             job.seed), autodiff.loss)
        if coarse:
            raise CopyFails(coarse, coarse, engine.path)
    if not all(e.passed for entries in results.values() for e in entries):
        say("each layer call, and each step of your cells, on its own")
        restore(frozen)
        stopping = set(stops.places)
        for name, (shape, entry) in own_backward_witness(
                engine, [c for c in autodiff.calls if f"layer '{c.layer}'" not in stopping],
                job.training, job.seed, fd_rtol, lambda: restore(frozen)).items():
            results[name], shapes[name] = [entry], shape
        not_witnessed += _cell_steps(engine, autodiff, job, fd_rtol, results)
        clock.lap("layers_on_their_own")
    finite = {name: [_finite(e) for e in entries] for name, entries in results.items()}
    tensors = [CheckedTensor(name=name, shape=shapes.get(name),
                             passed=all(e.passed for e in entries), witnesses=entries)
               for name, entries in finite.items()]
    failed = [t.name for t in tensors if not t.passed]
    witnesses = sorted({e.witness for t in tensors for e in t.witnesses},
                       key=["finite_differences", "numpy_reference", "cell_steps",
                            "own_backward"].index)
    return KerasCheckReport(
        model=model_entry(job, engine, autodiff), loss=loss_entry(job, autodiff),
        examples=chosen, dtype=dtype,
        dtype_reason=_costs(not_float64, dtype, fd_rtol, rounding, autodiff.loss),
        held_fixed=stops.described(),
        tolerances={"finite_differences": fd_rtol, "numpy_reference": ref_rtol,
                    **{w: fd_rtol for w in ("cell_steps", "own_backward") if w in witnesses}},
        tensors=tensors, not_witnessed=not_witnessed,
        summary=CheckSummary(passed=not failed, checked_tensors=len(tensors),
                             failed_tensors=failed, witnesses=witnesses,
                             comparisons=sum(len(t.witnesses) for t in tensors),
                             failures=sum(not e.passed for t in tensors for e in t.witnesses)),
        timings=clock.laps(timings))


def _stops(engine: KerasEngine, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
           frozen: list[tuple[Any, np.ndarray]], sample_weight: Any) -> stopped.Stops:
    """The tensors the model stops the gradient of, on the unperturbed call (see
    :mod:`~gradscope.keras.stopped`); a stop inside a recurrent loop is refused."""
    feed, y = engine.tensors(inputs, targets)
    weights = engine.weight_tensors(sample_weight)
    restore(frozen)
    try:
        stops = stopped.record(engine.tf, lambda: whole_model_loss(
            engine.model, lambda f, t, o: engine.compute_loss(f, t, o, weights), feed, y,
            engine.training))
    finally:
        restore(frozen)
    if stops.in_loops:
        raise ConfigError(
            f"{engine.path}: stop_gradient in {', '.join(sorted(set(stops.in_loops)))}, inside "
            "a recurrent loop (or a tf.cond): the tape treats the stopped tensor as a constant "
            "at every step, and finite differences cannot hold a value per step fixed, so "
            "check cannot witness this model's gradients; explain shows them", where=engine.path)
    return stops


def _finite(entry: WitnessEntry) -> WitnessEntry:
    """A witness whose error is not a number (NaN in a difference, an overflow) has failed,
    and says so: JSON has no NaN, and the report never passes it."""
    if entry.error is None or np.isfinite(entry.error):
        return entry
    return entry.model_copy(update={"error": None, "passed": False,
                                    "detail": f"{entry.detail}; its error is {entry.error}"})


def _costs(not_float64: str | None, dtype: str, rtol: float, rounding: float,
           loss: float) -> str | None:
    """Why check did not compute in float64, and what its own dtype costs."""
    if not_float64 is None:
        return None
    return (f"{not_float64}. In {dtype} the loss's rounding, measured on the model, is "
            f"{rounding * max(abs(loss), 1.0) / 2:.1e} (of a loss of {loss:.4g}): the finite "
            "differences resolve a derivative along a direction to about "
            f"{float(rounding_noise(loss, step_for(dtype), rounding)):.1e}, and to a relative "
            f"{rtol:.0e} beyond that (in float64, "
            f"{tolerance('finite_differences').rtol:.0e}); a smaller error in a "
            "gradient would pass")


def _loss_along(engine: KerasEngine, inputs: dict[str, np.ndarray],
                targets: dict[str, np.ndarray], frozen: list[tuple[Any, np.ndarray]],
                sample_weight: Any, seed: int) -> Callable[[float], float]:
    """The loss of Keras' own call with every trainable weight moved by ``h`` along one
    random unit direction (for :func:`~gradscope.keras.check.precision.coarse_loss` and
    :func:`~gradscope.keras.check.precision.measured_rounding`)."""
    tf = engine.tf
    feed, y = engine.tensors(inputs, targets)
    weights = engine.weight_tensors(sample_weight)
    variables = list(engine.model.trainable_variables)
    bases = [np.array(v.numpy()) for v in variables]
    rng = np.random.default_rng([seed, 5])
    draws = [rng.standard_normal(base.shape) for base in bases]
    norm = float(np.sqrt(sum(float(np.sum(d * d)) for d in draws))) or 1.0

    @tf.function(reduce_retracing=True)
    def evaluate(feed: list[Any]) -> Any:
        return whole_model_loss(engine.model,
                                lambda f, t, o: engine.compute_loss(f, t, o, weights),
                                feed, y, engine.training)

    def along(h: float) -> float:
        restore(frozen)
        try:
            for variable, base, draw in zip(variables, bases, draws, strict=True):
                variable.assign(base + h * draw / norm)
            return float(evaluate(feed).numpy())
        finally:
            for variable, base in zip(variables, bases, strict=True):
                variable.assign(base)

    return along


def _cell_steps(engine: KerasEngine, autodiff: KerasPass, job: KerasJob, rtol: float,
                results: dict[str, list[WitnessEntry]]) -> list[NotWitnessed]:
    """Where something disagrees: each RNN over a cell of the user's own, step by step
    (:mod:`~gradscope.keras.check.cell_steps`), on the tensors check already names."""
    missing = []
    for call in your_cells(engine, autodiff.calls):
        cell = engine.operation(call.layer).cell
        paths = [v.path for v in cell.trainable_variables if v.path in results]
        try:
            entries = cell_steps_witness(engine, call, job.training, job.seed, rtol, paths)
        except Exception as exc:  # noqa: BLE001  (the user's cell, on a folded batch)
            missing.append(NotWitnessed(layer=call_label(call.layer, call.index),
                                        witness="cell_steps", reason=not_run(exc)))
            continue
        for name, entry in entries.items():
            if name in results:
                results[name].append(entry)
    return missing


def _finite_differences(engine: KerasEngine, autodiff: KerasPass,
                        inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                        frozen: list[tuple[Any, np.ndarray]], directions: int | None,
                        rtol: float, atol: float | None, seed: int,
                        results: dict[str, list[WitnessEntry]],
                        shapes: dict[str, list[int]], fixed: dict[str, np.ndarray],
                        weights: dict[str, np.ndarray], sample_weight: Any = None,
                        rounding: float = ROUNDING) -> list[NotWitnessed]:
    """Every tensor jointly first (:mod:`~gradscope.keras.check.joint_differences`): the weights,
    the float inputs and the zero initial states of Keras' own call, moved together. Where a
    joint direction disagrees, every tensor is probed on its own instead, which names it.
    Initial states Keras' own call does not ask for (wired in, carried by a stateful layer)
    are probed on their own, through the replay. ``weights``: every weight's value as the
    tape saw it (shared, read only, with the NumPy reference), what each probe restores.
    ``rounding``: the loss's rounding relative to max(|loss|, 1) (float64's bound, or what
    :func:`measured_rounding` found in the model's own dtype). Returns the initial states it
    could not probe on their own (a subclassed model's)."""
    tf = engine.tf
    feed, y = engine.tensors(inputs, targets)
    rng = np.random.default_rng([seed, 2])
    variables = {v.path: v for v in engine.model.trainable_variables}
    hooked = _hooked_states(engine, autodiff)
    parts = [Part(path, gradient, weights[path])
             for path, gradient in autodiff.gradients.items() if gradient is not None]
    parts += [Part(f"input {name}", gradient, value, fixed.get(name))
              for name, value in inputs.items()
              if (gradient := autodiff.input_gradients.get(name)) is not None]
    parts += [Part(f"{label}/{state}", gradient, np.zeros_like(gradient))
              for label, names in hooked.names.items()
              for state, gradient in zip(names, autodiff.state_gradients.get(label, []),
                                         strict=False) if gradient is not None]
    parts_by_name = {part.name: part for part in parts}

    def joint_loss(feed: list[Any], shifts: list[list[list[Any]]]) -> Any:
        # Keras' own call of the whole model, not gradscope's replay: the witness must not
        # share the engine's reading of the model. Its layers' zero states are shifted as
        # Keras asks for them, counted here.
        with zero_states_shifted(list(zip(hooked.layers, shifts, strict=True))):
            return whole_model_loss(engine.model,
                                    lambda f, t, o: engine.compute_loss(f, t, o, sample_weight),
                                    feed, y, engine.training)

    evaluate = _compiled(tf, joint_loss)

    def loss_at(values: dict[str, np.ndarray]) -> float:
        restore(frozen)
        moved = [(variables[name], value) for name, value in values.items()
                 if name in variables]
        try:
            for variable, value in moved:
                variable.assign(value)
            changed = [tf.constant(values[f"input {name}"]) if f"input {name}" in values
                       else tensor for name, tensor in zip(inputs, feed, strict=True)]
            return float(evaluate(changed, hooked.shifts(values, tf)).numpy())
        finally:
            for variable, _ in moved:
                variable.assign(parts_by_name[variable.path].value)

    joint = (joint_check(parts, JOINT_DIRECTIONS if directions is None else directions, rng,
                         autodiff.loss, rtol, atol, step_for(engine.dtype_name), loss_at,
                         rounding) if parts else None)
    if joint is not None and joint.passed:
        for part in parts:
            shapes[part.name] = list(part.gradient.shape)
            results.setdefault(part.name, []).append(WitnessEntry(
                witness="finite_differences", error=joint.error, tolerance=rtol, passed=True,
                detail=joint.detail))
        alone = set()
    else:
        alone = set(parts_by_name)
    alone |= {f"{call_label(c.layer, c.index)}/{name}" for c in autodiff.calls if c.states
              and call_label(c.layer, c.index) not in hooked.names
              for name in state_names(engine.operation(c.layer))}
    unshifted: list[NotWitnessed] = []
    if is_subclassed(engine.model):
        # Its graph is its call: a state is shifted only where Keras asks for zeros (jointly),
        # never through gradscope's replay of the layers.
        for call in autodiff.calls:
            label = call_label(call.layer, call.index)
            names = {f"{label}/{name}" for name in state_names(engine.operation(call.layer))}
            if call.states and names & alone:
                alone -= names
                unshifted.append(NotWitnessed(
                    layer=label, witness="finite_differences",
                    reason="a subclassed model's initial state is shifted only with every "
                           "other tensor at once, where Keras asks for zeros; on its own it "
                           "would need gradscope's replay of the layers, which a model whose "
                           "graph is its own call does not have (the NumPy reference still "
                           "witnesses GRU, LSTM and SimpleRNN states)"))
    if alone:
        _one_by_one(engine, autodiff, feed, y, frozen,
                    PER_TENSOR_DIRECTIONS if directions is None else directions, rtol, atol,
                    rng, results, shapes, fixed, sample_weight, inputs, alone, rounding)
    return unshifted


def _compiled(tf: Any, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` compiled by XLA, which runs a long recurrent forward pass in float64 in
    about 0.7 of the time of TensorFlow's graph (and compiles faster than that traces), or as
    a graph where XLA cannot compile the model. Either way the same Keras call: a joint
    direction that disagrees sends every tensor to its own probes, run as a graph."""
    chosen: list[Any] = []
    compiled = tf.function(function, jit_compile=True, reduce_retracing=True)
    traced = tf.function(function, reduce_retracing=True)

    def run(*args: Any) -> Any:
        if chosen:
            return chosen[0](*args)
        try:
            with native_stderr_silenced():
                value = compiled(*args)
            chosen.append(compiled)
        except Exception:  # noqa: BLE001  (any op XLA has no kernel for: the graph serves)
            value = traced(*args)
            chosen.append(traced)
        return value

    return run


@dataclass
class _HookedStates:
    """The zero initial states finite differences shift in Keras' own call: per call label,
    the state names; per layer whose ``get_initial_state`` is asked, the calls in the order
    Keras makes them, and which of each call's states are that layer's."""

    names: dict[str, list[str]] = field(default_factory=dict)
    layers: list[Any] = field(default_factory=list)
    requests: list[list[tuple[str, list[int], list[tuple[int, ...]]]]] = field(
        default_factory=list)  # per layer: per request (call label, state indices, shapes)

    def shifts(self, values: dict[str, np.ndarray], tf: Any) -> list[list[list[Any]]]:
        """Per layer, per request, one tensor per state: the value in ``values`` (zero where
        a state does not move)."""
        return [[[tf.constant(values.get(f"{label}/{self.names[label][k]}", np.zeros(shape)))
                  for k, shape in zip(indices, shapes, strict=True)]
                 for label, indices, shapes in per_request]
                for per_request in self.requests]


def _hooked_states(engine: KerasEngine, autodiff: KerasPass) -> _HookedStates:
    """The layers every call of which starts from Keras' own zeros (asked of
    ``get_initial_state`` once per call and per direction)."""
    hooked = _HookedStates()
    by_layer: dict[str, list[CapturedCall]] = {}
    for call in autodiff.calls:
        by_layer.setdefault(call.layer, []).append(call)
    for name, calls in by_layer.items():
        if not any(call.states for call in calls):
            continue
        if not all(call.states and call.state_source == "zeros" for call in calls):
            continue
        directions = state_layers(engine.operation(name))
        per = len(calls[0].states) // len(directions)
        if any(len(call.states) != per * len(directions) for call in calls):
            continue
        for call in calls:
            hooked.names[call_label(call.layer, call.index)] = state_names(
                engine.operation(call.layer))
        for d, layer in enumerate(directions):
            hooked.layers.append(layer)
            hooked.requests.append([
                (call_label(call.layer, call.index), list(range(d * per, (d + 1) * per)),
                 [tuple(int(n) for n in call.states[k].shape)
                  for k in range(d * per, (d + 1) * per)])
                for call in sorted(calls, key=lambda c: c.index)])
    return hooked


def _one_by_one(engine: KerasEngine, autodiff: KerasPass, feed: list[Any], y: list[Any],
                frozen: list[tuple[Any, np.ndarray]], directions: int, rtol: float,
                atol: float | None, rng: np.random.Generator,
                results: dict[str, list[WitnessEntry]], shapes: dict[str, list[int]],
                fixed: dict[str, np.ndarray], sample_weight: Any,
                inputs: dict[str, np.ndarray], names: set[str], rounding: float) -> None:
    """Each tensor in ``names`` on its own: central differences along random unit directions
    and at single elements (the largest |g| and random ones)."""
    tf = engine.tf
    state_calls = [call for call in autodiff.calls if call.states]
    zero_deltas = {call_label(c.layer, c.index): [tf.zeros_like(s) for s in c.states]
                   for c in state_calls}

    @tf.function(reduce_retracing=True)
    def evaluate(feed: list[Any]) -> Any:
        # Keras' own call of the whole model, not gradscope's replay: the witness must not
        # share the engine's reading of the model.
        return whole_model_loss(engine.model,
                                lambda f, t, o: engine.compute_loss(f, t, o, sample_weight),
                                feed, y, engine.training)

    @tf.function(reduce_retracing=True)
    def evaluate_shifted(feed: list[Any], deltas: dict[str, list[Any]]) -> Any:
        # An initial state exists only in the replay, which makes it explicit: shifting it
        # needs the replay. Its unshifted loss is checked against Keras' own call (below).
        loss, _, _ = engine.forward(feed, y, lambda tensor: None, deltas=deltas,
                                    sample_weight=sample_weight)
        return loss

    def loss_with(new_feed: list[Any] | None = None,
                  deltas: dict[str, list[Any]] | None = None) -> float:
        restore(frozen)
        if deltas is None:
            return float(evaluate(new_feed or feed).numpy())
        return float(evaluate_shifted(feed, deltas).numpy())

    states = {f"{call_label(c.layer, c.index)}/{n}" for c in state_calls
              for n in state_names(engine.operation(c.layer))}
    dtype = engine.dtype_name
    step = step_for(dtype)
    if names & states:
        own, replayed = loss_with(), loss_with(deltas=zero_deltas)
        same = 1e-9 if dtype == "float64" else 1e-5  # the replay's ops, rounded in dtype
        agree = own == replayed or abs(own - replayed) <= same * max(1.0, abs(own)) or (
            np.isnan(own) and np.isnan(replayed))  # no number either way: the probes fail
        if not agree:
            raise InternalError(
                f"internal error: {engine.path}: with its initial states unshifted, "
                f"gradscope's layer-by-layer run gives the loss {replayed:.12g}, Keras' own "
                f"call {own:.12g}: the initial-state probes would measure another model; "
                "please report it")

    variables = {v.path: v for v in engine.model.trainable_variables}

    def record(name: str, gradient: np.ndarray, evaluate_at: Callable[[np.ndarray], float],
               base: np.ndarray, keep: np.ndarray | None = None) -> None:
        probes = probes_for(name, gradient, directions, rng)
        if keep is not None:
            probes = _restricted(probes, keep)
        plus = np.array([evaluate_at((base + step * p.direction).astype(base.dtype))
                         for p in probes])
        minus = np.array([evaluate_at((base - step * p.direction).astype(base.dtype))
                          for p in probes])
        settled = settle_kinks(gradient, probes, plus, minus, evaluate_at, base,
                                autodiff.loss, rtol, atol, dtype, rounding)
        shapes[name] = list(gradient.shape)
        if not settled.groups:
            results.setdefault(name, []).append(WitnessEntry(
                witness="finite_differences", error=None, tolerance=rtol, passed=True,
                at_kink=True, detail=settled.kink_detail(len(probes))))
            return
        error, passed, detail = max(
            (directional_error(gradient, group, p, m, autodiff.loss, rtol, atol, taken,
                               rounding)
             for group, p, m, taken in settled.groups), key=lambda found: found[0])
        if settled.kinks:
            detail += f"; {settled.kink_detail(len(probes))}"
        if keep is not None:
            detail += "; masked steps held fixed (their mask depends on their values)"
        results.setdefault(name, []).append(WitnessEntry(
            witness="finite_differences", error=error, tolerance=rtol, passed=passed,
            detail=detail))

    for path, gradient in autodiff.gradients.items():
        if gradient is None or path not in names:
            continue
        variable = variables[path]
        base = np.array(variable.numpy())

        def at_weight(value: np.ndarray, variable: Any = variable,
                      base: np.ndarray = base) -> float:
            variable.assign(value)
            try:
                return loss_with()
            finally:
                variable.assign(base)

        record(path, gradient, at_weight, base)
    for index, (name, value) in enumerate(inputs.items()):
        gradient = autodiff.input_gradients.get(name)
        if gradient is None or f"input {name}" not in names:
            continue

        def at_input(perturbed: np.ndarray, index: int = index) -> float:
            changed = list(feed)
            changed[index] = tf.constant(perturbed)
            return loss_with(new_feed=changed)

        record(f"input {name}", gradient, at_input, value, fixed.get(name))
    for call in state_calls:
        label = call_label(call.layer, call.index)
        state_names_here = state_names(engine.operation(call.layer))
        for k, gradient in enumerate(autodiff.state_gradients.get(label, [])):
            if gradient is None or f"{label}/{state_names_here[k]}" not in names:
                continue

            def at_state(delta: np.ndarray, label: str = label, k: int = k) -> float:
                deltas = {key: list(value) for key, value in zero_deltas.items()}
                deltas[label][k] = tf.constant(delta)
                return loss_with(deltas=deltas)

            record(f"{label}/{state_names_here[k]}", gradient, at_state, np.zeros_like(gradient))


def _masked_inputs(job: KerasJob, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """For inputs a Masking layer reads: 1 where an element may be perturbed, 0 on the masked
    steps (all features equal to mask_value): moving one of those would unmask the step, a
    jump that no derivative describes."""
    keep = {}
    for spec in job.inputs:
        reader = job.graph.layer(spec.pad_reader) if spec.pad_reader else None
        if reader is None or reader.class_name != "Masking" or spec.name not in inputs:
            continue
        value = inputs[spec.name]
        masked = np.all(value == spec.pad_value, axis=-1, keepdims=True)
        keep[spec.name] = np.broadcast_to(~masked, value.shape).astype(np.float64)
    return keep


def _restricted(probes: list[Probe], keep: np.ndarray) -> list[Probe]:
    """The probes with their masked parts removed (and renormalised); empty ones dropped."""
    kept = []
    for probe in probes:
        direction = probe.direction * keep
        norm = float(np.linalg.norm(direction))
        if norm > 0:
            kept.append(Probe(probe.tensor, probe.label, direction / norm))
    return kept


def _numpy_reference(engine: KerasEngine, autodiff: KerasPass,
                     weights: dict[str, np.ndarray], rtol: float,
                     results: dict[str, list[WitnessEntry]],
                     sketch: Sketch) -> list[NotWitnessed]:
    """BPTT in NumPy for every GRU, LSTM and SimpleRNN call, and for each direction of a
    Bidirectional one, fed the call's captured input and initial states and the gradients the
    tape gives its outputs (split between the directions as the merge mode joined them). The
    layer's regularization penalties are added (the tape's gradients are those of the whole
    loss). A weight is compared once every call of its layer was witnessed, a wide one
    projected by ``sketch`` (:class:`~gradscope.reference.Sketch`). Returns what it could not
    witness, and why."""
    with blas_beside_tensorflow():
        return _reference(engine, autodiff, weights, rtol, results, sketch)


@dataclass
class _StateRows:
    """An initial state's gradient, slice by slice: the NumPy reference's and the tape's."""

    label: str  # the call's
    reference: list[np.ndarray] = field(default_factory=list)
    tape: list[np.ndarray] = field(default_factory=list)


#: The NumPy reference takes a call this many examples at a time: what it holds (every gate
#: at every step) then stays that of a batch of 32, whatever the batch.
REFERENCE_EXAMPLES = 32


def _reference(engine: KerasEngine, autodiff: KerasPass, weights: dict[str, np.ndarray],
               rtol: float, results: dict[str, list[WitnessEntry]],
               sketch: Sketch) -> list[NotWitnessed]:
    missing: list[NotWitnessed] = []
    incomplete: set[str] = set()  # layers with a call not witnessed
    skipped: set[str] = set()  # call labels not witnessed
    totals: dict[str, np.ndarray] = {}
    owners: dict[str, str] = {}  # variable path → the layer whose calls it sums over
    states: dict[str, _StateRows] = {}
    upstream: dict[str, list[np.ndarray]] = {}  # the current call's, whole, for its slices
    calls = {call_label(c.layer, c.index): c for c in autodiff.calls}
    for recurrent in each_recurrent_call(engine, autodiff, weights, REFERENCE_EXAMPLES):
        if isinstance(recurrent, KerasNotAnalysed):
            missing.append(NotWitnessed(layer=recurrent.layer, witness="numpy_reference",
                                        reason=recurrent.reason))
            skipped.add(recurrent.layer)
            incomplete.add(calls[recurrent.layer].layer)
            continue
        if recurrent.label in skipped:
            continue
        reason = _reference_call(engine, autodiff, calls[recurrent.label], recurrent, totals,
                                 owners, states, upstream, sketch)
        if reason:
            missing.append(NotWitnessed(layer=recurrent.label, witness="numpy_reference",
                                        reason=reason))
            skipped.add(recurrent.label)
            incomplete.add(recurrent.call.layer)
        # One slice at a time: its NumPy caches (every gate at every step) go before the next
        # one is run.
        del recurrent
    for name, found in states.items():
        if found.label not in skipped:
            _compare(results, name, np.concatenate(found.reference), np.concatenate(found.tape),
                     rtol)
    variables = {v.path: v for v in engine.model.weights}
    for path, total in totals.items():
        tape = autodiff.gradients.get(path)
        if tape is None or owners[path] in incomplete:
            continue
        penalty = penalty_gradient(getattr(variables[path], "regularizer", None),
                                   np.asarray(weights[path], np.float64))
        if total.shape != tape.shape:  # the reference kept it projected
            _compare(results, path, total + sketch.project(penalty), sketch.project(tape),
                     rtol, unprojected=tape)
        else:
            _compare(results, path, total + penalty, tape, rtol)
    return missing


def _reference_call(engine: KerasEngine, autodiff: KerasPass, whole: CapturedCall,
                    recurrent: RecurrentCall, totals: dict[str, np.ndarray],
                    owners: dict[str, str], states: dict[str, _StateRows],
                    upstream: dict[str, list[np.ndarray]], sketch: Sketch) -> str | None:
    """One recurrent call's BPTT, for the examples ``recurrent.rows`` of ``whole``: its
    weight gradients added to ``totals``, its initial-state gradients and the tape's for the
    same examples added to ``states``. ``upstream`` keeps the call's gradients from above,
    taken once for all its slices. Returns why its penalties cannot be added in NumPy, if
    they cannot."""
    layer = engine.operation(recurrent.call.layer)
    subs = ([layer.forward_layer, layer.backward_layer] if len(recurrent.units) > 1
            else [layer])
    reason = _penalty_without_numpy_form(layer, subs)
    if reason:
        return reason
    rows = recurrent.rows
    if recurrent.label not in upstream:
        upstream.clear()  # the call before is done: its arrays go
        # The activity penalty is divided by the whole batch: taken on the whole call.
        upstream[recurrent.label] = [
            activity_gradient(layer.activity_regularizer, np.asarray(o, np.float64))
            + (0.0 if g is None else np.asarray(g, np.float64))
            for o, g in zip(whole.outputs, autodiff.output_gradients[recurrent.label],
                            strict=True)]
    gradients: list[np.ndarray | None] = [g[rows] for g in upstream[recurrent.label]]
    tape_states = [None if g is None else g[rows]
                   for g in autodiff.state_gradients.get(recurrent.label, [])]
    for unit, sub, (d_seq, d_h_final, d_c_final) in zip(
            recurrent.units, subs, upstream_gradients(recurrent, gradients), strict=True):
        _, backward = RECURRENT[cell_key(unit.cell)]
        # Each call's gradient from above comes from the tape: ∂L/∂x_t is not needed.
        _, d_states, d_params = backward(unit.params, unit.cache, d_seq, d_h_final,
                                         d_c_final=d_c_final, inputs=False, sketch=sketch)
        for variable in sub.weights:
            short = variable.path.split("/")[-1]
            totals[variable.path] = totals.get(variable.path, 0) + d_params[short]
            owners[variable.path] = recurrent.call.layer
        ours = list(d_states) if isinstance(d_states, tuple) else [d_states]
        mine, tape_states = tape_states[:len(ours)], tape_states[len(ours):]
        for state_name, reference, value in zip(unit.cell.state_names, ours, mine,
                                                strict=True):
            if value is not None:
                found = states.setdefault(f"{unit.label}/{state_name}",
                                          _StateRows(recurrent.label))
                found.reference.append(reference)
                found.tape.append(value)
    return None


def _penalty_without_numpy_form(layer: Any, subs: list[Any]) -> str | None:
    """Why a recurrent layer's penalties cannot be added in NumPy: a regularizer of its own
    (or of a direction), or an activity regularizer on a Bidirectional's direction (its
    penalty is on the direction's output, before the merge the tape sees)."""
    for sub in subs:
        for variable in sub.weights:
            reason = unsupported(getattr(variable, "regularizer", None))
            if reason:
                return reason
    if len(subs) > 1 and any(getattr(sub, "activity_regularizer", None) is not None
                             for sub in subs):
        return "an activity regularizer on a direction of the Bidirectional"
    return unsupported(getattr(layer, "activity_regularizer", None))


def _compare(results: dict[str, list[WitnessEntry]], name: str, reference: np.ndarray,
             tape: np.ndarray, rtol: float, unprojected: np.ndarray | None = None) -> None:
    """max |reference − tape| / max |tape|. ``unprojected``: the tape's gradient itself, where
    ``reference`` and ``tape`` are both it times the same random signs (its max is the scale)."""
    whole = tape if unprojected is None else unprojected
    error = float(np.max(np.abs(reference - tape))) / max(float(np.max(np.abs(whole))), 1e-300)
    detail = f"max |reference − tape| / max |tape| over {whole.size} elements"
    if unprojected is not None:
        columns = tape.shape[-1]
        detail = (f"max |(reference − tape)·S| / max |tape|, S: {whole.shape[-1]}×{columns} "
                  "random signs (never below the unprojected error but for a chance of "
                  f"2^-{columns})")
    results.setdefault(name, []).append(WitnessEntry(
        witness="numpy_reference", error=error, tolerance=rtol, passed=error <= rtol,
        detail=detail))
