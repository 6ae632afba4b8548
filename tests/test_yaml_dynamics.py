"""State Jacobians, per-step gradients and input influence against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import initial_params, synthetic_batch
from gradscope.yaml.dynamics import dynamics, influence_map
from gradscope.yaml.engine import Engine

EPS = 1e-6


def _model(layers):
    spec = load_spec({"input_size": 3, "time_steps": 6, "batch_size": 2, "layers": layers,
                      "loss": "mse", "dtype": "float64"})
    algebra = model_shapes(spec)
    rng = np.random.default_rng(2)
    params = {k: v + 0.4 * rng.standard_normal(v.shape) for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra)
    for value in batch.initial_states.values():
        value[...] = rng.standard_normal(value.shape)
    engine = Engine(algebra)
    return engine, params, batch


def _finals(engine, params, batch, tf, probes=None):
    predictions, finals = engine.forward(
        {k: tf.constant(v) for k, v in params.items()}, tf.constant(batch.x),
        {k: tf.constant(v) for k, v in batch.initial_states.items()}, probes)
    return predictions, {k: v.numpy() for k, v in finals.items()}


def _with_state(batch, name, value):
    return type(batch)(x=batch.x, y=batch.y, source=batch.source,
                       initial_states={**batch.initial_states, name: value})


STACKS = [
    [{"gru": 3}, {"type": "gru", "units": 2, "layout": "keras"}, {"dense": 2}],
    [{"lstm": 2}, {"simple_rnn": 3}, {"dense": 1}],
]


@pytest.mark.parametrize("layers", STACKS)
def test_state_jacobians_match_finite_differences(layers, tf):
    engine, params, batch = _model(layers)
    _, found = dynamics(engine, params, batch)
    cells = engine.shapes.cells
    for block in found.jacobians:
        source = next(c for c in cells if c.name == block.source_layer)
        target = next(c for c in cells if c.name == block.target_layer)
        columns = [(f"{source.name}/{s}", k) for s in source.state_names
                   for k in range(source.units)]
        for column, (state, k) in enumerate(columns):
            value = batch.initial_states[state]
            bumped = []
            for sign in (1, -1):
                shifted = value.copy()
                shifted[:, k] += sign * EPS
                _, finals = _finals(engine, params, _with_state(batch, state, shifted), tf)
                bumped.append(np.concatenate(
                    [finals[f"{target.name}/{s[0]}_T"] for s in target.state_names], axis=1))
            numerical = (bumped[0] - bumped[1]) / (2 * EPS)  # (B, rows)
            np.testing.assert_allclose(block.blocks[:, :, column], numerical, rtol=1e-6,
                                       atol=1e-9, err_msg=f"{block.target_layer} ← {state}")
    # Block lower-triangular: an upper layer never reaches a lower one.
    pairs = [(b.target_layer, b.source_layer) for b in found.jacobians]
    names = [c.name for c in cells]
    assert pairs == [(t, s) for j, t in enumerate(names) for s in names[: j + 1]]


def test_per_step_gradients_are_the_total_gradient_of_each_state(tf):
    """‖∂L/∂h_t‖ comes from one backward pass; each step's value is the true total derivative,
    recurrence included: perturbing h_t (through the zero probe) changes the loss by it."""
    engine, params, batch = _model(STACKS[0])
    result = engine.run(params, batch, per_step=True)
    rng = np.random.default_rng(3)
    x = tf.constant(batch.x)
    for name, gradient in result.sequence_gradients.items():
        for t in (0, 2, 5):
            direction = np.zeros((6, *gradient[:, 0].shape))  # time-major probe
            direction[t] = rng.standard_normal(gradient[:, 0].shape)
            losses = []
            for sign in (1, -1):
                probes = engine.probe_zeros(x)
                probes[name] = tf.constant(sign * EPS * direction)
                predictions, _ = _finals(engine, params, batch, tf, probes)
                losses.append(float(engine.loss(predictions, tf.constant(batch.y))))
            numerical = (losses[0] - losses[1]) / (2 * EPS)
            analytic = float(np.sum(gradient[:, t] * direction[t]))
            assert numerical == pytest.approx(analytic, rel=1e-6, abs=1e-12), (name, t)


def test_influence_matches_finite_differences_and_is_causal(tf):
    engine, params, batch = _model(STACKS[0])
    _, found = dynamics(engine, params, batch, at=3)
    last = engine.shapes.cells[-1].name
    per_example = np.zeros((2, 6))
    for s in range(6):
        for f in range(3):
            outs = []
            for sign in (1, -1):
                x = batch.x.copy()
                x[:, s, f] += sign * EPS
                sequences: dict = {}
                engine.forward({k: tf.constant(v) for k, v in params.items()}, tf.constant(x),
                               {k: tf.constant(v) for k, v in batch.initial_states.items()},
                               sequences=sequences)
                outs.append(sequences[f"{last}/h"].numpy()[3])  # (B, u)
            per_example[:, s] += np.sum(((outs[0] - outs[1]) / (2 * EPS)) ** 2, axis=1)
    expected = np.median(np.sqrt(per_example), axis=0)
    np.testing.assert_allclose(found.influence, expected, rtol=1e-5, atol=1e-12)
    assert np.all(found.influence[4:] == 0)  # x_s after t cannot influence h_t
    heat = influence_map(engine, params, batch, [3, 5])
    np.testing.assert_allclose(heat[0], found.influence, rtol=1e-12)


def test_the_combined_pass_equals_the_ordinary_engine_pass(tf):
    engine, params, batch = _model(STACKS[1])
    combined, _ = dynamics(engine, params, batch)
    ordinary = engine.run(params, batch, per_step=True)
    assert combined.loss == pytest.approx(ordinary.loss, rel=1e-12)
    for name in ordinary.weight_gradients:
        np.testing.assert_allclose(combined.weight_gradients[name],
                                   ordinary.weight_gradients[name], rtol=1e-10, atol=1e-14)
    for name in ordinary.sequence_gradients:
        np.testing.assert_allclose(combined.sequence_gradients[name],
                                   ordinary.sequence_gradients[name], rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(combined.input_gradient, ordinary.input_gradient, rtol=1e-10,
                               atol=1e-14)


def test_an_lstms_per_step_c_gradient_is_the_total_through_h_t_too(tf):
    """‖∂L/∂c_t‖ is the total: through h_t = o_t·tanh(c_t) at the same step as well as through
    c_{t+1}. The truth is the BPTT recurrence, computed here in NumPy from the forward's own
    gates: dc_t = dh_t·o_t·(1 − tanh²c_t) + dc_{t+1}·f_{t+1}, with dh_t the total ∂L/∂h_t
    (itself held to finite differences above)."""
    spec = load_spec({"input_size": 3, "time_steps": 6, "batch_size": 2, "loss": "mse",
                      "dtype": "float64", "layout": "keras",
                      "layers": [{"lstm": 4}, {"dense": 2}]})
    algebra = model_shapes(spec)
    rng = np.random.default_rng(5)
    params = {k: v + 0.5 * rng.standard_normal(v.shape)
              for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra)
    engine = Engine(algebra)
    result = engine.run(params, batch, per_step=True)
    dh, dc = result.sequence_gradients["lstm_1/h"], result.sequence_gradients["lstm_1/c"]
    trajectories: dict = {}
    engine.forward({k: tf.constant(v) for k, v in params.items()}, tf.constant(batch.x),
                   {k: tf.constant(v) for k, v in batch.initial_states.items()},
                   trajectories=trajectories)
    h, c = (np.swapaxes(trajectories[f"lstm_1/{s}"].numpy(), 0, 1) for s in "hc")
    u = 4
    h_prev = np.concatenate([batch.initial_states["lstm_1/h0"][:, None], h[:, :-1]], axis=1)
    z = (batch.x @ params["lstm_1/kernel"] + h_prev @ params["lstm_1/recurrent_kernel"]
         + params["lstm_1/bias"])
    f, o = (1 / (1 + np.exp(-z[..., k * u:(k + 1) * u])) for k in (1, 3))
    expected = np.zeros_like(dc)
    carried = np.zeros_like(dc[:, 0])
    for t in reversed(range(6)):
        expected[:, t] = dh[:, t] * o[:, t] * (1 - np.tanh(c[:, t]) ** 2) + carried
        carried = expected[:, t] * f[:, t]
    np.testing.assert_allclose(dc, expected, rtol=1e-10, atol=1e-14)
    assert np.all(np.abs(dc[:, -1]) > 0)  # the last step's c reaches the loss through h_T
