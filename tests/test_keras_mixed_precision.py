"""explain under mixed_float16: the shares lost at the loss scale equal those of a float32
shadow computed here by hand (Keras' own tape for the weights, a hand-written unroll of the
LSTM cell for ∂L/∂h_t and the ∂L/∂c_t step t+1 sends back), at scale 1 and at 2¹⁵; the
'mixed' column equals the mixed model's own scaled tape."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gradscope
from gradscope.keras.mixed_precision import classify, observed

BATCH, STEPS, FEATURES, UNITS = 4, 5, 3, 4


def _model(scale: float) -> Any:
    import keras

    keras.utils.set_random_seed(7)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((STEPS, FEATURES)),
                                  keras.layers.LSTM(UNITS, return_sequences=True),
                                  keras.layers.Dense(2)])
    finally:
        keras.config.set_dtype_policy(previous)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=scale), loss="mse")
    return model


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    # Small inputs and targets near 0: gradients from 1e-12 up, some lost in float16.
    return (rng.normal(size=(BATCH, STEPS, FEATURES)).astype("float32") * 1e-2,
            rng.normal(size=(BATCH, STEPS, 2)).astype("float32") * 1e-3)


def _shadow(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The float32 step by hand: the same weights in float32 layers, the LSTM cell unrolled
    in Python, and the tape's gradients on the weights and on each h_t and c_t."""
    import keras
    import tensorflow as tf

    lstm, dense = model.layers
    cell = keras.layers.LSTMCell(UNITS, dtype="float32")
    head = keras.layers.Dense(2, dtype="float32")
    cell.build((None, FEATURES))
    head.build((None, UNITS))
    cell.set_weights(lstm.cell.get_weights())
    head.set_weights(dense.get_weights())
    h = c = tf.zeros((BATCH, UNITS))
    with tf.GradientTape() as tape:
        hs, cs = [], []
        for t in range(STEPS):
            h, (h, c) = cell(tf.constant(x[:, t]), [h, c])
            # The c that step t+1 receives: its gradient is what the backward carries back
            # through time (the path c_t → h_t inside step t is not in it).
            c = tf.identity(c)
            hs.append(h)
            cs.append(c)
        loss = keras.losses.MeanSquaredError()(y, head(tf.stack(hs, axis=1)))
    variables = [*cell.trainable_variables, *head.trainable_variables]
    gradients = tape.gradient(loss, [variables, hs, cs])
    paths = [v.path for v in [*lstm.cell.trainable_variables, *dense.trainable_variables]]
    found = {path: g.numpy() for path, g in zip(paths, gradients[0], strict=True)}
    found[f"{lstm.name}/h_t"] = np.stack([g.numpy() for g in gradients[1]], axis=1)
    # The last c goes nowhere: no gradient (0).
    found[f"{lstm.name}/c_t"] = np.stack([np.zeros((BATCH, UNITS), np.float32) if g is None
                                  else g.numpy() for g in gradients[2]], axis=1)
    return found


def _mixed(model: Any, x: np.ndarray, y: np.ndarray, scale: float) -> dict[str, np.ndarray]:
    """The mixed model's own tape, the loss scaled as fit's train step scales it."""
    import keras
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x)) * scale
    gradients = tape.gradient(loss, model.trainable_variables)
    return {v.path: g.numpy() for v, g in zip(model.trainable_variables, gradients,
                                             strict=True)}


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 15])
def test_shares_equal_a_float32_shadow_by_hand(tf: Any, scale: float) -> None:
    model = _model(scale)
    x, y = _batch()
    report = gradscope.explain(model, x=x, y=y).mixed_precision
    assert report is not None and report.loss_scale == scale
    assert report.compute_dtype == "float16"
    shadow = _shadow(model, x, y)
    mixed = _mixed(model, x, y, scale)
    tensors = {t.path: t for t in report.tensors}
    assert set(tensors) == set(shadow)
    lost = 0
    for path, truth in shadow.items():
        entry, size = tensors[path], truth.size
        expected = classify(truth, scale, "float16")
        lost += expected[0]
        assert (entry.underflow, entry.subnormal, entry.overflow) == tuple(
            n / size for n in expected), path
        if path in mixed:
            assert entry.mixed == [n / size for n in observed(mixed[path], truth, "float16")]
    nonzero = np.concatenate([np.abs(g).ravel() for g in shadow.values()])
    nonzero = nonzero[nonzero > 0]
    assert report.scale_range == pytest.approx(
        [2.0 ** -14 / nonzero.min(), 65504 / nonzero.max()], rel=1e-6)
    if scale == 1:
        assert lost > 0  # the test sees underflow happen
        assert any("loss scale is 1" in w for w in report.warnings)
    else:
        assert not any("loss scale is 1" in w for w in report.warnings)


def test_classify_by_the_limits() -> None:
    tiny = 2.0 ** -24
    values = np.array([0.0, tiny / 4, tiny, 2.0 ** -14, 1e5, -1e5], np.float32)
    assert classify(values, 1.0, "float16") == (1, 1, 2)
    assert classify(values, 2.0 ** 10, "float16") == (0, 1, 2)
    assert classify(values, 1.0, "bfloat16") == (0, 0, 0)
