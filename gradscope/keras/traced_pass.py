"""GradientFlow's extra pass as one ``tf.function`` for a model's engine: traced (beside
training, or at the first observation that needs it) and run on an observed batch.

The pass is Keras' own call of the whole model, looked on (see
:mod:`~gradscope.keras.observed_call`), its recurrent loops probed, so that its one backward
gives every state's total ∂L/∂s_t too (:mod:`~gradscope.keras.state_probes`). Where a model
cannot be looked on, the pass is the engine's replay, witnessed once by Keras' own call of
the whole model."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope._tf import (
    grappler_if,
    import_tensorflow,
    native_stderr_silenced,
    without_grappler,
)
from gradscope.keras.engine import CapturedCall, KerasPass, call_label
from gradscope.keras.observed_call import NotObserved
from gradscope.keras.state_probes import (
    carried_back,
    carries_back,
    filled,
    probe_targets,
    state_totals,
    tape_for,
)
from gradscope.keras.whole_model import (
    all_variables,
    confirm,
    dense_gradients,
    moved_state,
    moved_variables,
    pass_of,
    restore,
    snapshot,
    whole_model_function,
)

tf = import_tensorflow(start=False)  # the runtime is the user's to configure


class TracedPass:
    """The pass of one engine. ``trace`` gets what tracing saw (the calls' names, the thread
    it ran on; GradientFlow adds when its warm-up began)."""

    def __init__(self, engine: Any, stateless: bool = False) -> None:
        self.engine = engine
        #: With ``stateless``, the variables whose values each run is given (one per
        #: variable, as :func:`~gradscope.keras.whole_model.snapshot` copies them): the pass
        #: reads those under Keras' StatelessScope, never the variables themselves.
        self.variables = all_variables(engine.model) if stateless else None
        #: Whether the traced pass reads no variable of the model itself (seen in what its
        #: trace captured): it may then run while training moves them (on GradientFlow's
        #: worker). False until traced, and wherever a read escaped the scope.
        self.beside = False
        self.trace: dict[str, Any] = {}
        self.function: Any = None
        self.concrete: Any = None
        self.witness_concrete: Any = None  # Keras' own call, traced with the pass
        self.witnessed = False  # Keras' own call has been handed an observation to confirm
        #: The pass is Keras' own call, looked on; False where it cannot be (a model whose
        #: calls the hooks cannot see): the replay, witnessed.
        self.own = True
        #: Run with Grappler: the pass takes a second gradient through a loop
        #: (:func:`~gradscope._tf.grappler_if`); every run of one function takes the same.
        self.optimised = carries_back(engine.model)

    def warm(self, inputs: list[Any], targets: list[Any]) -> None:
        """Trace the pass for ``inputs`` and ``targets`` (``tf.TensorSpec``s) and run it once
        on zeros (discarded), where TensorFlow builds the function; the witness too, until it
        has run.

        Traced for the shapes of fit's own spec: where Keras gives every batch one size (the
        samples divide into whole batches), the batch axis is static there and here, which
        traces in less time than a free one. A batch of another size (``observe`` in a loop,
        a later fit) is traced again for it, with the batch axis free."""
        with native_stderr_silenced():
            function, concrete = self._traced(list(inputs), list(targets))
            zeros = [tf.zeros((s.shape[0] or 1, *s.shape[1:]), s.dtype)
                     for s in [*inputs, *targets]]
            # Zeros are no batch of the user's: whatever they give is dropped, and an error
            # here says nothing of the observation, which runs on real ones. Not where a
            # call moves a state training reads (a recurrent cell's dropout seed, drawn even
            # in inference mode; a stateful layer's state): this runs beside training, which
            # could not be given its state back; the first observation builds it then.
            if not _moves_training_state(self.engine.model):
                with contextlib.suppress(tf.errors.OpError), grappler_if(self.optimised):
                    concrete(*self._values(None), zeros[:len(inputs)], zeros[len(inputs):],
                             None)
            self.function, self.concrete = function, concrete
            if not self.witnessed and not self.own:
                self.witness_concrete = _trace_witness(self.engine, inputs, targets, zeros)

    def _traced(self, inputs: list[Any], targets: list[Any]) -> tuple[Any, Any]:
        """The pass's function and its concrete function for these specs: Keras' own call
        where it can be looked on, else (from then on) the replay."""
        if self.own:
            try:
                return self._traced_as(True, inputs, targets)
            except NotObserved:
                self.own = False
        return self._traced_as(False, inputs, targets)

    def _traced_as(self, own: bool, inputs: list[Any], targets: list[Any]) -> tuple[Any, Any]:
        """:meth:`_traced` for ``own``. A stateless trace that captured a TensorFlow resource
        (:func:`_reads_none`: a layer read its variable past Keras' StatelessScope, so that
        its gradient is not the given value's) is dropped, and the pass reads the variables
        from then on."""
        variables = self.variables
        head = [] if variables is None else [[tf.TensorSpec(v.shape, v.dtype)
                                              for v in variables]]
        function = _trace(self.engine, self.trace, own, variables)
        concrete = function.get_concrete_function(*head, inputs, targets)
        self.beside = variables is not None and _reads_none(concrete)
        if variables is not None and not self.beside:
            self.variables = None
            return self._traced_as(own, inputs, targets)
        return function, concrete

    def forget(self) -> None:
        """Drop a trace made beside training that failed: the pass is traced again where it is
        needed, and raises its error there."""
        self.function = self.concrete = None
        self.beside = False

    def takes(self, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
              sample_weight: Any = None) -> bool:
        """Whether the traced pass runs on this batch as it is traced (no trace again: another
        batch size, or sample weights, would trace the model's layers once more)."""
        if self.concrete is None or sample_weight is not None:
            return False
        signature = self.concrete.structured_input_signature[0]
        first = 0 if self.variables is None else 1  # after the weights' values
        specs = [*signature[first], *signature[first + 1]]
        given = [*inputs.values(), *targets.values()]
        return len(specs) == len(given) and all(
            spec.shape.is_compatible_with(np.shape(value))
            for spec, value in zip(specs, given, strict=True))

    def _values(self, values: list[Any] | None) -> list[Any]:
        """The head of a stateless pass's arguments: ``values``, or the variables' own now
        (nothing for a pass that reads the variables)."""
        if self.variables is None:
            return []
        return [snapshot(self.variables) if values is None else values]

    def run(self, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
            sample_weight: Any = None, values: list[Any] | None = None) -> KerasPass:
        """One traced forward and backward pass; the same KerasPass engine.run gives.
        ``values``: a stateless pass's weights (one per ``variables``; None: theirs now)."""
        engine = self.engine
        feed = [tf.convert_to_tensor(v) for v in inputs.values()]
        ys = [tf.convert_to_tensor(v) for v in targets.values()]
        # TensorFlow's native log lines at a first op
        with native_stderr_silenced(), grappler_if(self.optimised):
            if self.function is None:
                # Traced once with the batch axis free: the last, smaller batch of an epoch
                # does not trace again.
                self.function, self.concrete = self._traced(
                    [_free_batch(t) for t in feed], [_free_batch(t) for t in ys])
            # After tracing, which may drop the stateless form. The pass calls the layers: a
            # stateful one would carry this batch's state into the next training step. What
            # the pass moves is put back (a stateless pass moves none, and may run where
            # training moves them).
            head = self._values(values)
            before = moved_state(engine.model) if self.variables is None else []
            try:
                if sample_weight is not None:  # weighed batches: traced for their weights
                    loss, grads, captured = self.function(*head, feed, ys, sample_weight)
                else:
                    try:
                        loss, grads, captured = self.concrete(*head, feed, ys, None)
                    except (TypeError, ValueError):  # another batch size or time: trace for it
                        loss, grads, captured = self.function(*head, feed, ys)
            except NotObserved:  # traced again for this batch, and not looked on: the replay
                self.own = False
                self.forget()
                return self.run(inputs, targets, sample_weight, values)
        restore(before)
        calls, totals = [], {}
        for meta, loops, tensors in zip(self.trace["calls"], self.trace["loops"], captured,
                                        strict=True):
            states, state_grads, probe_grads, mask, back = tensors
            call = CapturedCall(layer=meta[0], index=meta[1], class_name=meta[2], args=[],
                                outputs=[], states=[s.numpy() for s in states],
                                state_source=meta[3],
                                mask=np.asarray(mask[0]) if mask else None)
            calls.append((call, state_grads))
            if probe_grads:
                totals[call_label(call.layer, call.index)] = state_totals(loops, probe_grads, back)
        gradients, _ = dense_gradients(engine.model.trainable_variables, grads)
        return KerasPass(
            loss=float(loss.numpy()), gradients=gradients, sparse_rows={},
            state_gradients={call_label(c.layer, c.index): [_numpy(g) for g in sg]
                             for c, sg in calls if c.states},
            calls=[c for c, _ in calls], output_shapes={}, state_totals=totals)

    def witness(self, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                result: KerasPass, sample_weight: Any = None,
                values: list[Any] | None = None) -> Callable[[], None] | None:
        """Where the pass is the replay, at its first observation (None afterwards, as the
        traced pass is the same function then), Keras' own call of the whole model on the same
        batch and weights must give the pass's loss and gradients: the witness outside the
        engine. (None where the pass is Keras' own call.) The weights are copied now (or
        ``values`` are taken, those a stateless pass ran on); the returned job runs the call
        later, on the worker beside training, under Keras' StatelessScope from the copies,
        before the observation is recorded (a trace takes less from training than an eager
        call)."""
        if self.witnessed or self.own:
            return None
        self.witnessed = True
        engine = self.engine
        feed, ys = engine.tensors(inputs, targets)
        variables = self.variables or all_variables(engine.model)
        if values is None or self.variables is None:
            values = snapshot(variables)
        label = f"GradientFlow on model '{engine.model.name}'"
        traced = self.witness_concrete if sample_weight is None else None

        def witness() -> None:
            with native_stderr_silenced(), without_grappler():
                own = None
                if traced is not None:
                    with contextlib.suppress(TypeError, ValueError):  # another batch shape
                        own = traced(values, feed, ys, None)
                if own is None:  # traced for this batch
                    own = whole_model_function(engine.model, engine.compute_loss,
                                               engine.training, variables)(
                        values, feed, ys, sample_weight)
                loss, grads = own
            confirm(result.loss, result.gradients, pass_of(engine.model, loss, grads),
                    engine.dtype_name, label)

        return witness


def _moves_training_state(model: Any) -> bool:
    """Whether a call of ``model``, even in inference mode, moves a state its training reads
    next: a stateful layer's carried state, or the seed generator of a recurrent cell with
    dropout (Keras' ``DropoutRNNCell`` draws its masks at every call, whatever the mode; a
    ``Dropout`` layer draws only in training)."""
    tracked = {id(v) for v in model.non_trainable_variables}
    if any(id(v) not in tracked for v in moved_variables(model)):  # a stateful layer's
        return True
    return any(getattr(layer, "seed_generator", None) is not None and (
        float(getattr(layer, "dropout", 0) or 0) > 0
        or float(getattr(layer, "recurrent_dropout", 0) or 0) > 0)
        for layer in model._flatten_layers(include_self=False, recursive=True))


def _trace(engine: Any, trace: dict[str, Any], own: bool,
           variables: list[Any] | None = None) -> Any:
    """One tf.function: the engine's forward (``own``: Keras' own call, looked on) under a
    tape, its recurrent loops probed, and the gradients of the loss with respect to every
    weight, every initial state and every probe. ``trace`` gets the calls' names and their
    probed loops at tracing. With ``variables``, the function takes their values first and
    reads those, under Keras' StatelessScope (which neither reads nor moves the variables),
    and the weights' gradients are with respect to them."""

    def body(feed: list[Any], targets: list[Any], sample_weight: Any, weights: list[Any]
             ) -> Any:
        with tape_for(tf, True) as tape:  # for carried_back
            if variables is not None:
                tape.watch(weights)
            loss, _, calls = engine.forward(feed, targets, tape.watch,
                                            sample_weight=sample_weight, own=own,
                                            probe_states=True)
        kept = [c for c in calls if c.states or c.probes]
        probed = [probe_targets(c.probes) for c in kept]
        grads, state_grads, probe_grads = tape.gradient(
            loss, [weights, [c.states for c in kept], probed])
        trace["calls"] = [(c.layer, c.index, c.class_name, c.state_source) for c in kept]
        trace["loops"] = [c.probes for c in kept]
        trace["thread"] = threading.current_thread().name
        # Each call's mask (where each example's steps ran: the flow's carried ratio
        # reads a padded batch by it), as explain's pass has it.
        masks = [[c.mask] if hasattr(c.mask, "dtype") else [] for c in kept]
        probe_grads = filled(tf, probed, probe_grads)
        back = [carried_back(tf, tape, c.probes, found) if found else []
                for c, found in zip(kept, probe_grads, strict=True)]
        return loss, grads, [(call.states, sg, pg, mask, cb) for call, sg, pg, mask, cb in zip(
            kept, state_grads, probe_grads, masks, back, strict=True)]

    if variables is None:
        @tf.function(autograph=False, reduce_retracing=True)
        def run(feed: list[Any], targets: list[Any], sample_weight: Any = None) -> Any:
            return body(feed, targets, sample_weight, engine.model.trainable_variables)

        return run

    from keras.src.backend.common.stateless_scope import StatelessScope

    positions = {id(v): k for k, v in enumerate(variables)}
    trainable = [positions[id(v)] for v in engine.model.trainable_variables]

    @tf.function(autograph=False, reduce_retracing=True)
    def stateless(values: list[Any], feed: list[Any], targets: list[Any],
                  sample_weight: Any = None) -> Any:
        # collect_losses: in a StatelessScope, Keras keeps what layers add (activity
        # regularizers, add_loss) in the scope, where model.losses reads it.
        with StatelessScope(state_mapping=list(zip(variables, values, strict=True)),
                            collect_losses=True):
            return body(feed, targets, sample_weight, [values[k] for k in trainable])

    return stateless


def _reads_none(concrete: Any) -> bool:
    """Whether the traced ``concrete`` function captured no TensorFlow resource: it reads every
    weight from the values it is given. A read that escaped Keras' StatelessScope (a layer
    that reads its TensorFlow variable itself, a variable made after the pass was set up)
    captures that variable's handle, and so would a random generator or a table: each of
    those is read (or moved) where training reads it, not beside it."""
    return not any(t.dtype == tf.resource for t in concrete.graph.external_captures)


def _trace_witness(engine: Any, inputs: list[Any], targets: list[Any],
                   zeros: list[Any]) -> Any:
    """The witness (Keras' own call of the whole model, see ``TracedPass.witness``), traced
    for fit's batches beside training while a core is free (every step keeps both busy later),
    and run once on zeros. None where it cannot be traced so: the observation then traces it
    for its batch."""
    try:
        variables = all_variables(engine.model)
        values = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
        concrete = whole_model_function(engine.model, engine.compute_loss, engine.training,
                                        variables).get_concrete_function(
            values, list(inputs), list(targets), None)
        with contextlib.suppress(tf.errors.OpError), without_grappler():
            concrete([tf.zeros(v.shape, v.dtype) for v in values],
                     zeros[:len(inputs)], zeros[len(inputs):], None)
    except Exception:  # noqa: BLE001  (the observation traces it again, and says what fails)
        return None
    return concrete


def _free_batch(tensor: Any) -> Any:
    return tf.TensorSpec((None, *tensor.shape[1:]), tensor.dtype)


def _numpy(tensor: Any) -> np.ndarray | None:
    return None if tensor is None else tensor.numpy()


__all__ = ["TracedPass"]
