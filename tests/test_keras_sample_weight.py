"""Sample weights weigh the loss exactly as Keras' compute_loss does: given to the API, in a
--data file, and in fit's batches for GradientFlow. The truth is Keras' own tape with the same
weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import keras_tape_norms, run_gradscope

import gradscope

RTOL = 1e-5



@pytest.fixture(scope="module")
def classifier(tf: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    import keras
    from keras import layers

    keras.utils.set_random_seed(51)
    model = keras.Sequential([keras.Input((5, 3)), layers.GRU(4, name="gru"),
                              layers.Dense(3, name="head")])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 5, 3)).astype("float32")
    y = rng.integers(0, 3, 6)
    weights = np.array([1.0, 0.0, 2.0, 0.5, 3.0, 0.25], "float32")
    return model, x, y, weights


def test_explain_weighs_the_loss_as_keras_does(classifier, tf):
    model, x, y, weights = classifier
    report = gradscope.explain(model, x=x, y=y, sample_weight=weights)
    loss, truth = keras_tape_norms(model, x, y, weights)
    assert report.loss.value == pytest.approx(loss, rel=RTOL)
    unweighted = gradscope.explain(model, x=x, y=y)
    assert unweighted.loss.value != pytest.approx(loss, rel=1e-3)
    for entry in report.gradients:
        assert entry.stats.l2 == pytest.approx(truth[entry.path], rel=RTOL), entry.path
    (term,) = report.loss.terms
    assert term.counted is not None and "sample weights sum to 6.75 over 6" in term.counted


def test_a_data_file_with_sample_weight_gives_the_same_numbers(classifier, tf, tmp_path: Path):
    model, x, y, weights = classifier
    path = tmp_path / "classifier.keras"
    model.save(path)
    data = tmp_path / "batch.npz"
    np.savez(data, x=x, y=y, sample_weight=weights)
    result = run_gradscope("explain", str(path), "--data", str(data), "--json", "-q")
    assert result.returncode == 0, result.stderr
    import json

    document = json.loads(result.stdout)
    loss, _ = keras_tape_norms(model, x, y, weights)
    assert document["loss"]["value"] == pytest.approx(loss, rel=RTOL)
    np.savez(data, x=x, y=y, sample_weight=weights[:4])
    refused = run_gradscope("explain", str(path), "--data", str(data), "-q")
    assert refused.returncode == 2 and "sample_weight 4" in refused.stderr


def test_check_passes_with_sample_weights(classifier, tf):
    model, x, y, weights = classifier
    report = gradscope.check(model, x=x, y=y, sample_weight=weights)
    assert report.summary.passed
    loss, _ = keras_tape_norms(model, x.astype("float64"), y, weights.astype("float64"))
    assert report.loss.value == pytest.approx(loss, rel=1e-5)


def test_sample_weights_without_targets_are_refused(classifier):
    from gradscope.errors import GradscopeError

    model, x, _, weights = classifier
    with pytest.raises(GradscopeError, match="sample_weight= was given without y="):
        gradscope.explain(model, x=x, sample_weight=weights)
    with pytest.raises(GradscopeError, match="sample_weight has a non-finite value"):
        gradscope.explain(model, x=x, y=classifier[2], sample_weight=weights * np.nan)


def test_gradient_flow_applies_the_batch_sample_weights(classifier, tf):
    """In fit, with sample weights in the batches: the observed loss is the one fit
    minimises on that batch (one batch, so the weights observed are the final ones)."""
    import keras

    from gradscope.keras import GradientFlow

    model, x, y, weights = classifier
    trained = keras.models.clone_model(model)
    trained.set_weights(model.get_weights())
    trained.compile(optimizer=keras.optimizers.SGD(0.1), loss=model.loss)
    flow = GradientFlow(every=1)
    trained.fit(x, y, sample_weight=weights, batch_size=6, epochs=1, verbose=0,
                callbacks=[flow])
    loss, truth = keras_tape_norms(trained, x, y, weights)
    (observation,) = flow.history.observations
    assert observation.loss == pytest.approx(loss, rel=RTOL)
    # The series are in the model's order, named as explain names them (truth: by path).
    for variable, series in zip(trained.trainable_variables, flow.history.weights,
                                strict=True):
        assert series.norms[0] == pytest.approx(truth[variable.path], rel=RTOL)
    flow.observe(x, y, step=5, sample_weight=weights)
    assert flow.history.observations[-1].loss == pytest.approx(loss, rel=RTOL)
