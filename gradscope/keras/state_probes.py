"""Zero probes on every state inside Keras' own recurrent loop, so that the pass's one backward
gives the total ∂L/∂s_t of every state after every step (``explain --flow``, GradientFlow).

While inside :func:`states_probed`, on the thread that entered it, each recurrent layer's
``inner_loop`` runs Keras' own ``backend.rnn`` over the layer's own cell, as ``RNN.inner_loop``
does, with a zero tensor per state as a further input sequence: each step adds its slice to
every state it leaves, and returns that probed state as its output where the cell returns the
state itself. Adding zeros changes no value; the gradient on a probe is the total gradient on
that state after that step, the recurrence included. Masked steps are masked inside the step
(the probe is added after), so that the carried state is probed too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

#: ``probe_states=SQUARES`` (``KerasEngine.run``): each loop without a mask probed in
#: squares mode (:func:`probed_loop`), what diagnose reads alone.
SQUARES = "squares"
Probing = bool | Literal["squares"]


@dataclass
class ProbedLoop:
    """One run of one recurrent layer's loop, probed: the probes (one per state, flat, in
    Keras' order, (B, T, ·) in input order) and a zero added to what the loop returns (the
    output sequence, or its last step), both watched by the tape."""

    probes: list[Any]
    above: Any
    backwards: bool
    sequences: bool  # ``above`` is the whole output sequence, not its last step
    #: Which state the cell returns as its output (None: an output of its own).
    output_state: int | None = None
    #: With ``probe_inputs``: a zero added to the input sequence the loop reads (B, T, ·), in input
    #: order, watched: its gradient is ∂L/∂x_t of the call, through this loop.
    inputs: Any = None
    #: Every state after the loop's last step, flat, and where each example's steps ran
    #: (B, T), input order (None: every step): :func:`carried_back` differentiates them.
    final: list[Any] | None = None
    ran: Any = None
    #: Squares mode (:func:`probed_loop` with ``squares``): in place of the probes, a zero
    #: (B, T, 2) float64 whose "gradient" is each step's ‖∂L/∂s_t‖² and ‖its carried part‖²
    #: (:func:`_squares_kept`), and a zero per state (B, ·) added at the last step, whose
    #: gradient is that state's total there.
    sink: Any = None
    lasts: list[Any] | None = None


@dataclass
class StateTotals:
    """The totals of one probed loop, in NumPy (the model's dtype): per state, ∂L/∂(the state
    after step t) (B, T, ·), and the part of ∂L/∂(the output at t) that arrives from above
    (B, T, ·), both in processing order (reversed for a go_backwards layer)."""

    totals: list[np.ndarray]
    direct: np.ndarray
    backwards: bool
    output_state: int | None
    #: ∂L/∂x_t of the input sequence through this loop (B, T, ·), in input order, where the
    #: loop was probed with ``probe_inputs``.
    inputs: np.ndarray | None = None
    #: Where the gradient from above may enter at every step (the output is the sequence):
    #: per example and step (B, T), processing order, ‖v_t‖² of every state joined, where v
    #: is what the loss puts on the state at the example's last step that ran, carried back
    #: through the recurrence alone (:func:`carried_back`). None where the output is the
    #: last step alone: there the totals are that already.
    carried_back: np.ndarray | None = None
    #: A loop probed in squares mode (``totals`` and ``direct`` then empty): per example and
    #: step (B, T), processing order, ‖∂L/∂s_t‖² and ‖its carried part‖² (the total less what
    #: arrives from above on the state the cell returns as its output), every state joined,
    #: in float64; and each state's total after the last step (B, ·).
    squares: tuple[np.ndarray, np.ndarray] | None = None
    last: list[np.ndarray] | None = None


def probeable(layer: Any) -> bool:
    """Whether the layer's loop is Keras' own ``inner_loop`` over a cell (an RNN, GRU, LSTM,
    SimpleRNN or ConvLSTM, not a loop a subclass writes itself), which the probes can run.
    A layer that asks for cuDNN alone (``use_cudnn=True``) is left to Keras."""
    import keras

    from gradscope.keras.live import is_builtin

    if not isinstance(layer, keras.layers.RNN) or getattr(layer, "cell", None) is None:
        return False
    own = getattr(type(layer), "inner_loop", None)
    return (own is not None and is_builtin(getattr(own, "__module__", None))
            and getattr(layer, "use_cudnn", "auto") is not True)


@contextlib.contextmanager
def states_probed(layers: list[Any], found: list[ProbedLoop | None],
                  watch: Callable[[Any], None], probe_inputs: bool = False,
                  squares: bool = False) -> Iterator[None]:
    """While inside, the loop of each of ``layers`` that :func:`probeable` accepts, run by this
    thread, is probed, and ``found[k]`` is the :class:`ProbedLoop` of ``layers[k]`` (None where
    it did not run, ran more than once, or could not be probed: Keras' own loop ran then).
    ``probe_inputs``: the input sequence each loop reads is probed too (``explain --flow`` shows
    ∂L/∂x_t; where nothing upstream is trained, the backward need not compute it otherwise).
    Other threads run Keras' own loop. ``squares``: each loop without a mask in squares mode
    (see :func:`probed_loop`)."""
    from gradscope.keras.observed_call import inner_loops_replaced

    found[:] = [None] * len(layers)
    runs = [0] * len(layers)

    def probing(index: int, layer: Any) -> Callable[..., Any]:
        def loop(own: Any, sequences: Any, initial_state: Any, mask: Any,
                 training: Any) -> Any:
            runs[index] += 1
            try:
                probed, result = probed_loop(layer, sequences, initial_state, mask, training,
                                             watch, probe_inputs, squares)
            except Exception:  # noqa: BLE001  (a structure the probes do not take: the
                # loop runs as Keras runs it, unprobed; an error of the cell's own is raised
                # there, as Keras raises it)
                runs[index] += 1
                return own(sequences, initial_state, mask, training=training)
            found[index] = probed if runs[index] == 1 else None
            return result

        return loop

    try:
        with inner_loops_replaced([(layer, probing(index, layer))
                                   for index, layer in enumerate(layers)
                                   if probeable(layer)]):
            yield
    finally:
        for index, count in enumerate(runs):
            if count > 1:
                found[index] = None


def probed_loop(layer: Any, sequences: Any, initial_state: Any, mask: Any, training: Any,
                watch: Callable[[Any], None], probe_inputs: bool = False,
                squares: bool = False) -> tuple[ProbedLoop, Any]:
    """``layer.inner_loop(sequences, initial_state, mask, training)`` as ``RNN.inner_loop``
    runs it (Keras' ``backend.rnn``, the same cell and arguments), probed; returns the probes
    and what the loop returns, ``(last_output, outputs, final_states)``, of the same values.

    ``squares`` (a loop without a mask, and without ``probe_inputs``): what diagnose reads of
    the totals alone, per step ‖∂L/∂s_t‖² and ‖its carried part‖², and each state's total
    after the last step, without a probe of the whole sequence: the probes, each (B, T, ·)
    with its time-major copies, its stack and their gradients', held about 0.6 GB more at the
    peak of the LSTM 256 × 2's pass at 1000 steps than Keras' own backward. Each step's new
    states go through an identity (:func:`_squares_kept`) whose backward passes their
    gradients on unchanged and gives a (B, T, 2) zero in float64, read by the backward as
    the loop reads its inputs, those two squares; and a zero per state (B, ·), added to the
    state at the last step alone, gets that state's total there as its gradient."""
    import tensorflow as tf
    from keras.src import backend, tree
    from keras.src.layers.layer import Layer

    cell = layer.cell
    kwargs = ({"training": training}
              if isinstance(cell, Layer) and cell._call_has_training_arg else {})
    if tree.is_nested(mask):  # as GRU's and LSTM's own inner_loop take it
        mask = mask[0]
    if not tree.is_nested(initial_state):
        initial_state = [initial_state]
    flat = list(tree.flatten(initial_state))
    steps = sequences.shape[1]
    backwards = bool(layer.go_backwards)
    squares = squares and mask is None and not probe_inputs
    if squares:
        return _squares_loop(layer, sequences, initial_state, watch, kwargs)
    probes = [tf.zeros([*_batch_and(sequences), *_dims(s)[1:]], s.dtype) for s in flat]
    watch(probes)
    read = None
    if probe_inputs:
        read = tf.zeros_like(sequences)
        watch(read)
        sequences = sequences + read
    keep = None
    if mask is not None:
        keep = tf.cast(mask, tf.bool)
        keep = tf.expand_dims(keep, -1) if len(keep.shape) == 2 else keep
    loop = ProbedLoop(probes=probes, above=None, backwards=backwards,
                      sequences=bool(layer.return_sequences), inputs=read,
                      ran=None if keep is None else tf.reshape(keep, tf.shape(keep)[:2]))

    def step(inputs: Any, states: Any) -> tuple[Any, Any]:
        x_t, keep_t, probes_t = ((inputs[0], inputs[1], inputs[2:]) if keep is not None
                                 else (inputs[0], None, inputs[1:]))
        out, new = cell(x_t, states, **kwargs)
        flat_new = list(tree.flatten(new if tree.is_nested(new) else [new]))
        same = [k for k, n in enumerate(flat_new) if n is out]
        if keep_t is not None:  # Keras' masking: a masked step keeps the states
            flat_new = [_where(tf, keep_t, n, s)
                        for n, s in zip(flat_new, tree.flatten(states), strict=True)]
        flat_new = [n + p for n, p in zip(flat_new, probes_t, strict=True)]
        if same:
            loop.output_state = same[0]
            out = flat_new[same[0]]
        return out, tree.pack_sequence_as(initial_state, flat_new)

    # One flat tuple: backend.rnn's unrolled loop indexes each of its items by time.
    inputs = (sequences, *probes) if keep is None else (sequences, keep, *probes)
    last, outputs, final = backend.rnn(
        step, inputs, initial_state, go_backwards=backwards, mask=None, unroll=layer.unroll,
        # backend.rnn reads a length it is not given from inputs.shape, which nested inputs
        # lack; a time axis known only at run time goes in a list: a tensor would be taken
        # for per-example lengths, and its truth value asked.
        input_length=steps if steps is not None else [tf.shape(sequences)[1]],
        zero_output_for_mask=layer.zero_output_for_mask,
        return_all_outputs=layer.return_sequences or keep is not None)
    if keep is not None:
        # Keras' masked loop returns, at a masked step, the last kept step's output (zeros
        # before the first), or zeros with zero_output_for_mask.
        kept = tf.reverse(keep, [1]) if backwards else keep
        outputs = (_where(tf, kept, outputs, tf.zeros_like(outputs), axis=2)
                   if layer.zero_output_for_mask else _carried_forward(tf, outputs, kept))
        last = outputs[:, -1]
        outputs = outputs if layer.return_sequences else outputs[:, -1:]
    loop.final = list(tree.flatten(final))
    # A zero on what the loop returns: its gradient is what arrives from above at each step.
    loop.above = tf.zeros_like(outputs if layer.return_sequences else last)
    watch(loop.above)
    if layer.return_sequences:
        outputs = outputs + loop.above
        last = outputs[:, -1]
    else:
        last = last + loop.above
        outputs = tf.expand_dims(last, 1)
    return loop, (last, outputs, final)


def _squares_loop(layer: Any, sequences: Any, initial_state: Any,
                  watch: Callable[[Any], None], kwargs: dict[str, Any]
                  ) -> tuple[ProbedLoop, Any]:
    """:func:`probed_loop` in squares mode (no mask, no probe of the inputs)."""
    import tensorflow as tf
    from keras.src import backend, tree

    cell = layer.cell
    backwards = bool(layer.go_backwards)
    flat = list(tree.flatten(initial_state))
    batch_and = _batch_and(sequences)
    steps = sequences.shape[1]
    sink = tf.zeros([*batch_and, 2], tf.float64)
    lasts = [tf.zeros(_dims(s), s.dtype) for s in flat]
    watch([sink, lasts])
    # 1 at the step the loop runs last (the first in input order where it runs backwards).
    position = tf.range(batch_and[1])
    final = 0 if backwards else batch_and[1] - 1
    at_last = tf.tile(tf.cast(position == final, sequences.dtype)[None, :, None],
                      [batch_and[0], 1, 1])  # (B, T, 1): backend.rnn takes rank 3 and up
    loop = ProbedLoop(probes=[], above=None, backwards=backwards,
                      sequences=bool(layer.return_sequences), sink=sink, lasts=lasts)

    def step(inputs: Any, states: Any) -> tuple[Any, Any]:
        x_t, sink_t, last_t = inputs
        out, new = cell(x_t, states, **kwargs)
        flat_new = list(tree.flatten(new if tree.is_nested(new) else [new]))
        same = [k for k, n in enumerate(flat_new) if n is out]
        flat_new = [n + p * tf.cast(tf.reshape(last_t, [-1, *[1] * (len(n.shape) - 1)]),
                                    n.dtype) for n, p in zip(flat_new, lasts, strict=True)]
        kept = _squares_kept(tf, sink_t, flat_new, same[0] if same else None)
        flat_new = kept[:len(flat_new)]
        if same:
            loop.output_state = same[0]
            out = kept[-1]
        return out, tree.pack_sequence_as(initial_state, flat_new)

    last, outputs, final_states = backend.rnn(
        step, (sequences, sink, at_last), initial_state, go_backwards=backwards, mask=None,
        unroll=layer.unroll,
        input_length=steps if steps is not None else [tf.shape(sequences)[1]],
        zero_output_for_mask=layer.zero_output_for_mask,
        return_all_outputs=layer.return_sequences)
    loop.final = list(tree.flatten(final_states))
    return loop, (last, outputs, final_states)


def _squares_kept(tf: Any, sink_t: Any, states: list[Any], output: int | None) -> list[Any]:
    """``states`` unchanged (and, where the cell returns state ``output`` as its output, a
    copy of it for the output, last), through an identity whose backward passes on each
    state's gradient (the output copy's added to its state's) and gives ``sink_t`` (B, 2)
    what diagnose reads of them in place of a gradient: Σ over the states of ‖total‖² and of
    ‖its carried part‖² (the output copy's left out), in float64. Not a derivative: a zero
    input whose backward slot carries two numbers per example out of the loop's backward,
    where a probe would carry the whole state."""
    count = len(states)

    @tf.custom_gradient
    def kept(sink: Any, *values: Any) -> Any:
        copies = [tf.identity(v) for v in values]
        if output is not None:
            copies.append(tf.identity(values[output]))

        def backward(*upstream: Any) -> Any:
            given = [tf.zeros_like(c) if g is None else g
                     for g, c in zip(upstream, copies, strict=True)]
            carried = given[:count]
            totals = list(carried)
            if output is not None:
                totals[output] = carried[output] + given[count]

            def joined(values: list[Any]) -> Any:
                return tf.add_n([tf.reduce_sum(tf.square(tf.cast(v, tf.float64)),
                                               axis=list(range(1, len(v.shape))))
                                 for v in values])

            return (tf.cast(tf.stack([joined(totals), joined(carried)], axis=1), sink.dtype),
                    *totals)

        return copies, backward

    return list(kept(sink_t, *states))


def _batch_and(sequences: Any) -> list[Any]:
    """(B, T) of a batch-major sequence, static where known (the probes keep static shapes,
    as the loop's states must)."""
    return _dims(sequences)[:2]


def _dims(tensor: Any) -> list[Any]:
    """Each axis's size: static where known, else the tensor's own."""
    import tensorflow as tf

    return [d if d is not None else tf.shape(tensor)[i] for i, d in enumerate(tensor.shape)]


def _where(tf: Any, keep: Any, value: Any, other: Any, axis: int = 1) -> Any:
    """``value`` where ``keep`` (its first ``axis`` axes are the value's), else ``other``."""
    keep = tf.reshape(keep, [*(-1 if i == 0 else tf.shape(keep)[i] for i in range(axis)),
                             *[1] * (len(value.shape) - axis)])
    return tf.where(keep, value, other)


def _carried_forward(tf: Any, outputs: Any, kept: Any) -> Any:
    """Each step's output (B, T, ·) where ``kept`` (B, T, 1), else the last kept step's
    before it, zeros before the first: what Keras' masked loop returns."""
    kept = kept[:, :, 0]
    steps = tf.shape(kept)[1]
    positions = tf.range(steps)
    count = tf.cumsum(tf.cast(kept, tf.int32), axis=1)  # kept steps up to t
    # The kept positions first, in order; the count-th of them is the last kept up to t.
    order = tf.argsort(tf.where(kept, positions[None, :], steps + positions[None, :]),
                       axis=1, stable=True)
    last = tf.gather(order, tf.maximum(count - 1, 0), batch_dims=1)
    carried = tf.gather(outputs, last, batch_dims=1)
    return _where(tf, count > 0, carried, tf.zeros_like(carried), axis=2)


def probe_targets(loops: list[ProbedLoop | None]) -> list[Any]:
    """What the tape differentiates for one call's loops: ``[[probes, above], …]``, and the
    input sequence's probe after them where the loop has one (empty unless every loop of the
    call was probed)."""
    if not loops or not all(loops):
        return []
    return [[loop.sink, loop.lasts] if loop.sink is not None else
            [loop.probes, loop.above] + ([loop.inputs] if loop.inputs is not None else [])
            for loop in loops if loop is not None]


def filled(tf: Any, targets: list[Any], gradients: list[Any]) -> list[Any]:
    """The tape's gradients of :func:`probe_targets`, a zero where it gave None (the loss does
    not reach that probe)."""
    return tf.nest.map_structure(lambda t, g: tf.zeros_like(t) if g is None else g,
                                 targets, gradients)


def carried_back(tf: Any, tape: Any, loops: list[ProbedLoop | None],
                 gradients: list[Any]) -> list[Any]:
    """Per probed loop of one call (as :func:`probe_targets` lists them), where its output is
    the whole sequence: ‖v_t‖² per example and step (B, T), input order, every state joined,
    where v is what the loss puts on the states at the example's last step that ran (the
    totals there, from the tape's (filled) ``gradients``), carried back through the
    recurrence alone: the gradient of (those totals) · (the loop's final states) with
    respect to every probe, one more backward through the loop (:func:`gradient`). Where
    a gradient enters at every step (a layer below another, a tagger, a decoder), a product
    of the totals' gains step by step is no gain of any gradient: each step's fresh part
    decays fastest in its first steps back, and the product compounds that. None for a loop
    that returns its last step alone: its totals are carried back from there already."""
    kept = [lp for lp in loops if lp is not None]
    found: list[Any] = []
    for loop, (probes, *_) in zip(kept, gradients, strict=True):
        if (loop.sink is not None or not loop.sequences or loop.final is None
                or len(loop.final) != len(probes)):
            found.append(None)
            continue
        steps = tf.shape(probes[0])[1]
        last = last_steps(tf, loop.ran, tf.shape(probes[0])[0], steps, loop.backwards)
        if loop.backwards:  # the probes are in input order
            last = steps - 1 - last
        seeds = [tf.gather(g, last, axis=1, batch_dims=1) for g in probes]
        found.append(joined_squares(tf, gradient(tf, tape, loop.final, loop.probes, seeds)))
    return found


def joined_squares(tf: Any, values: list[Any]) -> Any:
    """Σ v² over every state and every axis past the first two (the batch and time, either
    way round), in float64."""
    return tf.add_n([tf.reduce_sum(tf.square(tf.cast(v, tf.float64)),
                                   axis=list(range(2, len(v.shape)))) for v in values])


def gradient(tf: Any, tape: Any, targets: Any, sources: Any, seeds: Any) -> Any:
    """The gradient of ``targets`` (seeded with ``seeds``) with respect to ``sources``, a zero
    where they are unconnected: in a traced function from the graph itself
    (``tf.gradients``), which reuses the forward loop's intermediates, where a second
    gradient of a tape through a ``while`` loop costs about a second pass of the whole
    model's backward (3 s more on an LSTM 256 × 2 at 1000 steps) and a persistent tape
    alone 2 s more; run eagerly, from ``tape``, which must then be persistent
    (:func:`tape_for`)."""
    if tf.executing_eagerly():
        return tape.gradient(targets, sources, output_gradients=seeds,
                             unconnected_gradients="zero")
    found = tf.gradients(tf.nest.flatten(targets), tf.nest.flatten(sources),
                         grad_ys=tf.nest.flatten(seeds), unconnected_gradients="zero")
    return tf.nest.pack_sequence_as(sources, found)


def tape_for(tf: Any, probed: bool, **options: Any) -> Any:
    """The tape of a pass whose loops are probed (``probed``): persistent where it runs
    eagerly, for :func:`carried_back`'s second gradient (in a traced function that
    gradient comes from the graph: :func:`gradient`)."""
    return tf.GradientTape(persistent=probed and tf.executing_eagerly(), **options)


def last_steps(tf: Any, ran: Any, batch: Any, steps: Any, backwards: bool) -> Any:
    """Each example's last step that ran (B,), in the order the loop runs them, from where
    its steps ran (``ran`` (B, T), input order; None: every step)."""
    if ran is None:
        return tf.fill([batch], steps - 1)
    ran = tf.cast(ran, tf.int32)
    ran = ran if backwards else tf.reverse(ran, [1])  # processing order, reversed
    return steps - 1 - tf.argmax(ran, axis=1, output_type=tf.int32)


def carries_back(model: Any) -> bool:
    """Whether a probed pass of ``model`` takes :func:`carried_back`'s second gradient: a
    layer the probes run returns its whole sequence."""
    return any(probeable(layer) and bool(getattr(layer, "return_sequences", False))
               for layer in model._flatten_layers(include_self=False, recursive=True))


def state_totals(loops: list[ProbedLoop | None], gradients: list[Any],
                 back: list[Any] | None = None) -> list[StateTotals]:
    """One :class:`StateTotals` per loop, from the tape's (filled) gradients of
    :func:`probe_targets` and, where given, :func:`carried_back`, in processing order."""
    found = []
    kept = [lp for lp in loops if lp is not None]
    back = back if back is not None else [None] * len(kept)
    for loop, (probes, above, *inputs), squares in zip(kept, gradients, back, strict=True):
        if loop.sink is not None:  # squares mode: (sink, lasts)
            read = np.asarray(probes, np.float64)
            read = read[:, ::-1] if loop.backwards else read
            found.append(StateTotals(totals=[], direct=np.zeros(0), backwards=loop.backwards,
                                     output_state=loop.output_state,
                                     squares=(read[..., 0], read[..., 1]),
                                     last=[np.asarray(g) for g in above]))
            continue
        totals = [np.asarray(g) for g in probes]  # in the model's dtype: norms cast them
        if loop.backwards:
            totals = [t[:, ::-1] for t in totals]
        direct = np.asarray(above)
        if not loop.sequences:  # the last step's output alone is returned
            whole = np.zeros((direct.shape[0], totals[0].shape[1], *direct.shape[1:]),
                             direct.dtype)
            whole[:, -1] = direct
            direct = whole
        if squares is not None:
            squares = np.asarray(squares, np.float64)
            squares = squares[:, ::-1] if loop.backwards else squares
        found.append(StateTotals(totals=totals, direct=direct, backwards=loop.backwards,
                                 output_state=loop.output_state,
                                 inputs=np.asarray(inputs[0]) if inputs else None,
                                 carried_back=squares))
    return found


__all__ = ["SQUARES", "ProbedLoop", "Probing", "StateTotals", "carried_back", "carries_back",
           "gradient", "joined_squares", "last_steps", "probeable", "state_totals", "states_probed",
           "tape_for"]
