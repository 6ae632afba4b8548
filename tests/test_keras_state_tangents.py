"""gradscope/keras/state_tangents.py: ∂(final states)/∂(initial states), its tangents carried
forward in blocks of columns.

The truth: Keras' own LSTMCell (float64) unrolled by hand in a Python loop under a tape, and
``batch_jacobian`` of its final [h, c] with respect to the initial [h, c].
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradscope.keras import state_tangents

T, F, B, UNITS = 6, 3, 4, 3


def _cell_and_inputs(tf: Any) -> tuple[Any, Any, list[Any]]:
    import keras

    keras.utils.set_random_seed(5)
    cell = keras.layers.LSTMCell(UNITS, dtype="float64")
    cell.build((None, F))
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(T, B, F)))  # time-major
    initial = [tf.constant(rng.normal(size=(B, UNITS))) for _ in range(2)]
    return cell, x, initial


def _unrolled(tf: Any, cell: Any, x: Any, initial: list[Any]) -> np.ndarray:
    joined = tf.concat(initial, axis=1)
    with tf.GradientTape() as tape:
        tape.watch(joined)
        states = list(tf.split(joined, 2, axis=1))
        for t in range(T):
            _, states = cell(x[t], states)
        final = tf.concat(list(states), axis=1)
    return np.asarray(tape.batch_jacobian(final, joined))


@pytest.mark.parametrize(("budget", "folded"), [(state_tangents.TANGENT_BYTES, None),
                                                (1, None), (1, False)])
def test_the_carried_tangents_are_the_jacobian_in_one_block_or_many(tf, monkeypatch, budget,
                                                                    folded):
    """With the budget of one column, the 6 columns come in 6 blocks; the numbers are the
    same as in one block, and those of the tape; the block folded into the batch (a small
    state's default) or under ``tf.vectorized_map`` (a large state's) alike."""
    monkeypatch.setattr(state_tangents, "TANGENT_BYTES", budget)
    cell, x, initial = _cell_and_inputs(tf)

    def advance(weights: Any, states: list[Any], inputs_t: tuple[Any, ...]) -> list[Any]:
        return list(cell(inputs_t[0], states)[1])

    compute = state_tangents.jacobian_function(tf, advance, folded)
    jacobian, final = state_tangents.state_jacobian(tf, compute, {}, (x,), initial)
    assert state_tangents.block_columns(B, 2 * UNITS, 8) == (6 if budget > 1 else 1)
    np.testing.assert_allclose(jacobian, _unrolled(tf, cell, x, initial), rtol=1e-12,
                               atol=1e-14)
    assert final.shape == (B, 2 * UNITS)


def test_a_block_holds_what_the_budget_allows():
    width = 512
    per_column = 32 * width * state_tangents.TANGENT_NUMBERS_PER_UNIT * 8
    assert state_tangents.block_columns(32, width, 8) == min(
        width, state_tangents.TANGENT_BYTES // per_column)
    assert state_tangents.block_columns(10**6, width, 8) == 1
    assert state_tangents.block_columns(1, 4, 4) == 4
