"""An example of gradscope in a user's own pytest suite: run it with

    .venv/bin/pytest examples/test_my_gradients.py

Each test builds a small Keras model or layer of the kind people write, and checks its
gradients with gradscope.testing, as torch.autograd.gradcheck would for PyTorch. The last test
shows what a wrong gradient looks like: a layer whose tf.custom_gradient is off by a factor.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradscope.testing import assert_gradients, check_layer

RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, 12, 3)).astype("float32")
Y = RNG.standard_normal((8, 2)).astype("float32")


@keras.saving.register_keras_serializable("example")
class ScaledTanh(keras.layers.Layer):
    """A layer of one's own, with a weight and a hand-written gradient."""

    def __init__(self, wrong_by: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.wrong_by = wrong_by

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        @tf.custom_gradient
        def scaled_tanh(v, scale):
            y = tf.tanh(v * scale)

            def backward(dy):
                inner = dy * (1.0 - y * y)
                # The gradient with respect to v, off by wrong_by unless it is 1.
                dv = inner * scale * self.wrong_by
                dscale = tf.reduce_sum(inner * v, axis=tf.range(tf.rank(v) - 1))
                return dv, dscale

            return y, backward

        return scaled_tanh(x, tf.cast(self.scale, x.dtype))

    def get_config(self):
        return {**super().get_config(), "wrong_by": self.wrong_by}


def model_with(layer):
    inputs = keras.Input((12, 3))
    h = keras.layers.GRU(5, name="gru")(layer(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    model.compile(loss="mse")
    return model


def test_a_gru_model_gradients():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((12, 3)), keras.layers.GRU(5),
                              keras.layers.Dense(2)])
    model.compile(loss="mse")
    report = assert_gradients(model, X, Y)
    assert report.summary.passed


def test_my_layer_on_its_own():
    check_layer(ScaledTanh(name="scaled_tanh"), X)


def test_a_recurrent_cell_on_its_own():
    check_layer(keras.layers.LSTMCell(4, name="cell"), X)


def test_my_layer_inside_a_model():
    keras.utils.set_random_seed(2)
    assert_gradients(model_with(ScaledTanh(name="scaled_tanh")), X, Y)


def test_a_wrong_custom_gradient_is_caught():
    keras.utils.set_random_seed(2)
    model = model_with(ScaledTanh(wrong_by=0.5, name="scaled_tanh"))
    with pytest.raises(AssertionError, match="finite diff"):
        assert_gradients(model, X, Y)
    with pytest.raises(AssertionError, match=r"input inputs? ?\S* · finite diff"):
        check_layer(ScaledTanh(wrong_by=0.5, name="scaled_tanh"), X)
