"""``gradscope check MODEL.keras``: every gradient of the user's model against witnesses that
do not share the tape's reading of it.

check runs on a float64 copy of the model with the same weights (or in the model's own dtype
where the user's code does not run in float64: :mod:`~gradscope.keras.check.precision`), on
at most ``examples`` examples of the batch (:mod:`~gradscope.keras.checked_examples`). The
finite differences and the NumPy reference witness every tensor; where one disagrees, the
cell steps and the own backward say where. Each witness is a module that returns what it
found; this one merges them into the report.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from gradscope.errors import ConfigError, DataError
from gradscope.gradcheck import (
    ROUNDING_STEPS,
    SMALL_LOSS,
    checked_tensors,
    rounding_noise,
    small_loss_rounding,
    step_for,
    tolerance,
    unwitnessed,
)
from gradscope.guard import give_back_freed_memory
from gradscope.keras import stopped
from gradscope.keras.check import (
    carry,
    cell_steps,
    finite_differences,
    numpy_reference,
    own_backward,
)
from gradscope.keras.check.precision import (
    coarse_loss,
    loss_along,
    measured_rounding,
    not_in_dtype,
)
from gradscope.keras.check.probing import Probing, Witnessed
from gradscope.keras.checked_examples import DEFAULT_EXAMPLES, choose, take
from gradscope.keras.data import UNRANGED_IDS, batch_targets, unranged
from gradscope.keras.engine import CopyFails, KerasEngine, call_label, state_names
from gradscope.keras.explain import KerasJob, loss_entry, model_entry
from gradscope.keras.nonfinite import all_finite, diagnose
from gradscope.keras.weight_names import names_by_path
from gradscope.keras.whole_model import moved_state, restore
from gradscope.report.models import (
    EVERY_WITNESS,
    CheckedExamples,
    CheckSummary,
    KerasCheckReport,
    NotWitnessed,
)
from gradscope.timing import Clock, Progress

#: The witnesses in the order of the report.
WITNESSES = [finite_differences.WITNESS, numpy_reference.WITNESS, carry.WITNESS,
             cell_steps.WITNESS, own_backward.WITNESS]


def check(job: KerasJob, directions: int | None = None, rtol: float | None = None,
          atol: float | None = None, progress: Progress | None = None, timings: bool = False,
          after_autodiff: Callable[[Any], None] | None = None,
          examples: int | None = DEFAULT_EXAMPLES,
          chosen: CheckedExamples | None = None, chunks: int | None = None) -> KerasCheckReport:
    """``examples``: at most this many examples of the batch, chosen as
    :mod:`~gradscope.keras.checked_examples` says (None: every one), unless ``chosen`` is
    the choice already made. ``directions``: the
    finite differences' random directions, joint and then per tensor (None:
    :data:`~gradscope.keras.check.joint_differences.JOINT_DIRECTIONS` and
    :data:`~gradscope.gradcheck.PER_TENSOR_DIRECTIONS`).
    ``after_autodiff(model)`` runs between the tape and the witnesses (tests use it to mutate
    the float64 copy: a check that cannot fail is a defect; where check runs in the model's
    own dtype, it is given the user's model object itself). ``chunks``: also truncated BPTT
    in that many chunks, carried, against the tape (:mod:`~gradscope.keras.check.carry`)."""
    from gradscope._tf import native_stderr_silenced

    # TensorFlow's graph optimiser logs each float64 op it passes over ("Not handling type
    # DT_DOUBLE") as the witnesses first run the copy's functions: from Python too (the CLI
    # silences them already), none is shown; Python's own stderr still works.
    with native_stderr_silenced():
        return _checked(job, directions, rtol, atol, progress, timings, after_autodiff,
                        examples, chosen, chunks)


def _checked(job: KerasJob, directions: int | None, rtol: float | None, atol: float | None,
             progress: Progress | None, timings: bool,
             after_autodiff: Callable[[Any], None] | None, examples: int | None,
             chosen: CheckedExamples | None, chunks: int | None) -> KerasCheckReport:
    say = progress or (lambda message: None)
    guessed = unranged(job.inputs)
    if guessed and job.batch.source.startswith("synthetic"):
        # Found tried as a new user would: a correct CTC model failed check on labels drawn
        # 0–9 for its 6 classes (its loss negative), a false alarm.
        names = ", ".join(f"'{name}'" for name in guessed)
        raise DataError(f"input{'s' if len(guessed) > 1 else ''} {names} "
                        f"hold{'' if len(guessed) > 1 else 's'} integers that no Embedding "
                        "reads: a synthetic "
                        f"batch draws them 0–{UNRANGED_IDS - 1}, which gradscope cannot tell "
                        "are valid for the model (a CTC loss's labels, an index), and a check "
                        "on values the model does not take can fail a correct gradient; "
                        "supply the data (--data, or x= in Python)", where="--data")
    chosen = choose(job, examples) if chosen is None else chosen
    say("importing TensorFlow, loading the model and its float64 copy")
    try:
        copy = KerasEngine(job.source, job.outputs, job.plan, training=job.training,
                           seed=job.seed, dtype="float64")
        return _check(job, copy, chosen, directions, rtol, atol, say, timings, after_autodiff,
                      chunks=chunks)
    except CopyFails as exc:
        reason = exc.reason
    say(f"the float64 copy does not run in float64 ({reason}): checking in the model's dtype")
    engine = KerasEngine(job.source, job.outputs, job.plan, training=job.training, seed=job.seed)
    return _check(job, engine, chosen, directions, rtol, atol, say, timings, after_autodiff,
                  reason, chunks)


def _floats_in(dtype: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` with every float one in ``dtype`` (integer token ids left as they are)."""
    return {name: value.astype(dtype) if value.dtype.kind == "f" else value
            for name, value in arrays.items()}


def _refuse_all_zero(autodiff: Any, sample_weight: Any) -> None:
    """A check of gradients that are all exactly 0 cannot fail: every witness agrees with 0.
    Refused (exit 2), with the likely cause, rather than passed."""
    gradients = [g for g in autodiff.gradients.values() if g is not None]
    if not gradients or any(np.any(np.asarray(g) != 0) for g in gradients):
        return
    weights = None if sample_weight is None else np.asarray(
        list(sample_weight.values())[0] if isinstance(sample_weight, dict) else sample_weight)
    cause = ("every sample weight of these examples is 0" if weights is not None
             and weights.size and not np.any(weights) else f"the loss is {autodiff.loss:g}")
    raise DataError(f"nothing to check: every gradient is exactly 0 on these examples "
                    f"({cause}), and a check of zeros cannot fail; give examples whose loss "
                    "reaches the weights", where="data")


def _check(job: KerasJob, engine: KerasEngine, chosen: CheckedExamples,
           directions: int | None, rtol: float | None, atol: float | None, say: Progress,
           timings: bool, after_autodiff: Callable[[Any], None] | None,
           not_float64: str | None = None, chunks: int | None = None) -> KerasCheckReport:
    """Check on ``engine``'s model: the float64 copy (which raises :class:`CopyFails` where
    the user's code turns out not to run in float64), or the model in its own dtype, with
    ``not_float64`` saying why."""
    clock = Clock()
    dtype = engine.dtype_name
    copied = engine.model is not engine.user_model
    # Drawn for the whole batch: the examples keep the targets explain uses.
    targets = batch_targets(job.plan, job.batch.targets, engine.output_shapes(job.batch.inputs),
                            job.seed, job.batch.path)
    inputs, targets = (_floats_in(dtype, take(arrays, chosen.indices, job.batch_size))
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
    if not all_finite(autodiff):
        say("a number is not finite: where it was born, on these examples")
        return _not_finite(job, engine, autodiff, chosen, inputs, targets, sample_weight,
                           clock, timings)
    if copied:
        say("the model as fit runs it, in its own dtype, on these examples")
        overflowed = _as_fit_runs_it(job, engine, chosen, inputs, targets, sample_weight,
                                     autodiff.loss, clock, timings)
        if overflowed is not None:
            return overflowed
    _refuse_all_zero(autodiff, sample_weight)
    if after_autodiff is not None:
        after_autodiff(model)
    give_back_freed_memory()  # the tape's, before the witnesses set the peak
    clock.lap("autodiff")
    fd_rtol = rtol if rtol is not None else tolerance("finite_differences", dtype).rtol
    ref_rtol = rtol if rtol is not None else tolerance("numpy_reference", dtype).rtol
    # The NumPy reference runs on another thread beside the finite differences (its BLAS and
    # TensorFlow's kernels release the GIL), on the weights as they are now: the differences
    # move the variables meanwhile.
    probing = Probing(engine, autodiff, inputs, targets, frozen,
                      engine.weight_tensors(sample_weight),
                      {v.path: np.array(v.numpy()) for v in model.weights}, job.seed,
                      fd_rtol, atol)
    stops = _stops(probing) if stops_met[0] else stopped.Stops()
    if dtype != "float64":  # the loss's rounding, measured on the model
        with stopped.held(engine.tf, stops):
            probing = replace(probing, rounding=measured_rounding(loss_along(probing), dtype))
    elif abs(autodiff.loss) < SMALL_LOSS:  # 64 epsilons of 1 would hide its gradients
        with stopped.held(engine.tf, stops):
            along = loss_along(probing)
            probing = replace(probing, rounding=small_loss_rounding(
                [along(h) for h in ROUNDING_STEPS]))
    say("finite differences, and the NumPy reference where it models a layer")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradscope-reference") as pool, \
            stopped.held(engine.tf, stops):
        reference = pool.submit(clock.timed, "numpy_reference",
                                lambda: numpy_reference.witness(probing, ref_rtol))
        witnessed: list[Witnessed] = [
            finite_differences.witness(probing, directions,
                                        finite_differences.masked_inputs(job, inputs))]
        clock.lap("finite_differences")
        witnessed.append(reference.result())
    clock.lap("numpy_reference_wait")
    carry_check = None
    carry_rtol = rtol if rtol is not None else tolerance(carry.WITNESS, dtype).rtol
    if chunks is not None:
        say(f"truncated BPTT in {chunks} chunks, carried")
        found, carry_check = carry.witness(probing, chunks, carry_rtol)
        witnessed.append(found)
        clock.lap(carry.WITNESS)
    if copied and not all(w.passed for w in witnessed):
        say("does the float64 copy really compute in float64?")
        with stopped.held(engine.tf, stops):
            coarse = coarse_loss(loss_along(probing), autodiff.loss)
        if coarse:
            raise CopyFails(coarse, coarse, engine.path)
    unresolved = unwitnessed([r for w in witnessed for r in w.results])
    if not all(w.passed for w in witnessed):
        say("each layer call, and each step of your cells, on its own")
        probing.restore()
        witnessed.append(own_backward.witness(probing, stops.places))
        named = {result.tensor for found in witnessed for result in found.results}
        witnessed.append(cell_steps.witness(probing, named))
        clock.lap("layers_on_their_own")
    elif unresolved:
        # What the finite differences could not resolve (a chaotic trajectory amplifies
        # every perturbation of the whole sequence), each step of your cell may still
        # witness: one step amplifies nothing. Found tried as a new user would: a bias
        # gradient 1.5× too large in such a cell passed, unwitnessed.
        say("each step of your cells on its own, where the finite differences did not settle")
        probing.restore()
        witnessed.append(cell_steps.witness(probing, unresolved))
        clock.lap("layers_on_their_own")
    # Each weight by explain's name for it, Keras' path beside it (the witnesses read paths).
    as_explain = names_by_path(job.graph, engine.operation, engine.model)
    paths = {name: path for path, name in as_explain.items()}
    tensors = checked_tensors(
        [replace(r, tensor=as_explain.get(r.tensor, r.tensor))
         for w in witnessed for r in w.results],
        shapes={as_explain.get(n, n): s for w in witnessed for n, s in w.shapes.items()})
    tensors = [t.model_copy(update={"path": paths.get(t.name)}) for t in tensors]
    failed = [t.name for t in tensors if not t.passed]
    # With every witness now, the steps' too.
    left_out = {as_explain.get(n, n)
                for n in unwitnessed([r for w in witnessed for r in w.results])}
    witnesses = sorted({e.witness for t in tensors for e in t.witnesses}, key=WITNESSES.index)
    return KerasCheckReport(
        model=model_entry(job, engine, autodiff), loss=loss_entry(job, autodiff),
        examples=chosen, dtype=dtype,
        dtype_reason=_costs(not_float64, dtype, fd_rtol, probing.rounding, autodiff.loss),
        held_fixed=stops.described(),
        tolerances={finite_differences.WITNESS: fd_rtol, numpy_reference.WITNESS: ref_rtol,
                    **({carry.WITNESS: carry_rtol} if chunks is not None else {}),
                    **{w: fd_rtol for w in WITNESSES[3:] if w in witnesses}},
        carry=carry_check,
        tensors=tensors,
        not_witnessed=[*_unreached(engine, autodiff),
                       *(n for w in witnessed for n in w.not_witnessed)],
        summary=CheckSummary(passed=not failed, checked_tensors=len(tensors),
                             failed_tensors=failed, witnesses=witnesses,
                             comparisons=sum(len(t.witnesses) for t in tensors),
                             failures=sum(not e.passed for t in tensors for e in t.witnesses),
                             unwitnessed_tensors=[t.name for t in tensors
                                                  if t.name in left_out]),
        timings=clock.laps(timings))


def _unreached(engine: KerasEngine, autodiff: Any) -> list[NotWitnessed]:
    """The trainable weights and initial states that the loss does not reach (TF autodiff
    gives them no gradient): no witness compares them, and the report says so. Found tried
    as a new user would: a cell whose call skips its recurrent term passed check, its
    recurrent kernel and h0 left out of the table and the JUnit file without a word."""
    names = [path for path, gradient in autodiff.gradients.items() if gradient is None]
    for call in autodiff.calls:
        label = call_label(call.layer, call.index)
        gradients = autodiff.state_gradients.get(label)
        if call.states and gradients is not None:
            names += [f"{label}/{state}" for state, gradient in
                      zip(state_names(engine.operation(call.layer)), gradients, strict=False)
                      if gradient is None]
    return [NotWitnessed(layer=name, witness=EVERY_WITNESS,
                         reason="the loss does not reach it: TF autodiff gives it no "
                                "gradient, so there is nothing to compare")
            for name in names]


def _as_fit_runs_it(job: KerasJob, copy: KerasEngine, chosen: CheckedExamples,
                    inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                    sample_weight: Any, copy_loss: float, clock: Clock,
                    timings: bool) -> KerasCheckReport | None:
    """The model as fit runs it, in its own dtype, on the checked examples (the float64
    copy's numbers do not show what fit takes): where its loss or a gradient is not finite,
    that is the report (exit 1; the copy's finite gradients are not the ones fit takes), the
    cause saying what the copy computed. None where the model's own pass is finite. Found
    tried as a new user would, where this ran only for a copy's numbers near the model's
    range: a float32 softmax underflowing to 0 under a log loss passed check, and a float16
    state past 65504 under a tanh head was refused as all-zero gradients (saturated in the
    copy), where fit's loss was NaN. On the model the copy was made from (``copy``'s
    ``user_model``, loaded once: a second load of a user-sized file cost more than the pass)."""
    own = KerasEngine(copy.user_model, job.outputs, job.plan, training=job.training,
                      seed=job.seed)
    dtype = own.dtype_name
    inputs, targets = _floats_in(dtype, inputs), _floats_in(dtype, targets)
    result = own.run(inputs, targets, sample_weight=sample_weight)
    if all_finite(result):
        return None
    report = _not_finite(job, own, result, chosen, inputs, targets, sample_weight, clock,
                         timings)
    found = report.nonfinite
    assert found is not None
    policy = _policy_where(own.user_model, found.layer)
    compute = str(policy.compute_dtype)
    runs = (f"{dtype}, in which the model runs" if compute == dtype else
            f"{compute}, in which the model computes ({policy.name})")
    cause = (f"{found.cause}. A float64 copy with the same weights computes a loss of "
             f"{copy_loss:.4g} and finite gradients, but {runs}, cannot hold them: no "
             "gradient is compared")
    return report.model_copy(update={"nonfinite": found.model_copy(update={"cause": cause})})


def _policy_where(model: Any, layer: str | None) -> Any:
    """The dtype policy of ``model``'s layer named ``layer`` (where a number was born), else
    the model's."""
    try:
        return model.get_layer(layer).dtype_policy if layer else model.dtype_policy
    except ValueError:  # an input's name, or the loss's
        return model.dtype_policy


def _not_finite(job: KerasJob, engine: KerasEngine, autodiff: Any, chosen: CheckedExamples,
                inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                sample_weight: Any, clock: Clock, timings: bool) -> KerasCheckReport:
    """A loss or gradient that is not finite: no witness can compare it, so check says where
    it was born instead (a problem found: exit 1), its examples numbered in the batch."""
    found = None
    if chosen.indices is not None:
        # The whole batch, so that the examples (in the cause too) are numbered as the
        # user numbers them.
        dtype = engine.dtype_name
        whole = _floats_in(dtype, job.batch.inputs)
        every = batch_targets(job.plan, job.batch.targets, engine.output_shapes(whole),
                              job.seed, job.batch.path)
        every = _floats_in(dtype, every)
        result = engine.run(whole, every, sample_weight=job.batch.sample_weight)
        found = diagnose(engine, whole, every, job.batch.sample_weight, result)
    if found is None:
        found = diagnose(engine, inputs, targets, sample_weight, autodiff)
        assert found is not None  # the pass is not all finite
        if chosen.indices is not None:
            found = found.model_copy(update={"examples": [chosen.indices[e]
                                                          for e in found.examples]})
    clock.lap("nonfinite")
    return KerasCheckReport(
        model=model_entry(job, engine, autodiff), loss=loss_entry(job, autodiff),
        examples=chosen, dtype=engine.dtype_name, tolerances={}, tensors=[],
        nonfinite=found,
        summary=CheckSummary(passed=False, checked_tensors=0, failed_tensors=[], witnesses=[],
                             comparisons=0, failures=0),
        timings=clock.laps(timings))


def _stops(probing: Probing) -> stopped.Stops:
    """The tensors the model stops the gradient of, on the unperturbed call (see
    :mod:`~gradscope.keras.stopped`); a stop inside a recurrent loop is refused."""
    engine = probing.engine
    feed, y = probing.tensors()
    probing.restore()
    try:
        stops = stopped.record(engine.tf, lambda: probing.keras_loss(feed, y))
    finally:
        probing.restore()
    if stops.in_loops:
        raise ConfigError(
            f"{engine.path}: stop_gradient in {', '.join(sorted(set(stops.in_loops)))}, inside "
            "a recurrent loop (or a tf.cond): the tape treats the stopped tensor as a constant "
            "at every step, and finite differences cannot hold a value per step fixed, so "
            "check cannot witness this model's gradients; explain shows them", where=engine.path)
    return stops


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
