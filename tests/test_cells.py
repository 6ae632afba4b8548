"""Each cell layout against TensorFlow's own implementation of it, with the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import initial_params, synthetic_batch
from gradscope.yaml.engine import Engine


def _setup(layer: dict, dtype: str = "float64"):
    spec = load_spec({"input_size": 5, "time_steps": 7, "batch_size": 3, "layers": [layer],
                      "loss": "mse", "dtype": dtype})
    algebra = model_shapes(spec)
    rng = np.random.default_rng(5)
    params = {k: (v + 0.3 * rng.standard_normal(v.shape)).astype(dtype)
              for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra)
    for value in batch.initial_states.values():
        value[...] = rng.standard_normal(value.shape)
    return algebra, params, batch


def _ours(algebra, params, batch, tf):
    engine = Engine(algebra)
    predictions, finals = engine.forward({k: tf.constant(v) for k, v in params.items()},
                                         tf.constant(batch.x),
                                         {k: tf.constant(v) for k, v in
                                          batch.initial_states.items()})
    return predictions.numpy(), {k: v.numpy() for k, v in finals.items()}


@pytest.mark.parametrize("kind", ["lstm", "simple_rnn"])
def test_keras_layout_equals_keras_layer(kind, tf):
    import keras

    algebra, params, batch = _setup({"type": kind, "units": 4, "layout": "keras"})
    ours, finals = _ours(algebra, params, batch, tf)
    layer_class = {"lstm": keras.layers.LSTM, "simple_rnn": keras.layers.SimpleRNN}[kind]
    layer = layer_class(4, return_sequences=True, dtype="float64")
    layer.build((None, 7, 5))
    name = f"{kind}_1"
    layer.set_weights([params[f"{name}/kernel"], params[f"{name}/recurrent_kernel"],
                       params[f"{name}/bias"]])
    initial = [batch.initial_states[f"{name}/h0"]]
    if kind == "lstm":
        initial.append(batch.initial_states[f"{name}/c0"])
    theirs = np.asarray(layer(batch.x, initial_state=initial))
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(finals[f"{name}/h_T"], theirs[:, -1], rtol=1e-12, atol=1e-12)


def test_block_lstm_equals_tf_lstm_block_cell(tf):
    """TF1 LSTMCell layout: TF's LSTMBlockCell kernel (gates i, j(ci), f, o; forget_bias 1)."""
    algebra, params, batch = _setup({"type": "lstm", "units": 4}, dtype="float32")
    ours, finals = _ours(algebra, params, batch, tf)
    h, c = batch.initial_states["lstm_1/h0"], batch.initial_states["lstm_1/c0"]
    zeros = np.zeros(4, np.float32)
    for t in range(7):
        _, c, _, _, _, _, h = tf.raw_ops.LSTMBlockCell(
            x=batch.x[:, t], cs_prev=c, h_prev=h, w=params["lstm_1/kernel"], wci=zeros,
            wcf=zeros, wco=zeros, b=params["lstm_1/bias"], forget_bias=1.0, cell_clip=-1.0,
            use_peephole=False)
        np.testing.assert_allclose(ours[:, t], h.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(finals["lstm_1/c_T"], c.numpy(), rtol=1e-5, atol=1e-6)


def test_block_simple_rnn_is_tanh_of_the_concatenation(tf):
    algebra, params, batch = _setup({"type": "simple_rnn", "units": 4})
    ours, _ = _ours(algebra, params, batch, tf)
    h = batch.initial_states["simple_rnn_1/h0"]
    for t in range(7):
        h = np.tanh(np.concatenate([batch.x[:, t], h], axis=1) @ params["simple_rnn_1/kernel"]
                    + params["simple_rnn_1/bias"])
        np.testing.assert_allclose(ours[:, t], h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind,layout,shapes", [
    ("lstm", "block", {"kernel": (9, 16), "bias": (16,)}),
    ("lstm", "keras", {"kernel": (5, 16), "recurrent_kernel": (4, 16), "bias": (16,)}),
    ("simple_rnn", "block", {"kernel": (9, 4), "bias": (4,)}),
    ("simple_rnn", "keras", {"kernel": (5, 4), "recurrent_kernel": (4, 4), "bias": (4,)}),
])
def test_algebra_shapes_and_states(kind, layout, shapes):
    algebra = model_shapes(load_spec({"input_size": 5, "time_steps": 2, "batch_size": 3,
                                      "layers": [{"type": kind, "units": 4, "layout": layout}]}))
    assert {w.short: w.shape for w in algebra.weights} == shapes
    states = ["h0", "c0"] if kind == "lstm" else ["h0"]
    assert [s.name for s in algebra.states] == [f"{kind}_1/{s}" for s in states]


@pytest.mark.parametrize("layers", [
    [{"lstm": 4}, {"dense": 3}],
    [{"type": "lstm", "units": 4, "layout": "keras"}, {"simple_rnn": 3},
     {"type": "simple_rnn", "units": 2, "layout": "keras"}, {"dense": 2}],
    [{"gru": 3}, {"type": "lstm", "units": 3, "return_sequences": False}, {"dense": 2}],
])
def test_numpy_reference_equals_tf_for_lstm_and_simple_rnn(layers, tf):
    from gradscope.yaml.reference import reference_gradients

    spec = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 3, "layers": layers,
                      "dtype": "float64"})
    algebra = model_shapes(spec)
    rng = np.random.default_rng(1)
    params = {k: v + 0.2 * rng.standard_normal(v.shape) for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra)
    for value in batch.initial_states.values():
        value[...] = rng.standard_normal(value.shape)
    result = Engine(algebra).run(params, batch)
    reference = reference_gradients(algebra, params, batch)
    autodiff = {**result.weight_gradients, **result.state_gradients, "x": result.input_gradient}
    assert set(reference.gradients) == set(autodiff)
    assert reference.loss == pytest.approx(result.loss, rel=1e-12)
    for name, expected in autodiff.items():
        np.testing.assert_allclose(reference.gradients[name], expected, rtol=1e-10, atol=1e-13,
                                   err_msg=name)


@pytest.mark.parametrize("key,options", [("gru_keras", {}),
                                         ("gru_keras", {"reset_after": False}),
                                         ("lstm_keras", {}), ("simple_rnn_keras", {})])
def test_a_step_linearised_by_hand_is_forward_mode_autodiff(key, options, tf):
    """``tf_step_tangent`` (the --jacobians loop's step) against TensorFlow's forward-mode
    autodiff of ``tf_step``, one tangent column at a time, at a point away from zero."""
    from gradscope.cells import CELLS

    cell = CELLS[key](name="rnn", units=4, input_size=3, input_label="input", options=options)
    assert cell.has_tangent
    rng = np.random.default_rng(2)
    params = {k: tf.constant(v + 0.5 * rng.standard_normal(v.shape))
              for k, v in cell.init_params(rng).items()}
    weights = cell.tf_step_weights(tf, params)
    (inputs,) = cell.tf_inputs(tf, params, tf.constant(rng.standard_normal((1, 5, 3))))
    states = tuple(tf.constant(rng.standard_normal((5, 4))) for _ in cell.state_names)
    block = tuple(tf.constant(rng.standard_normal((3, 5, 4))) for _ in cell.state_names)
    after, moved = cell.tf_step_tangent(tf, weights, states, (inputs[0],), block)
    for mine, truth in zip(after, cell.tf_step(tf, weights, states, (inputs[0],)),
                           strict=True):
        np.testing.assert_allclose(mine, truth, rtol=1e-14)
    for k in range(3):
        with tf.autodiff.ForwardAccumulator(states, tuple(t[k] for t in block)) as acc:
            new = cell.tf_step(tf, weights, states, (inputs[0],))
        for mine, truth in zip(moved, acc.jvp(new), strict=True):
            np.testing.assert_allclose(mine[k], truth, rtol=1e-12, atol=1e-14)
    # With the projected input's tangent too (what the memory horizon reads, ∂h_t/∂x_s).
    step_input = inputs[0]
    _, apply = cell.tf_step_linear(tf, weights, states, (step_input,))
    along = tf.constant(rng.standard_normal((3, *step_input.shape)))
    moved = apply(block, (along,))
    for k in range(3):
        with tf.autodiff.ForwardAccumulator((*states, step_input),
                                            (*(t[k] for t in block), along[k])) as acc:
            new = cell.tf_step(tf, weights, states, (step_input,))
        for mine, truth in zip(moved, acc.jvp(new), strict=True):
            np.testing.assert_allclose(mine[k], truth, rtol=1e-12, atol=1e-14)
