"""A copy of the model that ``GradientFlow(diagnose_every=N)`` diagnoses during ``fit``.

A diagnosis steps each recurrent layer's cell, which reads its weights as they are when it
runs. On a copy (Keras' ``clone_model``: the same layers from their configs, so the same
names but its input layers', and the same computation) given the weights the step left, it
gives the same numbers: the tests hold them to ``gradscope.diagnose`` on the model itself.
The copy is made at the first diagnosis (:func:`copy_of`, on the training thread), and
witnessed on the callback's worker on that diagnosis's batch (:meth:`DiagnosisTwin.witness`:
the model's own call, from copies of its variables, under Keras' StatelessScope), while
training goes on;
no reading of a copy not witnessed is recorded. It keeps its own engine and its own traced
functions, traced (and compiled) by the first diagnosis's read, beside training too. Each
later one is given the weights the step left in one traced function (:meth:`take_weights`,
training waiting about 0.4 ms) and read beside training: the whole diagnosis is one function
compiled by XLA (:mod:`~gradscope.keras.diagnose.one_function`), and the diagnosed step
costs fit about 1 ms more than another, where waiting for it cost about 5 ms (at
diagnose_every=4, on bench/callback_overhead.py's model). Read so as graphs of many small
ops, an earlier diagnosis of 10 ms made every step beside it about 5 ms longer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.diagnosis_record import CallReading


class DiagnosisTwin:
    """The copy, its engine and its traced functions."""

    def __init__(self, model: Any, engine: Any, source: Any) -> None:
        self.model = model
        self.engine = engine
        self.source = source  # the model copied, whose variables ``hold`` and ``witness`` take
        self.cache: dict[Any, Any] = {}
        #: Whether a read has ended: its functions are traced (and compiled) then.
        self.ready = False
        #: Whether its outputs have been held to the model's own (:meth:`witness`); no
        #: reading of a copy not witnessed is recorded.
        self.witnessed = False
        self._copy: Any = None  # take_weights' traced function

    def hold(self, variables: list[Any], values: list[Any]) -> None:
        """The copy's weights set to ``values`` (of ``variables``, the source's
        :func:`~gradscope.keras.whole_model.all_variables` as
        :func:`~gradscope.keras.whole_model.snapshot` copied them)."""
        self.model.set_weights(weights_of(self.source, variables, values))

    def witness(self, inputs: dict[str, np.ndarray], variables: list[Any],
                values: list[Any]) -> bool:
        """Hold ``values`` (see :meth:`hold`), and whether the copy's outputs on ``inputs`` (a
        batch) are the source model's own from them (else: state the copy did not get,
        another computation). The model's own call reads ``values`` under Keras'
        StatelessScope, which neither reads nor moves its variables: GradientFlow witnesses
        the copy on its worker while training goes on (on the GRU 64 → GRU 32 of
        bench/callback_overhead.py, about 0.4 s of CPU, the first in its process: both calls
        traced in one function; called eagerly where they cannot be traced)."""
        import keras
        from keras.src.backend.common.stateless_scope import StatelessScope

        from gradscope.gradcheck import tolerance
        from gradscope.keras.whole_model import model_outputs

        model = self.source
        self.hold(variables, values)
        feed = [keras.ops.convert_to_tensor(v) for v in inputs.values()]
        rtol, atol = tolerance("replay", str(model.dtype_policy.compute_dtype))

        def both(values: list[Any], feed: list[Any]) -> tuple[list[Any], list[Any]]:
            # Even in inference mode a call moves what training reads next (a recurrent
            # cell draws its dropout masks from its seed generator): in the scope, nothing.
            with StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
                own = model_outputs(model, feed, False)
            return own, model_outputs(self.model, feed, False)

        try:
            try:
                # Both calls traced in one function: 0.43 s of CPU where called eagerly they
                # took 0.65 s (bench/callback_overhead.py's model, the first in its process).
                own, copied = self.engine.tf.function(both, autograph=False)(list(values),
                                                                             feed)
            except Exception:  # noqa: BLE001  (a call that only runs eagerly: called so)
                own, copied = both(values, feed)
            self.witnessed = all(
                np.allclose(np.asarray(theirs), np.asarray(ours), rtol=rtol, atol=atol)
                for ours, theirs in zip(own, copied, strict=True))
        except Exception:  # noqa: BLE001  (a copy that cannot be called so is no copy)
            self.witnessed = False
        return self.witnessed

    def take_weights(self, model: Any) -> None:
        """The model's weights as they are now, assigned to the copy's variables in one traced
        function (no NumPy copy between them); under a distribution strategy, through NumPy."""
        if model.distribute_strategy.num_replicas_in_sync > 1:
            self.model.set_weights(model.get_weights())
            return
        if self._copy is None:
            tf = self.engine.tf
            pairs = list(zip(self.model.weights, model.weights, strict=True))

            @tf.function(autograph=False)
            def copy() -> None:
                for mine, theirs in pairs:
                    mine.assign(theirs.value)

            self._copy = copy
        self._copy()

    def read(self, weights: list[np.ndarray] | None, inputs: dict[str, np.ndarray],
             targets: dict[str, np.ndarray], sample_weight: Any, exponents: int,
             measure_horizon: bool, compiled: bool = False
             ) -> tuple[list[CallReading], list[tuple[str, str]]]:
        """Every recurrent call read on this batch, the copy holding ``weights`` (the
        model's ``get_weights()`` when the step ended; None: those it holds); ``compiled``:
        see :func:`~gradscope.keras.diagnose.during_training.read_calls`."""
        from gradscope.keras.diagnose.during_training import read_calls

        if weights is not None:
            self.model.set_weights(weights)
        # The copy's outputs in the model's order, whatever the copy's inputs are named.
        targets = dict(zip(self.engine.output_names, targets.values(), strict=True))
        # Each read is given the model's weights (take_weights, hold): nothing reads the
        # copy's own state, which its calls move (its cells' seed generators).
        found = read_calls(self.engine, inputs, targets, sample_weight, exponents,
                           measure_horizon, self.cache, compiled, put_state_back=False)
        self.ready = True
        return found


def weights_of(model: Any, variables: list[Any], values: list[Any]) -> list[np.ndarray]:
    """``model.get_weights()`` as ``values`` (of ``variables``, which hold its weights) give
    them."""
    held = {id(v): value for v, value in zip(variables, values, strict=True)}
    return [np.asarray(held[id(w)]) for w in model.weights]


def copy_of(model: Any, loss: str | None) -> DiagnosisTwin | None:
    """The copy of ``model``, compiled with its loss (or ``loss``), and its engine, not yet
    witnessed (:meth:`DiagnosisTwin.witness`). None where Keras cannot copy it so (a
    subclassed model without ``get_config``, a layer Keras cannot rebuild), where the copy's
    weights differ in shape, or where a layer is stateful (its carried state is no weight,
    which ``set_weights`` would not give the copy): the diagnoses then run on the model
    itself, between two steps."""
    import keras

    from gradscope.keras.live_engine import make_engine
    from gradscope.keras.whole_model import stateful_layers

    if stateful_layers(model):
        return None
    try:
        twin = keras.models.clone_model(model)
        shapes = [tuple(w.shape) for w in model.weights]
        if [tuple(w.shape) for w in twin.weights] != shapes or _names(twin) != _names(model):
            return None
        if loss is None:
            twin.compile(loss=model.loss)
        return DiagnosisTwin(twin, make_engine(twin, loss), model)
    except Exception:  # noqa: BLE001  (many ways not to copy; the model itself still serves)
        return None


def make_twin(model: Any, loss: str | None, inputs: dict[str, np.ndarray]
              ) -> DiagnosisTwin | None:
    """The copy of ``model`` (:func:`copy_of`), witnessed on ``inputs`` with the model's
    variables as they are now; None where there is none or its witness fails."""
    from gradscope.keras.whole_model import all_variables, snapshot

    twin = copy_of(model, loss)
    if twin is None:
        return None
    variables = all_variables(model)
    return twin if twin.witness(inputs, variables, snapshot(variables)) else None


def _names(model: Any) -> list[str]:
    """The names of ``model``'s layers the readings are labelled by. Not its input layers':
    Keras' copy of a functional model renames them (``input_layer`` to ``keras_tensor``), and
    the batch is given to the copy by position."""
    from gradscope.keras.engine import class_label

    return [layer.name for layer in model.layers if class_label(layer) != "InputLayer"]


__all__ = ["DiagnosisTwin", "copy_of", "make_twin", "weights_of"]
