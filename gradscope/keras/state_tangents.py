"""∂(final states)/∂(initial states) per example, carried forward through time.

``--jacobians`` needs every entry of each example's Jacobian (its Frobenius norm and smallest
singular value read them all), so S state units cost S Jacobian–vector products through T
steps whichever way they are taken. Here they are taken forward: one loop over time carries
the states and a block of tangent columns (k, B, S); each step is the cell's own step under a
``ForwardAccumulator``, vectorised over the block by ``tf.vectorized_map``. The step's weights
are read once for the whole block (one matmul of k·B rows), and nothing is kept per step.
Blocks are sized to :data:`TANGENT_BYTES`. A step ``vectorized_map`` cannot convert raises;
a stepped cell then takes ``batch_jacobian`` (a backward pass per unit, the same numbers).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

#: What one block of tangent columns may hold at a step, in bytes: its columns are as many as
#: fit (see :func:`block_columns`). Smaller blocks cost no more CPU time: on an LSTM 256,
#: batch 32, blocks of 16, 64 and 256 columns took 11.3, 10.2 and 10.7 CPU-s for 40 steps.
TANGENT_BYTES = 256 << 20
#: Numbers held per tangent column, example and state unit at a step (the tangents carried
#: and their step's intermediates under ``vectorized_map``): the growth of peak RSS with the
#: block's columns on that LSTM (0.96 GB at 128 columns, 2.5 GB at 512) is about 35; with
#: the allocator's slack, 48.
TANGENT_NUMBERS_PER_UNIT = 48

#: ``advance(weights, states, inputs_t)`` → the states after one step (a list, in order).
Advance = Callable[[Any, list[Any], tuple[Any, ...]], list[Any]]
#: ``tangent(weights, states, inputs_t, tangents)`` → the states after one step and J_t applied
#: to a block of tangent columns, one (k, B, w_i) per state: a step linearised by hand
#: (:meth:`~gradscope.cells.base.Cell.tf_step_tangent`).
Tangent = Callable[[Any, list[Any], tuple[Any, ...], list[Any]], tuple[list[Any], list[Any]]]


def block_columns(batch: int, width: int, itemsize: int) -> int:
    """How many tangent columns one block carries for ``batch`` examples of ``width`` state
    units: as many as :data:`TANGENT_BYTES` holds, at least one, at most ``width``."""
    per_column = max(1, batch * width * TANGENT_NUMBERS_PER_UNIT * itemsize)
    return int(min(width, max(1, TANGENT_BYTES // per_column)))


def tangent_bytes(batch: int, width: int, itemsize: int) -> int:
    """The bytes one block of :func:`block_columns` holds at its peak, with the Jacobian
    itself (B, S, S) and its copy for the singular values: what the memory guard counts."""
    columns = block_columns(batch, width, itemsize)
    held = columns * batch * width * TANGENT_NUMBERS_PER_UNIT * itemsize
    return held + 2 * batch * width * width * 8


#: States of at most this many numbers carry their block folded into the batch (k copies of
#: each step under one accumulator) rather than under ``tf.vectorized_map``, whose conversion
#: of the step costs about half a second each time it is traced: more than the whole
#: Jacobian of a small state (the seed model's GRU 64: 0.5 s traced, 0.2 s run).
FOLDED_WIDTH = 128


def jacobian_function(tf: Any, advance: Advance, folded: bool | None = None,
                      tangent: Tangent | None = None) -> Any:
    """A traced function ``(weights, inputs, initial, columns)`` → (∂s_T/∂s_0[:, :, columns]
    (B, S, k), s_T (B, S)): ``inputs`` a tuple of time-major tensors (T, B, ·) that
    ``advance`` reads one step at a time, ``initial`` the list of initial states (B, w_i),
    ``columns`` (k,) the state units whose tangents are carried. The loop over time is a
    ``tf.foldl``: a loop in the graph, keeping only its carry. ``folded``: the block's
    columns folded into the batch, not ``tf.vectorized_map`` (default: for states of at
    most :data:`FOLDED_WIDTH` numbers). ``tangent``: the step linearised by hand, which
    carries the whole block with the step's own values computed once (else forward-mode
    autodiff of ``advance``)."""

    @tf.function(autograph=False, reduce_retracing=True)
    def compute(weights: Any, inputs: tuple[Any, ...], initial: list[Any],
                columns: Any) -> tuple[Any, Any]:
        widths = [int(s.shape[1]) for s in initial]
        joined = tf.concat(initial, axis=1)
        width = sum(widths)
        fold = width <= FOLDED_WIDTH if folded is None else folded

        def step(states: Any, inputs_t: tuple[Any, ...]) -> Any:
            parts = list(tf.split(states, widths, axis=1))
            return tf.concat(advance(weights, parts, inputs_t), axis=1)

        def body(carry: tuple[Any, Any], inputs_t: tuple[Any, ...]) -> tuple[Any, Any]:
            states, tangents = carry
            if tangent is not None:
                after, moved = tangent(weights, list(tf.split(states, widths, axis=1)),
                                       inputs_t, list(tf.split(tangents, widths, axis=2)))
                return tf.concat(after, axis=1), tf.concat(moved, axis=2)

            def product(tangent: Any) -> Any:
                with tf.autodiff.ForwardAccumulator(states, tangent) as accumulator:
                    after = step(states, inputs_t)
                return accumulator.jvp(after, unconnected_gradients="zero")

            if not fold:
                moved = tf.vectorized_map(product, tangents, fallback_to_while_loop=False)
                return step(states, inputs_t), moved
            # The block folded into the batch: one accumulator over k copies of the step.
            k, batch = tf.shape(tangents)[0], tf.shape(states)[0]
            copies = tf.tile(states, tf.stack([k, 1]))
            read = tuple(tf.tile(value, tf.concat([[k], tf.ones([tf.rank(value) - 1],
                                                                 tf.int32)], 0))
                         for value in inputs_t)
            flat = tf.reshape(tangents, tf.shape(copies))
            with tf.autodiff.ForwardAccumulator(copies, flat) as accumulator:
                after = step(copies, read)
            moved = accumulator.jvp(after, unconnected_gradients="zero")
            return after[:batch], tf.reshape(moved, tf.shape(tangents))

        start = tf.one_hot(columns, width, dtype=joined.dtype)[:, None, :]
        start = tf.tile(start, tf.stack([1, tf.shape(joined)[0], 1]))  # (k, B, S)
        final, tangents = tf.foldl(body, inputs, initializer=(joined, start))
        return tf.transpose(tangents, [1, 2, 0]), final

    return compute


def state_jacobian(tf: Any, compute: Any, weights: Any, inputs: tuple[Any, ...],
                   initial: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """∂(final states)/∂(initial states) per example (B, S, S) and the final states (B, S),
    in float64, by ``compute`` (:func:`jacobian_function`) over blocks of columns.

    Raises:
        ValueError: (or another TensorFlow error) where ``tf.vectorized_map`` cannot convert
            the step; nothing is computed then.
    """
    batch = int(initial[0].shape[0])
    width = sum(int(s.shape[1]) for s in initial)
    size = block_columns(batch, width, initial[0].dtype.size)
    blocks, final = [], None
    with _pfor_quiet():
        for first in range(0, width, size):
            columns = tf.range(first, min(width, first + size))
            block, final = compute(weights, inputs, initial, columns)
            blocks.append(np.asarray(block, np.float64))
    jacobian = np.concatenate(blocks, axis=2) if len(blocks) > 1 else blocks[0]
    return jacobian, np.asarray(final, np.float64)


@contextlib.contextmanager
def _pfor_quiet() -> Iterator[None]:
    """TensorFlow's logger silent while ``vectorized_map`` converts a step: an op it cannot
    convert is logged at ERROR level before the ValueError that says so, and the caller
    falls back without showing it."""
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)
