"""The failing batch run again, a piece at a time, for the search for a non-finite number's
birth (:mod:`~gradscope.keras.nonfinite`, forward and loss;
:mod:`~gradscope.keras.nonfinite.backward`): one layer call, or Keras' own call of the model and
its loss, eagerly, with the ops looked at; and where in a tensor the first non-finite number
sits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.keras.engine import CapturedCall
from gradscope.keras.nonfinite.births import Birth, first_birth


def positions(value: np.ndarray) -> tuple[int | None, list[int]]:
    """The first time step (axis 1 of a tensor of rank 3 or more) holding a non-finite
    number, and the examples holding one there (any position, for rank 2)."""
    bad: np.ndarray = np.asarray(~np.isfinite(np.asarray(value, np.float64)))
    if bad.ndim < 2:
        return None, [int(e) for e in np.flatnonzero(bad)] if bad.ndim else []
    if bad.ndim == 2:
        return None, [int(e) for e in np.flatnonzero(bad.any(axis=1))]
    per_step: np.ndarray = np.asarray(bad.reshape(bad.shape[0], bad.shape[1], -1).any(axis=2))
    step = int(np.flatnonzero(per_step.any(axis=0))[0])
    return step, [int(e) for e in np.flatnonzero(per_step[:, step])]


def layer_call(engine: Any, layer: Any, call: CapturedCall, args: list[Any] | None = None,
               states: list[Any] | None = None) -> Any:
    """The layer called again, eagerly, on what the captured call received."""
    args = [a for a in call.args if engine.tf.is_tensor(a)] if args is None else args
    kwargs: dict[str, Any] = {}
    if getattr(layer, "_call_has_training_arg", False):
        kwargs["training"] = engine.training
    if call.mask is not None and getattr(layer, "_call_has_mask_arg", False):
        kwargs["mask"] = call.mask
    states = call.states if states is None else states
    if states:
        kwargs["initial_state"] = list(states)
    return layer(args[0] if len(args) == 1 else list(args), **kwargs)


def loss_rerun(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
               sample_weight: Any, watch: Any = None) -> tuple[list[Any], Any, Birth | None]:
    """Keras' own call of the model, eagerly, then its loss with the loss's ops looked at:
    the outputs, the loss (or, with ``watch(tape, outputs, loss)``, what it takes from a
    tape around the loss: the loss's backward is then looked at too) and the first op that
    made a non-finite value. The model's moved state is put back."""
    from gradscope.keras.whole_model import as_a_run_starts, losses_kept, model_outputs

    feed, y = engine.tensors(inputs, targets)
    weights = engine.weight_tensors(sample_weight)
    tf = engine.tf
    with as_a_run_starts(engine.model, engine.training, engine.seed), \
            losses_kept(engine.model):
        outputs = model_outputs(engine.model, feed, engine.training)

        def run() -> Any:
            if watch is None:
                return engine.compute_loss(feed, y, outputs, weights)
            with tf.GradientTape() as tape:
                tape.watch(outputs)
                loss = engine.compute_loss(feed, y, outputs, weights)
            return watch(tape, outputs, loss)

        found, birth = first_birth(run)
    return outputs, found, birth
