"""Backward: the loss and every value of the pass finite, a gradient not. From the output
side, the loss's own backward first (∂L/∂ each output), then each layer call in reverse call
order whose ∂L/∂output is finite: its backward, rerun eagerly with its ops looked at, is the
first to make a non-finite gradient when one of ∂L/∂(its inputs, initial states, weights)
is not. A recurrent call is then stepped (:mod:`~gradscope.keras.stepped`) to the step whose
total ∂L/∂h_t first is not finite, counting back from the last.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.keras.engine import CapturedCall, call_label
from gradscope.keras.nonfinite.births import Birth, finite, first_birth
from gradscope.keras.nonfinite.causes import entry, op_cause, where
from gradscope.keras.nonfinite.reruns import layer_call, loss_rerun, positions
from gradscope.report.models import NonFiniteEntry

#: What the backward op of a function says when it is infinite at a point.
DERIVATIVES = {"SqrtGrad": "the derivative of sqrt at 0 is infinite",
               "RsqrtGrad": "the derivative of 1/sqrt at 0 is infinite",
               "Reciprocal": "a derivative divides by 0", "RealDiv": "a derivative divides by 0",
               "DivNoNan": "a derivative divides by 0",
               "Log1p": "the derivative of log at 0 is infinite"}


def backward(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
             sample_weight: Any) -> NonFiniteEntry | None:
    """Where the first non-finite gradient of a finite pass is born (None: not found).

    Args:
        engine: The engine that ran the pass.
        inputs: The batch's inputs, by name.
        targets: The targets it used, by output name.
        sample_weight: As the pass took them.

    Returns:
        The diagnosis, or None.
    """

    def output_gradients(tape: Any, outputs: list[Any], loss: Any) -> Any:
        return tape.gradient(loss, outputs)

    _, grads, birth = loss_rerun(engine, inputs, targets, sample_weight,
                                 watch=output_gradients)
    bad = [np.asarray(g) for g in grads or () if g is not None and not finite(g)]
    if bad:
        step, examples = _positions(bad[0])
        return entry("backward", "loss", "loss", step, examples,
                     _cause(birth, step, examples), birth)
    rerun = engine.run(inputs, targets, watch_outputs=True, sample_weight=sample_weight)
    for call in reversed(rerun.calls):
        upstream = rerun.output_gradients.get(call_label(call.layer, call.index), [])
        if all(g is None for g in upstream) or not all(finite(g) for g in upstream
                                                       if g is not None):
            continue
        found = _call_backward(engine, call, upstream)
        if found is not None:
            return found
    return None


def _call_backward(engine: Any, call: CapturedCall, upstream: list[Any]) -> NonFiniteEntry | None:
    """One call's backward from its finite ∂L/∂outputs, rerun eagerly: the diagnosis where
    it makes a non-finite gradient."""

    tf, keras = engine.tf, engine.keras
    layer = engine.operation(call.layer)
    args = [tf.convert_to_tensor(a) for a in call.args if tf.is_tensor(a)]
    floats = [a for a in args if a.dtype.is_floating]
    states = [tf.convert_to_tensor(s) for s in call.states]
    weights = list(getattr(layer, "trainable_weights", []))

    def run() -> Any:
        with tf.GradientTape() as tape:
            tape.watch([*floats, *states])
            flat = list(keras.tree.flatten(layer_call(engine, layer, call, args, states)))
        given = [tf.zeros_like(o) if g is None else tf.cast(g, o.dtype)
                 for o, g in zip(flat, upstream, strict=False)]
        return tape.gradient(flat[:len(given)], [*floats, *states, *weights],
                             output_gradients=given)

    grads, birth = first_birth(run)
    if grads is None or all(g is None or finite(g) for g in grads):
        return None
    label = call_label(call.layer, call.index)
    step: int | None
    stepped = _stepped_totals(engine, call, upstream)
    if stepped is not None:
        step, examples, label = stepped
    else:
        bad = next(np.asarray(g) for g in grads if g is not None and not finite(g))
        batch = tuple(args[0].shape[:1]) if args else ()
        step, examples = _positions(bad) if batch and bad.shape[:1] == batch else (None, [])
    return entry("backward", "layer", label, step, examples, _cause(birth, step, examples),
                 birth)


def _stepped_totals(engine: Any, call: CapturedCall,
                    upstream: list[Any]) -> tuple[int, list[int], str] | None:
    """A recurrent call stepped with its ∂L/∂outputs: the step (input order) whose backward
    made the first total ∂L/∂h_t that is not finite, counting back from the last (the total
    on the state after step t is carried back by step t + 1's backward, which is where it was
    made: found tried as a new user would, a sqrt at 0 in step 10 was said to be step 9's),
    its examples, and the direction; None where the call is not stepped or every total is
    finite."""
    from gradscope.keras.stepped import step_call

    stepped = step_call(engine, call, upstream, engine.training, carry_back=False)
    if isinstance(stepped, str) or stepped.totals is None:
        return None
    for direction, totals in zip(stepped.directions, stepped.totals, strict=True):
        joined = np.concatenate([t.reshape(t.shape[0], t.shape[1], -1) for t in totals],
                                axis=2)
        bad = ~np.isfinite(joined).all(axis=2)
        if not bad.any():
            continue
        last = int(np.flatnonzero(bad.any(axis=0))[-1])  # processing order: the last
        examples = [int(e) for e in np.flatnonzero(bad[:, last])]
        step = min(last + 1, joined.shape[1] - 1)  # whose backward carried it to last
        shown = joined.shape[1] - 1 - step if direction.backwards else step
        return shown, examples, direction.label
    return None


def _positions(value: np.ndarray) -> tuple[int | None, list[int]]:

    return positions(value)


def _cause(birth: Birth | None, step: int | None, examples: list[int]) -> str:
    if birth is not None and birth.op_type in DERIVATIVES and birth.inputs:
        first = birth.inputs[0]
        bad = ~np.isfinite(birth.output)
        values = np.abs(first[bad] if first.shape == bad.shape else first)
        low = float(np.min(values)) if values.size else 0.0
        return (f"{DERIVATIVES[birth.op_type]}: its argument is {low:.3g}"
                f"{where(step, examples)}; the value is finite, its gradient is not")
    return op_cause(birth, step, examples, what="the gradient")
