"""Across time inside the user's Keras model: gradient flow and state Jacobians of every
recurrent call, wherever it sits in the graph.

- ``‖∂L/∂h_t‖`` per step, WITH the recurrence: the total gradient arriving at h_t, from above
  at step t plus what flows back from t+1. Keras' layer hides h_t inside its loop, so the
  call is re-run in gradscope's NumPy reference cell (float64) on the captured input and
  initial state, and its BPTT is fed the upstream ∂L/∂(the call's outputs) that the tape gave:
  one backward pass, whose carry at each step is that total.
- ``‖∂L/∂x_t‖`` per step for every float sequence input (B, T, F), from the same tape.
- ``∂h_T/∂h_0`` per example of every recurrent call: gradscope's TF cell on the captured
  input, in float64, with ``batch_jacobian`` inside one traced function per layer.

A call the cells do not model (masked input, other activations, go_backwards, stateful,
dropout in training mode, a Bidirectional wrapper) is listed as not analysed, with the reason:
never a number that may be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.keras.engine import CapturedCall, KerasPass, call_label
from gradscope.keras.layers import LayerFacts, explainer_for
from gradscope.keras.layers.recurrent import RecurrentExplainer
from gradscope.keras.witness import TOLERANCES, _unwitnessed, weights_by_key
from gradscope.reference import RECURRENT, cell_key
from gradscope.report.models import (
    JacobianEntry,
    KerasFlowSequence,
    KerasGradientFlow,
    KerasNotAnalysed,
    KerasStateJacobians,
)

FLOW_METHOD = ("the total ∂L/∂h_t of each recurrent call: gradscope's NumPy reference BPTT "
               "(float64) re-runs the call on its captured input and initial state and is fed "
               "the tape's ∂L/∂(the call's outputs), one backward pass; ∂L/∂x_t from the tape; "
               "norms are Frobenius over the batch")
JACOBIAN_METHOD = ("∂(final state)/∂(initial state) per example: gradscope's TF cell on the "
                   "captured input and initial state, float64, batch_jacobian in one traced "
                   "function per layer")

BIDIRECTIONAL = ("Bidirectional: its forward and backward layers run inside the wrapper; "
                 "gradscope does not analyse them separately yet")


@dataclass
class RecurrentCall:
    """One call of a GRU, LSTM or SimpleRNN layer, with what gradscope needs to re-run it."""

    label: str
    call: CapturedCall
    facts: LayerFacts
    explainer: RecurrentExplainer
    weights: dict[str, np.ndarray]  # by short name, as Keras holds them


def recurrent_calls(job: Any, engine: Any,
                    result: KerasPass) -> tuple[list[RecurrentCall], list[KerasNotAnalysed]]:
    """Every recurrent call of the run that gradscope's cells model exactly, and the others
    with the reason they are left out."""
    from gradscope.keras.explain import layer_facts

    usable: list[RecurrentCall] = []
    skipped: list[KerasNotAnalysed] = []
    for call in result.calls:
        label = call_label(call.layer, call.index)
        if call.class_name == "Bidirectional":
            skipped.append(KerasNotAnalysed(layer=label, reason=BIDIRECTIONAL))
            continue
        if call.class_name not in {"GRU", "LSTM", "SimpleRNN"}:
            continue
        node = job.graph.layer(call.layer)
        explainer = explainer_for(node.class_name, node.module)
        if not isinstance(explainer, RecurrentExplainer):
            skipped.append(KerasNotAnalysed(layer=label, reason="no gradscope cell for "
                                                                f"{node.class_name}"))
            continue
        facts = layer_facts(job.graph, node, [(None, *np.shape(call.args[0])[1:])])
        reason = _unwitnessed(call, facts)
        if reason is None and engine.training:
            dropouts = [f"{key} {facts.option(key)}" for key in ("dropout", "recurrent_dropout")
                        if float(facts.option(key, 0.0) or 0.0) > 0]
            if dropouts:
                reason = ("training mode with " + " and ".join(dropouts)
                          + ": the cells do not model dropout masks")
        if reason is not None:
            skipped.append(KerasNotAnalysed(layer=label, reason=reason))
            continue
        usable.append(RecurrentCall(label=label, call=call, facts=facts, explainer=explainer,
                                    weights=weights_by_key(engine.operation(call.layer),
                                                           facts)))
    return usable, skipped


def _params(recurrent: RecurrentCall) -> dict[str, np.ndarray]:
    """The weights in float64, with a zero bias when the layer has none (use_bias=False)."""
    params = {k: np.asarray(v, np.float64) for k, v in recurrent.weights.items()}
    if "bias" not in params:
        cell = recurrent.explainer.cell(recurrent.facts)
        units = cell.units
        if cell_key(cell) == "gru_keras":
            params["bias"] = np.zeros((2, 3 * units))
        else:
            params["bias"] = np.zeros(({"gru": 3, "lstm": 4, "simple_rnn": 1}[cell.kind]
                                       * units,))
    return params


def _keras_last_h(recurrent: RecurrentCall) -> np.ndarray:
    output = np.asarray(recurrent.call.outputs[0], np.float64)
    return output[:, -1] if recurrent.facts.option("return_sequences") else output


def _reproduces(ours: np.ndarray, keras: np.ndarray, dtype: str) -> str | None:
    """None when the cell's h_T equals Keras' to the witness tolerance, else why not."""
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES["float32"])
    if ours.shape != keras.shape:
        return f"gradscope's cell gives h_T of shape {ours.shape}, Keras {keras.shape}"
    error = float(np.max(np.abs(ours - keras))) if ours.size else 0.0
    allowed = atol + rtol * (float(np.max(np.abs(keras))) if keras.size else 0.0)
    if not error <= allowed:
        return (f"gradscope's cell does not reproduce Keras' h_T (max |error| {error:.1e} > "
                f"{allowed:.1e})")
    return None


# -- gradient flow ---------------------------------------------------------------------------


def total_state_gradients(recurrent: RecurrentCall, result: KerasPass,
                          dtype: str) -> np.ndarray | str:
    """The total ∂L/∂h_t (B, T, u) of one call, or the reason it cannot be given."""
    call, facts = recurrent.call, recurrent.facts
    cell = recurrent.explainer.cell(facts)
    forward, backward = RECURRENT[cell_key(cell)]
    params = _params(recurrent)
    x = np.asarray(call.args[0], np.float64)
    states = [np.asarray(s, np.float64) for s in call.states]
    sequence, cache = forward(params, x, *states)
    problem = _reproduces(sequence[:, -1], _keras_last_h(recurrent), dtype)
    if problem:
        return problem
    grads = result.output_gradients.get(recurrent.label)
    if grads is None:
        return "the run did not watch this call's outputs"
    upstream = [np.zeros(np.shape(o)) if g is None else np.asarray(g, np.float64)
                for o, g in zip(call.outputs, grads, strict=True)]
    if facts.option("return_sequences"):
        d_h_seq = upstream[0]
    else:
        d_h_seq = np.zeros((*x.shape[:2], cell.units))
        d_h_seq[:, -1] = upstream[0]
    returns_state = bool(facts.option("return_state"))
    d_h_final = upstream[1] if returns_state else None
    d_c_final = upstream[2] if returns_state and call.class_name == "LSTM" else None
    totals: list[np.ndarray] = []
    backward(params, cache, d_h_seq, d_h_final, d_c_final=d_c_final, totals=totals)
    return np.stack(totals, axis=1)


def per_step_norms(gradient: np.ndarray) -> list[float]:
    """Frobenius norm over every axis but the time axis 1."""
    squares = np.asarray(gradient, np.float64) ** 2
    return [float(v) for v in np.sqrt(squares.sum(axis=tuple(i for i in range(squares.ndim)
                                                             if i != 1)))]


def gradient_flow(job: Any, engine: Any, result: KerasPass) -> KerasGradientFlow:
    """``result`` must come from ``engine.run(..., watch_outputs=True, watch_inputs=True)``."""
    from gradscope.inspect import flow_flags

    usable, skipped = recurrent_calls(job, engine, result)
    sequences: list[KerasFlowSequence] = []
    for recurrent in usable:
        totals = total_state_gradients(recurrent, result, engine.dtype_name)
        if isinstance(totals, str):
            skipped.append(KerasNotAnalysed(layer=recurrent.label, reason=totals))
            continue
        sequences.append(KerasFlowSequence(what=f"∂L/∂{recurrent.label}/h_t", kind="state",
                                           source=recurrent.label,
                                           norms=per_step_norms(totals)))
    for name, value in job.batch.inputs.items():
        if value.dtype.kind != "f" or value.ndim != 3:
            continue
        gradient = result.input_gradients.get(name)
        norms = (per_step_norms(gradient) if gradient is not None
                 else [0.0] * int(value.shape[1]))
        sequences.append(KerasFlowSequence(what=f"∂L/∂{name}_t", kind="input", source=name,
                                           norms=norms))
    order = {call_label(c.layer, c.index): i for i, c in enumerate(result.calls)}
    skipped.sort(key=lambda entry: order.get(entry.layer, len(order)))
    flags = flow_flags({s.what: np.asarray(s.norms) for s in sequences})
    return KerasGradientFlow(method=FLOW_METHOD, sequences=sequences, not_analysed=skipped,
                             flags=flags)


# -- state Jacobians -------------------------------------------------------------------------


def state_jacobians(job: Any, engine: Any, result: KerasPass) -> KerasStateJacobians:
    usable, skipped = recurrent_calls(job, engine, result)
    tf = engine.tf
    functions: dict[str, Any] = {}
    entries: list[JacobianEntry] = []
    for recurrent in usable:
        cell = recurrent.explainer.cell(recurrent.facts)
        if recurrent.call.layer not in functions:
            functions[recurrent.call.layer] = _jacobian_function(tf, cell)
        params = {k: tf.constant(v) for k, v in _params(recurrent).items()}
        x = tf.constant(np.asarray(recurrent.call.args[0], np.float64))
        initial = tf.constant(np.concatenate(
            [np.asarray(s, np.float64) for s in recurrent.call.states], axis=1))
        from gradscope._tf import native_stderr_silenced

        with native_stderr_silenced():
            jacobian, final = functions[recurrent.call.layer](params, x, initial)
        problem = _reproduces(final.numpy()[:, :cell.units], _keras_last_h(recurrent),
                              engine.dtype_name)
        if problem:
            skipped.append(KerasNotAnalysed(layer=recurrent.label, reason=problem))
            continue
        blocks = jacobian.numpy()  # (B, rows, columns)
        frobenius = np.sqrt(np.sum(blocks**2, axis=(1, 2)))
        singular = np.linalg.svd(blocks, compute_uv=False)
        two = len(cell.state_names) > 1
        entries.append(JacobianEntry(
            target=f"{recurrent.label}/" + ("[h_T, c_T]" if two else "h_T"),
            source=f"{recurrent.label}/" + ("[h0, c0]" if two else "h0"),
            shape=list(blocks.shape[1:]),
            frobenius_median=float(np.median(frobenius)),
            frobenius_min=float(np.min(frobenius)),
            frobenius_max=float(np.max(frobenius)),
            largest_singular_median=float(np.median(singular[:, 0])),
            smallest_singular_median=float(np.median(singular[:, -1]))))
    order = {call_label(c.layer, c.index): i for i, c in enumerate(result.calls)}
    skipped.sort(key=lambda entry: order.get(entry.layer, len(order)))
    return KerasStateJacobians(method=JACOBIAN_METHOD, entries=entries, not_analysed=skipped)


def _jacobian_function(tf: Any, cell: Any) -> Any:
    """One traced function for one layer: (params, x (B, T, F), [h0, c0] (B, S)) →
    (∂[h_T, c_T]/∂[h0, c0] (B, S, S), [h_T, c_T] (B, S))."""
    count = len(cell.state_names)

    @tf.function(autograph=False, reduce_retracing=True)
    def compute(params: dict[str, Any], x: Any, initial: Any) -> tuple[Any, Any]:
        with tf.GradientTape() as tape:
            tape.watch(initial)
            states = tuple(tf.split(initial, count, axis=1))
            _, finals = cell.tf_sequence(tf, params, tf.transpose(x, [1, 0, 2]), states)
            final = tf.concat(list(finals), axis=1)
        return tape.batch_jacobian(final, initial, experimental_use_pfor=False), final

    return compute
