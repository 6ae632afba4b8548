"""Across time: state Jacobians, gradient flow per step, and the influence of each input step.

- ``∂h_T^(j)/∂h_0^(i)`` for every pair of recurrent layers i ≤ j (block lower-triangular:
  a later layer's initial state cannot reach an earlier layer), per example, with its
  Frobenius norm and singular values. For an LSTM the state is [h, c].
- ``‖∂L/∂h_t‖`` per layer and step, and ``‖∂L/∂x_t‖`` per step: from ONE backward pass, through
  the zero probes of :meth:`gradscope.model.Engine.forward`.
- ``‖∂h_t/∂x_s‖`` for a chosen t (the last step by default): the influence of input step s on
  the last recurrent layer's state at step t.

The Jacobians come from one ``tf.function``: per group of rows, a forward pass on a tape read
by one gradient call, then one backward pass per Jacobian row inside an in-graph loop
(``tf.map_fn``), each with a one-hot ``output_gradients``: examples are independent, so one
pass gives that row for every example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope._tf import native_stderr_silenced
from gradscope.data import Batch
from gradscope.model import Engine, Pass


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


def layer_states(engine: Engine) -> dict[str, list[StateRef]]:
    return {
        cell.name: [StateRef(cell.name, s[0], cell.units) for s in cell.state_names]
        for cell in engine.shapes.cells
    }


def state_jacobians_and_influence(
    engine: Engine, params: dict[str, np.ndarray], batch: Batch, at: int,
) -> tuple[list[JacobianBlock], np.ndarray, Pass]:
    """The Jacobian blocks, ‖∂h_at/∂x_s‖ (B, T) of the last recurrent layer, and the ordinary
    pass (loss, every gradient, total ∂L/∂h_t per step), all from one traced forward pass."""
    tf = engine.tf
    dtype = engine.dtype
    states_by_layer = layer_states(engine)
    layers = list(states_by_layer)
    last = layers[-1]
    last_size = engine.shapes.cells[-1].units
    at_last = at == batch.x.shape[1] - 1

    def names(layer: str, final: bool) -> list[str]:
        return [f"{ref.layer}/{ref.state}{'_T' if final else '0'}"
                for ref in states_by_layer[layer]]

    # Rows are grouped by target layer j: their backward passes only go through layers ≤ j,
    # towards the initial states of those layers. When t is the last step, the last layer's
    # h rows are h_t itself, so the same passes give the influence of x.
    @tf.function(autograph=False)
    def compute(params: dict[str, Any], x: Any, y: Any, states: dict[str, Any],
                at: Any) -> tuple[list[Any], Any, dict[str, Any]]:
        def recorded(with_probes: bool = False) -> tuple[Any, Any, dict[str, Any],
                                                         dict[str, Any], dict[str, Any],
                                                         list[Any], Any]:
            """A forward pass on a tape of its own, read by ONE gradient call (in a
            ``tf.map_fn`` body, traced once). Not one persistent tape for all: under a
            persistent tape TF builds every while loop for higher-order gradients, which is
            slower to trace and to run."""
            probes = engine.probe_zeros(x) if with_probes else {}
            with tf.GradientTape() as tape:
                tape.watch([params, x, states, probes])
                sequences: dict[str, Any] = {}
                predictions, finals = engine.forward(params, x, states, probes or None,
                                                     sequences)
                loss = engine.loss(predictions, y)
                targets = [tf.concat([finals[n] for n in names(layer, final=True)], axis=1)
                           for layer in layers]
                h_at = tf.gather(sequences[f"{last}/h"], at)  # (B, u_last), time-major source
            return tape, loss, finals, sequences, probes, targets, h_at

        tape, loss, finals, sequences, probes, _, _ = recorded(with_probes=True)
        weight_gradients, state_gradients, input_gradient, probe_gradients = tape.gradient(
            loss, [params, states, x, probes])
        ordinary = {
            "loss": loss, "weights": weight_gradients, "states": state_gradients,
            "x": input_gradient, "finals": finals,
            "sequences": {k: tf.transpose(v, [1, 0, 2]) for k, v in sequences.items()},
            "sequence_gradients": {k: tf.transpose(v, [1, 0, 2])
                                   for k, v in probe_gradients.items()},
        }
        batch_size = tf.shape(x)[0]

        def one_hot(k: Any, width: int) -> Any:
            return tf.one_hot(tf.fill([batch_size], k), width, dtype=x.dtype)

        groups = []
        influence = None
        for j, layer in enumerate(layers):
            tape, *_, targets, _ = recorded()
            target = targets[j]
            sources = [states[n] for lower in layers[: j + 1] for n in names(lower, False)]
            size = target.shape[1]
            with_x = layer == last and at_last

            def row(k: Any, tape: Any = tape, target: Any = target, sources: Any = sources,
                    size: int = size, with_x: bool = with_x) -> Any:
                grads = tape.gradient(target, [*sources, x] if with_x else sources,
                                      output_gradients=one_hot(k, size),
                                      unconnected_gradients="zero")
                if with_x:
                    return tf.concat(grads[:-1], axis=1), tf.reduce_sum(tf.square(grads[-1]), 2)
                return tf.concat(grads, axis=1)

            signature = (x.dtype, x.dtype) if with_x else x.dtype
            out = tf.map_fn(row, tf.range(size), fn_output_signature=signature)
            if with_x:
                out, squares = out
                influence = tf.reduce_sum(squares[:last_size], axis=0)  # the h rows only
            groups.append(tf.transpose(out, [1, 0, 2]))  # (B, rows, columns)

        if influence is None:
            tape, *_, h_at = recorded()

            def influence_row(k: Any) -> Any:
                d_x = tape.gradient(h_at, x, output_gradients=one_hot(k, last_size),
                                    unconnected_gradients="zero")
                return tf.reduce_sum(tf.square(d_x), axis=2)  # (B, T)

            influence = tf.reduce_sum(tf.map_fn(influence_row, tf.range(last_size),
                                                fn_output_signature=x.dtype), axis=0)
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
    return blocks, influence.numpy().astype(np.float64), ordinary_pass


def dynamics(engine: Engine, params: dict[str, np.ndarray], batch: Batch,
             at: int | None = None) -> tuple[Pass, Dynamics]:
    """The ordinary pass and everything across time, from one ``tf.function`` call."""
    steps = batch.x.shape[1]
    at = steps - 1 if at is None else at
    jacobians, influence, per_step_pass = state_jacobians_and_influence(engine, params, batch,
                                                                        at)
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
    )


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
