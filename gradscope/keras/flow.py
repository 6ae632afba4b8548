"""Across time inside the user's Keras model (``explain --flow``, ``--jacobians``, and the
GradientFlow callback): the gradient flow and state Jacobians of every recurrent call,
wherever it sits in the graph.

The total ∂L/∂h_t at every step comes from the pass itself, whose loops were probed
(:mod:`~gradscope.keras.state_probes`); a call whose loop was not is stepped through its own
cell (:mod:`~gradscope.keras.stepped`). The NumPy cells re-run a call they model on its
captured input and initial state (the witnesses, and ∂h_T/∂h_0 by the TF cell in float64);
every output must first be rebuilt. A call neither can read is listed as not analysed, with
the reason, never given a number that may be wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gradscope.cells.base import Cell
from gradscope.errors import InternalError
from gradscope.formats import read_on
from gradscope.gradcheck import tolerance
from gradscope.keras.cross_check import (
    cell_params,
    compared_outputs,
    computed_in,
    not_modelled,
    unmodelled,
)
from gradscope.keras.engine import CapturedCall, KerasPass, call_label, class_label
from gradscope.keras.layers import LayerFacts, explainer_for
from gradscope.keras.layers.recurrent import RecurrentExplainer
from gradscope.keras.probed_flow import (
    back_ratio_of,
    carried_ratio_of,
    counted,
    example_squares,
    examples_ran,
    loop_flows,
    processing_ran,
    resting_on,
)
from gradscope.keras.state_probes import StateTotals
from gradscope.report.models import (
    FlowFlag,
    InfluenceMap,
    JacobianEntry,
    KerasFlowSection,
    KerasFlowSequence,
    KerasInfluence,
    KerasNotAnalysed,
    KerasStateJacobians,
)

PROBED_FLOW = ("the total ∂L/∂h_t of each recurrent call, from the pass's own backward: "
               "while Keras runs the model, its loop (backend.rnn over the layer's own cell) "
               "adds a zero to every state after every step, and the tape's gradient on that "
               "zero is the total gradient on the state; ∂L/∂x_t of the call's input "
               "sequence likewise, from a zero added to the sequence the loop reads (both "
               "directions' parts summed for a Bidirectional)")
STEPPED_FLOW = ("the total ∂L/∂h_t of each recurrent call: the cell the model holds, stepped "
                "in tf.scan with Keras' masking on the call's captured input and initial "
                "state, after its outputs are held to Keras' own, under one tape fed the "
                "tape's ∂L/∂(the call's outputs)")
FLOW_READING = ("a model input's ∂L/∂x_t from the tape; norms are Frobenius over the batch; "
                "a recurrent call is flagged by how much of ∂L/∂h its recurrence carries back "
                "from the last step it runs to the first (the product of the one-step gains "
                "‖∂L/∂h_t − its part from above‖ / ‖∂L/∂h_(t+1)‖; where the call returns its "
                "sequence, of what arrives at its last step carried back alone, one more "
                "backward pass), a model input by its norm at t=0 over its norm at the last "
                "step")
FLOW_METHOD = f"{PROBED_FLOW}; {FLOW_READING}"
JACOBIAN_METHOD = ("∂(final state)/∂(initial state) per example: gradscope's TF cell on the "
                   "captured input and initial state, float64, the tangents of every "
                   "initial-state unit carried forward through one loop over time")

STEPPED_JACOBIAN = ("a call gradscope's cells do not model: the cell the model holds, "
                    "stepped in tf.scan with Keras' masking, in its own dtype (a masked "
                    "GRU, LSTM or SimpleRNN of Keras': gradscope's cell linearised by hand on "
                    "the layer's weights, in float64, a masked step keeping the states, its "
                    "final states held to the layer's own)")

#: Bidirectional merge modes whose gradient gradscope splits between the two directions.
MERGE_MODES = ("concat", "sum", "ave", "mul", None)

STEPPED_NOTE = ("a call whose loop is not Keras' own (a fused kernel, a loop a layer writes "
                "itself) is stepped through the cell the model holds, in tf.scan under one "
                "tape, after its outputs are held to Keras' own")
BACKWARDS_NOTE = ("a go_backwards layer, and the backward layer of a Bidirectional, is shown "
                  "in its processing order: its t = 0 is the last input step; the model's "
                  "inputs are then not flagged by the ends of ∂L/∂x_t (a layer reading them "
                  "backwards carries the gradient towards t = 0), only the layers are")


@dataclass
class Unit:
    """One recurrent layer as gradscope re-runs it: a plain call, or one direction of a
    Bidirectional call. ``x`` and every sequence are in processing order (reversed for a
    go_backwards layer)."""

    label: str  # "decoder", "decoder[1]", "both/forward"
    class_name: str
    cell: Cell
    params: dict[str, np.ndarray]  # float64
    x: np.ndarray  # (B, T, F) float64, processing order
    states: list[np.ndarray]  # float64
    backwards: bool
    sequence: np.ndarray = field(default_factory=lambda: np.zeros(0))  # h_1 … h_T
    cache: Any = None
    final_c: np.ndarray | None = None

    @property
    def state_count(self) -> int:
        return len(self.cell.state_names)

    def finals(self) -> list[np.ndarray]:
        return [self.sequence[:, -1]] + ([self.final_c] if self.final_c is not None else [])


@dataclass
class RecurrentCall:
    """A recurrent call whose every output gradscope's NumPy cells reproduce."""

    label: str
    call: CapturedCall
    units: list[Unit]
    return_sequences: bool
    return_state: bool
    merge_mode: str | None = "concat"  # Bidirectional only
    #: The examples of the call this covers (all of them, unless taken in slices).
    rows: slice = field(default_factory=lambda: slice(None))


#: The Keras layers whose calls gradscope's cells can model.
RECURRENT_CLASSES = frozenset({"GRU", "LSTM", "SimpleRNN", "Bidirectional"})


#: Keras' own cells: their output is their first state, h.
KERAS_CELLS = ("GRUCell", "LSTMCell", "SimpleRNNCell", "ConvLSTMCell")


def stepped_only(layer: Any) -> bool:
    """Whether the calls of ``layer`` are recurrent calls that only the stepped cell can
    analyse: an ``RNN`` over a cell, a ConvLSTM, or a subclass of Keras' recurrent layers."""
    from keras.layers import RNN, Bidirectional

    return (class_label(layer) not in RECURRENT_CLASSES
            and isinstance(layer, RNN | Bidirectional))


def recurrent_calls(job: Any, engine: Any, result: KerasPass,
                    weights: dict[str, np.ndarray] | None = None,
                    ) -> tuple[list[RecurrentCall], list[KerasNotAnalysed]]:
    """Every recurrent call of the run that gradscope's cells model exactly, and the others
    with the reason they are left out. The cells take the layers' weights as they are now, or
    from ``weights`` (variable path → value, ``recurrent_weights()``) as they were at the
    pass, when the model may have trained on since."""
    usable: list[RecurrentCall] = []
    skipped: list[KerasNotAnalysed] = []
    for found in each_recurrent_call(engine, result, weights):
        if isinstance(found, KerasNotAnalysed):
            skipped.append(found)
        else:
            usable.append(found)
    return usable, skipped


def each_recurrent_call(engine: Any, result: KerasPass,
                        weights: dict[str, np.ndarray] | None = None,
                        examples: int | None = None,
                        ) -> Iterator[RecurrentCall | KerasNotAnalysed]:
    """:func:`recurrent_calls` one call at a time, in the order of the run: a caller that is
    done with a call before it asks for the next holds one call's caches at a time. With
    ``examples``, a call comes in slices of at most that many examples (``rows``), one at a
    time; a slice the cells do not reproduce ends its call (the reason, once)."""
    for call in result.calls:
        if call.class_name not in RECURRENT_CLASSES:
            continue
        label = call_label(call.layer, call.index)
        size = int(call.args[0].shape[0]) if call.args else 0
        step = examples if examples and size > examples else max(size, 1)
        for start in range(0, max(size, 1), step):
            rows = slice(start, start + step)
            found = _prepare(call if step >= size else _examples(call, rows, size), label,
                             engine, weights)
            if isinstance(found, str):
                yield KerasNotAnalysed(layer=label, reason=found)
                break
            found.rows = rows
            yield found
            del found  # not held while the next slice runs


def _examples(call: CapturedCall, rows: slice, size: int) -> CapturedCall:
    """The call as it ran for the examples ``rows`` (every tensor with a batch axis, sliced)."""
    def part(value: Any) -> Any:
        shape = getattr(value, "shape", None)
        return value[rows] if shape is not None and len(shape) and shape[0] == size else value

    return replace(call, args=[part(a) for a in call.args],
                   outputs=[part(o) for o in call.outputs],
                   states=[part(s) for s in call.states],
                   mask=None if call.mask is None else part(call.mask))


def masked_steps(call: CapturedCall) -> str | None:
    """Why a call's steps are not a plain recurrence, if its batch has masked steps (with
    every step kept, Keras' masked loop computes exactly the plain recurrence)."""
    if call.mask is not None and not np.all(np.asarray(call.mask)):
        return ("the input is masked and this batch has masked steps (Keras holds the state "
                "over them)")
    return None


def _prepare(call: CapturedCall, label: str, engine: Any,
             weights: dict[str, np.ndarray] | None) -> RecurrentCall | str:
    """The call's units, run forward in NumPy and checked against every output Keras gave,
    or the reason gradscope does not analyse the call."""
    layer = engine.operation(call.layer)
    masked = masked_steps(call)
    if masked:
        return f"{masked}; the cells do not model masks"
    if not call.states:
        return ("stateful" if getattr(layer, "stateful", False)
                else "no initial state captured")
    bidirectional = call.class_name == "Bidirectional"
    if bidirectional:
        parts = [(f"{label}/forward", layer.forward_layer),
                 (f"{label}/backward", layer.backward_layer)]
        if layer.merge_mode not in MERGE_MODES:
            return f"Bidirectional merge_mode {layer.merge_mode!r}"
        if class_label(layer.forward_layer) not in {"GRU", "LSTM", "SimpleRNN"}:
            return f"Bidirectional over {class_label(layer.forward_layer)}"
    else:
        parts = [(label, layer)]
    x = np.asarray(call.args[0], np.float64)
    states = [np.asarray(s, np.float64) for s in call.states]
    units: list[Unit] = []
    for name, sub in parts:
        class_name = class_label(sub)
        facts = LayerFacts(name=sub.name, class_name=class_name, config=sub.get_config(),
                           input_shapes=((None, *x.shape[1:]),))
        reasons = unmodelled(facts, engine.training)
        if reasons:
            return not_modelled(reasons)
        explainer = explainer_for(class_name)
        if not isinstance(explainer, RecurrentExplainer):
            return f"no gradscope cell for {class_name}"
        cell = explainer.cell(facts)
        count = len(cell.state_names)
        mine, states = states[:count], states[count:]
        backwards = bool(getattr(sub, "go_backwards", False))
        units.append(Unit(label=name, class_name=class_name, cell=cell,
                          params=_params(sub, cell, weights), x=x[:, ::-1] if backwards else x,
                          states=mine, backwards=backwards))
    recurrent = RecurrentCall(label=label, call=call, units=units,
                              return_sequences=bool(layer.return_sequences),
                              return_state=bool(layer.return_state),
                              merge_mode=layer.merge_mode if bidirectional else None)
    for unit in units:
        forward, _ = unit.cell.numpy_functions()
        unit.sequence, unit.cache = forward(unit.params, unit.x, *unit.states)
        if unit.state_count > 1:
            unit.final_c = unit.cache[-1]["c"]
    return _reproduces(recurrent, engine.dtype_name) or recurrent


def _params(layer: Any, cell: Cell,
            weights: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """The weights in float64 by short name, with a zero bias when the layer has none."""
    return cell_params(cell, {v.path.split("/")[-1]: np.asarray(
        v.numpy() if weights is None else weights[v.path]) for v in layer.weights})


def recurrent_weights(engine: Any, result: KerasPass) -> dict[str, np.ndarray]:
    """A copy of every weight of the run's recurrent layers, by variable path: what
    ``recurrent_calls(..., weights=)`` reads after the model has moved on."""
    layers = {call.layer for call in result.calls
              if call.class_name in RECURRENT_CLASSES}
    return {v.path: np.array(v.numpy()) for name in sorted(layers)
            for v in engine.operation(name).weights}


def _outputs(recurrent: RecurrentCall) -> list[np.ndarray]:
    """What Keras returns for this call, rebuilt from the NumPy sequences."""
    ys = [u.sequence if recurrent.return_sequences else u.sequence[:, -1]
          for u in recurrent.units]
    states = [s for u in recurrent.units for s in u.finals()] if recurrent.return_state else []
    if len(ys) == 1:
        return [ys[0], *states]
    forward, backward = ys
    if recurrent.return_sequences:
        backward = backward[:, ::-1]
    merged = {"concat": lambda: [np.concatenate([forward, backward], axis=-1)],
              "sum": lambda: [forward + backward], "ave": lambda: [(forward + backward) / 2],
              "mul": lambda: [forward * backward],
              None: lambda: [forward, backward]}[recurrent.merge_mode]()
    return [*merged, *states]


def _reproduces(recurrent: RecurrentCall, dtype: str) -> str | None:
    """None when every output of the call equals Keras' to the witness tolerance."""
    found = output_error(recurrent, dtype)
    return found if isinstance(found, str) else None


def output_error(recurrent: RecurrentCall, dtype: str) -> tuple[float, float] | str:
    """The largest |error| of the NumPy cells' outputs against Keras' and what the witness
    tolerance allows there, or why they do not reproduce them."""
    rtol, atol = tolerance("cross_check", computed_in(recurrent.call, dtype))
    return compared_outputs(_outputs(recurrent), recurrent.call.outputs, rtol, atol,
                            "gradscope's cells")


def rerun_call(call: CapturedCall, engine: Any) -> RecurrentCall | str:
    """One recurrent call (a Bidirectional one as its two directions) rerun in gradscope's
    NumPy cells, checked against every output Keras gave; or why it is not."""
    return _prepare(call, call_label(call.layer, call.index), engine, None)


# -- gradient flow ---------------------------------------------------------------------------


def upstream_gradients(recurrent: RecurrentCall, gradients: list[np.ndarray | None]) -> list[
        tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """Per unit: ∂L/∂h_t from above (B, T, u) in processing order, ∂L/∂h_T and ∂L/∂c_T from
    the returned states (None when not returned)."""
    outputs = recurrent.call.outputs
    grads = [np.zeros(np.shape(o)) if g is None else np.asarray(g, np.float64)
             for o, g in zip(outputs, gradients, strict=True)]
    units = recurrent.units
    if len(units) == 1:
        d_ys, rest = [grads[0]], grads[1:]
    else:
        mode = recurrent.merge_mode
        first, second = (u.sequence if recurrent.return_sequences else u.sequence[:, -1]
                         for u in units)
        if recurrent.return_sequences:
            second = second[:, ::-1]  # as merged: aligned with the input steps
        if mode is None:
            d_ys, rest = [grads[0], grads[1]], grads[2:]
        else:
            d, rest = grads[0], grads[1:]
            width = units[0].cell.units
            d_ys = {"concat": lambda: [d[..., :width], d[..., width:]],
                    "sum": lambda: [d, d], "ave": lambda: [d / 2, d / 2],
                    "mul": lambda: [d * second, d * first]}[str(mode)]()
        if recurrent.return_sequences:
            d_ys[1] = d_ys[1][:, ::-1]  # back to the backward layer's processing order
    result = []
    for unit, d_y in zip(units, d_ys, strict=True):
        if recurrent.return_sequences:
            d_seq = d_y
        else:
            d_seq = np.zeros(unit.sequence.shape)
            d_seq[:, -1] = d_y
        d_h_final = d_c_final = None
        if recurrent.return_state:
            mine, rest = rest[:unit.state_count], rest[unit.state_count:]
            d_h_final = mine[0]
            d_c_final = mine[1] if unit.state_count > 1 else None
        result.append((d_seq, d_h_final, d_c_final))
    return result


def total_state_gradients(recurrent: RecurrentCall, result: KerasPass
                          ) -> list[tuple[np.ndarray, np.ndarray]] | str:
    """Per unit, the total ∂L/∂h_t (B, T, u) and the part of it that arrives from above at
    step t (the rest is carried back from t+1), both in processing order; or why they cannot
    be given."""
    gradients = result.output_gradients.get(recurrent.label)
    if gradients is None:
        return "the run did not watch this call's outputs"
    parts = []
    for unit, (d_seq, d_h_final, d_c_final) in zip(recurrent.units,
                                                   upstream_gradients(recurrent, gradients),
                                                   strict=True):
        _, backward = unit.cell.numpy_functions()
        totals: list[np.ndarray] = []
        backward(unit.params, unit.cache, d_seq, d_h_final, d_c_final=d_c_final,
                 totals=totals, inputs=False)
        parts.append((np.stack(totals, axis=1), np.asarray(d_seq, np.float64)))
    return parts


def carried_ratio(total: np.ndarray, direct: np.ndarray,
                  ran: np.ndarray | None = None) -> float | None:
    """How much of ∂L/∂h survives being carried back through the recurrence, from the last
    step the layer runs to its first: the product over t of ‖∂L/∂h_t − its part from above at
    t‖ / ‖∂L/∂h_{t+1}‖, each the gain of one step back (steps whose ∂L/∂h_{t+1} is 0 carry
    nothing and are left out). It reads the recurrence, not where the loss puts its gradient:
    the two directions of a Bidirectional layer, each in the order it runs, are read alike.
    Where the gradient enters at the last step only, it is ‖∂L/∂h_0‖ / ‖∂L/∂h_{T−1}‖; where
    it enters at every step (the call returns its sequence), the ratio is read instead from
    what arrives at the last step carried back alone
    (:func:`~gradscope.keras.probed_flow.back_ratio_of`).
    ``total`` and ``direct``: (B, T, u) in processing order; each step's gain is taken over
    the examples whose step t+1 ran (``ran`` (B, T), processing order;
    :func:`~gradscope.keras.probed_flow.carried_ratio_of`). None: nothing to carry."""
    total = np.asarray(total, np.float64)
    return carried_ratio_of(example_squares(total - direct), example_squares(total), ran)


def recurrence_flag(what: str, ratio: float | None, steps: int,
                    ran: np.ndarray | None = None,
                    states: list[str] | None = None,
                    rests_on: tuple[int, int] | None = None) -> FlowFlag | None:
    """Vanishing or exploding, by :func:`carried_ratio` beyond FLOW_FACTOR either way
    (:func:`gradscope.dynamics.flow_kind`, the rule diagnose reads its own flow by); the
    flag points to ``gradscope diagnose`` for why. ``ran`` (B, T): where each example's
    steps ran; a padded batch's ratio is read aligned at each example's last step
    (:func:`~gradscope.keras.probed_flow.carried_ratio_of`), over the steps its longest
    example ran, and is said so. ``states``: the names of the states the ratio joins, said
    where they are more than one (an LSTM's is of h and c together, where ``what`` names
    h). ``rests_on``: (how many examples, of how many that ran) the ratio rests on, said
    where not every one (:func:`~gradscope.keras.probed_flow.resting_on`)."""
    from gradscope.gradient_stats import carried_flag

    longest = steps if ran is None else int(np.max(np.sum(ran, axis=1), initial=0))
    span = (f"from t={steps - 1} to t=0 (the order the layer runs)" if longest >= steps else
            f"over the {longest} steps its longest example ran (each example's from its own "
            "last step)")
    note = "" if rests_on is None else f" ({resting_words(rests_on)})"
    return carried_flag(what, ratio, span, states, note)


def resting_words(rests_on: tuple[int, int]) -> str:
    """Of how many examples a carried ratio is read, where not every one that ran."""
    return f"{read_on(rests_on)}: the others get no gradient at their last step that ran"


def per_step_norms(gradient: np.ndarray) -> list[float]:
    """Frobenius norm over every axis but the time axis 1."""
    squares = np.asarray(gradient, np.float64) ** 2
    return [float(v) for v in np.sqrt(squares.sum(axis=tuple(i for i in range(squares.ndim)
                                                             if i != 1)))]


def gradient_flow(job: Any, engine: Any, result: KerasPass) -> KerasFlowSection:
    """``result`` must come from ``engine.run(..., watch_outputs=True, watch_inputs=True,
    probe_states=True)``. A call whose loop was probed is read from the pass itself; any
    other recurrent call is stepped through the cell the model holds
    (:mod:`~gradscope.keras.stepped`)."""
    from gradscope.gradient_stats import flow_flags

    by_call: list[tuple[str, list[KerasFlowSequence]]] = []
    flags: list[FlowFlag] = []
    still: list[KerasNotAnalysed] = []
    backwards = any_probed = any_stepped = False
    for call in result.calls:
        label = call_label(call.layer, call.index)
        layer = engine.operation(call.layer)
        kind = class_label(layer)
        probed = result.state_totals.get(label)
        if probed is not None:
            found, found_flags, reversed_order = _probed_flow(layer, label, probed,
                                                              call.mask)
            any_probed = True
        elif call.class_name in RECURRENT_CLASSES or stepped_only(layer):
            stepped = _stepped_flow(engine, call, result, kind)
            if isinstance(stepped, KerasNotAnalysed):
                still.append(stepped)
                continue
            found, found_flags, reversed_order = stepped
            any_stepped = True
        else:
            continue
        backwards = backwards or reversed_order
        flags += found_flags
        by_call.append((label, found))
    sequences = [sequence for _, found in by_call for sequence in found]
    for name, value in job.batch.inputs.items():
        if value.dtype.kind != "f" or value.ndim != 3:
            continue
        gradient = result.input_gradients.get(name)
        norms = (per_step_norms(gradient) if gradient is not None
                 else [0.0] * int(value.shape[1]))
        sequences.append(KerasFlowSequence(what=f"∂L/∂{name}_t", kind="input", source=name,
                                           norms=norms))
    sequences = _once(sequences, job.batch.inputs)
    # Flagged by their norm at t=0 over the last: the model's own inputs (a recurrent call's
    # input has its call's recurrence flag). Not where a call runs backwards: a layer that
    # reads its input from the last step carries the gradient towards t = 0, so the ends of
    # the input's series compare the other way round (its layers' own flags read it).
    if not backwards:
        flags += flow_flags({s.what: np.asarray(s.norms) for s in sequences
                             if s.kind == "input" and s.source in job.batch.inputs})
    if any_stepped and not any_probed:
        method = f"{STEPPED_FLOW}; {FLOW_READING}"
    else:
        method = FLOW_METHOD + ("; " + STEPPED_NOTE if any_stepped else "")
    method += "; " + BACKWARDS_NOTE if backwards else ""
    return KerasFlowSection(method=method, sequences=sequences, not_analysed=still,
                            flags=flags)


def _once(sequences: list[KerasFlowSequence], inputs: dict[str, Any]
          ) -> list[KerasFlowSequence]:
    """Without a call's ∂L/∂x_t that is a model input's own, step for step (a layer that
    alone reads the input): shown once, under the input's name."""
    own = [s.norms for s in sequences if s.kind == "input" and s.source in inputs]
    return [s for s in sequences if s.kind != "input" or s.source in inputs
            or not any(len(n) == len(s.norms) and np.allclose(n, s.norms, rtol=1e-6, atol=0)
                       for n in own)]


def _probed_flow(layer: Any, label: str, probed: list[StateTotals], mask: Any = None
                 ) -> tuple[list[KerasFlowSequence], list[FlowFlag], bool]:
    """A call read from its probed loops: the total ∂L/∂s_t of each direction (h alone for
    Keras' own layers, every state for a cell of the user's), in processing order, and the
    flag of the whole state's recurrence."""
    sequences, flags = [], []
    loops = loop_flows(layer, label, probed, mask)
    for loop in loops:
        output = loop.totals.output_state
        ratio = None if output is None else loop.carried()
        rests = None if ratio is None else loop.rests_on()
        ran = counted(loop.ran)
        for k in loop.shown:
            sequences.append(KerasFlowSequence(
                what=loop.what(k), kind="state", source=loop.label,
                norms=per_step_norms(loop.totals.totals[k]), backwards=loop.totals.backwards,
                carried=ratio if k == output else None,
                carried_examples=list(rests) if k == output and rests else None,
                examples_ran=ran))
        steps = loop.totals.totals[0].shape[1]
        flag = (None if output is None
                else recurrence_flag(loop.what(output), ratio, steps, loop.ran, loop.names,
                                     rests))
        if flag is not None:
            flags.append(flag)
    read = [loop.totals.inputs for loop in loops if loop.totals.inputs is not None]
    if read and len(read) == len(loops):
        # Every direction reads the same sequence, in input order: its gradient is the sum.
        sequences.append(KerasFlowSequence(what=f"∂L/∂{label}/x_t", kind="input", source=label,
                                           norms=per_step_norms(np.sum(read, axis=0)),
                                           examples_ran=examples_ran(mask,
                                                                     np.shape(read[0])[1])))
    return sequences, flags, any(loop.totals.backwards for loop in loops)


def influences(engine: Any, result: KerasPass, at: int | None,
               heatmap: bool) -> list[KerasInfluence]:
    """‖∂h_t/∂x_s‖ of every recurrent call that can be stepped (each direction of a
    Bidirectional), t = ``at`` (default: the last step), with ``heatmap`` over the steps
    :func:`~gradscope.gradient_stats.map_rows` gives too. ``at`` beyond a call's steps is a
    ConfigError."""
    from gradscope.errors import ConfigError
    from gradscope.gradient_stats import map_rows
    from gradscope.keras.stepped import influence, step_call

    found: list[KerasInfluence] = []
    for call in result.calls:
        if not (call.class_name in RECURRENT_CLASSES
                or stepped_only(engine.operation(call.layer))):
            continue
        label = call_label(call.layer, call.index)
        stepped = engine.stepped_calls.get(label) or step_call(engine, call, None,
                                                               engine.training)
        if isinstance(stepped, str):
            continue  # listed under not_analysed by the flow
        steps = int(np.shape(call.args[0])[1])
        if at is not None and not 0 <= at < steps:
            raise ConfigError(f"--at {at} is outside the {steps} time steps of "
                              f"{stepped.label}; expected 0 to {steps - 1}", where="--at")
        t = steps - 1 if at is None else at
        rows = map_rows(steps, t) if heatmap else []
        for index, direction in enumerate(stepped.directions):
            norms = influence(engine, stepped, index, [t, *rows])
            heat = (InfluenceMap(steps=rows, values=[[float(v) for v in norms[r]]
                                                     for r in rows]) if heatmap else None)
            found.append(KerasInfluence(source=direction.label, step=t,
                                        influence=[float(v) for v in norms[t]],
                                        influence_map=heat))
    return found


def _stepped_flow(engine: Any, call: CapturedCall, result: KerasPass, kind: str
                  ) -> tuple[list[KerasFlowSequence], list[FlowFlag], bool] | KerasNotAnalysed:
    """A call stepped through the cell the model holds: the total ∂L/∂h_t of each direction
    (of every state, for an ``RNN`` over a cell of the user's), in processing order, and its
    flag. For a cell of the user's, no flag: what arrives from above at a step is the
    gradient of the cell's output, which need not be its state."""
    from gradscope.keras.stepped import carried_back, step_call

    label = call_label(call.layer, call.index)
    upstream = result.output_gradients.get(label)
    if upstream is None:
        return KerasNotAnalysed(layer=label, reason="the run did not watch this call's outputs")
    stepped = step_call(engine, call, upstream, engine.training)
    if isinstance(stepped, str):
        return KerasNotAnalysed(layer=label, reason=stepped)
    engine.stepped_calls[label] = stepped
    assert stepped.totals is not None and stepped.direct is not None
    sequences, flags = [], []
    same = stepped.output_is_state or [True] * len(stepped.directions)
    for index, (direction, totals, direct, output_is_state) in enumerate(zip(
            stepped.directions, stepped.totals, stepped.direct, same, strict=True)):
        # A cell of the user's (in an RNN, or a subclass of it): every state, no flag.
        own_cell = kind == "RNN" or class_label(direction.layer.cell) not in KERAS_CELLS
        names = direction.names if own_cell else direction.names[:1]
        for k, (name, total) in enumerate(zip(names, totals, strict=False)):
            short = f"{name[0]}_t" if name in ("h0", "c0") else f"{name}_t"
            # A cell of the user's is a black box: a state other than its output can be
            # moved only as the next step reads it, not where the same step's output reads it.
            # So is the first, where the cell's output is not that state itself.
            later = k > 0 or not output_is_state
            what = f"∂L/∂{direction.label}/{short}" + (" (as step t+1 reads it)" if later
                                                       else "")
            ratio = rests = None
            if not own_cell and total.shape == direct.shape:
                # What the recurrence carries is the whole state: an LSTM's c carries what
                # its h does not, so both are read together (the gradient from above
                # arrives at h alone).
                whole = np.concatenate(totals, axis=-1)
                above = np.concatenate([direct, *(np.zeros_like(t) for t in totals[1:])],
                                       axis=-1)
                ran = processing_ran(stepped.call.mask, total.shape[1], direction.backwards)
                back = carried_back(stepped, index)
                ratio = (carried_ratio(whole, above, ran) if back is None else
                         back_ratio_of(back, ran))
                rests = (None if ratio is None else resting_on(
                    example_squares(whole) if back is None else back, ran))
                flag = recurrence_flag(what, ratio, total.shape[1], ran,
                                       [n.removesuffix("0") for n in direction.names], rests)
                if flag is not None:
                    flags.append(flag)
            sequences.append(KerasFlowSequence(
                what=what, kind="state", source=direction.label, norms=per_step_norms(total),
                backwards=direction.backwards, carried=ratio,
                carried_examples=list(rests) if rests else None,
                examples_ran=examples_ran(stepped.call.mask, total.shape[1],
                                          direction.backwards)))
    if stepped.inputs is not None:
        sequences.append(KerasFlowSequence(
            what=f"∂L/∂{label}/x_t", kind="input", source=label,
            norms=per_step_norms(stepped.inputs),
            examples_ran=examples_ran(stepped.call.mask, np.shape(stepped.inputs)[1])))
    return sequences, flags, any(d.backwards for d in stepped.directions)


def _in_call_order(skipped: list[KerasNotAnalysed], result: KerasPass) -> None:
    order = {call_label(c.layer, c.index): i for i, c in enumerate(result.calls)}
    skipped.sort(key=lambda entry: order.get(entry.layer, len(order)))


# -- state Jacobians -------------------------------------------------------------------------


def state_jacobians(job: Any, engine: Any, result: KerasPass) -> KerasStateJacobians:
    """∂(final state)/∂(initial state) per example of every unit of every recurrent call,
    one call at a time (its rerun in gradscope's NumPy cells is let go before the next)."""
    from gradscope._blas import blas_beside_tensorflow

    functions: dict[str, Any] = {}
    entries: list[JacobianEntry] = []
    skipped: set[str] = set()
    usable = False
    calls = each_recurrent_call(engine, result)
    while True:
        with blas_beside_tensorflow():  # the NumPy rerun (see gradscope/_blas.py)
            recurrent = next(calls, None)
        if recurrent is None:
            break
        if isinstance(recurrent, KerasNotAnalysed):
            skipped.add(recurrent.layer)
        else:
            usable = True
            entries += _call_jacobians(engine.tf, recurrent, functions)
        del recurrent  # not held while the next call is rerun
    cells = {call_label(c.layer, c.index) for c in result.calls
             if stepped_only(engine.operation(c.layer))}
    stepped, still = _stepped_jacobians(engine, result, skipped | cells)
    order = {call_label(c.layer, c.index): i for i, c in enumerate(result.calls)}
    entries = sorted(entries + stepped,
                     key=lambda e: order.get(e.target.split("/")[0], len(order)))
    _in_call_order(still, result)
    method = (JACOBIAN_METHOD + ("; " + STEPPED_JACOBIAN if stepped else "") if usable
              else "∂(final state)/∂(initial state) per example: " + STEPPED_JACOBIAN)
    return KerasStateJacobians(method=method, entries=entries, not_analysed=still)


def _call_jacobians(tf: Any, recurrent: RecurrentCall,
                    functions: dict[str, Any]) -> list[JacobianEntry]:
    """The Jacobian entry of each unit of a call gradscope's cells model, once its final
    states in the TF cell equal the NumPy cell's; ``functions`` keeps one traced function
    per layer (and direction) across calls."""
    from gradscope._tf import native_stderr_silenced

    entries = []
    rtol, atol = tolerance("cross_check")
    for unit in recurrent.units:
        key = unit.label.removeprefix(recurrent.label) + "@" + recurrent.call.layer
        if key not in functions:
            functions[key] = _jacobian_function(tf, unit.cell)
        with native_stderr_silenced():
            jacobian, ours = functions[key](unit)
        reference = np.concatenate(unit.finals(), axis=1)
        error = float(np.max(np.abs(ours - reference))) if ours.size else 0.0
        if not error <= atol + rtol * float(np.max(np.abs(reference), initial=0.0)):
            raise InternalError(
                f"internal error: {unit.label}: gradscope's TF cell and its NumPy cell "
                f"disagree on the final state (max |error| {error:.1e}); please report it")
        entries.append(_jacobian_entry(unit.label, list(unit.cell.state_names), jacobian))
    return entries


def _stepped_jacobians(engine: Any, result: KerasPass, labels: set[str],
                       ) -> tuple[list[JacobianEntry], list[KerasNotAnalysed]]:
    """∂(final states)/∂(initial states) of the calls ``labels`` names, each stepped through
    the cell the model holds; or why not."""
    from gradscope.keras.stepped import state_jacobian, step_call

    entries: list[JacobianEntry] = []
    still: list[KerasNotAnalysed] = []
    for call in result.calls:
        label = call_label(call.layer, call.index)
        if label not in labels:
            continue
        stepped = engine.stepped_calls.get(label) or step_call(engine, call, None,
                                                               engine.training)
        if isinstance(stepped, str):
            still.append(KerasNotAnalysed(layer=label, reason=stepped))
            continue
        for index, direction in enumerate(stepped.directions):
            blocks = state_jacobian(engine, stepped, index)
            if isinstance(blocks, str):
                still.append(KerasNotAnalysed(layer=direction.label, reason=blocks))
                continue
            # In the dtype it was computed in: float64 by hand, else the cell's own.
            entries.append(_jacobian_entry(direction.label, direction.names, blocks,
                                           blocks.dtype))
    return entries, still


def _jacobian_entry(label: str, names: list[str], blocks: np.ndarray,
                    dtype: Any = np.float64) -> JacobianEntry:
    """The per-example blocks (B, rows, columns), computed in ``dtype``, summed up as the YAML
    report does (:func:`~gradscope.dynamics.singular_summary`); ``names`` the initial states'
    (h0, c0, states[k])."""
    from gradscope.dynamics import singular_summary

    finals = [n.removesuffix("0") + "_T" if n in ("h0", "c0") else f"{n}_T" for n in names]
    return JacobianEntry(
        target=f"{label}/{_joined(finals)}", source=f"{label}/{_joined(list(names))}",
        shape=list(blocks.shape[1:]),
        **singular_summary(blocks, float(np.finfo(np.dtype(dtype)).eps)))


def _joined(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"[{', '.join(parts)}]"


def _jacobian_function(tf: Any, cell: Cell) -> Any:
    """One layer's ``jacobian(unit)`` → (∂[h_T, c_T]/∂[h0, c0] (B, S, S), [h_T, c_T] (B, S)),
    in float64 through gradscope's TF cell: the tangents of every initial-state unit carried
    forward (:mod:`~gradscope.keras.state_tangents`), traced once per layer."""
    from gradscope.keras.state_tangents import jacobian_function, state_jacobian

    def advance(weights: Any, states: list[Any], inputs_t: tuple[Any, ...]) -> list[Any]:
        return list(cell.tf_step(tf, weights, tuple(states), inputs_t))

    def tangent(weights: Any, states: list[Any], inputs_t: tuple[Any, ...],
                tangents: list[Any]) -> tuple[list[Any], list[Any]]:
        after, moved = cell.tf_step_tangent(tf, weights, tuple(states), inputs_t,
                                            tuple(tangents))
        return list(after), list(moved)

    compute = jacobian_function(tf, advance, tangent=tangent if cell.has_tangent else None)

    def jacobian(unit: Unit) -> tuple[np.ndarray, np.ndarray]:
        params = {k: tf.constant(v) for k, v in unit.params.items()}
        inputs = cell.tf_inputs(tf, params, tf.constant(np.swapaxes(unit.x, 0, 1)))
        return state_jacobian(tf, compute, cell.tf_step_weights(tf, params), tuple(inputs),
                              [tf.constant(s) for s in unit.states])

    return jacobian
