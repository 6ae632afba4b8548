"""A Keras GRU, LSTM or SimpleRNN call read in one loop, as a fit's diagnoses read it: the
step linearised by hand (:func:`~gradscope.keras.stepped.linearised`) steps the state and
carries the Lyapunov columns at once, in one function compiled by XLA; the gates are then
counted on the pairs it stepped through (in a graph: in the loop's function they doubled
XLA's compilation).

The general path (:func:`~gradscope.keras.diagnose.during_training.read_calls`) steps the call
through the layer's own cell, then scans the Lyapunov columns along that trajectory, then
counts the gates: three functions, each dispatched from Python, two loops over the steps. On
the GRU 64 → GRU 32 of bench/callback_overhead.py, 8 examples, a diagnosis took about 10 ms
that way. Here the trajectory is gradscope's algebra of the cell, so it is held to Keras'
own: the call's output (its sequence, or its last step) must equal what Keras' call returned
to :func:`~gradscope.keras.diagnose.captured.captured_pass`, to the rounding a pair of steps
is held to (``tolerance("cross_check")``), or the general path reads the call. Its exponents
are then the general path's to the compute dtype's rounding, as XLA's own order of sums
leaves them anyway.

Only where that path would take the same steps: inference mode (no dropout masks), no mask,
the initial states captured, one direction (a Bidirectional's two go the general way).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.keras.engine import class_label

#: The layers read so: gradscope's cells model them (:func:`~gradscope.keras.stepped.linearised`).
KINDS = ("GRU", "LSTM", "SimpleRNN")


def read_in_one_loop(engine: Any, call: Any, exponents: int) -> tuple[
        str, np.ndarray, np.ndarray, Any] | None:
    """The call's (label, log|R_t[i, i]| (B, T, k), where each step ran (B, T), gate
    reading or None) for ``exponents`` columns, or None where the general path reads it
    (not a layer of :data:`KINDS`, training mode, a mask, no captured initial state, a cell
    gradscope's algebra does not model, or a trajectory that is not Keras' own)."""
    from gradscope._tf import native_stderr_silenced, without_grappler
    from gradscope.gradcheck import tolerance
    from gradscope.keras.diagnose.gates import count_gates, known_gates
    from gradscope.keras.diagnose.trajectory import drawn_start
    from gradscope.keras.engine import call_label
    from gradscope.keras.stepped import engine_cached, linearised

    layer = engine.operation(call.layer)
    if (class_label(layer) not in KINDS or engine.training or call.mask is not None
            or not call.states or getattr(layer, "stateful", False)):
        return None
    dtype = str(np.dtype(layer.cell.compute_dtype))
    by_hand = engine_cached(engine, ("by hand", id(layer), dtype),
                            lambda: linearised(engine, layer, dtype) or False)
    if not by_hand:
        return None
    widths = [int(np.shape(s)[-1]) for s in call.states]
    size = sum(widths)
    count = min(exponents, size)
    start = np.eye(size, count) if count >= size else drawn_start(size, count)
    loop = engine_cached(engine, ("one loop", id(layer), dtype, count),
                         lambda: _loop(engine, layer, by_hand, widths, count))
    tf = engine.tf
    x = np.asarray(call.args[0])
    if getattr(layer, "go_backwards", False):
        x = x[:, ::-1]
    try:
        with native_stderr_silenced(), without_grappler():
            logs, sequence = loop(tf.convert_to_tensor(x),
                                  [tf.convert_to_tensor(s) for s in call.states],
                                  tf.convert_to_tensor(start))
    except Exception:  # noqa: BLE001  (anything XLA or the algebra refuses: the general path)
        return None
    sequence = np.asarray(sequence)
    outputs = sequence if getattr(layer, "return_sequences", False) else sequence[:, -1]
    truth = np.asarray(call.outputs[0])
    rtol, atol = tolerance("cross_check", dtype)
    if outputs.shape != truth.shape or not np.allclose(outputs, truth, rtol=rtol, atol=atol):
        return None
    reading = None
    if known_gates(layer) is None:  # on every pair (x_t, h_(t−1)) the loop stepped through
        before = np.concatenate([np.asarray(call.states[0], sequence.dtype)[:, None],
                                 sequence[:, :-1]], axis=1)
        reading = count_gates(engine, layer.cell, x.reshape(-1, x.shape[-1]),
                              before.reshape(-1, before.shape[-1]))
    return (call_label(call.layer, call.index), np.asarray(logs, np.float64),
            np.ones(x.shape[:2], bool), reading)


def _loop(engine: Any, layer: Any, by_hand: Any, widths: list[int], count: int) -> Any:
    """:func:`stepped_loop`, under XLA where it compiles (:func:`~gradscope._tf.xla_or_graph`).
    The gates are counted apart, in a graph
    (:func:`~gradscope.keras.diagnose.gates.count_gates`): in the loop's function they made
    XLA's compilation about twice as long (0.57 s instead of 0.29 s for the first GRU of
    bench/callback_overhead.py's model), for about 0.8 ms a call."""
    from gradscope._tf import xla_or_graph

    return xla_or_graph(engine.tf, stepped_loop(engine, layer, by_hand, widths, count),
                        autograph=False, reduce_retracing=True)


def stepped_loop(engine: Any, layer: Any, by_hand: Any, widths: list[int], count: int) -> Any:
    """``loop(x, initial, start)`` → (the logs (B, T, count), the first state's sequence
    (B, T, w)): the state stepped and the Lyapunov columns carried at once, in one
    ``tf.while_loop`` (to be traced: the caller's function compiles it)."""
    from gradscope.keras.diagnose.trajectory import carried_step

    tf = engine.tf
    dtype = layer.cell.compute_dtype

    def loop(x: Any, initial: list[Any], start: Any) -> Any:
        batch, steps = tf.shape(x)[0], tf.shape(x)[1]
        weights = by_hand.weights()  # once, not per step
        x = tf.cast(x, dtype)

        def body(t: Any, states: list[Any], q: Any, logs: Any, sequence: Any
                 ) -> tuple[Any, ...]:
            after, q, stretch = carried_step(
                tf, lambda blocks: by_hand(weights, states, (x[:, t],), blocks), q, widths)
            return t + 1, after, q, logs.write(t, stretch), sequence.write(t, after[0])

        first = [tf.cast(s, dtype) for s in initial]
        _, _, _, logs, sequence = tf.while_loop(
            lambda t, *_: t < steps, body,
            (tf.constant(0), first, tf.tile(tf.cast(start, dtype)[None], [batch, 1, 1]),
             tf.TensorArray(tf.float64, size=steps, element_shape=[None, count]),
             tf.TensorArray(dtype, size=steps, element_shape=[None, widths[0]])))
        return (tf.transpose(logs.stack(), [1, 0, 2]),
                tf.transpose(sequence.stack(), [1, 0, 2]))

    return loop


__all__ = ["KINDS", "read_in_one_loop", "stepped_loop"]
