"""The loss header tells the whole loss: each output's loss with its settings and weight, what a
mask counts, every regularization and added term by layer, and the terms add up to the loss
Keras' own tape computes."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from conftest import render_text

import gradscope


def _keras_loss(tf: Any, model: Any, x: Any, y: Any) -> float:
    prediction = model(x, training=False)
    return float(model.compute_loss(x=x, y=y, y_pred=prediction, training=False))


@pytest.fixture(scope="module")
def regularized_classifier(tf: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    import keras
    from keras import layers, regularizers

    keras.utils.set_random_seed(41)
    x = keras.Input((5, 3), name="x")
    gru = layers.GRU(4, kernel_regularizer=regularizers.L2(0.05),
                     activity_regularizer=regularizers.L1(0.02), name="gru")
    logits = layers.Dense(3, name="logits")(gru(x))
    aux = layers.Dense(1, name="aux")(gru(x))
    model = keras.Model(x, [logits, aux])
    model.compile(loss=[keras.losses.CategoricalCrossentropy(from_logits=True,
                                                             label_smoothing=0.1,
                                                             reduction="sum"),
                        keras.losses.Huber(delta=0.5)], loss_weights=[1.0, 0.3])
    rng = np.random.default_rng(7)
    return (model, rng.standard_normal((4, 5, 3)).astype("float32"),
            [np.eye(3)[rng.integers(0, 3, 4)].astype("float32"),
             rng.standard_normal((4, 1)).astype("float32")])


def test_the_terms_add_up_to_keras_own_loss(regularized_classifier, tf):
    model, x, y = regularized_classifier
    report = gradscope.explain(model, x=x, y=y)
    terms = report.loss.terms
    assert report.loss.value == pytest.approx(_keras_loss(tf, model, x, y), rel=1e-5)
    assert sum(t.value for t in terms) == pytest.approx(report.loss.value, rel=1e-5)
    kinds = [(t.kind, t.name) for t in terms]
    assert kinds == [("output", "logits"), ("output", "aux"),
                     ("regularizer", "gru/gru_cell/kernel"), ("added", "gru")]
    logits, aux = terms[0], terms[1]
    assert logits.settings is not None and aux.settings is not None
    assert logits.settings["from_logits"] is True and logits.settings["reduction"] == "sum"
    assert logits.settings["label_smoothing"] == pytest.approx(0.1)
    assert aux.settings["delta"] == pytest.approx(0.5) and aux.weight == pytest.approx(0.3)
    assert "activity regularizer L1" in terms[3].detail and "2 terms" in terms[3].detail


def test_the_header_says_each_term_with_its_settings(regularized_classifier, tf):
    model, x, y = regularized_classifier
    raw = render_text(gradscope.explain(model, x=x, y=y), 80)
    for label in ("reduction", "label_smoothing", "delta", "weight"):
        assert not re.search(label + r"[ \u00a0]*\n", raw), f"{label} parts from its value"
    text = " ".join(raw.split())
    assert "the sum of:" in text
    # The loss line says its value holds the added terms too, not the output losses alone.
    assert re.search(r"loss = \S+: .* \+ 2 added terms \(below\)", text)
    assert "from_logits · reduction sum · label_smoothing 0.1" in text
    assert "delta 0.5" in text and "× loss weight 0.3" in text
    assert "gru/gru_cell/kernel: kernel regularizer L2(l2=0.05)" in text


def test_a_masked_sequence_loss_says_what_the_mask_counts(tf):
    import keras
    from keras import layers

    keras.utils.set_random_seed(42)
    model = keras.Sequential([keras.Input((6,), dtype="int32"),
                              layers.Embedding(10, 4, mask_zero=True),
                              layers.GRU(4, return_sequences=True),
                              layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tokens = np.array([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 0]], "int32")
    targets = np.array([[0, 1, 2, 0, 0, 0], [1, 1, 2, 2, 0, 0]])
    report = gradscope.explain(model, x=tokens, y=targets)
    (term,) = report.loss.terms
    assert term.counted is not None and "keeps 8 of 12 positions" in term.counted
    assert report.loss.value == pytest.approx(_keras_loss(tf, model, tokens, targets), rel=1e-5)
    assert report.to_dict()["loss"]["terms"][0]["counted"] == term.counted


def test_a_loss_of_one_term_is_said_as_that_term_not_a_sum(tf):
    """One output's loss with a setting worth saying: its line stands alone (found tried as a
    new user would: "the sum of:" above a single term)."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(44)
    model = keras.Sequential([keras.Input((5, 3)), layers.GRU(4), layers.Dense(3, name="out")])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(9).standard_normal((4, 5, 3)).astype("float32")
    report = gradscope.explain(model, x=x, y=np.array([0, 1, 2, 1]))
    (term,) = report.loss.terms
    lines = render_text(report, 80).splitlines()
    assert not any("sum of" in line for line in lines)
    (said,) = [line for line in lines if "out: sparse_categorical_crossentropy" in line]
    assert said.split() == [f"{term.value:.6g}", "out:", "sparse_categorical_crossentropy", "·",
                            "from_logits"]
    assert said.startswith("  ")  # under the loss line, as the terms of a sum are


def test_one_number_as_loss_weights_weighs_the_one_loss(tf):
    """``compile(loss="mse", loss_weights=0.5)``: Keras weighs its one loss by 0.5, and so do
    the header and the report's weight (they said 1 when the weights were a bare number)."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(43)
    model = keras.Sequential([keras.Input((5, 3)), layers.GRU(4), layers.Dense(2)])
    model.compile(loss="mse", loss_weights=0.5)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 5, 3)).astype("float32")
    y = rng.standard_normal((4, 2)).astype("float32")
    report = gradscope.explain(model, x=x, y=y)
    assert report.loss.value == pytest.approx(_keras_loss(tf, model, x, y), rel=1e-6)
    assert [o.weight for o in report.loss.outputs] == [0.5]
    assert "mean_squared_error × 0.5" in report.loss.name
