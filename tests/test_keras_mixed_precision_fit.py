"""GradientFlow during fit under mixed_float16: at each observation, the shares lost at the
optimizer's loss scale equal those of a float32 shadow computed here by hand (the LSTM cell
unrolled under a tape, with the weights the model had at that step, on the batch fit trained
on), at scale 1 and at 2¹⁵; the last observation's section equals explain's on the same
weights and batch; the TensorBoard events hold the tags and `gradscope watch` reads it all
back (text and --json). A float32 model takes no mixed-precision pass at all:
test_keras_callback's fitted run asserts that."""

from __future__ import annotations

import html
import json
from typing import Any

import numpy as np
import pytest
from conftest import (
    lstm_float32_shadow,
    mixed_lstm,
    mixed_lstm_batch,
    render_text,
    run_without_tensorflow,
    tensorboard_events,
)

import gradscope
from gradscope.keras.mixed_precision import classify

BATCH, STEPS, FEATURES, UNITS = 4, 5, 3, 4
BATCHES = 2  # one epoch, observed after each batch


@pytest.fixture(scope="module", params=[1.0, 2.0 ** 15], ids=["scale 1", "scale 2^15"])
def fitted(request: Any, tmp_path_factory: Any, tf: Any) -> dict[str, Any]:
    import keras

    from gradscope.keras import GradientFlow

    scale = request.param
    model = mixed_lstm(scale, STEPS, FEATURES, UNITS, learning_rate=0.5)
    parts = [mixed_lstm_batch(BATCH, STEPS, FEATURES, seed) for seed in range(BATCHES)]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    weights: dict[int, list[np.ndarray]] = {}

    class KeepWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            weights[batch + 1] = self.model.get_weights()

    log_dir = tmp_path_factory.mktemp("mixed") / "run"
    flow = GradientFlow(every=1, log_dir=log_dir)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow, KeepWeights()])
    return {"scale": scale, "model": model, "flow": flow, "history": flow.history,
            "weights": weights, "parts": parts, "log_dir": log_dir}


def test_shares_at_each_observation_equal_a_float32_shadow_by_hand(fitted: Any) -> None:
    model, history, scale = fitted["model"], fitted["history"], fitted["scale"]
    assert [o.step for o in history.observations] == [1, 2]
    assert history.mixed_precision is not None
    final = model.get_weights()
    lost = 0
    try:
        for step, section in zip((1, 2), history.mixed_precision, strict=True):
            assert section is not None and section.loss_scale == scale
            model.set_weights(fitted["weights"][step])
            shadow = lstm_float32_shadow(model, *fitted["parts"][step - 1])
            tensors = {t.path: t for t in section.tensors}
            assert set(tensors) == set(shadow)
            for path, truth in shadow.items():
                expected = classify(truth, scale, "float16")
                lost += expected[0]
                entry = tensors[path]
                assert (entry.underflow, entry.subnormal, entry.overflow) == tuple(
                    n / truth.size for n in expected), (step, path)
            nonzero = np.concatenate([np.abs(g).ravel() for g in shadow.values()])
            nonzero = nonzero[nonzero > 0]
            assert section.scale_range == pytest.approx(
                [2.0 ** -14 / nonzero.min(), 65504 / nonzero.max()], rel=1e-6)
            low, high = section.scale_range
            assert section.in_range == (low <= scale <= high)
            assert any("loss scale is 1" in w for w in section.warnings) == (scale == 1)
    finally:
        model.set_weights(final)
    if scale == 1:
        assert lost > 0  # the test sees underflow happen during fit
    # Both mixed-precision passes were traced beside training, with the flow's own.
    watch = fitted["flow"]._mixed_precision.watch
    for traced in (watch.scaled, watch.shadow):
        assert traced.trace["thread"].startswith("gradscope-GradientFlow")


def test_the_last_observation_equals_explain_on_its_weights_and_batch(fitted: Any) -> None:
    x, y = fitted["parts"][-1]  # the model's weights are those of the last observation
    explained = gradscope.explain(fitted["model"], x=x, y=y).mixed_precision
    recorded = fitted["history"].mixed_precision[-1]
    assert explained is not None and recorded is not None
    assert recorded.tensors == explained.tensors
    assert recorded.scale_range == pytest.approx(explained.scale_range, rel=1e-12)
    assert recorded.warnings == explained.warnings


def test_tensorboard_holds_the_tags_and_watch_reads_them_back(fitted: Any, tf: Any) -> None:
    history, log_dir, scale = fitted["history"], fitted["log_dir"], fitted["scale"]
    scalars, _ = tensorboard_events(tf, log_dir)
    last = history.mixed_precision[-1]
    assert scalars["mixed_precision/loss_scale"] == {1: scale, 2: scale}
    assert scalars["mixed_precision/in_range"][2] == float(last.in_range)
    assert scalars["mixed_precision/scale_range_low"][2] == pytest.approx(
        last.scale_range[0], rel=1e-6)  # TensorBoard's scalars are float32
    # Each weight named as the flow's own series name it (lstm/kernel, not its Keras path).
    weights = {t.name for t in last.tensors if t.kind == "weight"}
    assert weights and weights <= {w.weight for w in history.weights}
    for tensor in last.tensors:
        for kind in ("underflow", "subnormal", "overflow"):
            assert scalars[f"mixed_precision/{kind}/{tensor.name}"][2] == pytest.approx(
                getattr(tensor, kind), rel=1e-6)
    assert scalars["mixed_precision/warnings"][2] == len(last.warnings)

    result = run_without_tensorflow("watch", str(log_dir), "--json")
    assert result.returncode == 0, result.stderr
    read = json.loads(result.stdout)
    assert read["mixed_precision"] == history.to_dict()["mixed_precision"]  # exact: JSON
    from jsonschema import Draft202012Validator

    schema = json.loads(run_without_tensorflow("schema", "watch").stdout)
    Draft202012Validator(schema).validate(read)

    text = " ".join(render_text(gradscope.watch(log_dir), 100).split())  # lines unwrapped
    assert "Mixed precision across training (mixed_float16" in text
    assert "At the last observation (step 2):" in text
    assert f"loss scale {scale:g}, LossScaleOptimizer(SGD)" in text
    if scale == 1:
        assert "⚠ the loss scale is 1" in text and "(at 2 of 2 observations" in text
    # callback.report() in a notebook: the same section, as HTML
    assert "Mixed precision across training (mixed_float16" in html.unescape(
        history._repr_html_())


def test_observe_in_a_custom_loop_warns_without_a_loss_scale_optimizer(tf: Any) -> None:
    """Layers under mixed_float16 in a model whose own policy is float32, compiled with a
    plain SGD (Keras wraps it in a LossScaleOptimizer only when the model's own policy is
    mixed_float16): fit would not scale the loss; observe() says so, and its shares are the
    hand shadow's at scale 1."""
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(7)
    model = keras.Sequential([
        keras.Input((STEPS, FEATURES)),
        keras.layers.LSTM(UNITS, return_sequences=True, dtype="mixed_float16"),
        keras.layers.Dense(2, dtype="mixed_float16")])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = mixed_lstm_batch(BATCH, STEPS, FEATURES)
    flow = GradientFlow(model=model)
    flow.observe(x, y)
    sections = flow.history.mixed_precision
    assert sections is not None and len(sections) == 1 and sections[0] is not None
    section = sections[0]
    assert section.loss_scale == 1 and section.optimizer == "SGD"
    assert any("not a LossScaleOptimizer" in w for w in section.warnings)
    # Said once: a second warning that the loss scale is 1 repeated the consequence.
    assert not any(w.startswith("the loss scale is 1") for w in section.warnings)
    shadow = lstm_float32_shadow(model, x, y)
    for tensor in section.tensors:
        truth = shadow[tensor.path]
        assert (tensor.underflow, tensor.subnormal, tensor.overflow) == tuple(
            n / truth.size for n in classify(truth, 1.0, "float16")), tensor.path


def test_a_scale_that_changes_during_fit_is_the_one_each_observation_uses(tf: Any) -> None:
    """A LossScaleOptimizer that doubles its scale after every finite step: each observation
    reads the scale of its moment, and the model's own scaled backward (the 'mixed' shares,
    whose trace holds the scale) equals a tape of the loss times that scale."""
    import keras

    from gradscope.keras import GradientFlow
    from gradscope.keras.mixed_precision import observed

    model = mixed_lstm(1.0, STEPS, FEATURES, UNITS)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=2.0 ** 10, dynamic_growth_steps=1),
        loss="mse")
    parts = [mixed_lstm_batch(BATCH, STEPS, FEATURES, seed) for seed in range(BATCHES)]
    weights: dict[int, list[np.ndarray]] = {}

    class KeepWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            weights[batch + 1] = self.model.get_weights()

    flow = GradientFlow(every=1)
    model.fit(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
              batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow, KeepWeights()])
    sections = flow.history.mixed_precision
    assert sections is not None
    assert [s.loss_scale for s in sections] == [2.0 ** 11, 2.0 ** 12]
    for step, section in zip((1, 2), sections, strict=True):
        model.set_weights(weights[step])
        x, y = parts[step - 1]
        shadow = lstm_float32_shadow(model, x, y)
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x)) * section.loss_scale
        own = tape.gradient(loss, model.trainable_variables)
        for variable, gradient in zip(model.trainable_variables, own, strict=True):
            entry = next(t for t in section.tensors if t.path == variable.path)
            truth = shadow[variable.path]
            assert entry.mixed == [n / truth.size for n in observed(
                gradient.numpy(), truth, "float16")], (step, variable.path)


def test_a_model_without_a_float32_copy_trains_on_and_says_why(tf: Any, tmp_path: Any) -> None:
    """A compiled loss Keras cannot rebuild from its config (explain refuses such a model with
    exit 2): fit goes on, every observation lists the section as not analysed, with why, in
    the history and in what `gradscope watch` reads back."""
    import keras

    from gradscope.keras import GradientFlow
    from gradscope.keras.engine import CopyFails

    class Scaled(keras.losses.Loss):
        def __init__(self, factor: float) -> None:  # not in get_config: cannot be rebuilt
            super().__init__()
            self.factor = factor

        def call(self, y_true: Any, y_pred: Any) -> Any:
            return keras.ops.mean((y_true - y_pred) ** 2, axis=-1) * self.factor

    model = mixed_lstm(2.0 ** 15, STEPS, FEATURES, UNITS)
    model.compile(optimizer=model.optimizer, loss=Scaled(0.5))
    x, y = mixed_lstm_batch(2 * BATCH, STEPS, FEATURES)
    with pytest.raises(CopyFails):
        gradscope.explain(model, x=x, y=y)
    flow = GradientFlow(every=1, log_dir=tmp_path)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[flow])
    for history in (flow.history, gradscope.watch(tmp_path)):
        assert history.mixed_precision is None
        [entry] = [e for e in history.not_analysed if e.layer == "mixed precision"]
        assert entry.steps == [1, 2]
        assert entry.reason.startswith("no mixed-precision section: its float32 shadow cannot "
                                       "be built (Keras cannot rebuild it in float32")
