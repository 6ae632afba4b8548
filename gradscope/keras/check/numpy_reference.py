"""The NumPy reference of a Keras model's check: BPTT written without TensorFlow.

For every GRU, LSTM and SimpleRNN call, and each direction of a Bidirectional one, it takes
what Keras computed around the layer (its input, initial states, and the tape's ∂L/∂outputs)
and derives the layer's own gradients independently, so a wrong gradient inside a recurrent
layer is told apart from one above or below it. A call it cannot stand in for is listed with
the reason. It runs on its own thread beside the finite differences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope._blas import blas_beside_tensorflow
from gradscope.cells.numpy_bptt import Sketch
from gradscope.gradcheck import WitnessResult, underflow_scale
from gradscope.keras.check.probing import Probing, Witnessed
from gradscope.keras.engine import CapturedCall, call_label
from gradscope.keras.flow import RecurrentCall, each_recurrent_call, upstream_gradients
from gradscope.keras.penalties import activity_gradient, penalty_gradient, unsupported
from gradscope.report.models import KerasNotAnalysed, NotWitnessed

WITNESS = "numpy_reference"

#: The NumPy reference takes a call this many examples at a time: what it holds (every gate
#: at every step) then stays that of a batch of 32, whatever the batch.
REFERENCE_EXAMPLES = 32


def witness(probing: Probing, rtol: float) -> Witnessed:
    """BPTT in NumPy for every GRU, LSTM and SimpleRNN call, and for each direction of a
    Bidirectional one, fed the call's captured input and initial states and the gradients the
    tape gives its outputs (split between the directions as the merge mode joined them). The
    layer's regularization penalties are added (the tape's gradients are those of the whole
    loss). A weight is compared once every call of its layer was witnessed, a wide one
    projected on random signs (:class:`~gradscope.cells.numpy_bptt.Sketch`). Its weight and
    initial-state gradients must equal the tape's, to ``rtol``."""
    with blas_beside_tensorflow():
        return _reference(probing, rtol, Sketch(probing.seed))


@dataclass
class _StateRows:
    """An initial state's gradient, slice by slice: the NumPy reference's and the tape's."""

    label: str  # the call's
    reference: list[np.ndarray] = field(default_factory=list)
    tape: list[np.ndarray] = field(default_factory=list)


@dataclass(frozen=True)
class _Slice:
    """One recurrent call's BPTT for some of its examples: each weight's gradient, and per
    initial state the reference's gradient and the tape's for the same examples."""

    weights: dict[str, np.ndarray]
    states: list[tuple[str, np.ndarray, np.ndarray]]


def _reference(probing: Probing, rtol: float, sketch: Sketch) -> Witnessed:
    engine, autodiff = probing.engine, probing.autodiff
    missing: list[NotWitnessed] = []
    incomplete: set[str] = set()  # layers with a call not witnessed
    skipped: set[str] = set()  # call labels not witnessed
    totals: dict[str, np.ndarray] = {}
    owners: dict[str, str] = {}  # variable path → the layer whose calls it sums over
    states: dict[str, _StateRows] = {}
    # The current call's gradients from above, whole, taken once for all its slices.
    above: tuple[str, list[np.ndarray]] | None = None
    calls = {call_label(c.layer, c.index): c for c in autodiff.calls}
    for recurrent in each_recurrent_call(engine, autodiff, probing.weights, REFERENCE_EXAMPLES):
        if isinstance(recurrent, KerasNotAnalysed):
            missing.append(NotWitnessed(layer=recurrent.layer, witness=WITNESS,
                                        reason=recurrent.reason))
            skipped.add(recurrent.layer)
            incomplete.add(calls[recurrent.layer].layer)
            continue
        if recurrent.label in skipped:
            continue
        layer = engine.operation(recurrent.call.layer)
        subs = ([layer.forward_layer, layer.backward_layer] if len(recurrent.units) > 1
                else [layer])
        reason = _penalty_without_numpy_form(layer, subs)
        if reason:
            missing.append(NotWitnessed(layer=recurrent.label, witness=WITNESS, reason=reason))
            skipped.add(recurrent.label)
            incomplete.add(recurrent.call.layer)
        else:
            if above is None or above[0] != recurrent.label:
                above = None  # the call before is done: its arrays go
                above = (recurrent.label, _from_above(probing, layer, calls[recurrent.label],
                                                      recurrent.label))
            found = _bptt(probing, recurrent, subs, above[1], sketch)
            for path, gradient in found.weights.items():
                totals[path] = totals.get(path, 0) + gradient
                owners[path] = recurrent.call.layer
            for name, reference, taped in found.states:
                rows = states.setdefault(name, _StateRows(recurrent.label))
                rows.reference.append(reference)
                rows.tape.append(taped)
            del found
        # One slice at a time: its NumPy caches (every gate at every step) go before the next
        # one is run.
        del recurrent
    dtype = engine.dtype_name
    results = [_compare(name, np.concatenate(kept.reference), np.concatenate(kept.tape), rtol,
                        dtype=dtype)
               for name, kept in states.items() if kept.label not in skipped]
    variables = {v.path: v for v in engine.model.weights}
    for path, total in totals.items():
        tape = autodiff.gradients.get(path)
        if tape is None or owners[path] in incomplete:
            continue
        penalty = penalty_gradient(getattr(variables[path], "regularizer", None),
                                   np.asarray(probing.weights[path], np.float64))
        if total.shape != tape.shape:  # the reference kept it projected
            results.append(_compare(path, total + sketch.project(penalty),
                                    sketch.project(tape), rtol, unprojected=tape, dtype=dtype))
        else:
            results.append(_compare(path, total + penalty, tape, rtol, dtype=dtype))
    return Witnessed(results=results, not_witnessed=missing)


def _from_above(probing: Probing, layer: Any, whole: CapturedCall,
                label: str) -> list[np.ndarray]:
    """The gradient of the loss at each of a call's outputs, its activity penalty's added
    (that penalty is divided by the whole batch: taken on the whole call)."""
    return [activity_gradient(layer.activity_regularizer, np.asarray(o, np.float64))
            + (0.0 if g is None else np.asarray(g, np.float64))
            for o, g in zip(whole.outputs, probing.autodiff.output_gradients[label],
                            strict=True)]


def _bptt(probing: Probing, recurrent: RecurrentCall, subs: list[Any],
          above: list[np.ndarray], sketch: Sketch) -> _Slice:
    """One recurrent call's BPTT, for the examples ``recurrent.rows``, from ``above``, the
    call's whole gradients from above."""
    rows = recurrent.rows
    gradients: list[np.ndarray | None] = [g[rows] for g in above]
    tape_states = [None if g is None else g[rows]
                   for g in probing.autodiff.state_gradients.get(recurrent.label, [])]
    found = _Slice(weights={}, states=[])
    for unit, sub, (d_seq, d_h_final, d_c_final) in zip(
            recurrent.units, subs, upstream_gradients(recurrent, gradients), strict=True):
        _, backward = unit.cell.numpy_functions()
        # Each call's gradient from above comes from the tape: ∂L/∂x_t is not needed.
        _, d_states, d_params = backward(unit.params, unit.cache, d_seq, d_h_final,
                                         d_c_final=d_c_final, inputs=False, sketch=sketch)
        for variable in sub.weights:
            found.weights[variable.path] = d_params[variable.path.split("/")[-1]]
        ours = list(d_states) if isinstance(d_states, tuple) else [d_states]
        mine, tape_states = tape_states[:len(ours)], tape_states[len(ours):]
        found.states.extend((f"{unit.label}/{state_name}", reference, value)
                            for state_name, reference, value in zip(
                                unit.cell.state_names, ours, mine, strict=True)
                            if value is not None)
    return found


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


def _compare(name: str, reference: np.ndarray, tape: np.ndarray, rtol: float,
             unprojected: np.ndarray | None = None, dtype: str = "float64") -> WitnessResult:
    """max |reference − tape| / max |tape|, the scale no smaller than ``dtype``'s
    :func:`~gradscope.gradcheck.underflow_scale` (the tape's dtype). ``unprojected``: the
    tape's gradient itself, where ``reference`` and ``tape`` are both it times the same
    random signs (its max is the scale)."""
    whole = tape if unprojected is None else unprojected
    largest = float(np.max(np.abs(whole))) if whole.size else 0.0
    floor = underflow_scale(dtype)
    error = float(np.max(np.abs(reference - tape), initial=0.0)) / max(largest, floor)
    detail = f"max |reference − tape| / max |tape| over {whole.size} elements"
    if unprojected is not None:
        columns = tape.shape[-1]
        detail = (f"max |(reference − tape)·S| / max |tape|, S: {whole.shape[-1]}×{columns} "
                  "random signs (never below the unprojected error but for a chance of "
                  f"2^-{columns})")
    if largest < floor:
        detail += (f"; max |tape| is {largest:.2g}, below {floor:.2g} ({dtype}'s smallest "
                   "normal number over its epsilon, where its arithmetic, which flushes "
                   "what underflows to 0, holds no relative tolerance): divided by that")
    return WitnessResult(WITNESS, name, error, rtol, error <= rtol, detail)
