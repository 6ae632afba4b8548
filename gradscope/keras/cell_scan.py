"""An RNN's cell run step by step over one of its calls, as Keras' RNN calls it.

explain's gradient flow through a cell of any class takes the total ∂L/∂ of each state per
step from one tape over this run (:func:`state_flow`); check's cell-steps witness
(:mod:`~gradscope.keras.check.cell_steps`) checks each step of the user's own cell on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope.errors import first_line
from gradscope.keras.engine import CapturedCall, state_names


def not_run(exc: BaseException) -> str:
    """Why a cell was left out: the user's cell, run step by step, raised ``exc``."""
    return f"the cell could not be run step by step: {first_line(exc)}"


def cell_run(engine: Any, layer: Any, call: CapturedCall, training: bool
             ) -> tuple[Callable[[Any, list[Any]], tuple[Any, list[Any]]], Any, list[Any]]:
    """One step of the layer's cell as Keras' RNN calls it (``step(x_t, states)`` → output and
    the new states, flat), the call's input time-major in processing order, and its initial
    states."""
    tf, keras = engine.tf, engine.keras
    cell = layer.cell
    kwargs = {"training": training} if getattr(cell, "_call_has_training_arg", False) else {}

    def step(x_t: Any, states: list[Any]) -> tuple[Any, list[Any]]:
        out, new = cell(x_t, list(states), **kwargs)
        return out, list(keras.tree.flatten(new))

    x = tf.convert_to_tensor(call.args[0])
    if getattr(layer, "go_backwards", False):
        x = tf.reverse(x, [1])
    return (step, tf.transpose(x, [1, 0, *range(2, len(x.shape))]),
            [tf.convert_to_tensor(s) for s in call.states])


def state_flow(engine: Any, call: CapturedCall, upstream: list[Any],
               training: bool) -> list[tuple[str, np.ndarray]]:
    """For an RNN over any cell: per initial state, the total ∂L/∂(that state after step t),
    (B, T, u) in processing order, from one tape over the cell run by ``tf.scan``: a zero
    probe is added to every state each step leaves, and to the step's output where the cell
    returns that very state as its output (the gradient from above arrives there too).
    ``upstream``: the tape's ∂L/∂ of each of the call's outputs."""
    tf = engine.tf
    layer = engine.operation(call.layer)
    step, x_tm, initial = cell_run(engine, layer, call, training)
    steps = int(x_tm.shape[0])
    first, _ = step(x_tm[0], initial)

    def body(carry: tuple[list[Any], Any], inputs: tuple[Any, list[Any]]
             ) -> tuple[list[Any], Any]:
        x_t, probes = inputs
        out, new = step(x_t, carry[0])
        shifted = [n + e for n, e in zip(new, probes, strict=True)]
        same = [k for k, n in enumerate(new) if n is out]
        return shifted, (shifted[same[0]] if same else out)

    @tf.function(autograph=False)
    def totals(x_tm: Any, initial: list[Any], upstream: list[Any]) -> list[Any]:
        probes = [tf.zeros([steps, *s.shape], s.dtype) for s in initial]
        with tf.GradientTape() as tape:
            tape.watch(probes)
            states, outs = tf.scan(body, (x_tm, probes),
                                   initializer=(initial, tf.zeros_like(first)))
            objective = _against(tf, layer, upstream, states, outs)
        return tape.gradient(objective, probes)

    found = totals(x_tm, initial, [None if g is None else tf.convert_to_tensor(g)
                                   for g in upstream])
    names = state_names(layer)
    return [(name, np.swapaxes(np.asarray(g), 0, 1))
            for name, g in zip(names, found, strict=True)]


def _against(tf: Any, layer: Any, upstream: list[Any], states: list[Any], outs: Any) -> Any:
    """Σ ⟨∂L/∂output, output⟩ over the call's outputs, rebuilt from the scan (time-major):
    the sequence or its last step, then the final states with ``return_state``."""
    returned = ([tf.transpose(outs, [1, 0, *range(2, len(outs.shape))])]
                if layer.return_sequences else [outs[-1]])
    if layer.return_state:
        returned += [s[-1] for s in states]
    return sum(tf.reduce_sum(tf.cast(g, r.dtype) * r)
               for g, r in zip(upstream, returned, strict=True) if g is not None)
