"""gradscope/keras/nonfinite/: where the first NaN or Inf of a pass is born, on planted
failures, each with the right layer, step, examples and cause.

The truth is computed here: NumPy unrolls the relu recurrence by hand (the step at which it
overflows float32, and its growth), the planted input says where its NaN is, and the loss a
failure plants is checked non-finite with Keras' own call. Models are small: a few units,
a batch of 6, at most 64 steps.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from conftest import keras_tape_norms, render_text, run_gradscope

import gradscope

B, F = 6, 3


def _sequences(steps: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(B, steps, F)).astype("float32")


def _relu_rnn(tf: Any, gain: float, rate: float = 0.0) -> Any:
    """A relu SimpleRNN whose recurrent kernel is ``gain``·I: its state grows ``gain``× a
    step (times 1/(1 − rate) for the units recurrent_dropout keeps)."""
    import keras

    x = keras.Input((64, F), name="x")
    rnn = keras.layers.SimpleRNN(4, activation="relu", recurrent_dropout=rate, name="rnn")
    # A tanh head: the loss stays finite wherever the state does.
    model = keras.Model(x, keras.layers.Dense(2, activation="tanh", name="head")(rnn(x)))
    model.compile(loss="mse")
    kernel, _, bias = rnn.get_weights()
    rnn.set_weights([np.full_like(kernel, 0.3), gain * np.eye(4, dtype="float32"), bias])
    return model


def _overflow_step(x: np.ndarray, gain: float) -> tuple[int, list[int]]:
    """By hand, in float32: the first step at which h_t = relu(x_t·0.3 + gain·h_{t-1})
    overflows, and the examples that overflow there."""
    h = np.zeros((B, 4), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(x.shape[1]):
            h = np.maximum(x[:, t] @ np.full((F, 4), 0.3, np.float32)
                           + h @ (gain * np.eye(4, dtype=np.float32)), 0).astype(np.float32)
            bad = ~np.isfinite(h).all(axis=1)
            if bad.any():
                return t, [int(e) for e in np.flatnonzero(bad)]
    raise AssertionError("the planted recurrence never overflows")


def test_nothing_is_searched_when_every_number_is_finite(tf):
    import keras

    model = keras.Sequential([keras.Input((5, F)), keras.layers.GRU(3), keras.layers.Dense(2)])
    model.compile(loss="mse")
    report = gradscope.explain(model, x=_sequences(5), y=np.zeros((B, 2), "float32"))
    assert report.nonfinite is None
    assert report.to_dict()["nonfinite"] is None


def test_a_fully_masked_example_under_a_masked_mean(tf):
    import keras

    x = _sequences(8)
    x[3] = 0.0  # every step of example 3 is masked
    inputs = keras.Input((8, F), name="x")
    hidden = keras.layers.GRU(4, return_sequences=True)(keras.layers.Masking(0.0)(inputs))
    pooled = keras.layers.GlobalAveragePooling1D(name="mean")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(pooled))
    model.compile(loss="mse")
    y = np.zeros((B, 2), "float32")
    assert not np.isfinite(keras_tape_norms(model, x, y)[0])
    found = gradscope.explain(model, x=x, y=y).nonfinite
    assert found is not None
    assert (found.pass_, found.origin, found.layer, found.step, found.examples) == (
        "forward", "layer", "mean", None, [3])
    assert found.cause.startswith("a fully masked example: the mean over 0 steps")
    assert found.operation in {"RealDiv", "Div", "DivNoNan"}


def _log_loss_classifier() -> tuple[Any, Any, Any]:
    """Flatten → Dense 3 softmax under −Σ y·log p (a loss of the user's own, no clipping),
    its kernel zeroed: the model, its softmax layer and its input."""
    import keras

    def log_loss(y_true: Any, y_pred: Any) -> Any:
        return -keras.ops.sum(y_true * keras.ops.log(y_pred), axis=-1)

    inputs = keras.Input((5, F), name="x")
    probs = keras.layers.Dense(3, activation="softmax", name="probs")
    model = keras.Model(inputs, probs(keras.layers.Flatten()(inputs)))
    model.compile(loss=log_loss)
    kernel, bias = probs.get_weights()
    probs.set_weights([np.zeros_like(kernel), bias])
    return model, probs, inputs


def test_log_of_zero_in_a_custom_loss(tf):
    import keras

    x = _sequences(5)
    x[5] *= 40.0  # example 5's logits spread far enough for softmax to give an exact 0
    model, probs, inputs = _log_loss_classifier()
    kernel, bias = probs.get_weights()
    kernel[:, 2] = -4.0 * np.sign(x[5].reshape(-1))  # class 2's logit: far below for 5
    probs.set_weights([kernel, bias])
    p = np.asarray(model(x))
    assert p[5, 2] == 0 and (p[:5] > 0).all()
    y = np.eye(3, dtype="float32")[[0, 1, 2, 0, 1, 0]]
    found = gradscope.explain(model, x=x, y=y).nonfinite
    assert found is not None
    assert (found.pass_, found.origin, found.step, found.examples) == (
        "forward", "loss", None, [5])
    assert found.operation == "Log"
    assert found.cause == ("log of 0: the softmax output for example 5 at class 2 is "
                           "exactly 0")
    # One output number is no class (found tried as a new user would: "at class 0" of a
    # regression's single output).
    single = keras.Model(inputs, keras.layers.Dense(1, name="pred")(
        keras.layers.Flatten()(inputs)))
    single.compile(loss=lambda y_true, y_pred: -keras.ops.log(y_pred) * y_true)
    negative = int(np.nonzero(np.asarray(single(x))[:, 0] < 0)[0][0])  # the first
    found = gradscope.explain(single, x=x, y=np.ones((6, 1), "float32")).nonfinite
    assert found is not None and found.operation == "Log"
    assert found.cause is not None and "class" not in found.cause
    assert f"for example {negative} is " in found.cause


def test_exp_overflow_in_a_custom_layer(tf):
    import keras

    @keras.saving.register_keras_serializable("gradscope_tests")
    class Exponential(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            return keras.ops.exp(x)

    x = _sequences(40)
    x[2, 37] = 812.0 / F  # the pre-activation of example 2 reaches 812 at step 37
    inputs = keras.Input((40, F), name="x")
    pre = keras.layers.Dense(1, kernel_initializer="ones", name="pre")(inputs)
    hidden = keras.layers.GRU(3)(Exponential(name="exp")(pre))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile(loss="mse")
    found = gradscope.explain(model, x=x, y=np.zeros((B, 2), "float32")).nonfinite
    assert found is not None
    assert (found.pass_, found.layer, found.step, found.examples, found.operation) == (
        "forward", "exp", 37, [2], "Exp")
    assert found.cause == "exp overflow: the pre-activation reached 812 at step 37 (example 2)"


def test_a_relu_simple_rnn_that_explodes(tf):
    x = np.abs(_sequences(64))
    model = _relu_rnn(tf, 4.4)
    step, examples = _overflow_step(x, 4.4)
    assert 55 <= step <= 63
    report = gradscope.explain(model, x=x, y=np.zeros((B, 2), "float32"))
    found = report.nonfinite
    assert found is not None
    assert (found.pass_, found.layer, found.step, found.examples) == (
        "forward", "rnn", step, examples)
    assert found.cause.startswith("the recurrent state grows 4.4× a step with relu, "
                                  "reaching ")
    assert found.cause.endswith(f"at step {step - 1}, and overflows float32 (largest "
                                f"3.4e+38) at step {step} (example {examples[0]})")
    text = render_text(report, 80)
    assert "Where the first NaN or Inf was born (forward pass)" in text
    assert "cause: the recurrent state grows 4.4×" in text


def test_a_loss_that_overflows_names_the_state_that_grew(tf):
    """Every layer output finite, the squared error not: the cause goes on to the relu state
    that made the prediction that large, its growth measured (2.2× a step here)."""
    import keras

    x = np.abs(_sequences(64))
    model = _relu_rnn(tf, 2.2)
    out = keras.layers.Dense(2, name="linear_head")(model.get_layer("rnn").output)
    model = keras.Model(model.inputs, out)
    model.compile(loss="mse")
    report = gradscope.explain(model, x=x, y=np.zeros((B, 2), "float32"))
    found = report.nonfinite
    assert found is not None and found.origin == "loss" and found.operation == "Square"
    assert ", because rnn's state grows 2.2× a step with relu, reaching " in found.cause
    assert "at step 63 (example " in found.cause


def test_recurrent_dropout_with_relu(tf):
    """Without dropout the state grows 2.2× a step and stays finite over 64 steps; in
    training mode recurrent_dropout 0.5 scales the units it keeps by 2 every step."""
    x = np.abs(_sequences(64))
    model = _relu_rnn(tf, 2.2, rate=0.5)
    y = np.zeros((B, 2), "float32")
    assert gradscope.explain(model, x=x, y=y).nonfinite is None
    found = gradscope.explain(model, x=x, y=y, training=True).nonfinite
    assert found is not None
    assert (found.pass_, found.layer) == ("forward", "rnn")
    assert found.step is not None and found.step < 64 and found.examples
    assert "a step with relu and recurrent_dropout 0.5 (the units it keeps are scaled by 2 " \
           "every step)" in found.cause


def test_nan_in_one_example_s_input_from_the_command_line(tf, tmp_path):
    import keras

    model = keras.Sequential([keras.Input((8, F), name="x"), keras.layers.GRU(3),
                              keras.layers.Dense(2, name="y")])
    model.compile(loss="mse")
    model.save(tmp_path / "model.keras")
    x = _sequences(8)
    x[3, 5, 1] = np.nan
    np.savez(tmp_path / "batch.npz", x=x, y=np.zeros((B, 2), "float32"))
    found = gradscope.explain(model, x=x, y=np.zeros((B, 2), "float32")).nonfinite
    assert found is not None
    assert (found.origin, found.layer, found.step, found.examples) == ("input", "x", 5, [3])
    assert found.cause.startswith("NaN in the input x: example 3, step 5, feature 1")
    run = run_gradscope("explain", str(tmp_path / "model.keras"), "--data",
                        str(tmp_path / "batch.npz"), "--json")
    assert run.returncode == 1, run.stderr
    document = json.loads(run.stdout)["nonfinite"]
    assert (document["pass"], document["layer"], document["step"], document["examples"]) == (
        "forward", "x", 5, [3])
    checked = run_gradscope("check", str(tmp_path / "model.keras"), "--data",
                            str(tmp_path / "batch.npz"))
    assert checked.returncode == 1, checked.stderr
    assert "NaN in the input x: example 3, step 5, feature 1" in checked.stdout
    # A NaN in the targets is the target's, by the output's name (found tried as a new user
    # would: "✗ input y" above "cause: NaN in the target y").
    y = np.zeros((B, 2), "float32")
    y[4, 1] = np.nan
    report = gradscope.explain(model, x=_sequences(8), y=y)
    found = report.nonfinite
    assert found is not None and (found.origin, found.layer, found.examples) == (
        "target", "y", [4])
    assert found.cause.startswith("NaN in the target y: example 4")
    assert "✗ target y, example 4" in render_text(report, 80)


def test_backward_the_derivative_of_sqrt_at_zero(tf):
    """The loss and every value finite, a gradient not: an L2 norm of a zero vector (example
    4 at step 2) is 0, and its derivative is not finite."""
    import keras

    @keras.saving.register_keras_serializable("gradscope_tests")
    class WithNorm(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            norm = keras.ops.sqrt(keras.ops.sum(x * x, axis=-1, keepdims=True))
            return keras.ops.concatenate([x, norm], axis=-1)

    x = _sequences(6)
    x[4, 2] = 0.0
    inputs = keras.Input((6, F), name="x")
    hidden = WithNorm(name="norm")(keras.layers.Dense(3, name="pre")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GRU(3)(hidden)))
    model.compile(loss="mse")
    y = np.ones((B, 2), "float32")
    loss, norms = keras_tape_norms(model, x, y)
    assert np.isfinite(loss) and not all(np.isfinite(v) for v in norms.values())
    report = gradscope.explain(model, x=x, y=y)
    found = report.nonfinite
    assert found is not None
    assert (found.pass_, found.origin, found.layer, found.step, found.examples,
            found.operation) == ("backward", "layer", "norm", 2, [4], "SqrtGrad")
    assert found.cause == ("the derivative of sqrt at 0 is infinite: its argument is 0 at "
                           "step 2 (example 4); the value is finite, its gradient is not")
    # A gradient every value of which is NaN has no norm (found tried as a new user would:
    # "‖g‖₂ 0 · mean|g| 0 · max|g| 0", and "l2": 0.0 in the JSON, as if it were zero).
    whole = [g for g in report.gradients if g.stats is not None
             and g.stats.nonfinite == int(np.prod(g.shape))]
    assert whole and all(g.stats.l2 is None and g.stats.max_abs is None for g in whole)
    assert not np.isfinite(norms[whole[0].path])
    assert "‖g‖₂ n/a · mean|g| n/a · max|g| n/a · NaN/Inf" in render_text(report, 200)
    assert report.to_dict()["gradients"][report.gradients.index(whole[0])]["stats"]["l2"] is None


@pytest.mark.parametrize("command", ["explain-keras", "check-keras"])
def test_the_schema_has_nonfinite_with_pass(command):
    from gradscope.report.models import json_schema

    schema = json.dumps(json_schema(command))
    assert '"nonfinite"' in schema and '"pass"' in schema


def test_check_picks_the_example_that_holds_nan_and_numbers_it_in_the_batch(tf):
    """A batch larger than check's default examples: the example whose input holds NaN is
    checked, and the diagnosis numbers it as the batch does."""
    import keras

    model = keras.Sequential([keras.Input((4, F), name="x"), keras.layers.GRU(2),
                              keras.layers.Dense(2)])
    model.compile(loss="mse")
    x = np.random.default_rng(1).normal(size=(40, 4, F)).astype("float32")
    x[37, 2, 0] = np.inf
    report = gradscope.check(model, x=x, y=np.zeros((40, 2), "float32"))
    assert not report.summary.passed and report.examples is not None
    assert report.examples.indices is not None and 37 in report.examples.indices
    found = report.nonfinite
    assert found is not None and (found.layer, found.step, found.examples) == ("x", 2, [37])
    assert found.cause.startswith("Inf in the input x: example 37, step 2, feature 0")


def _linear_head(tf: Any, gain: float, loss: str) -> Any:
    """The relu recurrence of :func:`_relu_rnn` under a linear head."""
    import keras

    model = _relu_rnn(tf, gain)
    out = keras.layers.Dense(2, name="linear_head")(model.get_layer("rnn").output)
    model = keras.Model(model.inputs, out)
    model.compile(loss=loss)
    return model


def test_check_fails_a_model_whose_own_float32_loss_overflows(tf):
    """Tried as a new user would: the relu state grows 3.5× a step, and its squared error is
    finite in check's float64 copy (about 1e70) but not in float32, where fit computes it
    (Keras' own call says inf). check said PASSED on the copy; it now fails (exit 1), says
    where the float32 number was born, and what the copy computed."""
    x = np.abs(_sequences(64))
    y = np.zeros((B, 2), "float32")
    model = _linear_head(tf, 3.5, "mse")
    assert not np.isfinite(float(model.compute_loss(x=x, y=y, y_pred=model(x))))
    report = gradscope.check(model, x=x, y=y)
    assert not report.summary.passed and report.dtype == "float32"
    found = report.nonfinite
    assert found is not None and found.origin == "loss" and found.operation == "Square"
    assert "A float64 copy with the same weights computes a loss of " in found.cause
    assert "but float32, in which the model runs, cannot hold them" in found.cause


def test_check_passes_a_model_near_float32_s_range_that_holds(tf):
    """The same recurrence under a mean absolute error: gradients near 1e35 in the copy,
    finite in float32 (Keras' own tape), so the model's own pass is run and check goes on to
    pass on the copy: no false alarm."""
    x = np.abs(_sequences(64))
    y = np.zeros((B, 2), "float32")
    model = _linear_head(tf, 3.5, "mae")
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x))
    gradients = tape.gradient(loss, model.trainable_variables)
    largest = max(float(np.max(np.abs(g))) for g in gradients)
    assert np.isfinite(float(loss)) and 1e35 < largest < 3e38
    report = gradscope.check(model, x=x, y=y)
    assert report.nonfinite is None and report.summary.passed and report.dtype == "float64"


def test_check_fails_a_model_whose_float32_softmax_underflows(tf):
    """Tried as a new user would: a loss taking the log of a softmax whose float32 output
    underflows to exactly 0 (the logits 150 apart) is inf where fit computes it, and finite
    in check's float64 copy, whose numbers stay far from float64's range: check passed on
    the copy. It now runs the model as fit does and fails (exit 1), where the float32 number
    was born and what the copy computed."""
    x = _sequences(5)
    model, probs, _ = _log_loss_classifier()
    kernel, bias = probs.get_weights()
    bias[:] = [0.0, 0.0, -150.0]  # class 2: exp(−150) is 0 in float32, 7e−66 in float64
    probs.set_weights([kernel, bias])
    y = np.eye(3, dtype="float32")[[0, 1, 2, 0, 1, 0]]
    assert not np.isfinite(float(model.compute_loss(x=x, y=y, y_pred=model(x))))
    report = gradscope.check(model, x=x, y=y)
    assert not report.summary.passed and report.summary.comparisons == 0
    found = report.nonfinite
    # Every example: 0·log(0) is NaN where class 2 is not the target.
    assert found is not None and found.operation == "Log" and found.examples == list(range(B))
    assert found.cause.startswith("log of 0: the softmax output for example 0 at class 2 is "
                                  "exactly 0. A float64 copy with the same weights computes "
                                  "a loss of ")
    assert "but float32, in which the model runs, cannot hold them" in found.cause


def test_check_fails_where_the_copy_saturates_and_the_model_overflows(tf):
    """Tried as a new user would: a relu SimpleRNN under mixed_float16 whose state passes
    65504, under a tanh head. In the float64 copy the head saturates, every gradient exactly
    0, and check refused the model as having nothing to check (exit 2) where fit's loss is
    NaN; the copy's numbers (about 1e7) are far from the model's float32 range, and the
    layer's float16 was not looked at. check now fails (exit 1) with the step where the
    float16 state overflows, and names float16."""
    import keras

    x = np.abs(_sequences(40))
    inputs = keras.Input((40, F), name="x")
    rnn = keras.layers.SimpleRNN(4, activation="relu", dtype="mixed_float16", name="rnn")
    model = keras.Model(inputs, keras.layers.Dense(2, activation="tanh", name="head")(
        rnn(inputs)))
    model.compile(loss="mse")
    kernel, _, bias = rnn.get_weights()
    rnn.set_weights([np.full_like(kernel, 0.3), 1.5 * np.eye(4, dtype="float32"), bias])
    h = np.zeros((B, 4))  # by hand, in float64: where the state first passes float16's max
    for t in range(40):
        h = np.maximum(x[:, t] @ np.full((F, 4), 0.3) + 1.5 * h, 0)
        if (h > 65504).any():
            break
    report = gradscope.check(model, x=x, y=np.zeros((B, 2), "float32"))
    found = report.nonfinite
    assert not report.summary.passed and found is not None
    assert (found.layer, found.step) == ("rnn", t)
    assert f"overflows float16 (largest 6.55e+04) at step {t}" in found.cause
    assert "A float64 copy with the same weights computes a loss of 1 " in found.cause
    assert "but float16, in which the model computes (" in found.cause


def test_backward_in_a_custom_cell_names_the_step_whose_backward_made_it(tf):
    """Tried as a new user would: a cell h_t = sqrt(pre_t²) on sequences padded with zeros
    in front, where pre_t is exactly 0 at every padded step. Counting back, the first
    backward that meets sqrt at 0 is the last padded step's: the gradient on the state
    before it is the first that is not finite. It was said to be the step before."""
    import keras

    @keras.saving.register_keras_serializable("gradscope_tests")
    class SqrtCell(keras.layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = self.state_size = self.output_size = units

        def build(self, shape: Any) -> None:
            self.w = self.add_weight(shape=(shape[-1], self.units), name="w")
            self.u = self.add_weight(shape=(self.units, self.units), name="u")

        def call(self, x: Any, states: Any) -> Any:
            pre = keras.ops.matmul(x, self.w) + 0.5 * keras.ops.matmul(states[0], self.u)
            h = keras.ops.sqrt(keras.ops.square(pre))
            return h, [h]

        def get_config(self) -> dict[str, Any]:
            return {**super().get_config(), "units": self.units}

    padded = 5  # example 2's steps 0–4 are zeros
    x = _sequences(12)
    x[2, :padded] = 0.0
    model = keras.Sequential([keras.Input((12, F), name="x"),
                              keras.layers.RNN(SqrtCell(4), name="sqrt_rnn"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    y = np.ones((B, 1), "float32")
    loss, norms = keras_tape_norms(model, x, y)
    assert np.isfinite(loss) and not all(np.isfinite(v) for v in norms.values())
    found = gradscope.explain(model, x=x, y=y).nonfinite
    assert found is not None and found.operation == "SqrtGrad"
    assert (found.pass_, found.layer, found.step, found.examples) == (
        "backward", "sqrt_rnn", padded - 1, [2])
