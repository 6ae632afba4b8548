"""Each example's weight gradients from one batched backward pass (``explain --per-example``).

In a model whose examples do not interact, the batched backward pass already holds every
example's adjoints; only the final sum over the examples into each weight mixes them. So the
model runs once, as Keras calls it, with gradscope looking on (:mod:`observed_call`):

* each recurrent loop (Keras' own ``backend.rnn`` over the layer's own cell, as
  ``RNN.inner_loop`` runs it) gets a zero probe on every result of every step of the cell
  (each state it returns, and its output where that is not a state), before Keras' masking,
  and hands back the states each step started from;
* each other layer call that owns trainable variables keeps its inputs, and its outputs are
  fresh tensors whose gradient is ∂L/∂(its outputs).

One tape gives the gradient of the examples' summed losses on all of them. Then, with no loop
over time, each example's weight gradient is the VJP of ONE step of the layer's own cell
evaluated on all T steps at once as a batch of rows (the inputs, the states the steps started
from, the probes' gradients as cotangents: zero at a masked step, whose state Keras carries
through), or the VJP of the layer's own call of the example; both vectorised over the examples
(``tf.vectorized_map``, no while loop under it), so each weight gradient's matmul becomes one
batched matmul of the batched backward's FLOPs.

What this cannot split raises :class:`NotSplit` (the caller falls back to the Jacobian), and
every run returns the evidence that it split correctly: each recomputed step or call equals
what Keras' own call computed, and the loss's gradient on the model's outputs keeps each
example's row apart (a loss that mixes the examples fails it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Weighted layers whose examples interact in training mode (batch statistics).
BATCH_MIXING = frozenset({"BatchNormalization", "SyncBatchNormalization"})
#: Keras' own layers that run code of the user's.
USER_CODE = frozenset({"Lambda", "TFSMLayer"})


class NotSplit(Exception):  # noqa: N818  (a signal to the caller, not an error for users)
    """The model has a call the split cannot take apart by example; the message says which."""


@dataclass
class LoopRecord:
    """One run of one recurrent layer's loop: what each step read and the probes on what it
    returned, all batch-major (B, T, ·) in input order."""

    layer: Any
    sequences: Any
    keep: Any  # (B, T) booleans, or None
    initial: Any  # the initial state's structure, as the cell takes its states
    started: list[Any] = field(default_factory=list)  # each state entering each step
    raw: list[Any] = field(default_factory=list)  # each state the cell returned, unmasked
    probes: list[Any] = field(default_factory=list)  # one per state
    #: What the loop returned at each step, unmasked, in processing order (watched: its
    #: gradient is the output's own cotangent where the output is no state).
    outputs: Any = None
    output_is_state: bool = True
    training: Any = None


@dataclass
class CallRecord:
    """One call of a loop-free layer that owns trainable variables."""

    layer: Any
    flat: list[Any]  # its arguments, flat (args then kwargs)
    structure: Any  # (args, kwargs) to pack ``flat`` into
    outputs: list[Any] = field(default_factory=list)  # fresh, watched


@dataclass
class Recorder:
    """Every layer call of one observed run of the model, sorted into what the split takes
    (see the module); ``watch`` is given each probe and fresh output."""

    watch: Callable[[Any], None]
    training: bool
    loops: list[LoopRecord] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)

    def wrap(self, operation: Any, keras_call: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(operation, keras_call, args, kwargs)

        return call

    def call(self, operation: Any, keras_call: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        from keras import tree

        from gradscope.keras.engine import class_label
        from gradscope.keras.live import is_builtin
        from gradscope.keras.state_probes import probeable

        kind = class_label(operation)
        loops = ([operation.forward_layer, operation.backward_layer]
                 if kind == "Bidirectional" else [operation])
        if all(probeable(layer) for layer in loops):
            for layer in loops:
                if _ids(layer.trainable_variables) != _ids(layer.cell.trainable_variables):
                    raise NotSplit(f"{layer.name}: trainable variables outside its cell")
                cell = layer.cell
                if self.training and (bool(getattr(cell, "dropout", 0))
                                      or bool(getattr(cell, "recurrent_dropout", 0))):
                    raise NotSplit(f"{layer.name}: dropout in its cell in training mode")
            with loops_recorded(loops, self):
                return keras_call(*args, **kwargs)
        nested = [layer for layer in [operation, *_sublayers(operation)]
                  if getattr(layer, "cell", None) is not None or class_label(layer)
                  in ("RNN", "Bidirectional")]
        if nested:
            raise NotSplit(f"{operation.name}: a recurrent call the split does not know")
        if not getattr(operation, "trainable_variables", None):
            if not is_builtin(type(operation).__module__) or kind in USER_CODE:
                raise NotSplit(f"{operation.name}: a layer of your own without weights, "
                               "which could mix the examples")
            return keras_call(*args, **kwargs)
        if self.training and kind in BATCH_MIXING:
            raise NotSplit(f"{operation.name}: {kind} in training mode mixes the examples")
        flat = list(tree.flatten((args, kwargs)))
        record = CallRecord(layer=operation, flat=flat, structure=(args, kwargs))
        out = keras_call(*args, **kwargs)
        record.outputs = [_fresh(output, self.watch) for output in tree.flatten(out)]
        self.calls.append(record)
        return tree.pack_sequence_as(out, record.outputs)


def _ids(variables: list[Any]) -> set[int]:
    return {id(v) for v in variables}


def _sublayers(operation: Any) -> list[Any]:
    flatten = getattr(operation, "_flatten_layers", None)
    return list(flatten(include_self=False, recursive=True)) if flatten else []


def _fresh(output: Any, watch: Callable[[Any], None]) -> Any:
    """A watched copy of a layer's output, its Keras mask carried over."""
    import tensorflow as tf
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    copy = tf.identity(output)
    mask = get_keras_mask(output)
    if mask is not None:
        set_keras_mask(copy, mask)
    watch(copy)
    return copy


@contextlib.contextmanager
def observed(model: Any, recorder: Recorder) -> Iterator[None]:
    """While inside, Keras' own call of ``model`` (on this thread) is recorded by
    ``recorder``; a subclassed model, whose code between its layers is its own, is not split."""
    from gradscope.keras.observed_call import runner_wrapped
    from gradscope.keras.subclassed import is_subclassed

    if is_subclassed(model):
        raise NotSplit("a subclassed model: its code between the layers is its own")
    runner = getattr(model, "_functional", None) or model
    with runner_wrapped(runner, recorder.wrap):
        yield


@contextlib.contextmanager
def loops_recorded(layers: list[Any], recorder: Recorder) -> Iterator[None]:
    """While inside, each of ``layers``' loops, run by this thread, is :func:`recorded_loop`
    (once each)."""
    from gradscope.keras.observed_call import inner_loops_replaced

    def loop_of(layer: Any) -> Callable[..., Any]:
        def loop(own: Any, sequences: Any, initial_state: Any, mask: Any,
                 training: Any) -> Any:
            record, result = recorded_loop(layer, sequences, initial_state, mask, training,
                                           recorder.watch)
            recorder.loops.append(record)
            return result

        return loop

    with inner_loops_replaced([(layer, loop_of(layer)) for layer in layers]):
        yield


def recorded_loop(layer: Any, sequences: Any, initial_state: Any, mask: Any, training: Any,
                  watch: Callable[[Any], None]) -> tuple[LoopRecord, Any]:
    """``layer.inner_loop(sequences, initial_state, mask, training)`` as ``RNN.inner_loop``
    runs it (Keras' ``backend.rnn`` over the same cell), with a zero probe on each result of
    each step before the masking, and each step's starting states handed back; returns the
    record and what the loop returns, ``(last_output, outputs, final_states)``, of the same
    values (the masked outputs as :func:`~gradscope.keras.state_probes.probed_loop` builds
    them)."""
    import tensorflow as tf
    from keras.src import backend, tree
    from keras.src.layers.layer import Layer

    from gradscope.keras.state_probes import _carried_forward, _dims, _where

    cell = layer.cell
    kwargs = ({"training": training}
              if isinstance(cell, Layer) and cell._call_has_training_arg else {})
    if tree.is_nested(mask):
        mask = mask[0]
    if not tree.is_nested(initial_state):
        initial_state = [initial_state]
    flat = list(tree.flatten(initial_state))
    batch, steps = _dims(sequences)[:2]
    if sequences.shape[1] is None:
        raise NotSplit(f"{layer.name}: a time axis known only at run time")
    keep = None if mask is None else tf.cast(mask, tf.bool)
    if keep is not None and len(keep.shape) != 2:
        raise NotSplit(f"{layer.name}: a mask of rank {len(keep.shape)}")
    probes = [tf.zeros([batch, steps, *_dims(s)[1:]], s.dtype) for s in flat]
    watch(probes)
    record = LoopRecord(layer=layer, sequences=sequences, keep=keep, initial=initial_state,
                        probes=probes, training=training)
    count = len(flat)

    def step(inputs: Any, states: Any) -> tuple[Any, Any]:
        x_t, keep_t, probes_t = ((inputs[0], inputs[1], inputs[2:]) if keep is not None
                                 else (inputs[0], None, inputs[1:]))
        started = list(tree.flatten(states))
        out, new = cell(x_t, states, **kwargs)
        raw = list(tree.flatten(new if tree.is_nested(new) else [new]))
        same = [k for k, n in enumerate(raw) if n is out]
        probed = [n + p for n, p in zip(raw, probes_t, strict=True)]
        # Where the output is a state, its probe takes the gradient from above too; else
        # the output's own gradient is read on the sequence the loop returns.
        record.output_is_state = bool(same)
        out = probed[same[0]] if same else out
        if keep_t is not None:  # Keras' masking: a masked step keeps the states
            probed = [_where(tf, keep_t, n, s)
                      for n, s in zip(probed, started, strict=True)]
        return (out, *started, *raw), tree.pack_sequence_as(initial_state, probed)

    # backend.rnn takes sequences of rank 3 at least: the mask as (B, T, 1).
    inputs = ((sequences, *probes) if keep is None
              else (sequences, tf.expand_dims(keep, -1), *probes))
    backwards = bool(layer.go_backwards)
    _, outputs, final = backend.rnn(
        step, inputs, initial_state, go_backwards=backwards, mask=None, unroll=False,
        input_length=steps, zero_output_for_mask=layer.zero_output_for_mask,
        return_all_outputs=True)
    outputs, rest = outputs[0], list(outputs[1:])
    watch(outputs)
    record.outputs = outputs
    if backwards:  # processing order back to input order, as the probes are
        rest = [tf.reverse(r, [1]) for r in rest]
    record.started, record.raw = rest[:count], rest[count:]
    if keep is not None:
        kept = tf.expand_dims(tf.reverse(keep, [1]) if backwards else keep, -1)  # (B, T, 1)
        outputs = (_where(tf, kept, outputs, tf.zeros_like(outputs), axis=2)
                   if layer.zero_output_for_mask else _carried_forward(tf, outputs, kept))
    last = outputs[:, -1]
    if not layer.return_sequences:
        outputs = outputs[:, -1:]
    return record, (last, outputs, final)


def loop_rows(record: LoopRecord, gradients: list[Any]) -> tuple[list[Any], Any]:
    """Per example, the gradient of each of the cell's trainable variables (B, ·), and how far
    the recomputed steps stray from Keras' (B,): the VJP of one step of the cell on the T
    steps of the example as rows, with the probes' gradients as cotangents (``gradients``:
    the tape's on :func:`loop_targets`)."""
    import tensorflow as tf
    from keras import tree

    cell = record.layer.cell
    variables = list(cell.trainable_variables)
    kwargs = ({"training": record.training}
              if getattr(cell, "_call_has_training_arg", False) else {})
    def one(elems: Any) -> Any:
        x, started, raw, cotangents = elems
        with tf.GradientTape() as tape:
            out, new = cell(x, tree.pack_sequence_as(record.initial, list(started)), **kwargs)
            flat = list(tree.flatten(new if tree.is_nested(new) else [new]))
        targets = flat if record.output_is_state else [*flat, out]
        grads = tape.gradient(targets, variables, output_gradients=list(cotangents),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        stray = tf.add_n([tf.reduce_max(tf.abs(tf.cast(n - r, tf.float64)))
                          for n, r in zip(flat, raw, strict=True)])
        return [tf.convert_to_tensor(g) for g in grads], stray

    *cotangents, on_outputs = gradients
    if not record.output_is_state:
        cotangents.append(tf.reverse(on_outputs, [1]) if record.layer.go_backwards
                          else on_outputs)
    elems = (record.sequences, list(record.started), list(record.raw), cotangents)
    return tf.vectorized_map(one, elems, fallback_to_while_loop=False)


def loop_targets(record: LoopRecord) -> list[Any]:
    """What the tape differentiates for one loop: its probes, then its output sequence."""
    return [*record.probes, record.outputs]


def call_rows(record: CallRecord, gradients: list[Any], size: int) -> tuple[list[Any], Any]:
    """Per example, the gradient of each of the layer's trainable variables (B, ·), and how
    far its recomputed call strays from Keras' (B,): the VJP of the layer's own call on the
    example alone, with ∂L/∂(its outputs) as cotangents."""
    import tensorflow as tf
    from keras import tree

    layer = record.layer
    variables = list(layer.trainable_variables)
    batched = [k for k, value in enumerate(record.flat)
               if tf.is_tensor(value) and len(value.shape) > 0 and value.shape[0] == size]

    def one(elems: Any) -> Any:
        pieces, observed, cotangents = elems
        flat = list(record.flat)
        for k, piece in zip(batched, pieces, strict=True):
            flat[k] = piece[None]
        args, kwargs = tree.pack_sequence_as(record.structure, flat)
        with tf.GradientTape() as tape:
            outputs = list(tree.flatten(layer(*args, **kwargs)))
        grads = tape.gradient(outputs, variables,
                              output_gradients=[g[None] for g in cotangents],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        stray = tf.add_n([tf.reduce_max(tf.abs(tf.cast(o[0] - v, tf.float64)))
                          for o, v in zip(outputs, observed, strict=True)])
        return [tf.convert_to_tensor(g) for g in grads], stray

    elems = ([record.flat[k] for k in batched], list(record.outputs), list(gradients))
    return tf.vectorized_map(one, elems, fallback_to_while_loop=False)


def split_squares(tf: Any, recorder: Recorder, gradients: dict[str, list[Any]],
                  variables: list[Any], size: int
                  ) -> tuple[list[Any], list[Any], Any, Any, list[bool]]:
    """Per variable, each example's ‖g_i‖² (B,) and Σ_i g_i; the largest stray of a recomputed
    step or call, and the largest value it was compared with (float64 scalars); per variable,
    whether a recorded call uses it (one that none uses has zero rows here, and must have a
    zero gradient). ``gradients``: the tape's gradients on each record's probes / outputs."""
    rows: dict[int, Any] = {}
    strays = [tf.constant(0.0, tf.float64)]
    scales = [tf.constant(0.0, tf.float64)]
    for record, grads in zip(recorder.loops, gradients["loops"], strict=True):
        per, stray = loop_rows(record, grads)
        strays.append(tf.reduce_max(stray))
        scales += [tf.reduce_max(tf.abs(tf.cast(r, tf.float64))) for r in record.raw]
        for variable, g in zip(record.layer.cell.trainable_variables, per, strict=True):
            rows[id(variable)] = g if id(variable) not in rows else rows[id(variable)] + g
    for call, grads in zip(recorder.calls, gradients["calls"], strict=True):
        per, stray = call_rows(call, grads, size)
        strays.append(tf.reduce_max(stray))
        scales += [tf.reduce_max(tf.abs(tf.cast(o, tf.float64))) for o in call.outputs]
        for variable, g in zip(call.layer.trainable_variables, per, strict=True):
            rows[id(variable)] = g if id(variable) not in rows else rows[id(variable)] + g
    squares, summed = [], []
    for variable in variables:
        g = rows.get(id(variable))
        if g is None:
            squares.append(tf.zeros([size], variable.dtype))
            summed.append(tf.zeros(variable.shape, variable.dtype))
            continue
        squares.append(tf.reduce_sum(tf.reshape(tf.square(g), [size, -1]), axis=1))
        summed.append(tf.reduce_sum(g, axis=0))
    return (squares, summed, tf.reduce_max(tf.stack(strays)), tf.reduce_max(tf.stack(scales)),
            [id(variable) in rows for variable in variables])


__all__ = ["CallRecord", "LoopRecord", "NotSplit", "Recorder", "call_rows", "loop_rows",
           "loop_targets", "observed", "split_squares"]
