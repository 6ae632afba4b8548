"""``explain --per-example``: each example's gradient norms held to a loop of one tape per
example (Keras' own loss with the sample weights times e_i), in float64, for LSTM, GRU,
SimpleRNN and cells of the user's own, with masks, sample weights, a regularizer, a
Bidirectional and layers before and after; split from one batched backward pass, or, where
the examples interact, by the Jacobian, which says why."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from conftest import render_text

import gradscope
from gradscope.errors import ConfigError
from gradscope.keras.per_example import SPLIT_METHOD, noise_scale, outliers

BATCH, STEPS, FEATURES, UNITS = 5, 4, 3, 3


def _own_cell() -> Any:
    import keras

    class TwoWeightCell(keras.layers.Layer):
        """h_t = tanh(x_t·W + h_{t−1}·U) ∘ sigmoid(x_t·V): a cell gradscope does not know."""

        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = self.state_size = self.output_size = units

        def build(self, input_shape: Any) -> None:
            self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
            self.gate = self.add_weight(shape=(input_shape[-1], self.units), name="gate")
            self.recurrent = self.add_weight(shape=(self.units, self.units), name="recurrent")

        def call(self, x: Any, states: Any) -> Any:
            ops = keras.ops
            h = ops.tanh(ops.matmul(x, self.kernel) + ops.matmul(states[0], self.recurrent))
            h = h * ops.sigmoid(ops.matmul(x, self.gate))
            return h, [h]

    return TwoWeightCell


def _model(kind: str, dtype: str = "float64", regularizer: bool = False) -> Any:
    import keras

    keras.utils.set_random_seed(3)
    previous, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        recurrent = {"lstm": lambda: keras.layers.LSTM(UNITS, return_sequences=True),
                     "gru": lambda: keras.layers.GRU(UNITS, return_sequences=True),
                     "simple_rnn": lambda: keras.layers.SimpleRNN(UNITS,
                                                                  return_sequences=True),
                     "own_cell": lambda: keras.layers.RNN(_own_cell()(UNITS),
                                                          return_sequences=True)}[kind]()
        model = keras.Sequential([
            keras.Input((STEPS, FEATURES)), keras.layers.Masking(), recurrent,
            keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.01)
                               if regularizer else None)])
        model.compile(loss="mse")
    finally:
        keras.config.set_floatx(previous)
        keras.config.set_dtype_policy(policy)
    return model


def _batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, STEPS, FEATURES))
    x[1, 2:] = 0.0  # masked steps: the masked mean divides by the whole batch's count
    x[3] *= 4.0
    y = rng.normal(size=(BATCH, STEPS, 2))
    # Per example and step (Keras does not broadcast (batch,) weights over a masked
    # sequence's steps).
    weights = np.array([1.0, 2.0, 0.0, 1.0, 0.5])[:, None] * np.linspace(0.5, 1.5, STEPS)
    return x, y, weights


def _tuple_state_cell() -> Any:
    import keras

    class TupleStateCell(keras.layers.Layer):
        """Two states (h, m) and an output that is neither: o_t = h_t ∘ tanh(m_t)."""

        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = self.output_size = units
            self.state_size = (units, units)

        def build(self, input_shape: Any) -> None:
            self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
            self.recurrent = self.add_weight(shape=(self.units, self.units), name="recurrent")
            self.bias = self.add_weight(shape=(self.units,), name="bias")

        def call(self, x: Any, states: Any) -> Any:
            ops = keras.ops
            h, m = states
            h = ops.tanh(ops.matmul(x, self.kernel) + ops.matmul(h, self.recurrent) + self.bias)
            m = 0.5 * m + ops.sigmoid(ops.matmul(x, self.kernel))
            return h * ops.tanh(m), (h, m)

    return TupleStateCell


def _one_tape_per_example(model: Any, x: np.ndarray, y: np.ndarray,
                          weights: np.ndarray, training: bool = False) -> dict[str, np.ndarray]:
    """The truth: per layer, each example's gradient norm of Keras' own loss with the sample
    weights times e_i, less the loss with every weight 0 (the regularizer, no example's)."""
    import keras

    norms: dict[str, list[float]] = {layer.name: [] for layer in model.layers
                                     if layer.trainable_weights}
    previous = keras.config.floatx()
    # The loss in the model's dtype, as gradscope computes it (Keras casts to floatx).
    keras.config.set_floatx(str(model.trainable_variables[0].dtype))
    try:
        _tapes(model, x, y, weights, training, norms)
    finally:
        keras.config.set_floatx(previous)
    return {name: np.array(values) for name, values in norms.items()}


def _tapes(model: Any, x: np.ndarray, y: np.ndarray, weights: np.ndarray, training: bool,
           norms: dict[str, list[float]]) -> None:
    import tensorflow as tf

    for i in range(len(x)):
        one_hot = np.zeros((len(x),) + (1,) * (np.ndim(weights) - 1))
        one_hot[i] = 1.0
        with tf.GradientTape() as tape:
            prediction = model(x, training=training)
            share = (model.compute_loss(x=x, y=y, y_pred=prediction,
                                        sample_weight=weights * one_hot, training=training)
                     - model.compute_loss(x=x, y=y, y_pred=prediction,
                                          sample_weight=0.0 * weights, training=training))
        grads = [tf.convert_to_tensor(g)  # an Embedding's IndexedSlices made dense
                 for g in tape.gradient(share, model.trainable_variables)]
        by_path = dict(zip([v.path for v in model.trainable_variables], grads, strict=True))
        for layer in model.layers:
            if layer.trainable_weights:
                norms[layer.name].append(float(np.sqrt(sum(
                    np.sum(np.asarray(by_path[v.path]) ** 2) for v in layer.trainable_weights))))


@pytest.mark.parametrize(("kind", "dtype", "rtol"), [
    ("lstm", "float64", 1e-6), ("gru", "float64", 1e-6), ("simple_rnn", "float64", 1e-6),
    ("own_cell", "float64", 1e-6)])
def test_the_norms_are_a_loop_of_one_tape_per_example(tf, kind, dtype, rtol):
    model = _model(kind, dtype, regularizer=True)  # a term of the loss that is no example's
    x, y, weights = (value.astype(dtype) for value in _batch())
    report = gradscope.explain(model, x=x, y=y, sample_weight=weights, per_example=True)
    found = report.per_example
    assert found is not None and found.dtype == dtype
    truth = _one_tape_per_example(model, x, y, weights)
    assert sorted(found.layers) == sorted(truth)
    for name, norms in truth.items():
        np.testing.assert_allclose(found.layers[name], norms, rtol=rtol, atol=1e-12,
                                   err_msg=name)
    total = np.sqrt(sum(norms ** 2 for norms in truth.values()))
    np.testing.assert_allclose(found.l2, total, rtol=rtol)
    assert found.l2[2] == 0.0  # sample weight 0: no share of the loss
    assert found.added_terms is not None and found.added_terms > 0
    assert found.method == SPLIT_METHOD
    if kind == "lstm":  # a batch of fewer than 20: its top 10% is one example, said so
        assert found.top_examples == 1
        shares = np.sort(found.l2) ** 2
        text = render_text(report, 200)
        assert (f"the example with the largest norm carries {shares[-1] / shares.sum():.0%} "
                f"of Σ_i ‖g_i‖² (of {len(shares)} examples)") in text


def test_the_statistics_follow_their_definitions():
    squares = np.array([1.0, 4.0, 9.0, 16.0])
    batch = 2.0
    size = len(squares)
    expected = (size * size * squares.sum() - size * batch) / (size - 1) / batch
    assert noise_scale(squares, batch) == pytest.approx(expected)
    assert noise_scale(squares[:1], batch) is None
    assert outliers(np.array([1.0, 1.1, 0.9, 1.0, 1.05, 30.0, 0.95])) == [5]
    assert outliers(np.ones(6)) == []


def test_a_loss_that_divides_by_the_weights_is_refused(tf):
    import keras

    model = _model("gru", "float32")
    model.compile(loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    x, y, weights = (value.astype("float32") for value in _batch())
    with pytest.raises(ConfigError, match="not a sum of one share per example"):
        gradscope.explain(model, x=x, y=y, sample_weight=weights, per_example=True)


def test_a_yaml_spec_and_check_refuse_it():
    spec = {"input_size": 3, "time_steps": 4, "batch_size": 2,
            "layers": [{"gru": 3}, {"dense": 2}]}
    with pytest.raises(ConfigError, match="per_example= is for Keras models"):
        gradscope.explain(spec, per_example=True)


def _assert_a_loop_of_tapes(report: Any, model: Any, x: np.ndarray, y: np.ndarray,
                            weights: np.ndarray, training: bool = False) -> None:
    found = report.per_example
    truth = _one_tape_per_example(model, x, y, weights, training)
    assert sorted(found.layers) == sorted(truth)
    for name, norms in truth.items():
        np.testing.assert_allclose(found.layers[name], norms, rtol=1e-6, atol=1e-12,
                                   err_msg=name)
    np.testing.assert_allclose(found.l2, np.sqrt(sum(n ** 2 for n in truth.values())),
                               rtol=1e-6)


def _float64(build: Any) -> Any:
    import keras

    keras.utils.set_random_seed(5)
    previous, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        return build(keras)
    finally:
        keras.config.set_floatx(previous)
        keras.config.set_dtype_policy(policy)


def test_embedding_bidirectional_and_own_cells_are_split(tf):
    """Embedding (mask_zero) → Dense → Bidirectional GRU (a backwards direction, masked) →
    RNN(a cell with a tuple state whose output is no state) → Dense, sample weights."""

    def build(keras: Any) -> Any:
        tokens = keras.Input((STEPS,), dtype="int32")
        h = keras.layers.Embedding(7, 3, mask_zero=True)(tokens)
        h = keras.layers.Dense(3, activation="tanh")(h)
        h = keras.layers.Bidirectional(keras.layers.GRU(2, return_sequences=True))(h)
        h = keras.layers.RNN(_tuple_state_cell()(3))(h)
        model = keras.Model(tokens, keras.layers.Dense(2)(h))
        model.compile(loss="mse")
        return model

    model = _float64(build)
    rng = np.random.default_rng(1)
    x = rng.integers(1, 7, size=(BATCH, STEPS)).astype("int32")
    x[1, 2:] = 0  # masked steps, at the end
    x[4, :1] = 0  # and at the start
    y = rng.normal(size=(BATCH, 2))
    weights = np.array([1.0, 2.0, 0.5, 1.0, 0.0])
    report = gradscope.explain(model, x=x, y=y, sample_weight=weights, per_example=True)
    assert report.per_example.method == SPLIT_METHOD
    assert report.per_example.l2[4] == 0.0
    _assert_a_loop_of_tapes(report, model, x, y, weights)


def test_interacting_examples_fall_back_to_the_jacobian_and_say_why(tf):
    """BatchNormalization in training mode mixes the examples (batch statistics): the split
    refuses it, and the Jacobian gives the exact gradients, cross terms included."""

    def build(keras: Any) -> Any:
        model = keras.Sequential([
            keras.Input((STEPS, FEATURES)), keras.layers.SimpleRNN(UNITS),
            keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        model.compile(loss="mse")
        return model

    model = _float64(build)
    x, _, _ = _batch()
    y = np.random.default_rng(2).normal(size=(BATCH, 2))
    weights = np.ones(BATCH)
    report = gradscope.explain(model, x=x, y=y, sample_weight=weights, per_example=True,
                               training=True)
    method = report.per_example.method
    assert "pfor" in method and "BatchNormalization in training mode" in method
    # The reason alone (found tried as a new user would: Keras' own wrapping of an error
    # raised in a call, bold escape codes and "Arguments received…" included).
    assert re.search(r"\(not the batched pass split at each layer's call: batch_normalization"
                     r"\w*: BatchNormalization in training mode mixes the examples\)$",
                     method), method
    _assert_a_loop_of_tapes(report, model, x, y, weights, training=True)


def test_a_loss_that_mixes_the_examples_falls_back(tf):
    """A loss of the user's own whose every example's share reads the whole batch (its mean
    prediction): caught on the loss's gradient, and the Jacobian answers."""
    import keras

    def centred(y_true: Any, y_pred: Any) -> Any:
        ops = keras.ops
        centre = ops.mean(y_pred, axis=0, keepdims=True)
        return ops.mean(ops.square(y_true - y_pred + 0.5 * centre), axis=-1)

    model = _model("gru")
    model.compile(loss=centred)
    x, y, weights = _batch()
    report = gradscope.explain(model, x=x, y=y, sample_weight=weights, per_example=True)
    assert "the loss mixes the examples" in report.per_example.method
    _assert_a_loop_of_tapes(report, model, x, y, weights)
