"""explain under mixed_float16: the shares lost at the loss scale equal those of a float32
shadow computed here by hand (Keras' own tape for the weights, a hand-written unroll of the
LSTM cell for ∂L/∂h_t and the ∂L/∂c_t step t+1 sends back), at scale 1 and at 2¹⁵; the
'mixed' column equals the mixed model's own scaled tape."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import lstm_float32_shadow, mixed_lstm, mixed_lstm_batch

import gradscope
from gradscope.keras.mixed_precision import classify, observed

BATCH, STEPS, FEATURES, UNITS = 4, 5, 3, 4


def _model(scale: float) -> Any:
    return mixed_lstm(scale, STEPS, FEATURES, UNITS)


def _batch() -> tuple[np.ndarray, np.ndarray]:
    return mixed_lstm_batch(BATCH, STEPS, FEATURES)


def _shadow(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    return lstm_float32_shadow(model, x, y)


def _mixed(model: Any, x: np.ndarray, y: np.ndarray, scale: float) -> dict[str, np.ndarray]:
    """The mixed model's own tape, the loss scaled as fit's train step scales it."""
    import keras
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x)) * scale
    gradients = tape.gradient(loss, model.trainable_variables)
    return {v.path: g.numpy() for v, g in zip(model.trainable_variables, gradients,
                                             strict=True)}


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 15])
def test_shares_equal_a_float32_shadow_by_hand(tf: Any, scale: float) -> None:
    model = _model(scale)
    x, y = _batch()
    report = gradscope.explain(model, x=x, y=y).mixed_precision
    assert report is not None and report.loss_scale == scale
    assert report.compute_dtype == "float16"
    shadow = _shadow(model, x, y)
    mixed = _mixed(model, x, y, scale)
    tensors = {t.path: t for t in report.tensors}
    assert set(tensors) == set(shadow)
    lost = 0
    for path, truth in shadow.items():
        entry, size = tensors[path], truth.size
        expected = classify(truth, scale, "float16")
        lost += expected[0]
        assert (entry.underflow, entry.subnormal, entry.overflow) == tuple(
            n / size for n in expected), path
        if path in mixed:
            assert entry.mixed == [n / size for n in observed(mixed[path], truth, "float16")]
    nonzero = np.concatenate([np.abs(g).ravel() for g in shadow.values()])
    nonzero = nonzero[nonzero > 0]
    assert report.scale_range == pytest.approx(
        [2.0 ** -14 / nonzero.min(), 65504 / nonzero.max()], rel=1e-6)
    if scale == 1:
        assert lost > 0  # the test sees underflow happen
        assert any("loss scale is 1" in w for w in report.warnings)
    else:
        assert not any("loss scale is 1" in w for w in report.warnings)


def test_classify_by_the_limits() -> None:
    tiny = 2.0 ** -24
    values = np.array([0.0, tiny / 4, tiny, 2.0 ** -14, 1e5, -1e5], np.float32)
    assert classify(values, 1.0, "float16") == (1, 1, 2)
    assert classify(values, 2.0 ** 10, "float16") == (0, 1, 2)
    assert classify(values, 1.0, "bfloat16") == (0, 0, 0)


def test_the_notebook_display_shows_mixed_precision_per_example_and_nonfinite(tf: Any) -> None:
    """A report in a notebook (``_repr_html_``) draws the three sections of issue 37 with
    their numbers, as the terminal does."""
    import html
    import re

    from gradscope.formats import number

    def shown(report: Any) -> str:
        page = report._repr_html_()
        assert page.startswith("<pre")
        return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())

    model = _model(1.0)
    x, y = _batch()
    report = gradscope.explain(model, x=x, y=y, per_example=True)
    text = shown(report)
    found = report.mixed_precision
    assert found is not None and report.per_example is not None
    assert "Mixed precision (mixed_float16, loss scale 1, LossScaleOptimizer(SGD))" in text
    # The header says the model computes in float16 (found tried as a new user would: a
    # diagnosis said nothing of the dtype its cells stepped in), and each output's dtype.
    assert (report.model.dtype_policy, report.model.compute_dtype) == ("mixed_float16",
                                                                       "float16")
    assert "dtype policy mixed_float16 (computes in float16)" in text
    assert [o.dtype for o in report.model.outputs] == [str(model.outputs[0].dtype)]
    for tensor in found.tensors:
        shares = " ".join("0" if v == 0 else f"{v:.1%}" for v in (
            tensor.underflow, tensor.subnormal, tensor.overflow))
        assert f"{tensor.name} {shares}" in text
    # Each weight named as the report's gradients name it, its Keras path beside (found
    # tried as a new user would: this section alone listed sequential/lstm/lstm_cell/kernel).
    named = {g.path: g.name for g in report.gradients}
    weights = [t for t in found.tensors if t.kind == "weight"]
    assert weights and all(t.name == named[t.path] != t.path for t in weights)
    assert "the loss scale is 1" in text
    assert f"Per-example gradients ‖∂L_i/∂θ‖ ({BATCH} examples" in text
    assert f"all weights {number(min(report.per_example.l2))}" in text
    x[2, 3, 1] = np.nan
    broken = gradscope.explain(model, x=x, y=y)
    assert broken.nonfinite is not None
    text = shown(broken)
    assert "Where the first NaN or Inf was born (forward pass)" in text
    assert broken.nonfinite.cause in text and "example 2" in text


def test_per_example_norms_of_a_mixed_float16_gru_are_a_loop_of_tapes(tf: Any) -> None:
    """Found tried as a new user would: a mixed_float16 GRU's --per-example was an internal
    error ("the examples' gradients … do not add up to the tape's"): their sum was held to
    the tape's at float32's tolerance, where the steps compute in float16. It is held at
    float16's, and each example's norms to its own tape of Keras' loss."""
    import keras
    from test_keras_per_example import _one_tape_per_example

    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 12, 4)).astype("float32")
    y = rng.integers(0, 3, 16).astype("int32")
    inp = keras.Input((12, 4), name="x")
    h = keras.layers.GRU(8, name="gru", dtype="mixed_float16")(inp)
    h = keras.layers.Dense(8, activation="relu", name="hid", dtype="mixed_float16")(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="logits")(h))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    found = gradscope.explain(model, x=x, y=y, per_example=True).per_example
    assert found is not None
    truth = _one_tape_per_example(model, x, y, np.ones(16, "float32"))
    for name, norms in truth.items():
        np.testing.assert_allclose(found.layers[name], norms, rtol=2e-2, err_msg=name)


def test_an_inf_spread_in_the_backward_is_not_called_rounding():
    """Found tried as a new user would: a GRU's kernel 100% not finite in the model's own
    float16 backward, where the shadow's scaled gradients overflow at 24%, was said to be
    rounding that "moved values across the limits"; an inf made inside the backward spread."""
    from gradscope.keras.mixed_precision import _warnings
    from gradscope.report.models import MixedPrecisionTensor

    def tensor(path: str, overflow: float, mixed: list[float]) -> MixedPrecisionTensor:
        return MixedPrecisionTensor(path=path, kind="weight", entries=100, underflow=0.0,
                                    subnormal=0.0, overflow=overflow, mixed=mixed,
                                    agrees=False)

    said = _warnings("float16", 32768.0, "LossScaleOptimizer(Adam)",
                     [tensor("gru/kernel", 0.24, [0.0, 0.0, 1.0]),
                      tensor("dense/bias", 0.0, [0.05, 0.0, 0.0])], None)
    spread = [w for w in said if "spreads" in w]
    assert spread == ["the model's own float16 backward is not finite at more entries than "
                      "the float32 shadow's gradients overflow when scaled: 100.0% against "
                      "24.0% at gru/kernel. An inf made inside the backward spreads to every "
                      "gradient it reaches (in a recurrent layer, to each earlier step)"]
    assert any(w.endswith("more than 1% of the entries at dense/bias: rounding on the way "
                          "back moved values across the limits") for w in said)
