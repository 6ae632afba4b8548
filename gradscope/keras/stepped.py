"""A recurrent call stepped through the cell the model holds, as Keras' RNN loop steps it.

Across time, a Keras layer hides h_t inside its loop. This runs the layer's own cell object
(GRU, LSTM, SimpleRNN, ``RNN(your cell)``, each direction of a Bidirectional) step by step in
``tf.scan`` along the call's captured input, mask and initial state, with Keras' masking (a
masked step carries the state, and the output, through). It needs no NumPy version of the
cell. Every output it rebuilds must equal what Keras' own call returned before anything is
read from it; a call it cannot step is refused with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gradscope.errors import first_line
from gradscope.gradcheck import tolerance
from gradscope.keras.cross_check import cell_params, compared_outputs, unmodelled
from gradscope.keras.engine import CapturedCall, call_label, class_label, state_names
from gradscope.keras.state_probes import gradient, joined_squares, last_steps, tape_for

#: How the two directions of a Bidirectional call are merged into its output.
MERGES = ("concat", "sum", "ave", "mul", None)


@dataclass
class Direction:
    """One recurrent layer as stepped: a plain call, or one direction of a Bidirectional."""

    label: str  # "decoder", "both/forward"
    layer: Any
    names: list[str]  # its initial states' names, in Keras' order
    backwards: bool


@dataclass
class Stepped:
    """A recurrent call whose outputs the stepping rebuilt exactly, and what it found: per
    direction, the sequence of each state (B, T, ·) in processing order, and, with the
    gradient from above, the total ∂L/∂ each state after every step."""

    label: str
    call: CapturedCall
    directions: list[Direction]
    states: list[list[np.ndarray]]
    totals: list[list[np.ndarray]] | None = None
    #: Per direction, the part of ∂L/∂(output at t) that arrives from above at t (B, T, ·),
    #: processing order: where the output is the state, the rest of the total is carried
    #: back from t+1.
    direct: list[np.ndarray] | None = None
    #: With the gradient from above: ∂L/∂x_t of the call's input sequence (B, T, ·), in
    #: input order, every direction's part summed.
    inputs: np.ndarray | None = None
    #: Per direction, the dropout masks its cell stepped with (:data:`Masks`, in NumPy), or
    #: None where it draws none (inference mode, no dropout).
    masks: list[Masks | None] | None = None
    #: Per direction, whether the cell's output at a step is its first state itself (Keras'
    #: cells; a cell of the user's may return something else): else the total on that state
    #: is the gradient as step t+1 reads it, not where the same step's output reads it.
    output_is_state: list[bool] | None = None
    #: Per direction, where the call returns its whole output sequence (a gradient from
    #: above may enter at every step): ‖v_t‖² per example and step (B, T), processing order,
    #: every state joined, where v is what the loss puts on the states at the example's last
    #: step that ran, carried back through the recurrence alone
    #: (:func:`~gradscope.keras.state_probes.carried_back`); else None.
    carried_back: list[np.ndarray | None] | None = None
    #: Per direction, where the stepping kept squared norms only (``squares``, a long call):
    #: :func:`step_squares` as it gives them; the totals and what arrives from above are
    #: then None.
    squares: list[tuple[np.ndarray, np.ndarray]] | None = None


def joined_totals(stepped: Stepped, index: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Direction ``index``'s total ∂L/∂s_t with every state joined (B, T, Σw), and the part
    of it that arrives from above at each step (on the output state; zeros on the others,
    and on every state where the cell's output is not its first state: :func:`step_squares`);
    None where no gradient reached the call."""
    if stepped.totals is None or stepped.direct is None:
        return None
    totals = [np.asarray(t, np.float64) for t in stepped.totals[index]]
    direct = np.asarray(stepped.direct[index], np.float64)
    above = [np.zeros_like(t) for t in totals]
    if output_is_state(stepped, index) and direct.shape == totals[0].shape:
        above[0] = direct
    return np.concatenate(totals, axis=-1), np.concatenate(above, axis=-1)


def step_squares(stepped: Stepped, index: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per example and step (B, T), ‖∂L/∂s_t‖² and ‖its carried part‖² (the total less what
    arrives from above at t), every state joined, in float64: what :func:`joined_totals`
    holds, summed over the state as it is read, one example at a time (no float64 copy of
    the whole sequences). None where no gradient reached the call. Where the cell's output
    is not its first state itself (a cell of the user's returning, say, 2·h), nothing from
    above arrives on a state at its own step (the state's total is what step t+1 reads),
    and the carried part is the whole total (found writing the test of diagnose's squares
    alone: a change's carried flow took the output's gradient off a state it never
    reached, where the probed pass, the layer's own numbers, did not)."""
    if stepped.squares is not None:
        return stepped.squares[index]
    if stepped.totals is None or stepped.direct is None:
        return None
    totals = stepped.totals[index]
    direct = stepped.direct[index]
    first = totals[0]
    subtract = output_is_state(stepped, index) and direct.shape == first.shape
    whole = np.zeros(first.shape[:2])
    carried = np.zeros(first.shape[:2])
    axes = tuple(range(1, first.ndim - 1))  # an example's axes past time
    for example in range(first.shape[0]):
        others = sum((_squares(t[example], axes) for t in totals[1:]),
                     np.zeros(first.shape[1]))
        own = np.asarray(first[example], np.float64)
        rest = own - direct[example] if subtract else own
        whole[example] = _squares(own, axes) + others
        carried[example] = _squares(rest, axes) + others
    return whole, carried


def output_is_state(stepped: Stepped, index: int) -> bool:
    """Whether direction ``index``'s cell returns its first state itself as its output (a
    Keras cell; a cell of the user's may return something else)."""
    return stepped.output_is_state is None or bool(stepped.output_is_state[index])


def last_totals(found: list[Any], mask: Any) -> list[list[np.ndarray]]:
    """Per direction of a probed pass's
    :class:`~gradscope.keras.state_probes.StateTotals` (processing order), each state's total
    at each example's last step that ran, (B, ·): what :func:`step_call` carries back
    (``at_last``). ``mask``: the call's, input order, or None."""
    from gradscope.keras.probed_flow import processing_ran

    found_last = []
    for totals in found:
        if totals.last is not None:  # squares mode: no mask, its totals there already
            found_last.append(totals.last)
            continue
        batch, steps = totals.totals[0].shape[:2]
        ran = processing_ran(mask, steps, totals.backwards)
        last = (np.full(batch, steps - 1) if ran is None else
                steps - 1 - np.argmax(ran[:, ::-1], axis=1))
        found_last.append([t[np.arange(batch), last] for t in totals.totals])
    return found_last


def with_probed(stepped: Stepped, found: list[Any]) -> Stepped:
    """``stepped`` (stepped without a gradient from above, ``at_last`` from
    :func:`last_totals`) with the squares of Keras' own backward pass of the model, probed
    (:class:`~gradscope.keras.state_probes.StateTotals`, one per direction, processing
    order): per direction ‖∂L/∂s_t‖² and ‖its carried part‖² (the total less what arrives
    from above on the state the cell returns as its output), as :func:`step_squares` gives
    them from a stepping's own backward. Diagnose's main pass: the call is then stepped
    forward only, and, where it returns its sequence, carried back from its last step (on
    the LSTM 256 × 2 at 1000 steps, 3.3 s of steppings become about 1 s)."""
    from gradscope.keras.probed_flow import example_squares

    squares = []
    for totals in found:
        if totals.squares is not None:  # squares mode: summed inside the pass
            squares.append(totals.squares)
            continue
        k = totals.output_state
        squares.append((
            np.sum([example_squares(t) for t in totals.totals], axis=0),
            np.sum([example_squares(t - totals.direct
                                    if i == k and totals.direct.shape == t.shape else t)
                    for i, t in enumerate(totals.totals)], axis=0)))
    return replace(stepped, squares=squares, totals=None, direct=None)


def carried_back(stepped: Stepped, index: int) -> np.ndarray | None:
    """Direction ``index``'s ‖v_t‖² (B, T) of what arrives at each example's last step,
    carried back (:attr:`Stepped.carried_back`); None where the call returns its last step
    alone (its totals are that already) or no gradient reached it."""
    return None if stepped.carried_back is None else stepped.carried_back[index]


def _squares(value: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Σ value² over ``axes``, in float64."""
    value = np.asarray(value, np.float64)
    return np.sum(value * value, axis=axes)


def not_stepped(exc: BaseException) -> str:
    """Why a call was left out: its cell, run step by step, raised ``exc``."""
    return f"the cell could not be run step by step: {first_line(exc)}"


def directions_of(layer: Any, label: str) -> list[Direction] | str:
    """The layers a call of ``layer`` steps, or why it cannot be stepped."""
    kind = class_label(layer)
    if kind == "Bidirectional":
        if layer.merge_mode not in MERGES:
            return f"Bidirectional merge_mode {layer.merge_mode!r}"
        parts = [(f"{label}/forward", layer.forward_layer),
                 (f"{label}/backward", layer.backward_layer)]
    else:
        parts = [(label, layer)]
    found = []
    for name, sub in parts:
        if getattr(sub, "cell", None) is None:
            return f"{class_label(sub)} has no cell to step"
        found.append(Direction(name, sub, state_names(sub),
                               bool(getattr(sub, "go_backwards", False))))
    return found


#: The dropout masks a call drew in a cell: (input mask, recurrent mask), each None, one
#: tensor with a row per example (B, ·), or a list of them, one per gate (Keras'
#: ``implementation=1``: an LSTM draws 4, a GRU 3).
Masks = tuple[Any, Any]


def dropout_masks(engine: Any, layer: Any, call: CapturedCall, x: Any,
                  state: Any) -> Masks | str | None:
    """The dropout masks a training-mode call drew in its cell (None: it draws none): drawn
    again from where the cell's seed generator started in that run, as many times as the
    layer had been called, in Keras' order (input mask, then recurrent mask); or why they
    cannot be. The generator is left as it was."""
    cell: Any = layer.cell
    if not engine.training or not (getattr(cell, "dropout", 0) or
                                   getattr(cell, "recurrent_dropout", 0)):
        return None
    generator: Any = getattr(cell, "seed_generator", None)
    start = engine.seeded.get(id(generator))
    if generator is None or start is None:
        return "dropout in training mode from a seed generator gradscope did not seed"
    saved = np.asarray(generator.state.numpy())
    generator.state.assign(start)
    try:
        for _ in range(call.index + 1):
            cell.reset_dropout_mask()
            cell.reset_recurrent_dropout_mask()
            drawn = cell.get_dropout_mask(x[:, 0]), cell.get_recurrent_dropout_mask(state)
        return drawn
    finally:
        generator.state.assign(saved)
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()


def drawn_masks(engine: Any, directions: list[Direction], call: CapturedCall, x: Any,
                initial: list[Any]) -> list[Masks | None]:
    """Per direction, the dropout masks the call drew (:func:`dropout_masks`); raises
    ValueError with the reason where they cannot be drawn again."""
    found: list[Masks | None] = []
    start = 0
    for direction in directions:
        masks = dropout_masks(engine, direction.layer, call, x, initial[start])
        start += len(direction.names)
        if isinstance(masks, str):
            raise ValueError(masks)
        found.append(masks)
    return found


@contextlib.contextmanager
def cell_holding(cell: Any, masks: Masks | None) -> Iterator[None]:
    """``cell`` holding ``masks`` while it steps (None: nothing held), so that its calls in
    training mode multiply by them and draw none of their own; dropped afterwards. Inside a
    traced function, give the masks as its arguments: a tensor read from the cell at trace
    time would be kept in the trace as a constant, and a later call of it would step with
    the masks of the first."""
    if masks is None:
        yield
        return
    cell._dropout_mask, cell._recurrent_dropout_mask = masks
    try:
        yield
    finally:
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()


def masks_for_rows(tf: Any, masks: Masks | None, examples: Any) -> Masks | None:
    """``masks`` (a row per example) for rows folded into the batch: row r gets the masks of
    example ``examples[r]`` (a gather), so that each row steps as its example did."""
    from keras import tree

    return None if masks is None else tree.map_structure(
        lambda value: tf.gather(tf.convert_to_tensor(value), examples), masks,
        none_is_leaf=False)


def masks_numpy(masks: Masks | None) -> Masks | None:
    """``masks`` as NumPy arrays (the same structure)."""
    from keras import tree

    return None if masks is None else tree.map_structure(np.asarray, masks, none_is_leaf=False)


@contextlib.contextmanager
def masks_drawn(engine: Any, directions: list[Direction], call: CapturedCall, x: Any,
                initial: list[Any]) -> Iterator[None]:
    """Each direction's cell holding the dropout masks the call drew (training mode), so
    that stepping it draws none of its own; the masks are dropped afterwards."""
    drawn = drawn_masks(engine, directions, call, x, initial)
    with contextlib.ExitStack() as stack:
        for direction, masks in zip(directions, drawn, strict=True):
            stack.enter_context(cell_holding(direction.layer.cell, masks))
        yield


def step_call(engine: Any, call: CapturedCall, upstream: list[Any] | None,
              training: bool, cell_dtype: bool = False, reuse: bool = False,
              read_inputs: bool = True, squares: bool = False,
              carry_back: bool = True, compiled: bool = False,
              at_last: list[list[np.ndarray]] | None = None) -> Stepped | str:
    """``call`` stepped through its layer's own cells; with ``upstream`` (the tape's
    ∂L/∂ each output of the call), the total ∂L/∂ every state after every step too. Or why
    it is not stepped.

    ``cell_dtype``: the state sequences and totals kept in the cell's dtype, not float64
    (half the memory of a long call; the numbers are the same). ``reuse``: the traced step
    kept on ``engine`` for the next call of the same layer (:func:`engine_cached`).
    ``read_inputs``: ∂L/∂x_t of the input sequence too (``Stepped.inputs``; a quarter of the
    stepping's time on an LSTM 256 at 1000 steps). ``squares``: where the call is long
    (differentiated by stretches), only :func:`step_squares`' two per step are kept
    (``Stepped.squares``), not the totals (diagnose: 0.1 GB less on an LSTM 256 at 1000
    steps). ``carry_back``: where the call returns its sequence, what arrives at each
    example's last step is carried back (``Stepped.carried_back``, one more backward pass).
    ``compiled``: the stepping runs under XLA where it compiles (the cell's small ops fused:
    on a GRU 64 → GRU 32 at 50 steps, batch 32, 2.5 ms of CPU instead of 6.5 ms), its
    states then the graph's to the rounding of the cell's dtype; it pays for a call stepped
    again and again, as during ``fit``. ``at_last``: without ``upstream``, each direction's
    total ∂L/∂ each state at each example's last step that ran (from a probed pass:
    :func:`last_totals`), carried back alone where the call returns its sequence
    (``Stepped.carried_back``)."""
    layer = engine.operation(call.layer)
    label = call_label(call.layer, call.index)
    directions = directions_of(layer, label)
    if isinstance(directions, str):
        return directions
    if not call.states:
        if getattr(layer, "stateful", False):
            carried = _carried_states(directions)
            if carried is None:
                return "stateful, with no state carried to this call"
            call = replace(call, states=carried)
        else:
            own = _own_initial_states(directions, call)
            if isinstance(own, str):
                return own
            call = replace(call, states=own)
    try:
        run = (engine_cached(engine, ("stepped", id(layer), training, cell_dtype, read_inputs,
                                      squares, carry_back, compiled),
                             lambda: stepped_runner(engine, layer, directions, training,
                                                    cell_dtype, read_inputs, squares,
                                                    carry_back, compiled))
               if reuse else stepped_runner(engine, layer, directions, training, cell_dtype,
                                            read_inputs, squares, carry_back, compiled))
        outputs, states, totals, direct, inputs, masks, same, back, kept = run(
            call, upstream, at_last)
    except Exception as exc:  # noqa: BLE001  (the user's cell, run step by step)
        return not_stepped(exc)
    mismatch = _rebuilt(outputs, call, engine.dtype_name)
    if mismatch:
        return mismatch
    return Stepped(label=label, call=call, directions=directions, states=states,
                   totals=totals, direct=direct, inputs=inputs, masks=masks,
                   output_is_state=same, carried_back=back, squares=kept)


def _name_states(direction: Direction, count: int) -> None:
    """Names for a direction's ``count`` states where the run named none (or other
    counts): ``h0`` for one, else ``states[k]``."""
    if len(direction.names) != count:
        direction.names = ["h0"] if count == 1 else [f"states[{k}]" for k in range(count)]


def _carried_states(directions: list[Direction]) -> list[Any] | None:
    """A stateful layer's carried states where the run captured none (a subclass of ``RNN``
    with a loop of its own): what each direction holds now, which is what the call started
    from (every pass puts back the states it moves). None where a direction holds none yet.
    A wrong guess is caught: the rebuilt outputs must equal Keras' own."""
    from keras import tree

    states: list[Any] = []
    for direction in directions:
        held = getattr(direction.layer, "states", None)
        flat = list(tree.flatten(held)) if held is not None else []
        if not flat or any(s is None for s in flat):
            return None
        _name_states(direction, len(flat))
        states += [np.asarray(s) for s in flat]
    return states


def _own_initial_states(directions: list[Direction], call: CapturedCall) -> list[Any] | str:
    """The initial states Keras' call asks its layers for, where the run captured none (a
    ConvLSTM's feature maps, a cell that makes its own): each direction's
    ``get_initial_state``. A state wired in instead makes the rebuilt outputs differ from
    Keras', and the call is refused then."""
    from keras import tree

    batch = int(np.shape(call.args[0])[0])
    states: list[Any] = []
    for direction in directions:
        getter = getattr(direction.layer, "get_initial_state", None)
        if getter is None:
            return "no initial state captured"
        try:
            mine = list(tree.flatten(getter(batch)))
        except Exception as exc:  # noqa: BLE001  (the user's get_initial_state)
            return f"its get_initial_state raised: {first_line(exc)}"
        _name_states(direction, len(mine))
        states += mine
    return states


def _rebuilt(outputs: list[np.ndarray], call: CapturedCall, dtype: str) -> str | None:
    """None when every output the stepping rebuilt equals Keras' own: the same cell and the
    same operations, so only rounding may differ (Keras' loop and a scan over the same cell
    order their reductions alike only up to that: ten times the replay's tolerance)."""
    rtol, atol = tolerance("replay", dtype)
    found = compared_outputs(outputs, call.outputs, 10 * rtol, 10 * atol, "the stepped cell")
    return found if isinstance(found, str) else None


def stepped_runner(engine: Any, layer: Any, directions: list[Direction], training: bool,
                   cell_dtype: bool = False, read_inputs: bool = True,
                   squares: bool = False, carry_back: bool = True,
                   compiled: bool = False) -> Any:
    """``run(call, upstream)`` → the call's outputs rebuilt, each direction's state sequences
    and (with ``upstream``) the total ∂L/∂ each state after every step, what arrives from
    above, and ∂L/∂x_t of the input sequence, all in NumPy (the outputs in their dtype, the
    rest float64, the sequences and totals in the cell's dtype with ``cell_dtype``), and
    each direction's dropout masks (:func:`drawn_masks`). One traced function: the scan is
    a loop in the graph, never a Python loop over time; the masks are its arguments, so a
    trace kept for the next call (``reuse``) steps with that call's own. ``squares``: a long
    call keeps :func:`step_squares`' two in place of its totals (see :func:`step_call`); the
    totals and what arrives from above are then None, and the squares come last.
    ``carry_back``, ``compiled``: see :func:`step_call`."""
    tf, keras = engine.tf, engine.keras
    bidirectional = class_label(layer) == "Bidirectional"
    counts = [len(d.names) for d in directions]
    # A gradient from above may enter at every step: what enters at the last is carried
    # back once more (:func:`~gradscope.keras.state_probes.carried_back`).
    sequences = carry_back and bool(getattr(layer, "return_sequences", False))
    # Filled at tracing, per direction: whether its cell's output is its first state.
    seen: list[dict[str, Any]] = [{} for _ in directions]

    def stepping(x: Any, mask: Any, initial: list[Any], upstream: list[Any] | None,
                 drawn: list[Masks | None], stretched: bool = False) -> Any:
        starts = np.cumsum([0, *counts])
        parts = [initial[starts[k]:starts[k + 1]] for k in range(len(directions))]
        if stretched and upstream is not None:
            return _by_stretches(tf, keras, layer, directions, parts, drawn, x, mask,
                                 upstream, training, read_inputs, seen, squares)
        steps = tf.shape(x)[1]
        probes = [[tf.zeros(tf.concat([[steps], tf.shape(s)], 0), s.dtype) for s in part]
                  for part in parts]
        above: list[Any] = [None] * len(directions)
        # No variable watched: the probes, what arrives from above and (``read_inputs``) x;
        # persistent where what arrives at the last step is carried back once more.
        with tape_for(tf, sequences, watch_accessed_variables=False) as tape:
            tape.watch([probes, x] if read_inputs else [probes])
            scans = []
            for d, part, probe, masks, held in zip(directions, parts, probes, drawn, seen,
                                                   strict=True):
                with cell_holding(d.layer.cell, masks):
                    scans.append(scan_cell(tf, keras, d.layer, x, mask, part, probe, training,
                                           seen=held))
            # A zero added to each output sequence alone: its gradient is what arrives from
            # above at each step, apart from what the recurrence carries.
            above = [tf.zeros_like(outs) for _, outs in scans]
            tape.watch(above)
            scans = [(states, outs + zero) for (states, outs), zero in zip(scans, above,
                                                                           strict=True)]
            outputs = _outputs(tf, layer, scans, bidirectional)
            objective = (None if upstream is None else
                         tf.add_n([tf.reduce_sum(tf.cast(g, o.dtype) * o)
                                   for g, o in zip(upstream, outputs, strict=True)
                                   if g is not None]))
        totals = direct = read = back = None
        if objective is not None:
            totals, direct, *rest = tape.gradient(objective, [probes, above] + (
                [x] if read_inputs else []), unconnected_gradients="zero")
            read = rest[0] if rest else None
            if sequences:
                back = [_carried_back(tf, tape, states, probe, total, mask, d.backwards)
                        for (states, _), probe, total, d in zip(scans, probes, totals,
                                                                directions, strict=True)]
        return outputs, [scan[0] for scan in scans], totals, direct, read, back

    from gradscope._tf import batch_free, xla_or_graph

    traced = (xla_or_graph(tf, stepping, autograph=False, reduce_retracing=True) if compiled
              else batch_free(tf, tf.function(stepping, autograph=False,
                                              reduce_retracing=True)))

    @tf.function(autograph=False, reduce_retracing=True)
    def carried(x: Any, mask: Any, initial: list[Any], states: list[list[Any]],
                at_last: list[list[Any]], drawn: list[Masks | None]) -> Any:
        """A long call's :func:`_last_step_back`, per direction: a function of its own, run
        after the stepping has let its memory go (within it, the peak grew by 0.7 GB on an
        LSTM 256 at 1000 steps)."""
        starts = np.cumsum([0, *counts])
        found = []
        for k, (d, masks) in enumerate(zip(directions, drawn, strict=True)):
            with cell_holding(d.layer.cell, masks):
                found.append(_last_step_back(tf, keras, d, x, mask,
                                             initial[starts[k]:starts[k + 1]], states[k],
                                             at_last[k], training))
        return found

    def run(call: CapturedCall, upstream: list[Any] | None,
            at_last: list[list[np.ndarray]] | None = None) -> tuple[
            list[np.ndarray], list[list[np.ndarray]], list[list[np.ndarray]] | None,
            list[np.ndarray] | None, np.ndarray | None, list[Masks | None], list[bool],
            list[np.ndarray | None] | None, list[tuple[np.ndarray, np.ndarray]] | None]:
        from gradscope._tf import native_stderr_silenced, without_grappler

        x = tf.convert_to_tensor(call.args[0])
        mask = None if call.mask is None else tf.convert_to_tensor(call.mask)
        initial = [tf.convert_to_tensor(s) for s in call.states]
        given = (None if upstream is None or all(g is None for g in upstream) else
                 [None if g is None else tf.convert_to_tensor(g) for g in upstream])
        drawn = drawn_masks(engine, directions, call, x, initial)
        stretched = given is not None and int(np.shape(call.args[0])[1]) > 2 * STRETCH_STEPS
        with native_stderr_silenced(), without_grappler():
            outputs, states, totals, direct, read, back = traced(x, mask, initial, given,
                                                                 drawn, stretched)
            kept = None
            if stretched and squares:  # the squares in place of the totals
                kept, totals, at_last = totals, None, back
                back = carried(x, mask, initial, states, at_last, drawn) if sequences else None
            elif stretched and sequences and totals is not None:
                back = carried(x, mask, initial, states,
                               [_at_last_step(tf, part, mask, d.backwards)
                                for part, d in zip(totals, directions, strict=True)], drawn)
            elif given is None and sequences and at_last is not None:
                back = carried(x, mask, initial, states,
                               [[tf.cast(a, s.dtype) for a, s in zip(part, held, strict=True)]
                                for part, held in zip(at_last, states, strict=True)], drawn)
        kind = None if cell_dtype else np.float64
        return ([np.asarray(o) for o in outputs],  # in their dtype: only compared
                [[_batch_major(s, kind) for s in part] for part in states],
                None if totals is None else [[_batch_major(g, kind) for g in part]
                                             for part in totals],
                None if direct is None else [_batch_major(g, kind) for g in direct],
                None if read is None else np.asarray(read, np.float64),
                [masks_numpy(m) for m in drawn],
                [bool(held.get("output_is_state", True)) for held in seen],
                None if back is None else [np.swapaxes(np.asarray(b), 0, 1) for b in back],
                None if kept is None else [(np.swapaxes(np.asarray(w), 0, 1),
                                            np.swapaxes(np.asarray(c), 0, 1)) for w, c in kept])

    return run


#: A call longer than twice this many steps is differentiated this many steps at a time
#: (:func:`_by_stretches`).
STRETCH_STEPS = 128


def _by_stretches(tf: Any, keras: Any, layer: Any, directions: list[Direction],
                  parts: list[list[Any]], drawn: list[Masks | None], x: Any, mask: Any,
                  upstream: list[Any], training: bool, read_inputs: bool,
                  seen: list[dict[str, Any]], squares: bool = False) -> Any:
    """What ``stepped_runner``'s traced pass returns with ``upstream``, with the memory of
    :data:`STRETCH_STEPS` steps instead of every step's: the scans run forward once,
    untaped, keeping each state's sequence and the outputs; ∂L/∂ those outputs (what
    arrives from above at each step) and ∂L/∂ the final states come from Keras' merge
    alone; then, from the last stretch of steps to the first, each stretch is stepped again
    from the states the forward scan left before it, under its own tape, its gradient
    carrying on from what the stretch after it gave its first states (and its first
    output, which a masked step keeps). The numbers are the whole tape's; the cost is one
    more forward pass. With ``squares``, each direction keeps :func:`step_squares`' two
    (T, B) and its totals at each example's last step (``_stretches_back(keep="squares")``)
    in place of its totals, and what arrives from above is not returned."""
    bidirectional = class_label(layer) == "Bidirectional"
    scans = []
    for d, part, masks, held in zip(directions, parts, drawn, seen, strict=True):
        steps = tf.shape(x)[1]
        probe = [tf.zeros(tf.concat([[steps], tf.shape(s)], 0), s.dtype) for s in part]
        with cell_holding(d.layer.cell, masks):
            scans.append(scan_cell(tf, keras, d.layer, x, mask, part, probe, training,
                                   seen=held))
    sequences = [states for states, _ in scans]
    outs = [o for _, o in scans]
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch([sequences, outs])
        outputs = _outputs(tf, layer, list(zip(sequences, outs, strict=True)), bidirectional)
        objective = tf.add_n([tf.reduce_sum(tf.cast(g, o.dtype) * o)
                              for g, o in zip(upstream, outputs, strict=True) if g is not None])
    on_states, direct = tape.gradient(objective, [sequences, outs],
                                      unconnected_gradients="zero")
    totals, reads, at_last = [], [], []
    for k, (d, part, masks) in enumerate(zip(directions, parts, drawn, strict=True)):
        last = (last_steps(tf, mask, tf.shape(x)[0], tf.shape(x)[1], d.backwards)
                if squares else None)
        with cell_holding(d.layer.cell, masks):
            total, read, found = _stretches_back(
                tf, keras, d.layer, x, mask, part, sequences[k], outs[k], on_states[k],
                direct[k], training, read_inputs, keep="squares" if squares else "totals",
                last_ran=last, output_is_state=bool(seen[k].get("output_is_state", True)))
        totals.append(total)
        reads.append(read)
        at_last.append(found)
    read = tf.add_n(reads) if read_inputs else None
    if squares:
        return outputs, sequences, totals, None, read, at_last
    return outputs, sequences, totals, direct, read, None


def _last_step_back(tf: Any, keras: Any, direction: Direction, x: Any, mask: Any,
                    initial: list[Any], sequences: list[Any], at_last: list[Any],
                    training: bool) -> Any:
    """What arrives at each example's last step that ran, carried back alone
    (:func:`_carried_back`), for a long call: the backward by stretches again
    (:func:`_stretches_back`) from the state sequences the stepping kept (time-major,
    processing order), seeded with each example's totals at that step (``at_last``: per
    state, (B, ·)) there only. ‖v_t‖² (T, B)."""
    steps, batch = tf.shape(sequences[0])[0], tf.shape(sequences[0])[1]
    last = last_steps(tf, mask, batch, steps, direction.backwards)

    def seeds(first: Any, end: Any) -> list[Any]:
        here = tf.equal(tf.range(first, end)[:, None], last[None, :])  # (n, B)
        return [tf.where(_along(tf, here, s), g[None], tf.zeros_like(s[first:end]))
                for g, s in zip(at_last, sequences, strict=True)]

    # Nothing arrives on the outputs: what a masked step keeps of the last is not read.
    (back,), _, _ = _stretches_back(tf, keras, direction.layer, x, mask, initial, sequences,
                                    None, seeds, None, training, read_inputs=False,
                                    keep="joined")
    return back


def _stretches_back(tf: Any, keras: Any, layer: Any, x: Any, mask: Any, initial: list[Any],
                    sequences: list[Any], outs: Any, on_states: Any, on_outs: Any,
                    training: bool, read_inputs: bool, keep: str = "totals",
                    last_ran: Any = None, output_is_state: bool = True,
                    ) -> tuple[list[Any], Any, list[Any] | None]:
    """One direction's backward pass by stretches (:func:`_by_stretches`), a loop in the
    graph: the total ∂L/∂ each state after every step (time-major, processing order) and,
    with ``read_inputs``, ∂L/∂x (batch-major, input order; else None).

    ``outs`` None: nothing arrives on the outputs (``on_outs`` is not read); ``on_states``:
    each state's sequence, or ``on_states(first, end)`` → the stretch's. What is kept, a
    stretch's worth of memory instead of the whole sequence's: ``keep="joined"``, instead of
    the totals, ``[Σ over every state of its total²]``; ``keep="squares"``, :func:`step_squares`'
    two, ``[‖∂L/∂s_t‖², ‖its carried part‖²]``, both (T, B) in float64, and, third, each
    state's total at each example's step ``last_ran`` (B,) (else None). ``output_is_state``:
    the cell's output is its first state itself (:func:`step_squares`)."""
    steps = tf.shape(sequences[0])[0]
    count = (steps + STRETCH_STEPS - 1) // STRETCH_STEPS
    backwards = bool(getattr(layer, "go_backwards", False))
    dtype = layer.cell.compute_dtype
    initial = [tf.cast(s, dtype) for s in initial]
    outputs = outs is not None
    # step_squares' carried part: the output's gradient is taken off the first state's
    subtract = (outputs and output_is_state
                and list(outs.shape[2:]) == list(sequences[0].shape[2:]))

    def kept(first: Any, end: Any, on_probes: list[Any], acc: list[Any]) -> tuple[
            list[Any], list[Any]]:
        """What a stretch writes, and the totals at each example's last step so far."""
        if keep == "totals":
            return on_probes, acc
        whole = joined_squares(tf, on_probes)
        if keep == "joined":
            return [whole], acc
        rest = on_probes[0] - on_outs[first:end] if subtract else on_probes[0]
        carried = joined_squares(tf, [rest, *on_probes[1:]])
        here = tf.equal(tf.range(first, end)[:, None], last_ran[None, :])  # (n, B)
        acc = [a + tf.reduce_sum(tf.where(_along(tf, here, g), g, tf.zeros_like(g)), axis=0)
               for a, g in zip(acc, on_probes, strict=True)]
        return [whole, carried], acc

    def body(k: Any, carried: list[Any], carried_out: Any, written: list[Any],
             read: Any, acc: list[Any]) -> tuple[Any, ...]:
        stretch = count - 1 - k  # from the last stretch to the first
        first = stretch * STRETCH_STEPS
        end = tf.minimum(first + STRETCH_STEPS, steps)
        before = tf.maximum(first - 1, 0)
        start = [tf.where(first > 0, seq[before], s0)
                 for seq, s0 in zip(sequences, initial, strict=True)]
        last = tf.where(first > 0, outs[before], tf.zeros_like(outs[0])) if outputs else None
        # processing steps first..end−1: input steps T−end..T−first−1 when run backwards
        lo, hi = (steps - end, steps - first) if backwards else (first, end)
        xs = x[:, lo:hi]
        ms = None if mask is None else mask[:, lo:hi]
        probes = [tf.zeros_like(seq[first:end]) for seq in sequences]
        here = (on_states(first, end) if callable(on_states) else
                [g[first:end] for g in on_states])
        watched = [probes, start] + ([last] if outputs else [])
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(watched + ([xs] if read_inputs else []))
            states, o = scan_cell(tf, keras, layer, xs, ms, start, probes, training,
                                  last_output=last)
            objective = (tf.add_n([tf.reduce_sum(g * s)
                                   for g, s in zip(here, states, strict=True)])
                         + tf.add_n([tf.reduce_sum(c * s[-1])
                                     for c, s in zip(carried, states, strict=True)]))
            if outputs:
                objective += (tf.reduce_sum(on_outs[first:end] * o)
                              + tf.reduce_sum(carried_out * o[-1]))
        found = tape.gradient(objective, watched + ([xs] if read_inputs else []),
                              unconnected_gradients="zero")
        on_probes, on_start = found[:2]
        on_last = found[2] if outputs else carried_out
        pieces, acc = kept(first, end, on_probes, acc)
        written = [w.write(stretch, g) for w, g in zip(written, pieces, strict=True)]
        if read_inputs:  # time-major, so that the pieces join along axis 0
            read = read.write(count - 1 - stretch if backwards else stretch,
                              tf.transpose(found[-1], [1, 0, *range(2, len(x.shape))]))
        return k + 1, on_start, on_last, written, read, acc

    written = ([tf.TensorArray(seq.dtype, size=count, infer_shape=False) for seq in sequences]
               if keep == "totals" else
               [tf.TensorArray(tf.float64, size=count, infer_shape=False)
                for _ in range(1 if keep == "joined" else 2)])
    read = tf.TensorArray(x.dtype, size=count if read_inputs else 0, infer_shape=False)
    acc = [tf.zeros_like(s) for s in initial]
    _, _, _, written, read, acc = tf.while_loop(
        lambda k, *rest: k < count, body,
        (tf.constant(0), [tf.zeros_like(s) for s in initial],
         tf.zeros_like(outs[0]) if outputs else tf.zeros([], dtype), written, read, acc))
    totals = [w.concat() for w in written]
    at_last = acc if keep == "squares" else None
    if not read_inputs:
        return totals, None, at_last
    return totals, tf.transpose(read.concat(), [1, 0, *range(2, len(x.shape))]), at_last


def _at_last_step(tf: Any, totals: list[Any], mask: Any, backwards: bool) -> list[Any]:
    """Each state's total (time-major, processing order) at each example's last step that
    ran: (B, ·) per state."""
    steps, batch = tf.shape(totals[0])[0], tf.shape(totals[0])[1]
    at = tf.stack([last_steps(tf, mask, batch, steps, backwards), tf.range(batch)], axis=1)
    return [tf.gather_nd(g, at) for g in totals]


def _along(tf: Any, where: Any, value: Any) -> Any:
    """``where`` (T, B) broadcast to a time-major ``value`` (T, B, ·)."""
    return tf.reshape(where, [tf.shape(where)[0], tf.shape(where)[1],
                              *[1] * (len(value.shape) - 2)])


def _carried_back(tf: Any, tape: Any, states: list[Any], probes: list[Any],
                  totals: list[Any], mask: Any, backwards: bool) -> Any:
    """What the loss puts on the states at each example's last step that ran (``totals``
    there), carried back through the recurrence alone: ‖v_t‖² (T, B), time-major,
    processing order, every state joined; the gradient of those totals · the scan's final
    states with respect to its ``probes`` (the persistent ``tape``'s; ``states`` and
    ``totals`` time-major, ``mask`` (B, T) input order or None). See
    :func:`~gradscope.keras.state_probes.carried_back`."""
    # On the whole sequences the tape recorded, at their last step (a slice taken now
    # would not be on the tape).
    seeds = [tf.concat([tf.zeros_like(s[:-1]), g[None]], axis=0)
             for s, g in zip(states, _at_last_step(tf, totals, mask, backwards), strict=True)]
    back = gradient(tf, tape, states, probes, seeds)
    return joined_squares(tf, back)


def _batch_major(value: Any, dtype: Any = np.float64) -> np.ndarray:
    """A time-major sequence (T, B, ·) as (B, T, ·), in ``dtype`` (None: its own)."""
    return np.swapaxes(np.asarray(value, dtype), 0, 1)


def engine_cached(engine: Any, key: tuple[Any, ...], build: Any) -> Any:
    """``build()`` (a traced function), made once per ``engine`` and ``key``: the changes of
    a counterfactual run on one copy, whose variables a trace reads as they are at each call,
    so each reuses the first one's trace. An engine that takes no attribute builds every
    time."""
    store = getattr(engine, "_traces", None)
    if store is None:
        store = {}
        try:
            engine._traces = store
        except AttributeError:
            return build()
    if key not in store:
        store[key] = build()
    return store[key]


def cell_states(cell: Any, flat: list[Any]) -> Any:
    """The states as ``cell`` takes them, from their flat list: Keras' StackedRNNCells
    takes one entry per cell (``[[h, c], h]`` for an LSTMCell over a GRUCell), every other
    cell the flat list itself (what gradscope passed before; found tried as a new user
    would: a stack was refused with "LSTMCell.call(): list index out of range")."""
    if class_label(cell) != "StackedRNNCells":
        return list(flat)
    nested, at = [], 0
    for inner in cell.cells:
        size = inner.state_size
        count = len(size) if isinstance(size, (list, tuple)) else 1
        part = list(flat[at:at + count])
        nested.append(part if isinstance(size, (list, tuple)) else part[0])
        at += count
    if at != len(flat):
        return list(flat)  # not the stack's own count: as before (the run says why)
    return nested


def zero_output(tf: Any, layer: Any, x: Any, initial: list[Any], training: bool) -> Any:
    """Zeros shaped as the layer's cell's output at a step (B, ·): the last output Keras'
    masked loop carries before its first kept step (:func:`scan_cell`'s default)."""
    cell = layer.cell
    kwargs = {"training": training} if getattr(cell, "_call_has_training_arg", False) else {}
    states = [tf.cast(s, cell.compute_dtype) for s in initial]
    out, _ = cell(x[:, 0], cell_states(cell, states), **kwargs)
    return tf.zeros_like(out)


def scan_cell(tf: Any, keras: Any, layer: Any, x: Any, mask: Any, initial: list[Any],
          probes: list[Any], training: bool, cuts: Any = None,
          edges: list[Any] | None = None, last_output: Any = None,
          seen: dict[str, Any] | None = None) -> tuple[list[Any], Any]:
    """The layer's cell over ``x`` (B, T, ·) as Keras' RNN loop runs it: in processing order
    (reversed for go_backwards), a masked step keeping the states and the last output (or a
    zero output, with ``zero_output_for_mask``). A zero probe is added to every state a step
    leaves; where the cell returns that very state as its output, the output of a kept step
    is the probed state, so that the gradient from above at t reaches the probe. With
    ``cuts`` (T,) and ``edges`` (one (T, B, ·) per state), the states entering step p are
    held (``tf.stop_gradient``) where ``cuts[p]`` is nonzero, then ``edges[p]`` is added:
    truncated BPTT (:mod:`~gradscope.keras.truncation`); one edge more (behind a mask) holds
    the last output the loop carries there too, as a masked step's output is that last
    output, not a state. ``last_output``: the output before
    the first step (what a masked first step keeps; default zeros), for a stretch of a longer
    call. ``seen`` gets ``output_is_state`` at tracing: whether the cell's output is its first
    state itself. Returns every state's sequence and the outputs, time-major."""
    cell = layer.cell
    kwargs = {"training": training} if getattr(cell, "_call_has_training_arg", False) else {}
    backwards = bool(getattr(layer, "go_backwards", False))
    zeros_if_masked = bool(getattr(layer, "zero_output_for_mask", False))
    x_tm = tf.transpose(x, [1, 0, *range(2, len(x.shape))])
    m_tm = None if mask is None else tf.transpose(tf.cast(mask, tf.bool), [1, 0])
    if backwards:
        x_tm = tf.reverse(x_tm, [0])
        m_tm = None if m_tm is None else tf.reverse(m_tm, [0])
    initial = [tf.cast(s, cell.compute_dtype) for s in initial]

    def step(x_t: Any, states: list[Any]) -> tuple[Any, list[Any]]:
        out, new = cell(x_t, cell_states(cell, list(states)), **kwargs)
        return out, list(keras.tree.flatten(new))

    if last_output is None:
        last_output = zero_output(tf, layer, x, initial, training)

    def kept(m_t: Any, value: Any, other: Any) -> Any:
        shape = [-1] + [1] * (len(value.shape) - 1)
        return tf.where(tf.reshape(m_t, shape), value, other)

    def body(carry: tuple[list[Any], Any], elems: tuple[Any, ...]) -> tuple[list[Any], Any]:
        states, previous = carry
        x_t, m_t, probes_t, *cut = elems
        if cut:
            cut_t, edges_t = cut
            states = [tf.where(cut_t > 0, tf.stop_gradient(s), s) + e
                      for s, e in zip(states, edges_t[:len(states)], strict=True)]
            if len(edges_t) > len(states):
                previous = tf.where(cut_t > 0, tf.stop_gradient(previous), previous) \
                    + edges_t[-1]
        out, new = step(x_t, states)
        same = [k for k, n in enumerate(new) if n is out]
        if seen is not None:
            seen["output_is_state"] = 0 in same
        if m_t is not None:
            new = [kept(m_t, n, s) for n, s in zip(new, states, strict=True)]
            out = kept(m_t, out, tf.zeros_like(out) if zeros_if_masked else previous)
        new = [n + p for n, p in zip(new, probes_t, strict=True)]
        if same:
            # A masked step's output is the last output (or zero), not the carried state:
            # Keras' loop chains its outputs apart from its states.
            probed = new[same[0]]
            out = probed if m_t is None else kept(
                m_t, probed, tf.zeros_like(out) if zeros_if_masked else previous)
        return new, out

    cut = () if cuts is None else (cuts, edges)
    if m_tm is None:
        def unmasked(carry: tuple[list[Any], Any], items: tuple[Any, ...]) -> tuple[
                list[Any], Any]:
            return body(carry, (items[0], None, *items[1:]))

        states, outs = tf.scan(unmasked, (x_tm, probes, *cut),
                               initializer=(initial, last_output))
    else:
        states, outs = tf.scan(body, (x_tm, m_tm, probes, *cut),
                               initializer=(initial, last_output))
    return list(states), outs


def _outputs(tf: Any, layer: Any, scans: list[tuple[list[Any], Any]],
             bidirectional: bool) -> list[Any]:
    """What Keras returns for the call, from the scans (batch-major): the sequence (in
    processing order, as Keras returns a go_backwards layer's) or its last step, merged for a
    Bidirectional (its backward sequence flipped back), then the final states with
    ``return_state``."""
    sequences = layer.return_sequences
    ys = []
    for _, outs in scans:
        ys.append(tf.transpose(outs, [1, 0, *range(2, len(outs.shape))]) if sequences
                  else outs[-1])
    finals = [s[-1] for states, _ in scans for s in states] if layer.return_state else []
    if not bidirectional:
        return [ys[0], *finals]
    forward, backward = ys
    if sequences:
        backward = tf.reverse(backward, [1])
    mode = layer.merge_mode
    merged = {"concat": lambda: [tf.concat([forward, backward], axis=-1)],
              "sum": lambda: [forward + backward], "ave": lambda: [(forward + backward) / 2],
              "mul": lambda: [forward * backward],
              None: lambda: [forward, backward]}[mode]()
    return [*merged, *finals]


def _inputs(tf: Any, stepped: Stepped, index: int) -> tuple[Direction, Any, Any, list[Any]]:
    """Direction ``index`` of a stepped call, its input, mask and own initial states."""
    call = stepped.call
    counts = [len(d.names) for d in stepped.directions]
    start = int(np.sum(counts[:index]))
    initial = [tf.convert_to_tensor(s) for s in call.states[start:start + counts[index]]]
    mask = None if call.mask is None else tf.convert_to_tensor(call.mask)
    return stepped.directions[index], tf.convert_to_tensor(call.args[0]), mask, initial


def state_jacobian(engine: Any, stepped: Stepped, index: int) -> np.ndarray | str:
    """∂(final states)/∂(initial states) per example (B, S, S) of direction ``index`` of a
    stepped call, its states concatenated ([h, c] for an LSTM), in the cell's dtype: the
    tangents of every initial-state unit carried forward through the cell's steps
    (:mod:`~gradscope.keras.state_tangents`), or, where ``vectorized_map`` cannot convert
    the cell's step, one backward pass per unit; or why it cannot be given."""
    from gradscope._tf import native_stderr_silenced, without_grappler
    from gradscope.keras.state_tangents import jacobian_function
    from gradscope.keras.state_tangents import state_jacobian as carried

    tf = engine.tf
    direction, x, mask, initial = _inputs(tf, stepped, index)
    shapes = [[int(n) for n in s.shape[1:]] for s in initial]
    size = sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes)
    flat = all(len(shape) == 1 for shape in shapes)
    if not flat and (size > JACOBIAN_STATES
                     or int(x.shape[0]) * size * size > INFLUENCE_NUMBERS):
        return (f"a state of {size:,} numbers per example: its Jacobian ({size:,} × "
                f"{size:,} per example) is too large to compute")
    everything = [tf.convert_to_tensor(s) for s in stepped.call.states]
    with masks_drawn(engine, stepped.directions, stepped.call, x, everything), \
            native_stderr_silenced(), without_grappler():
        if not flat:
            # A state of several axes (a ConvLSTM's feature maps) is read flat.
            return _state_jacobian_backward(engine, direction, x, mask, initial)
        inputs, start = _time_major(tf, direction.layer, x, mask, initial)
        by_hand = linearised(engine, direction.layer)
        if by_hand is not None:
            # In float64, as gradscope's cells take an unmasked call.
            compute = jacobian_function(tf, _cell_advance(engine, direction.layer),
                                        tangent=by_hand)
            jacobian, final = carried(
                tf, compute, {}, tuple(v if v.dtype == tf.bool else tf.cast(v, tf.float64)
                                       for v in inputs),
                [tf.cast(s, tf.float64) for s in start])
            # Witnessed: gradscope's cell must end where the layer's own cell ended.
            ended = np.concatenate([s[:, -1].reshape(len(s), -1)
                                    for s in stepped.states[index]], axis=1)
            rtol, atol = tolerance("cross_check", str(x.dtype.name))
            if np.allclose(final, ended, rtol=rtol, atol=atol):
                return jacobian  # float64
        try:
            cell = direction.layer.cell
            # Dropout masks drawn for B examples do not fold k copies of the batch.
            dropping = engine.training and bool(getattr(cell, "dropout", 0)
                                                or getattr(cell, "recurrent_dropout", 0))
            compute = jacobian_function(tf, _cell_advance(engine, direction.layer),
                                        folded=False if dropping else None)
            jacobian, _ = carried(tf, compute, {}, inputs, start)
            return jacobian.astype(cell.compute_dtype)  # what it was computed in
        except Exception:  # noqa: BLE001  (a step vectorized_map cannot convert)
            return _state_jacobian_backward(engine, direction, x, mask, initial)


def linearised(engine: Any, layer: Any, dtype: str = "float64") -> Any:
    """For a Keras GRU, LSTM or SimpleRNN whose cell gradscope's cells model (masks aside),
    its step linearised by hand (:meth:`~gradscope.cells.base.Cell.tf_step_linear`) on the
    layer's own weights in ``dtype`` (read at each call), a :class:`Linearised`; else None."""
    from gradscope.keras.layers import LayerFacts, explainer_for
    from gradscope.keras.layers.recurrent import RecurrentExplainer

    kind = class_label(layer)
    if kind not in ("GRU", "LSTM", "SimpleRNN"):
        return None
    tf = engine.tf
    kernel = getattr(layer.cell, "kernel", None)
    if kernel is None:
        return None
    facts = LayerFacts(name=layer.name, class_name=kind, config=layer.get_config(),
                       input_shapes=((None, None, int(kernel.shape[0])),))
    explainer = explainer_for(kind)
    if unmodelled(facts, engine.training) or not isinstance(explainer, RecurrentExplainer):
        return None
    try:
        cell = explainer.cell(facts)
        variables = {v.path.split("/")[-1]: v for v in layer.weights}
        # Only the shapes are read here: the values are read at each call (a trace kept across
        # a change of the weights, by training or by a counterfactual, reads the new ones).
        shapes = cell_params(cell, {k: np.zeros(v.shape) for k, v in variables.items()})
    except Exception:  # noqa: BLE001  (a layer the explainer does not read: autodiff)
        return None
    if not cell.has_tangent or set(shapes) - set(variables) - {"bias"}:
        return None

    def read() -> tuple[dict[str, Any], dict[str, Any]]:
        params = {k: (tf.cast(tf.convert_to_tensor(variables[k]), dtype) if k in variables
                      else tf.zeros(value.shape, dtype)) for k, value in shapes.items()}
        return params, cell.tf_step_weights(tf, params)

    def projected(x: Any, weights: Any) -> Any:
        return cell.tf_inputs(tf, weights[0], x)[0]

    def step_linear(states: list[Any], projected_t: Any, step_weights: Any
                    ) -> tuple[list[Any], Any]:
        after, apply = cell.tf_step_linear(tf, step_weights, tuple(states), (projected_t,))
        return list(after), lambda tangents, inputs=None: list(apply(tuple(tangents), inputs))

    def linear(states: list[Any], x_t: Any, weights: Any = None) -> tuple[list[Any], Any]:
        weights = weights or read()
        return step_linear(states, projected(x_t[None], weights)[0], weights[1])

    return Linearised(linear, read, projected, step_linear,
                      algebra_key(kind, layer.get_config(), dtype))


#: Config keys of a Keras GRU, LSTM or SimpleRNN that do not change what its step computes
#: from the projected input, the states and the recurrent weights.
NOT_ALGEBRA = frozenset({"name", "trainable", "return_sequences", "return_state", "go_backwards",
                         "stateful", "unroll", "seed", "dtype"})


def algebra_key(kind: str, config: dict[str, Any], dtype: str) -> str:
    """What makes two layers' steps linearised by hand the same function of (the projected
    input, the states, the step weights): their class, the dtype the step runs in and every
    setting of their config but their name, their loop's settings and how their weights
    were drawn, held and limited. Layers that share it share the functions traced (and
    compiled) for it, given their own weights: both directions of a Bidirectional, a stack
    of layers of one size."""
    import json

    kept = {k: v for k, v in config.items() if k not in NOT_ALGEBRA
            and not k.endswith(("_initializer", "_regularizer", "_constraint"))}
    return json.dumps([kind, dtype, kept], sort_keys=True, default=str)


@dataclass
class Linearised:
    """A layer's step linearised by hand (:func:`linearised`). Called as
    ``(None, states, inputs_t, tangents)`` → (the new states, J_t applied to the block of
    tangents), a masked step (``inputs_t[1]`` False) keeping both, as
    :func:`~gradscope.keras.state_tangents.jacobian_function` takes a tangent;
    ``linear(states, x_t, weights)`` → (the new states, ``apply(tangents, inputs=None)``):
    the step's own values computed once for every block ``apply`` is given (a step that ran;
    ``inputs``: a block of tangents of the projected input, too).
    ``weights()`` reads the layer's weights as they are (in a traced loop: once, before it),
    for ``linear`` and ``projected``; without them, ``linear`` reads them itself: (the cell's
    parameters, the step weights)."""

    linear: Callable[..., tuple[list[Any], Any]]
    weights: Callable[[], Any]
    #: ``projected(x, weights)``: the projected inputs of a whole sequence (its leading axes
    #: kept: (B, T, ·) → (B, T, ·)), one matmul, outside a scan.
    projected: Callable[..., Any]
    #: ``step_linear(states, projected_t, step_weights)`` → ``linear``'s two, from the
    #: projected input and the step weights alone (``weights()[1]``): a function of the
    #: algebra (:func:`algebra_key`), not of the layer, which a scan shared by layers with
    #: one key takes as its arguments.
    step_linear: Callable[..., tuple[list[Any], Any]]
    key: str

    def __call__(self, weights: Any, states: list[Any], inputs_t: tuple[Any, ...],
                 tangents: list[Any]) -> tuple[list[Any], list[Any]]:
        after, apply = self.linear(states, inputs_t[0], weights)
        moved = apply(tangents)
        if len(inputs_t) == 1:
            return after, moved
        import tensorflow as tf

        keep = tf.reshape(inputs_t[1], [-1, 1])
        return ([tf.where(keep, a, s) for a, s in zip(after, states, strict=True)],
                [tf.where(keep[None], m, t) for m, t in zip(moved, tangents, strict=True)])


def _time_major(tf: Any, layer: Any, x: Any, mask: Any,
                initial: list[Any]) -> tuple[tuple[Any, ...], list[Any]]:
    """What the layer's loop reads at each step, time-major in processing order (the input,
    and the mask as booleans if there is one), and its initial states in the cell's dtype."""
    x_tm = tf.transpose(x, [1, 0, *range(2, len(x.shape))])
    inputs = [x_tm] if mask is None else [x_tm, tf.transpose(tf.cast(mask, tf.bool), [1, 0])]
    if getattr(layer, "go_backwards", False):
        inputs = [tf.reverse(value, [0]) for value in inputs]
    return tuple(inputs), [tf.cast(s, layer.cell.compute_dtype) for s in initial]


def _cell_advance(engine: Any, layer: Any) -> Any:
    """One step of the layer's cell, as Keras' loop takes it: a masked step keeps the
    states."""
    tf, keras, cell = engine.tf, engine.keras, layer.cell
    kwargs = ({"training": engine.training}
              if getattr(cell, "_call_has_training_arg", False) else {})

    def advance(weights: Any, states: list[Any], inputs_t: tuple[Any, ...]) -> list[Any]:
        _, new = cell(inputs_t[0], cell_states(cell, list(states)), **kwargs)
        new = list(keras.tree.flatten(new))
        if len(inputs_t) > 1:
            keep = tf.reshape(inputs_t[1], [-1, 1])
            new = [tf.where(keep, n, s) for n, s in zip(new, states, strict=True)]
        return new

    return advance


def _state_jacobian_backward(engine: Any, direction: Direction, x: Any, mask: Any,
                             initial: list[Any]) -> np.ndarray:
    """:func:`state_jacobian` by ``batch_jacobian``: one backward pass per state unit, each
    state read flat (a ConvLSTM's feature maps)."""
    tf, keras = engine.tf, engine.keras
    shapes = [[int(n) for n in s.shape[1:]] for s in initial]
    widths = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    batch = int(x.shape[0])

    @tf.function(autograph=False, reduce_retracing=True)
    def compute(x: Any, mask: Any, joined: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(joined)
            parts = [tf.reshape(p, [-1, *shape]) for p, shape in
                     zip(tf.split(joined, widths, axis=1), shapes, strict=True)]
            probes = [tf.zeros(tf.concat([[tf.shape(x)[1]], tf.shape(p)], 0), p.dtype)
                      for p in parts]
            states, _ = scan_cell(tf, keras, direction.layer, x, mask, parts, probes,
                              engine.training)
            final = tf.concat([tf.reshape(s[-1], [tf.shape(x)[0], -1]) for s in states],
                              axis=1)
        return tape.batch_jacobian(final, joined, experimental_use_pfor=False)

    joined = tf.concat([tf.reshape(s, [batch, -1]) for s in initial], axis=1)
    return np.asarray(compute(x, mask, joined))  # in the cell's dtype


#: The most numbers of ∂h_t/∂x one batch_jacobian holds at once (its units are taken in
#: slices of this size over B·T·features), and of ∂h_T/∂h_0 over the batch.
INFLUENCE_NUMBERS = 2**24
#: The most state numbers per example whose ∂h_T/∂h_0 is computed (one backward pass each).
JACOBIAN_STATES = 4096


def influence(engine: Any, stepped: Stepped, index: int,
              steps: list[int]) -> dict[int, np.ndarray]:
    """By step t of ``steps``: ‖∂h_t/∂x_s‖ for every input step s (input order), the median
    over the examples of each example's Frobenius norm, where h_t is direction ``index``'s
    output after processing step t. One traced function serves every t."""
    tf, keras = engine.tf, engine.keras
    direction, x, mask, initial = _inputs(tf, stepped, index)
    per_unit = int(np.prod(x.shape[:2])) * int(np.prod(x.shape[2:], dtype=np.int64))

    @tf.function(autograph=False, reduce_retracing=True)
    def compute(x: Any, mask: Any, initial: list[Any], at: Any) -> Any:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            probes = [tf.zeros(tf.concat([[tf.shape(x)[1]], tf.shape(s)], 0), s.dtype)
                      for s in initial]
            _, outs = scan_cell(tf, keras, direction.layer, x, mask, initial, probes,
                            engine.training)
            h = tf.reshape(outs[at], [tf.shape(x)[0], -1])
            # Sliced under the tape: a slice taken after it would be unconnected to x.
            size = max(1, INFLUENCE_NUMBERS // max(per_unit, 1))
            slices = [h[:, first:first + size] for first in range(0, int(h.shape[1]), size)]
        squares = tf.zeros(tf.shape(x)[:2], tf.float64)
        for part in slices:
            block = tape.batch_jacobian(part, x, experimental_use_pfor=False)
            block = tf.cast(block, tf.float64) ** 2
            squares += tf.reduce_sum(block, axis=[1, *range(3, len(block.shape))])
        return tf.sqrt(squares)

    from gradscope._tf import native_stderr_silenced, without_grappler

    everything = [tf.convert_to_tensor(s) for s in stepped.call.states]
    with masks_drawn(engine, stepped.directions, stepped.call, x, everything), \
            native_stderr_silenced(), without_grappler():
        return {t: np.median(np.asarray(compute(x, mask, initial, tf.constant(t)),
                                        np.float64), axis=0)
                for t in sorted(set(steps))}
