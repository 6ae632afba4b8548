"""The carry in numbers (``explain --chunks K``): is carrying gradients across truncated
batches worth it for this model, at these weights?

The time axis is cut into K chunks as ``check --chunks`` cuts it (:func:`chunk_lengths`), and
one traced function runs two backward passes in float64: full BPTT, and truncated BPTT with
``tf.stop_gradient`` on the state at every chunk boundary. ``g_full − g_truncated`` is exactly
what the carry adds. Zero "edge" tensors added to the state each step reads give, in the same
two passes, the seed question's ``tf.gradients(new_states, initial_states, grad_ys=…)`` at
every boundary (:meth:`CarryPasses.numbers`). How, for a reader: docs/explain.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.chunks import chunk_starts
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.data import Batch


@dataclass(frozen=True)
class ChunkProduct:
    """The seed's ``tf.gradients(ys, xs, grad_ys)`` for chunk ``chunk``, steps
    ``[start, stop)``: ``ys`` its final states, ``xs`` its initial states, ``grad_ys`` the next
    chunk's ∂L/∂(initial states). Keyed by initial-state name (``gru_1/h0``)."""

    chunk: int
    start: int
    stop: int
    grad_ys: dict[str, np.ndarray]
    products: dict[str, np.ndarray]


@dataclass(frozen=True)
class CarryNumbers:
    """Weight gradients of full and truncated BPTT (float64), and the products per chunk."""

    chunk_lengths: list[int]
    full: dict[str, np.ndarray]
    truncated: dict[str, np.ndarray]
    products: list[ChunkProduct]

    def carried(self, name: str) -> np.ndarray:
        return self.full[name] - self.truncated[name]


def state_names(shapes: ModelShapes) -> list[str]:
    """Every recurrent initial state, in layer order: gru_1/h0, lstm_1/h0, lstm_1/c0, …"""
    return [f"{cell.name}/{state}" for cell in shapes.cells for state in cell.state_names]


def carry_numbers(shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch,
                  lengths: list[int]) -> CarryNumbers:
    """Full and truncated BPTT, in float64, on ``params`` and ``batch`` cut into chunks of
    ``lengths`` steps."""
    return CarryPasses(shapes).numbers(params, batch, lengths)


class CarryPasses:
    """The float64 engine of ``shapes`` and its two-pass function, traced once and reused for
    every batch and cut of the same sizes."""

    def __init__(self, shapes: ModelShapes) -> None:
        from gradscope.yaml.engine import Engine  # imports TensorFlow

        self.shapes = shapes
        self.engine = Engine(shapes, dtype="float64")
        self._passes = self.engine.tf.function(_two_passes(self.engine), autograph=False)

    def numbers(self, params: dict[str, np.ndarray], batch: Batch, lengths: list[int],
                cut_steps: list[int] | None = None) -> CarryNumbers:
        """``cut_steps`` are the steps whose incoming state is cut; by default every chunk
        start after the first. (A test passes others to show that a wrong cut is caught.)"""
        from gradscope._tf import native_stderr_silenced

        time_steps = int(batch.x.shape[1])
        if not lengths or min(lengths) < 1 or sum(lengths) != time_steps:
            raise ValueError(f"chunk lengths {lengths} do not cut {time_steps} steps into "
                             "chunks")
        starts = chunk_starts(lengths)
        cut_steps = starts[1:] if cut_steps is None else cut_steps
        tf = self.engine.tf
        names = state_names(self.shapes)
        wide = batch.astype("float64")
        cuts = np.zeros(time_steps)
        cuts[list(cut_steps)] = 1.0
        with native_stderr_silenced():
            weights = {name: tf.constant(value, tf.float64) for name, value in params.items()}
            states = {name: tf.constant(wide.initial_states[name]) for name in names}
            full_weights, full_edges, truncated_weights, truncated_edges = self._passes(
                weights, tf.constant(wide.x), tf.constant(wide.y), states, tf.constant(cuts),
                tf.constant(starts, tf.int32))
        full_edge = {name: value.numpy() for name, value in full_edges.items()}
        truncated_edge = {name: value.numpy() for name, value in truncated_edges.items()}
        # The full pass's edge gradient at a chunk's start is the grad_ys carried into the
        # chunk before. The product through chunk k is the full pass's edge gradient at its
        # start minus the truncated pass's: every path that leaves chunk k crosses its end,
        # where the full gradient is the grad_ys. In float64 the difference is exact to about
        # 1e-16 of the gradients it is taken from.
        products = []
        for k in range(len(lengths) - 1):
            products.append(ChunkProduct(
                chunk=k, start=starts[k], stop=starts[k + 1],
                grad_ys={name: full_edge[name][k + 1] for name in names},
                products={name: full_edge[name][k] - truncated_edge[name][k] for name in names},
            ))
        return CarryNumbers(
            chunk_lengths=list(lengths),
            full={name: value.numpy() for name, value in full_weights.items()},
            truncated={name: value.numpy() for name, value in truncated_weights.items()},
            products=products,
        )


def _two_passes(engine: Any) -> Any:
    """One graph: the backward pass without cuts and with them, each returning the weight
    gradients and ∂L/∂(edges) at the chunk starts (K, B, units) by initial-state name."""
    tf = engine.tf

    def one_pass(params: dict[str, Any], x: Any, y: Any, states: dict[str, Any], cuts: Any,
                 at: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        steps, batch = tf.shape(x)[1], tf.shape(x)[0]
        edges = {name: tf.zeros([steps, batch, tf.shape(value)[-1]], dtype=x.dtype)
                 for name, value in states.items()}
        with tf.GradientTape() as tape:
            tape.watch([params, edges])
            predictions, _ = engine.forward(params, x, states, cuts=cuts, edges=edges)
            loss = engine.loss(predictions, y)
        weight_gradients, edge_gradients = tape.gradient(
            loss, [params, edges], unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return weight_gradients, {name: tf.gather(value, at)
                                  for name, value in edge_gradients.items()}

    def both(params: dict[str, Any], x: Any, y: Any, states: dict[str, Any], cuts: Any,
             at: Any) -> tuple[Any, ...]:
        full = one_pass(params, x, y, states, tf.zeros_like(cuts), at)
        truncated = one_pass(params, x, y, states, cuts, at)
        return (*full, *truncated)

    return both
