"""A fit's diagnosis in one function: Keras' own call of the model and, for every recurrent
call, the one loop (:mod:`~gradscope.keras.diagnose.one_loop`) and its gate counts, traced
together and compiled by XLA, so that a diagnosis is one call from Python.

Read the other way (:func:`~gradscope.keras.diagnose.during_training.read_calls`: the captured
pass, then each call's loop, then its gates), a diagnosis is five functions dispatched from
Python, their tensors taken to NumPy and given back between them: on the GRU 64 → GRU 32 of
bench/callback_overhead.py, 8 examples, about 5 ms, most of it the dispatches. Here the same
computation is one function, and the same checks are made on what it returns: each loop's
output is held to Keras' own output of that call (``tolerance("cross_check")``), and a
diagnosis where one is not is read the other way (and so is every later one).

Only where every recurrent call of the model would be read in one loop: a Keras GRU, LSTM
or SimpleRNN call in inference mode, without a mask, its initial states captured, one
direction, its cell one gradscope's algebra models. Anywhere else (found while the function
is traced, before XLA compiles it) the other way reads the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class _NotInOne(Exception):
    """Raised while tracing: a call of the model is not read in one loop."""


def read_in_one_function(engine: Any, inputs: dict[str, np.ndarray],
                         targets: dict[str, np.ndarray], sample_weight: Any, exponents: int,
                         cache: dict[Any, Any], put_state_back: bool = True,
                         ) -> list[tuple[str, Any, np.ndarray, np.ndarray, Any]] | None:
    """Every recurrent call's (label, layer, log|R_t[i, i]| (B, T, k), where each step ran
    (B, T), gate reading or None), as ``read_calls(compiled=True)`` reads them, or None where
    the model is read the other way (see the module's docstring). ``cache``: as
    ``read_calls`` keeps it; the function is traced and compiled once. ``put_state_back``:
    see ``read_calls``."""
    from gradscope._tf import native_stderr_silenced, without_grappler
    from gradscope.gradcheck import tolerance
    from gradscope.keras.diagnose.gates import gate_reading
    from gradscope.keras.whole_model import losses_kept, moved_state, restore, runs_eagerly

    key = ("one function", sample_weight is None, exponents)
    kept = cache.get(key)
    if kept is False or engine.training or runs_eagerly(engine.user_model):
        return None
    if kept is None:
        kept = _function(engine, exponents)
    function, traced = kept
    feed, ys = engine.tensors(inputs, targets)
    weights = engine.weight_tensors(sample_weight)
    # What the call moves (a stateful layer's state, a cell's seed generator) is put back.
    before = moved_state(engine.model) if put_state_back else []
    try:
        with native_stderr_silenced(), without_grappler(), losses_kept(engine.model):
            found = function(feed, ys, weights)
    except Exception:  # noqa: BLE001  (not every call in one loop, or not compiled by XLA)
        restore(before)
        cache[key] = False
        return None
    restore(before)
    cache[key] = kept
    readings = []
    for (label, layer), (logs, outputs, truth, counts) in zip(traced["calls"], found,
                                                                   strict=True):
        outputs, truth = np.asarray(outputs), np.asarray(truth)
        if not np.all(np.isfinite(truth)):
            return None  # this batch read the other way, which says why; later ones so again
        rtol, atol = tolerance("cross_check", str(np.dtype(layer.cell.compute_dtype)))
        if outputs.shape != truth.shape or not np.allclose(outputs, truth, rtol=rtol,
                                                             atol=atol):
            cache[key] = False  # not Keras' own trajectory: read the other way from now on
            return None
        logs = np.asarray(logs, np.float64)
        pairs = logs.shape[0] * logs.shape[1]
        gates = None if counts is None else gate_reading(layer.cell, counts, pairs)
        readings.append((label, layer, logs, np.ones(logs.shape[:2], bool), gates))
    return readings


def _function(engine: Any, exponents: int) -> tuple[Any, dict[str, Any]]:
    """The function ``(feed, ys, weights)`` → per recurrent call (its logs (B, T, k), the
    loop's output, Keras' output, the gate counts or None), and what its trace found (each
    call's label and layer); compiled by XLA at its first call."""
    from gradscope.keras.diagnose import is_recurrent
    from gradscope.keras.diagnose.gates import gate_counts, known_gates
    from gradscope.keras.diagnose.one_loop import KINDS, stepped_loop
    from gradscope.keras.diagnose.trajectory import drawn_start
    from gradscope.keras.engine import call_label, class_label
    from gradscope.keras.stepped import engine_cached, linearised

    tf = engine.tf
    traced: dict[str, Any] = {}

    def whole(feed: list[Any], ys: list[Any], weights: Any) -> list[Any]:
        _, _, calls = engine.forward(feed, ys, lambda tensor: None, sample_weight=weights,
                                     own=True)
        found, labels = [], []
        for call in calls:
            if not is_recurrent(engine, call):
                continue
            layer = engine.operation(call.layer)
            if (class_label(layer) not in KINDS or call.mask is not None or not call.states
                    or getattr(layer, "stateful", False)):
                raise _NotInOne(call_label(call.layer, call.index))
            dtype = str(np.dtype(layer.cell.compute_dtype))
            by_hand = engine_cached(engine, ("by hand", id(layer), dtype),
                                    lambda layer=layer, dtype=dtype:
                                    linearised(engine, layer, dtype) or False)
            if not by_hand:
                raise _NotInOne(call_label(call.layer, call.index))
            widths = [int(s.shape[-1]) for s in call.states]
            size = sum(widths)
            count = min(exponents, size)
            start = np.eye(size, count) if count >= size else drawn_start(size, count)
            x = call.args[0]
            if getattr(layer, "go_backwards", False):
                x = tf.reverse(x, [1])
            loop = stepped_loop(engine, layer, by_hand, widths, count)
            logs, sequence = loop(x, list(call.states), tf.constant(start))
            outputs = sequence if getattr(layer, "return_sequences", False) else sequence[:, -1]
            found.append((logs, outputs, call.outputs[0], x, call.states[0], sequence))
            labels.append((call_label(call.layer, call.index), layer))
        if not found:
            raise _NotInOne("no recurrent call")
        traced["calls"] = labels
        return found

    compiled = tf.function(whole, jit_compile=True, autograph=False, reduce_retracing=True)

    def counted(feed: list[Any], ys: list[Any], weights: Any) -> list[Any]:
        # The gates are counted in the graph, out of XLA's function, on every pair
        # (x_t, h_(t−1)) the loop stepped through: as count_gates counts them (the same ops;
        # in XLA's function they made its compilation about twice as long).
        found = []
        for index, part in enumerate(compiled(feed, ys, weights)):
            logs, outputs, truth, x, first, sequence = part
            layer = traced["calls"][index][1]
            counts = None
            if known_gates(layer) is None:
                before = tf.concat([tf.cast(first, sequence.dtype)[:, None],
                                    sequence[:, :-1]], axis=1)
                counts = gate_counts(tf, layer.cell, tf.reshape(x, [-1, tf.shape(x)[-1]]),
                                     tf.reshape(before, [-1, tf.shape(before)[-1]]), None)
            found.append((logs, outputs, truth, counts))
        return found

    return tf.function(counted, autograph=False, reduce_retracing=True), traced


__all__ = ["read_in_one_function"]
