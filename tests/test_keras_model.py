"""Saved Keras 3 models: explain them with their own names and weights, and agree with Keras."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_gradscope

from gradscope.algebra import model_shapes
from gradscope.data import synthetic_batch
from gradscope.errors import ConfigError
from gradscope.keras_model import load_keras_model
from gradscope.model import Engine


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tf):
    import keras

    folder = tmp_path_factory.mktemp("models")
    sequential = keras.Sequential([
        keras.Input((6, 5)),
        keras.layers.GRU(4, return_sequences=True, name="encoder"),
        keras.layers.LSTM(3, return_sequences=True),
        keras.layers.TimeDistributed(keras.layers.Dense(2), name="head"),
    ])
    inputs = keras.Input((None, 5))
    hidden = keras.layers.SimpleRNN(4, name="rnn")(inputs)
    functional = keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden))
    unsupported = keras.Sequential([
        keras.Input((6, 5)), keras.layers.GRU(4, return_sequences=True),
        keras.layers.Dropout(0.1), keras.layers.Conv1D(2, 2),
    ])
    paths = {}
    for name, model in [("sequential", sequential), ("functional", functional),
                        ("unsupported", unsupported)]:
        paths[name] = folder / f"{name}.keras"
        model.save(paths[name])
    return paths, sequential, functional


def test_round_trip_shapes_names_and_weights_equal_model_weights(saved, tf):
    paths, sequential, _ = saved
    spec, params = load_keras_model(str(paths["sequential"]), batch_size=3)
    # The model's own layer names (Keras numbers unnamed ones per process: read them back).
    assert [layer.name for layer in spec.layers] == [layer.name for layer in sequential.layers]
    assert spec.layers[0].name == "encoder" and spec.layers[2].name == "head"
    assert (spec.input_size, spec.time_steps, spec.batch_size) == (5, 6, 3)
    algebra = model_shapes(spec)
    assert [w.shape for w in algebra.weights] == [tuple(v.shape) for v in sequential.weights]
    for info, variable in zip(algebra.weights, sequential.weights, strict=True):
        np.testing.assert_array_equal(params[info.name], variable.numpy())


def test_gradients_equal_keras_own_gradients(saved, tf):
    paths, sequential, _ = saved
    spec, params = load_keras_model(str(paths["sequential"]), batch_size=3)
    algebra = model_shapes(spec)
    batch = synthetic_batch(algebra)
    ours = Engine(algebra).run(params, batch)
    x, y = tf.constant(batch.x), tf.constant(batch.y)
    with tf.GradientTape() as tape:
        logits = sequential(x)
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
    theirs = tape.gradient(loss, sequential.trainable_weights)
    assert ours.loss == pytest.approx(float(loss), rel=1e-5)
    for info, gradient in zip(algebra.weights, theirs, strict=True):
        np.testing.assert_allclose(ours.weight_gradients[info.name], gradient.numpy(),
                                   rtol=1e-4, atol=1e-7, err_msg=info.name)


def test_cli_explains_a_functional_model_given_its_missing_time_steps(saved):
    paths, _, functional = saved
    missing = run_gradscope("explain", str(paths["functional"]))
    assert missing.returncode == 2
    assert "its axis 1 is None; pass --time-steps" in missing.stderr
    result = run_gradscope("explain", str(paths["functional"]), "--time-steps", "7",
                           "--batch-size", "2", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["source"] == "keras"
    assert [layer["name"] for layer in document["layers"]] == ["rnn", "out"]
    assert [g["shape"] for g in document["gradients"]] == [
        list(v.shape) for v in functional.weights]
    assert "sum over the batch" in document["gradients"][-1]["meaning"]


def test_unsupported_layers_are_listed(saved):
    paths, _, _ = saved
    with pytest.raises(ConfigError, match=r"unsupported layers: dropout \(Dropout\), "
                                          r"conv1d \(Conv1D\)"):
        load_keras_model(str(paths["unsupported"]))
