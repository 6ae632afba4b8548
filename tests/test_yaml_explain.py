"""explain against TensorFlow itself: real gradient shapes equal the algebra, the layouts equal
TF's own GRU implementations, and the report validates against the published schema."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from gradscope.errors import InternalError
from gradscope.report.models import json_schema
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import initial_params, synthetic_batch
from gradscope.yaml.engine import Engine
from gradscope.yaml.explain import explain

recurrent = st.fixed_dictionaries(
    {"type": st.sampled_from(["gru", "lstm", "simple_rnn"]), "units": st.integers(1, 9),
     "layout": st.sampled_from(["block", "keras"])},
    optional={"reset_after": st.booleans()},
)


def _spec(layers, **extra):
    base = {"input_size": 5, "time_steps": 4, "batch_size": 3, "layers": layers}
    base.update(extra)
    return load_spec(base)


@st.composite
def stacks(draw):
    layers = draw(st.lists(recurrent, min_size=1, max_size=4))
    layers = [
        {k: v for k, v in layer.items()
         if k != "reset_after" or (layer["layout"] == "keras" and layer["type"] == "gru")}
        for layer in layers
    ]
    if draw(st.booleans()):
        layers[-1]["return_sequences"] = False
    heads = draw(st.lists(st.integers(1, 4), max_size=2))
    return _spec(
        layers + [{"dense": h} for h in heads],
        input_size=draw(st.integers(1, 7)), time_steps=draw(st.integers(1, 5)),
        batch_size=draw(st.integers(1, 4)),
        loss=draw(st.sampled_from(["softmax_cross_entropy", "mse"])),
        dtype=draw(st.sampled_from(["float32", "float64"])),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=stacks())
def test_tf_gradient_shapes_equal_the_algebra(spec, tf):
    algebra = model_shapes(spec)
    result = Engine(algebra).run(initial_params(algebra), synthetic_batch(algebra))
    for info in algebra.weights:
        assert result.weight_gradients[info.name].shape == info.shape, info.name
    for info in algebra.states:
        assert result.state_gradients[info.name].shape == info.shape, info.name
    assert np.isfinite(result.loss)


def test_seed_explain_report_validates_against_the_schema(tf):
    report = explain(load_spec())
    document = report.to_dict()
    Draft202012Validator(json_schema("explain")).validate(document)
    assert [tuple(g["shape"]) for g in document["gradients"]] == [
        (264, 128), (128,), (264, 64), (64,), (96, 64), (64,), (96, 32), (32,), (32, 3), (3,)]
    assert [tuple(s["shape"]) for s in document["initial_state_gradients"]] == [
        (34, 64), (34, 32)]
    assert document["carry"]["wrong_call_error"] == "Passed 10 grad_ys for 2 ys"
    # Softmax over 3 classes starts near log(3) with small weights.
    assert abs(document["loss"]["value"] - np.log(3)) < 0.3
    for gradient in document["gradients"]:
        assert gradient["stats"]["l2"] > 0 and gradient["stats"]["nonfinite"] == 0


def test_stats_are_those_of_the_real_gradient(tf):
    spec = _spec([{"gru": 3}, {"dense": 2}], dtype="float64")
    algebra = model_shapes(spec)
    result = Engine(algebra).run(initial_params(algebra), synthetic_batch(algebra))
    report = explain(spec)
    for entry in report.gradients:
        g = result.weight_gradients[entry.name]
        assert entry.stats.l2 == pytest.approx(np.linalg.norm(g), rel=1e-12)
        assert entry.stats.max_abs == pytest.approx(np.abs(g).max(), rel=1e-12)
    h0 = result.state_gradients["gru_1/h0"]
    per_example = np.linalg.norm(h0, axis=1)
    entry = report.initial_state_gradients[0]
    assert entry.per_example_norm.median == pytest.approx(np.median(per_example), rel=1e-12)


def test_a_shape_disagreement_is_an_internal_error(tf, monkeypatch):
    from gradscope.cells.gru_block import GRUBlock

    original = GRUBlock.weights

    def wrong(self):
        infos = original(self)
        return [infos[0].__class__(**{**infos[0].__dict__, "shape": (1, 1)}), *infos[1:]]

    monkeypatch.setattr(GRUBlock, "weights", wrong)
    spec = _spec([{"gru": 3}, {"dense": 2}])
    with pytest.raises(InternalError, match=r"gru_1/w_ru has shape \(8, 6\).*says \(1, 1\)"):
        explain(spec)


def _run_forward(engine, params, batch, tf):
    cast = {k: tf.constant(v) for k, v in params.items()}
    states = {k: tf.constant(v) for k, v in batch.initial_states.items()}
    predictions, finals = engine.forward(cast, tf.constant(batch.x), states)
    return predictions.numpy(), {k: v.numpy() for k, v in finals.items()}


@pytest.mark.parametrize("reset_after", [True, False])
def test_keras_layout_equals_keras_gru(tf, reset_after):
    """Witness for the keras layout: Keras 3's own GRU with the same weights agrees."""
    import keras

    spec = _spec([{"type": "gru", "units": 6, "layout": "keras", "reset_after": reset_after}],
                 dtype="float64", time_steps=7, loss="mse")
    algebra = model_shapes(spec)
    params = initial_params(algebra)
    rng = np.random.default_rng(3)
    params = {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in params.items()}
    batch = synthetic_batch(algebra)
    h0 = rng.standard_normal((3, 6))
    batch.initial_states["gru_1/h0"][...] = h0
    ours, finals = _run_forward(Engine(algebra), params, batch, tf)

    layer = keras.layers.GRU(6, return_sequences=True, reset_after=reset_after, dtype="float64")
    layer.build((None, 7, 5))
    layer.set_weights([params["gru_1/kernel"], params["gru_1/recurrent_kernel"],
                       params["gru_1/bias"]])
    theirs = np.asarray(layer(batch.x, initial_state=[h0]))
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(finals["gru_1/h_T"], theirs[:, -1], rtol=1e-12, atol=1e-12)


def test_block_layout_equals_tf_gru_block_cell(tf):
    """Witness for the block layout: TF's own GRUBlockCell kernel (float32 only) agrees."""
    spec = _spec([{"gru": 6}], time_steps=7, loss="mse")
    algebra = model_shapes(spec)
    params = initial_params(algebra)
    batch = synthetic_batch(algebra)
    rng = np.random.default_rng(4)
    h = rng.standard_normal((3, 6)).astype(np.float32)
    batch.initial_states["gru_1/h0"][...] = h
    ours, _ = _run_forward(Engine(algebra), params, batch, tf)
    for t in range(7):
        *_, h = tf.raw_ops.GRUBlockCell(
            x=batch.x[:, t], h_prev=h, w_ru=params["gru_1/w_ru"], w_c=params["gru_1/w_c"],
            b_ru=params["gru_1/b_ru"], b_c=params["gru_1/b_c"])
        np.testing.assert_allclose(ours[:, t], h.numpy(), rtol=1e-5, atol=1e-6)
