"""Across time in a YAML config's model (``explain --jacobians``, ``--flow``, ``--at``): how much
of the initial state survives to the end, and where the gradient fades.

∂h_T^(j)/∂h_0^(i) for every pair of recurrent layers i ≤ j, per example; ‖∂L/∂h_t‖ and
‖∂L/∂x_t‖ per step, from one backward pass through the zero probes of
:meth:`gradscope.yaml.engine.Engine.forward`; and the influence ‖∂h_t/∂x_s‖ for one t. All of
it is one ``tf.function``: the ordinary pass on a tape, then one backward scan over time that
carries every Jacobian row at once (:func:`_rows_backward`). What each shows: docs/explain.md,
"Across time".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope._tf import native_stderr_silenced
from gradscope.yaml.data import Batch
from gradscope.yaml.engine import Engine, Pass


@dataclass(frozen=True)
class StateRef:
    """One state of one recurrent layer: ``gru_1/h`` or ``lstm_1/c``."""

    layer: str
    state: str  # "h" or "c"
    units: int

    @property
    def name(self) -> str:
        return f"{self.layer}/{self.state}"


@dataclass(frozen=True)
class JacobianBlock:
    """∂(layer j's final state)/∂(layer i's initial state), per example."""

    target_layer: str
    source_layer: str
    shape: tuple[int, int]  # (rows: state size of j, columns: state size of i)
    frobenius: np.ndarray  # (B,)
    largest_singular: np.ndarray  # (B,)
    smallest_singular: np.ndarray  # (B,)
    blocks: np.ndarray  # (B, rows, columns)


@dataclass(frozen=True)
class Dynamics:
    jacobians: list[JacobianBlock]
    state_gradient_norms: dict[str, np.ndarray]  # "gru_1/h" → (T,), ‖∂L/∂h_t‖ over the batch
    input_gradient_norms: np.ndarray  # (T,)
    influence_step: int  # t
    influence: np.ndarray  # (T,) median over the batch of ‖∂h_t/∂x_s‖_F, zero for s > t
    influence_layer: str
    #: Per recurrent layer: how much of ∂L/∂s its recurrence carries back from the last step
    #: to the first (:func:`_back_ratio`), and the states s joins (["h", "c"] for an LSTM).
    carried_ratios: dict[str, float | None]
    joined: dict[str, list[str]]


def layer_states(engine: Engine) -> dict[str, list[StateRef]]:
    return {
        cell.name: [StateRef(cell.name, s[0], cell.units) for s in cell.state_names]
        for cell in engine.shapes.cells
    }


def state_jacobians_and_influence(
    engine: Engine, params: dict[str, np.ndarray], batch: Batch, at: int,
) -> tuple[list[JacobianBlock], np.ndarray, Pass, dict[str, np.ndarray]]:
    """The Jacobian blocks, ‖∂h_at/∂x_s‖ (B, T) of the last recurrent layer, the ordinary
    pass (loss, every gradient, total ∂L/∂h_t per step) and each layer's carried-back
    squares (:func:`_rows_backward`), all from one traced forward pass."""
    tf = engine.tf
    dtype = engine.dtype
    states_by_layer = layer_states(engine)
    layers = list(states_by_layer)
    at_last = at == batch.x.shape[1] - 1

    @tf.function(autograph=False)
    def compute(params: dict[str, Any], x: Any, y: Any, states: dict[str, Any],
                at: Any) -> tuple[list[Any], Any, dict[str, Any]]:
        probes = engine.probe_zeros(x)
        with tf.GradientTape() as tape:
            tape.watch([params, x, states, probes])
            sequences: dict[str, Any] = {}
            trajectories: dict[str, Any] = {}
            predictions, finals = engine.forward(params, x, states, probes, sequences,
                                                 trajectories=trajectories)
            loss = engine.loss(predictions, y)
        weight_gradients, state_gradients, input_gradient, probe_gradients = tape.gradient(
            loss, [params, states, x, probes])
        ordinary = {
            "loss": loss, "weights": weight_gradients, "states": state_gradients,
            "x": input_gradient, "finals": finals,
            "sequences": {k: tf.transpose(v, [1, 0, 2]) for k, v in sequences.items()},
            "sequence_gradients": {k: tf.transpose(v, [1, 0, 2])
                                   for k, v in probe_gradients.items()},
        }
        # What the loss puts on each layer's h at the last step (time-major totals): where
        # the carried-back vectors start (:func:`_rows_backward`).
        lasts = [probe_gradients[f"{cell.name}/h"][-1] for cell in engine.shapes.cells]
        groups, influence, carried = _rows_backward(engine, params, x, states, trajectories,
                                                    at, at_last, lasts)
        ordinary["carried_back"] = dict(zip(layers, carried, strict=True))
        return groups, tf.sqrt(influence), ordinary

    with native_stderr_silenced():
        groups, influence, ordinary = compute(
            {k: tf.constant(v, dtype=dtype) for k, v in params.items()},
            tf.constant(batch.x, dtype=dtype), tf.constant(batch.y, dtype=dtype),
            {k: tf.constant(v, dtype=dtype) for k, v in batch.initial_states.items()},
            tf.constant(at),
        )
    def arrays(tensors: dict[str, Any]) -> dict[str, Any]:
        return {name: value.numpy() for name, value in tensors.items()}

    carried = {name: value.numpy().astype(np.float64)
               for name, value in ordinary["carried_back"].items()}
    ordinary_pass = Pass(
        loss=float(ordinary["loss"].numpy()), weight_gradients=arrays(ordinary["weights"]),
        state_gradients=arrays(ordinary["states"]), final_states=arrays(ordinary["finals"]),
        input_gradient=ordinary["x"].numpy(), sequences=arrays(ordinary["sequences"]),
        sequence_gradients=arrays(ordinary["sequence_gradients"]),
    )
    sizes = {layer: sum(ref.units for ref in refs) for layer, refs in states_by_layer.items()}
    blocks = []
    for j, target_layer in enumerate(layers):
        group = groups[j].numpy().astype(np.float64)  # (B, rows of j, columns of layers ≤ j)
        column = 0
        for source_layer in layers[: j + 1]:
            block = group[:, :, column:column + sizes[source_layer]]
            column += sizes[source_layer]
            singular = np.linalg.svd(block, compute_uv=False)
            blocks.append(JacobianBlock(
                target_layer=target_layer, source_layer=source_layer, shape=block.shape[1:],
                frobenius=np.sqrt(np.sum(block**2, axis=(1, 2))),
                largest_singular=singular[:, 0], smallest_singular=singular[:, -1],
                blocks=block,
            ))
    return blocks, influence.numpy().astype(np.float64), ordinary_pass, carried


# Examples are independent, so a row's cotangent for every example is one block of the
# batch. One backward pass per row inside a ``tf.map_fn`` gives the same numbers (to float32
# rounding), at a higher cost, most of it tracing and per-op overhead.
def _rows_backward(engine: Engine, params: dict[str, Any], x: Any, states: dict[str, Any],
                   trajectories: dict[str, Any], at: Any, at_last: bool,
                   lasts: list[Any]) -> tuple[list[Any], Any, list[Any]]:
    """Every Jacobian row at once, ‖∂h_at/∂x_s‖² (B, T), and each layer's carried-back
    squares (B, T), by one backward scan over time.

    A row is one unit of one layer's final state (h, then c for an LSTM), for every example.
    Rows are ordered by target layer, so the rows that reach layer n are a suffix of them: a
    later layer's state cannot reach an earlier one. The backward scan carries, per layer,
    the cotangent of every row that reaches it, stacked in the batch axis (row-major: row r,
    example b at r·B + b); at step t it reruns that step of layer n on its states at t−1,
    repeated once per row, and one ``tape.gradient`` of the step with those cotangents gives
    them at t−1 and, through the layer's input, adds to layer n−1's at t. This is
    backpropagation through time, with all rows in one pass instead of one pass per row.
    The states at every step come from the ordinary pass (``trajectories``): computed once.

    The influence rows are the last layer's h units at step ``at``: when ``at`` is the last
    step they are Jacobian rows already; otherwise they are extra rows whose cotangent starts
    at step ``at``.

    Carried back: per layer, ‖v_t‖² of every state joined, where v starts as what the loss
    puts on the layer's h at the last step (``lasts``, its total there: nothing comes after
    it; nothing on an LSTM's c) and goes back through the layer's own recurrence alone, each
    step's Jᵀ on the whole state: B more rows at the end of the layer's block, which are
    never handed to the layer below. What a Keras layer's flow is flagged by
    (:func:`gradscope.keras.state_probes.carried_back`, on Keras' state pair alike): a loss at
    every step cannot make the total ∂L/∂h_t fade.
    """
    tf = engine.tf
    cells = engine.shapes.cells
    batch_size = tf.shape(x)[0]
    sizes = [cell.units * len(cell.state_names) for cell in cells]
    offsets = np.cumsum([0, *sizes]).tolist()  # row offset of each target layer
    rows = offsets[-1] + (0 if at_last else cells[-1].units)
    influence_start = offsets[-2] if at_last else offsets[-1]
    last_units = cells[-1].units
    #: Rows that reach layer n: rows[reach[n]:].
    reach = offsets[:-1]
    cell_params = [{info.short: params[info.name] for info in cell.weights()} for cell in cells]
    step_weights = [cell.tf_step_weights(tf, p) for cell, p in zip(cells, cell_params,
                                                                     strict=True)]

    def repeat(value: Any, times: int) -> Any:  # (B, n) → (times·B, n), row-major
        return tf.tile(value, [times, 1])

    x_major = tf.transpose(x, [1, 0, 2])  # (T, B, F)
    initial = tuple(states[f"{cell.name}/{s}"] for cell in cells for s in cell.state_names)
    # Every state at every step, each (T, B, u): the ordinary pass computed them already.
    trajectory = tuple(trajectories[f"{cell.name}/{s[0]}"] for cell in cells
                       for s in cell.state_names)
    previous = tuple(tf.concat([s0[None], seq[:-1]], axis=0)
                     for s0, seq in zip(initial, trajectory, strict=True))
    steps = tf.shape(x_major)[0]

    # The cotangents on the final states: row r of layer j's block is a one-hot on unit r.
    def start_cotangents() -> tuple[Any, ...]:
        return tuple(_one_hot_rows(tf, offsets[n] - reach[n] + k * cell.units, cell.units,
                                   rows - reach[n], batch_size, x.dtype)
                     for n, cell in enumerate(cells) for k in range(len(cell.state_names)))

    last_h = sum(len(cell.state_names) for cell in cells[:-1])  # index of the last layer's h
    # The cotangent injected at step ``at`` on the last layer's h (extra rows only).
    seed = None if at_last else _one_hot_rows(tf, influence_start - reach[-1], last_units,
                                               rows - reach[-1], batch_size, x.dtype)

    # v on each state at the last step: the loss's total on h, nothing on c.
    start_carries = tuple(last if k == 0 else tf.zeros_like(last)
                          for last, cell in zip(lasts, cells, strict=True)
                          for k in range(len(cell.state_names)))

    def backward_step(t: Any, carried: tuple[Any, ...], carries: tuple[Any, ...],
                      ) -> tuple[list[Any], Any, list[Any], Any]:
        """The cotangents and carried-back vectors on the states at t → at t−1, and this
        step's influence and carried-back squares."""
        cotangents, back = list(carried), list(carries)
        back_squares = []
        position = 0
        for cell in cells:
            count = len(cell.state_names)
            back_squares.append(tf.add_n([tf.reduce_sum(tf.square(v), axis=1)
                                          for v in back[position:position + count]]))
            position += count
        x_t = x_major[t]
        before = [s[t] for s in previous]
        after = [s[t] for s in trajectory]
        if seed is not None:
            hit = tf.cast(tf.equal(t, at), x.dtype)
            cotangents[last_h] = cotangents[last_h] + hit * seed
        squares = tf.zeros([batch_size], x.dtype)
        position = len(previous)
        for n in reversed(range(len(cells))):
            cell = cells[n]
            count = len(cell.state_names)
            position -= count
            times = rows - reach[n]  # and one more: the carried-back rows
            prev = [repeat(s, times + 1) for s in before[position:position + count]]
            layer_input = x_t if n == 0 else after[position - len(cells[n - 1].state_names)]
            with tf.GradientTape() as tape:
                if n == 0:
                    # The input projection once, then repeated: x itself is not a source here.
                    step_inputs = tuple(repeat(v[0], times + 1) for v in
                                        cell.tf_inputs(tf, cell_params[n], layer_input[None]))
                    tape.watch([prev, step_inputs])
                else:
                    repeated_input = repeat(layer_input, times + 1)
                    tape.watch([prev, repeated_input])
                    step_inputs = tuple(v[0] for v in cell.tf_inputs(
                        tf, cell_params[n], repeated_input[None]))
                new = cell.tf_step(tf, step_weights[n], tuple(prev), step_inputs)
            sources = [prev, step_inputs if n == 0 else repeated_input]
            d_prev, d_input = tape.gradient(
                list(new), sources,
                output_gradients=[tf.concat([c, v], axis=0) for c, v in zip(
                    cotangents[position:position + count], back[position:position + count],
                    strict=True)],
                unconnected_gradients="zero")
            split = times * batch_size
            cotangents[position:position + count] = [
                tf.ensure_shape(d[:split], c.shape) for d, c in zip(
                    d_prev, cotangents[position:position + count], strict=True)]
            back[position:position + count] = [
                tf.ensure_shape(d[split:], v.shape) for d, v in zip(
                    d_prev, back[position:position + count], strict=True)]
            if n > 0:
                # Layer n's rows are the tail of layer n−1's rows: add into that tail.
                below = position - len(cells[n - 1].state_names)  # layer n−1's h
                skip = (reach[n] - reach[n - 1]) * batch_size
                head = cotangents[below][:skip]
                cotangents[below] = tf.ensure_shape(tf.concat(
                    [head, cotangents[below][skip:] + d_input[:split]], axis=0),
                    cotangents[below].shape)
            else:
                # ∂h_at/∂x_t for the influence rows: through the input projection.
                first = (influence_start - reach[0]) * batch_size
                chosen = [d[first:first + last_units * batch_size] for d in d_input]
                x_rows = repeat(x_t, last_units)
                with tf.GradientTape() as tape:
                    tape.watch(x_rows)
                    projections = [v[0] for v in cell.tf_inputs(tf, cell_params[0],
                                                                 x_rows[None])]
                d_x = tape.gradient(projections, x_rows,
                                    output_gradients=chosen)
                squares = tf.reduce_sum(tf.reshape(tf.reduce_sum(tf.square(d_x), axis=1),
                                                   [last_units, batch_size]), axis=0)
        return cotangents, squares, back, tf.stack(back_squares)

    # A while loop, not tf.scan: only the influence squares are kept per step, never the
    # cotangents, whose size is the number of rows times the batch. One step at a time: the
    # steps depend on each other anyway, and each one's repeated states are that large too.
    held = len(initial)

    def body(t: Any, squares: Any, back_squares: Any, *carried: Any) -> tuple[Any, ...]:
        cotangents, step_squares, back, step_back = backward_step(t, carried[:held],
                                                                  carried[held:])
        return (t - 1, squares.write(t, step_squares), back_squares.write(t, step_back),
                *cotangents, *back)

    per_step = tf.TensorArray(x.dtype, size=steps, element_shape=tf.TensorShape([None]))
    per_back = tf.TensorArray(x.dtype, size=steps,
                              element_shape=tf.TensorShape([len(cells), None]))
    _, per_step, per_back, *finals = tf.while_loop(
        lambda t, *_: t >= 0, body,
        (steps - 1, per_step, per_back, *start_cotangents(), *start_carries),
        parallel_iterations=1)
    squares = tf.transpose(per_step.stack(), [1, 0])  # (B, T)
    carried_squares = tf.transpose(per_back.stack(), [1, 2, 0])  # (layers, B, T)

    return (_by_target_layer(tf, finals[:held], cells, offsets, batch_size, rows), squares,
            tf.unstack(carried_squares, num=len(cells)))


def _one_hot_rows(tf: Any, first: int, units: int, reaching: int, batch_size: Any,
                  dtype: Any) -> Any:
    """Cotangents (reaching·B, units) for ``reaching`` rows: rows first … first+units−1 are a
    one-hot on their unit, the others zero; each row repeated for every example (row r,
    example b at r·B + b)."""
    block = tf.concat([tf.zeros([first, units], dtype), tf.eye(units, dtype=dtype),
                       tf.zeros([reaching - first - units, units], dtype)], axis=0)
    return tf.reshape(tf.repeat(block, batch_size, axis=0), [reaching * batch_size, units])


def _by_target_layer(tf: Any, finals: list[Any], cells: Any, offsets: list[int],
                     batch_size: Any, rows: int) -> list[Any]:
    """The cotangents on the initial states, regrouped: per target layer j, its Jacobian
    rows against the initial states of layers ≤ j, (B, rows of j, columns of layers ≤ j)."""
    sizes = [cell.units * len(cell.state_names) for cell in cells]
    reach = offsets[:-1]
    by_layer, position = [], 0
    for n, cell in enumerate(cells):
        count = len(cell.state_names)
        stacked = tf.concat(finals[position:position + count], axis=1)  # (reaching·B, S_n)
        by_layer.append(tf.transpose(tf.reshape(stacked, [rows - reach[n], batch_size,
                                                          sizes[n]]), [1, 0, 2]))
        position += count
    return [tf.concat([by_layer[i][:, offsets[j] - reach[i]: offsets[j] - reach[i] + sizes[j]]
                       for i in range(j + 1)], axis=2) for j in range(len(cells))]


def dynamics(engine: Engine, params: dict[str, np.ndarray], batch: Batch,
             at: int | None = None) -> tuple[Pass, Dynamics]:
    """The ordinary pass and everything across time, from one ``tf.function`` call."""
    steps = batch.x.shape[1]
    at = steps - 1 if at is None else at
    jacobians, influence, per_step_pass, carried = state_jacobians_and_influence(
        engine, params, batch, at)
    assert per_step_pass.sequence_gradients is not None
    state_norms = {
        name: np.sqrt(np.sum(np.asarray(g, np.float64) ** 2, axis=(0, 2)))
        for name, g in per_step_pass.sequence_gradients.items()
    }
    input_norms = np.sqrt(np.sum(np.asarray(per_step_pass.input_gradient, np.float64) ** 2,
                                 axis=(0, 2)))
    return per_step_pass, Dynamics(
        jacobians=jacobians,
        state_gradient_norms=state_norms,
        input_gradient_norms=input_norms,
        influence_step=at,
        influence=np.median(influence, axis=0),
        influence_layer=engine.shapes.cells[-1].name,
        carried_ratios={name: _back_ratio(squares) for name, squares in carried.items()},
        joined={cell.name: [s[0] for s in cell.state_names] for cell in engine.shapes.cells},
    )


def _back_ratio(squares: np.ndarray) -> float | None:
    """‖v_0‖ / ‖v_(T−1)‖ over the batch (every example runs every step of a YAML spec): the
    product of the gains back, as a Keras layer's is read
    (:func:`gradscope.keras.probed_flow.back_ratio_of`); None where nothing arrives."""
    last = float(np.sqrt(np.sum(squares[:, -1])))
    if squares.shape[1] < 2 or not last > 0:
        return None
    return float(np.sqrt(np.sum(squares[:, 0]))) / last


def influence_map(engine: Engine, params: dict[str, np.ndarray], batch: Batch,
                  steps: list[int]) -> np.ndarray:
    """Median over the batch of ‖∂h_t/∂x_s‖_F for each t in ``steps`` and every s: (len, T).

    One backward pass per (t, unit of the last layer), all in one in-graph loop.
    """
    tf = engine.tf
    dtype = engine.dtype
    last = engine.shapes.cells[-1]
    pairs = np.array([(t, k) for t in steps for k in range(last.units)], dtype=np.int32)

    @tf.function(autograph=False)
    def compute(params: dict[str, Any], x: Any, states: dict[str, Any], pairs: Any) -> Any:
        with tf.GradientTape() as tape:  # one gradient call, traced once in the loop body
            tape.watch(x)
            sequences: dict[str, Any] = {}
            engine.forward(params, x, states, sequences=sequences)
            sequence = sequences[f"{last.name}/h"]  # (T, B, u), time-major
        batch_size = tf.shape(x)[0]

        def row(pair: Any) -> Any:
            cotangent = tf.one_hot(tf.fill([batch_size], pair[1]), last.units, dtype=x.dtype)
            cotangent = tf.scatter_nd(pair[:1][None], cotangent[None], tf.shape(sequence))
            d_x = tape.gradient(sequence, x, output_gradients=cotangent,
                                unconnected_gradients="zero")
            return tf.reduce_sum(tf.square(d_x), axis=2)  # (B, T)

        return tf.map_fn(row, pairs, fn_output_signature=x.dtype)

    squares = compute(
        {k: tf.constant(v, dtype=dtype) for k, v in params.items()},
        tf.constant(batch.x, dtype=dtype),
        {k: tf.constant(v, dtype=dtype) for k, v in batch.initial_states.items()},
        tf.constant(pairs),
    ).numpy().astype(np.float64)  # (pairs, B, T)
    per_step = squares.reshape(len(steps), last.units, *squares.shape[1:]).sum(axis=1)
    return np.asarray(np.median(np.sqrt(per_step), axis=1))
