"""Keras' own call of the model, looked on as ``engine.run`` runs it, in one ``tf.function``
traced once and kept: every layer call's tensors, and on request ∂L/∂(one call's outputs),
the backward pass then running only as far back as those outputs (no weight's gradient).

What a diagnosis during ``fit`` and each counterfactual's rerun need: ``engine.run`` traces its
pass anew every time, which costs more than the pass on a short batch and about a third of it
on the LSTM 256 × 2 at 1000 steps; its weight gradients are a backward pass through every
layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def captured_pass(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                  sample_weight: Any = None, cache: dict[Any, Any] | None = None,
                  upstream: str | None = None, compiled: bool = False,
                  put_state_back: bool = True) -> tuple[list[Any], dict[str, list[Any]]]:
    """Every layer call of one pass, with the tensors it received and returned; and with
    ``upstream`` (a call's label), that call's ∂L/∂(outputs) (the loss Keras computes, with
    the sample weights), as ``engine.run(..., watch_outputs=True)`` gives it: the backward
    pass runs back to that call only (to another call's outputs it would go through every
    recurrent layer between them, a while loop whose gradient TensorFlow computes whole).

    With ``cache`` (kept by the caller across passes on one engine): the traced function is
    made once and kept there. Where Keras' own call cannot be looked on or traced so (or
    without ``cache``, or in training mode, whose random draws ``engine.run`` seeds at every
    pass), ``engine.run`` itself, whose replay is witnessed by Keras' own call.
    ``put_state_back``: see ``read_calls``."""
    from gradscope.keras.engine import _eager_call, call_label
    from gradscope.keras.whole_model import losses_kept, moved_state, restore, runs_eagerly

    # A trace per call asked about.
    key = ("captured pass", upstream, sample_weight is None, compiled)
    kept = None if cache is None else cache.get(key)
    if cache is None or kept is False or engine.training or runs_eagerly(engine.user_model):
        return _run(engine, inputs, targets, sample_weight)
    tf = engine.tf
    feed, ys = engine.tensors(inputs, targets)
    weights = engine.weight_tensors(sample_weight)
    if kept is None:
        traced: dict[str, Any] = {}

        def forward(feed: list[Any], ys: list[Any], weights: Any) -> Any:
            if upstream is not None:
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    loss, _, calls = engine.forward(feed, ys, tape.watch, watch_outputs=True,
                                                    sample_weight=weights, own=True,
                                                    watch_only=upstream)
                gradients = tape.gradient(loss, [call.outputs for call in calls
                                                 if call_label(call.layer, call.index)
                                                 == upstream])
            else:
                _, _, calls = engine.forward(feed, ys, lambda tensor: None, own=True)
                gradients = []
            traced["calls"] = calls
            return [([a for a in c.args if tf.is_tensor(a)], c.outputs, c.states, c.mask)
                    for c in calls], gradients

        from gradscope._tf import xla_or_graph

        kept = ((xla_or_graph(tf, forward, autograph=False, reduce_retracing=True) if compiled
                 else tf.function(forward, autograph=False, reduce_retracing=True)), traced)
    forward, traced = kept
    from gradscope._tf import native_stderr_silenced, without_grappler

    # What the call moves (a stateful layer's state, a cell's seed generator) is put back.
    before = moved_state(engine.model) if put_state_back else []
    try:
        with native_stderr_silenced(), without_grappler(), losses_kept(engine.model):
            captured, gradients = forward(feed, ys, weights)
    except Exception:  # noqa: BLE001  (not looked on, or not traceable: engine.run says why)
        restore(before)
        cache[key] = False
        return _run(engine, inputs, targets, sample_weight)
    restore(before)
    cache[key] = kept
    calls = [_eager_call(call, *tensors)
             for call, tensors in zip(traced["calls"], captured, strict=True)]
    found = {upstream: [None if g is None else g.numpy() for g in gradients[0]]
             } if upstream is not None and gradients else {}
    return calls, found


def _run(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
         sample_weight: Any) -> tuple[list[Any], dict[str, list[Any]]]:
    result = engine.run(inputs, targets, watch_outputs=True, sample_weight=sample_weight)
    return result.calls, result.output_gradients
