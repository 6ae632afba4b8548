"""GradientFlow(per_example=True) during fit: at each observation, the per-example section
equals explain's (``gradscope.explain(..., per_example=True)``, itself held to a loop of one
tape per example in test_keras_per_example) on the weights that step left and the batch fit
trained on, sample weights and a smaller last batch included; the TensorBoard events hold the
tags and `gradscope watch` reads it all back (text and --json, exactly); a loss that is no sum
over the examples trains on, each observation saying why it has no section; a custom loop's
observe() takes it too. Without per_example (the default) nothing is made: test_keras_callback's
fitted run asserts that."""

from __future__ import annotations

import html
import json
from typing import Any

import numpy as np
import pytest
from conftest import render_text, run_without_tensorflow, tensorboard_events

import gradscope

BATCH, STEPS, FEATURES = 4, 5, 3
EXAMPLES = 11  # batches of 4, 4 and 3: the last shape traces again


def _model(loss: Any = "mse") -> Any:
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((STEPS, FEATURES)),
                              keras.layers.GRU(4, return_sequences=True),
                              keras.layers.LSTM(3), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    return model


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return (rng.normal(size=(EXAMPLES, STEPS, FEATURES)).astype("float32"),
            rng.normal(size=(EXAMPLES, 2)).astype("float32"),
            rng.uniform(0.2, 2.0, EXAMPLES).astype("float32"))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: Any, tf: Any) -> dict[str, Any]:
    import keras

    from gradscope.keras import GradientFlow

    model = _model()
    x, y, w = _data()
    weights: dict[int, list[np.ndarray]] = {}

    class KeepWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            weights[batch + 1] = self.model.get_weights()

    log_dir = tmp_path_factory.mktemp("per_example") / "run"
    flow = GradientFlow(every=1, log_dir=log_dir, per_example=True)
    model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow, KeepWeights()])
    return {"model": model, "history": flow.history, "weights": weights, "x": x, "y": y,
            "w": w, "log_dir": log_dir}


def _assert_same(found: Any, truth: Any) -> None:
    assert (found.method, found.dtype, found.top_examples, found.outliers,
            found.added_terms) == (truth.method, truth.dtype, truth.top_examples,
                                   truth.outliers, truth.added_terms)
    assert list(found.layers) == list(truth.layers)
    np.testing.assert_allclose(found.l2, truth.l2, rtol=1e-6)
    for layer, norms in truth.layers.items():
        np.testing.assert_allclose(found.layers[layer], norms, rtol=1e-6)
    assert found.top_share == pytest.approx(truth.top_share, rel=1e-6)
    assert found.noise_scale == pytest.approx(truth.noise_scale, rel=1e-5)


def test_each_observation_equals_explain_on_its_weights_and_batch(fitted: Any) -> None:
    model, history = fitted["model"], fitted["history"]
    assert [o.step for o in history.observations] == [1, 2, 3]
    assert history.per_example is not None and not history.not_analysed
    final = model.get_weights()
    try:
        for step, found in zip((1, 2, 3), history.per_example, strict=True):
            part = slice((step - 1) * BATCH, step * BATCH)
            model.set_weights(fitted["weights"][step])
            truth = gradscope.explain(model, x=fitted["x"][part], y=fitted["y"][part],
                                      sample_weight=fitted["w"][part],
                                      per_example=True).per_example
            assert found is not None and len(found.l2) == len(fitted["x"][part])
            _assert_same(found, truth)
    finally:
        model.set_weights(final)
    assert "split by example" in history.per_example[-1].method


def test_tensorboard_holds_the_tags_and_watch_reads_them_back(fitted: Any, tf: Any) -> None:
    history, log_dir = fitted["history"], fitted["log_dir"]
    scalars, _ = tensorboard_events(tf, log_dir)
    for step, found in zip((1, 2, 3), history.per_example, strict=True):
        norms = np.asarray(found.l2)
        assert scalars["per_example/noise_scale"][step] == pytest.approx(found.noise_scale,
                                                                         rel=1e-6)
        assert scalars["per_example/top_share"][step] == pytest.approx(found.top_share,
                                                                       rel=1e-6)
        assert scalars["per_example/max_over_median"][step] == pytest.approx(
            norms.max() / np.median(norms), rel=1e-6)
        for layer, values in found.layers.items():
            assert scalars[f"per_example/median/{layer}"][step] == pytest.approx(
                np.median(values), rel=1e-6)

    result = run_without_tensorflow("watch", str(log_dir), "--json")
    assert result.returncode == 0, result.stderr
    read = json.loads(result.stdout)
    assert read["per_example"] == history.to_dict()["per_example"]  # exact: JSON
    from jsonschema import Draft202012Validator

    schema = json.loads(run_without_tensorflow("schema", "watch").stdout)
    assert "per_example" in schema["properties"]
    Draft202012Validator(schema).validate(read)

    text = " ".join(render_text(gradscope.watch(log_dir), 100).split())  # lines unwrapped
    assert "Per-example gradients across training (3 of 3 observations" in text
    assert "noise scale B_simple" in text and "largest ‖g_i‖ / median" in text
    assert "At the last observation (step 3):" in text
    assert "Per-example gradients ‖∂L_i/∂θ‖ (3 examples, float32)" in text  # explain's table
    assert "Per-example gradients across training" in html.unescape(history._repr_html_())


def test_a_loss_that_is_no_sum_over_the_examples_trains_on_and_says_why(tmp_path: Any,
                                                                        tf: Any) -> None:
    import keras

    from gradscope.keras import GradientFlow

    model = _model(keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    x, y, w = _data()
    flow = GradientFlow(every=1, log_dir=tmp_path, per_example=True)
    fit = model.fit(x[:8], y[:8], sample_weight=w[:8], batch_size=BATCH, epochs=1,
                    shuffle=False, verbose=0, callbacks=[flow])
    assert len(fit.history["loss"]) == 1  # trained on
    history = flow.history
    assert [o.step for o in history.observations] == [1, 2]
    assert history.per_example is None
    # The loss's refusal holds for every batch: said once, at both steps.
    [entry] = history.not_analysed
    assert entry.layer == "per-example gradients" and entry.steps == [1, 2]
    assert "the loss is not a sum of one share per example" in entry.reason
    read = gradscope.watch(tmp_path)
    assert read.not_analysed == history.not_analysed and read.per_example is None
    text = " ".join(render_text(read, 100).split())
    assert "not analysed: per-example gradients:" in text


def test_a_custom_loops_observe_takes_it_too(tf: Any) -> None:
    from gradscope.keras import GradientFlow

    model = _model()
    x, y, _ = _data()
    flow = GradientFlow(model=model, per_example=True)
    flow.observe(x[:6], y[:6], step=1)
    truth = gradscope.explain(model, x=x[:6], y=y[:6], per_example=True).per_example
    [found] = flow.history.per_example
    _assert_same(found, truth)
