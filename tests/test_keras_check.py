"""check's witnesses account for the whole loss and know where the loss has no derivative:
regularization penalties are part of what the NumPy reference compares, a probe that straddles
relu's corner is reported as at a kink (never as a failed gradient), and a wrong gradient is
still caught on the same models."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from conftest import render_text

import gradscope


def _witness(report: Any, tensor: str, witness: str) -> Any:
    """A tensor's entry by its name (a weight's: its layer and its key there, as explain
    names it)."""
    entry = next(t for t in report.tensors if t.name == tensor)
    return next(e for e in entry.witnesses if e.witness == witness)


@pytest.fixture(scope="module")
def regularized(tf: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """Weight regularizers of every kind Keras has in L1, L2 and L1L2, and an activity
    regularizer on a GRU called twice."""
    import keras
    from keras import layers, regularizers

    keras.utils.set_random_seed(31)
    x = keras.Input((5, 3), name="x")
    gru = layers.GRU(4, kernel_regularizer=regularizers.L2(0.02),
                     recurrent_regularizer=regularizers.L1(0.01),
                     bias_regularizer=regularizers.L1L2(0.01, 0.03),
                     activity_regularizer=regularizers.L2(0.05), return_sequences=True,
                     name="gru")
    h = gru(x)
    twice = gru(layers.Dense(3, name="project")(h))
    model = keras.Model(x, layers.Dense(2, name="head")(layers.Flatten()(twice)))
    model.compile(loss="mse")
    rng = np.random.default_rng(3)
    return model, rng.standard_normal((4, 5, 3)), rng.standard_normal((4, 2))


def test_the_numpy_reference_includes_every_penalty(regularized, tf):
    model, x, y = regularized
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed
    for name in ("gru/kernel", "gru/recurrent_kernel", "gru/bias",
                 "gru/h0", "gru[1]/h0"):
        assert _witness(report, name, "numpy_reference").error < 1e-12, name


def test_a_reference_without_the_penalties_is_caught(regularized, tf, monkeypatch):
    """The mutant: the reference leaves the penalties out, as it once did. The tape's
    gradients hold them, so the reference must disagree."""
    from gradscope.keras.check import numpy_reference as check

    monkeypatch.setattr(check, "penalty_gradient", lambda regularizer, value: 0 * value)
    monkeypatch.setattr(check, "activity_gradient", lambda regularizer, value: 0 * value)
    model, x, y = regularized
    report = gradscope.check(model, x=x, y=y)
    assert not report.summary.passed
    assert not _witness(report, "gru/kernel", "numpy_reference").passed


def test_a_regularizer_without_a_numpy_form_is_said_and_not_compared(tf):
    import keras
    from keras import layers

    @keras.saving.register_keras_serializable(package="gradscope_tests")
    class Quartic(keras.regularizers.Regularizer):
        """A penalty gradscope has no NumPy form of: 0.01·Σx⁴."""

        def __call__(self, x: Any) -> Any:
            return 0.01 * keras.ops.sum(x ** 4)

        def get_config(self) -> dict[str, Any]:
            return {}

    keras.utils.set_random_seed(32)
    model = keras.Sequential([keras.Input((4, 3)), layers.GRU(
        3, kernel_regularizer=Quartic(), name="gru"), layers.Dense(2)])
    model.compile(loss="mse")
    rng = np.random.default_rng(4)
    report = gradscope.check(model, x=rng.standard_normal((3, 4, 3)),
                             y=rng.standard_normal((3, 2)))
    assert report.summary.passed
    (skipped,) = report.not_witnessed
    assert skipped.layer == "gru" and "Quartic" in skipped.reason
    assert "numpy_reference" not in report.summary.witnesses


@pytest.fixture(scope="module")
def relu_lstm(tf: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """The Bidirectional docstring's LSTM with relu: from zero states, cell states sit exactly
    at relu's corner."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(33)
    model = keras.Sequential([keras.Input((5, 3)),
                              layers.Bidirectional(layers.LSTM(4, activation="relu"),
                                                   name="bidirectional"),
                              layers.Dense(2, name="head")])
    model.compile(loss="mse")
    rng = np.random.default_rng(5)
    return model, rng.standard_normal((6, 5, 3)), rng.standard_normal((6, 2))


def test_a_probe_at_relu_corner_is_at_a_kink_not_a_failure(relu_lstm, tf):
    model, x, y = relu_lstm
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed
    kinked = [(t.name, e) for t in report.tensors for e in t.witnesses
              if "at a kink" in e.left_out]
    assert kinked, "the zero cell states of a relu LSTM straddle its corner"
    assert all(e.passed and "one-sided slopes differ" in e.left_out for _, e in kinked)
    # Every probe at a kink: the detail says so too; some: the JSON's left_out alone, and
    # the text a line of its own under the table.
    assert all(e.detail == e.left_out for _, e in kinked if e.at_kink)
    some = [(name, e) for name, e in kinked if not e.at_kink]
    assert all("at a kink" not in e.detail for _, e in some)
    from conftest import render_text

    text = " ".join(render_text(report, 200).split())
    assert all(" ".join(f"{name}: {e.left_out}".split()) in text for name, e in some)


def test_a_wrong_gradient_is_still_caught_on_the_relu_model(relu_lstm, tf):
    """Kinks are a property of the loss, never of the gradient: a weight changed after the
    tape (so that autodiff describes another model) must still fail."""
    model, x, y = relu_lstm

    def mutate(copy: Any) -> None:
        kernel = copy.get_layer("head").kernel
        kernel.assign(kernel.numpy() * 1.5)

    report = gradscope.check(model, x=x, y=y, after_autodiff=mutate)
    assert not report.summary.passed
    assert not _witness(report, "head/kernel", "finite_differences").passed


@pytest.fixture(scope="module")
def bidirectional_lstm(tf: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """Both directions, merged by product, with the final states (c_T too) used."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(34)
    x = keras.Input((5, 3), name="x")
    merged, h_f, c_f, h_b, c_b = layers.Bidirectional(
        layers.LSTM(4, return_sequences=True, return_state=True, name="lstm"), merge_mode="mul",
        name="both")(x)
    pooled = layers.GlobalAveragePooling1D()(merged)
    head = layers.Dense(2, name="head")(layers.Concatenate()([pooled, h_f, c_f, h_b, c_b]))
    model = keras.Model(x, head)
    model.compile(loss="mse")
    rng = np.random.default_rng(6)
    return model, rng.standard_normal((3, 5, 3)), rng.standard_normal((3, 2))


def test_each_direction_of_a_bidirectional_layer_has_its_numpy_reference(bidirectional_lstm,
                                                                          tf):
    model, x, y = bidirectional_lstm
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed and not report.not_witnessed
    for direction in ("forward_lstm", "backward_lstm"):
        for weight in ("kernel", "recurrent_kernel", "bias"):
            name = f"both/{direction}/{weight}"
            assert _witness(report, name, "numpy_reference").error < 1e-12, name
    for state in ("forward/h0", "forward/c0", "backward/h0", "backward/c0"):
        assert _witness(report, f"both/{state}", "numpy_reference").error < 1e-12, state


def test_the_reference_of_a_direction_catches_a_moved_weight(bidirectional_lstm, tf):
    model, x, y = bidirectional_lstm

    def mutate(copy: Any) -> None:
        kernel = copy.get_layer("both").backward_layer.cell.kernel
        kernel.assign(kernel.numpy() * 1.01)

    report = gradscope.check(model, x=x, y=y, after_autodiff=mutate)
    assert not report.summary.passed
    tensor = next(t for t in report.tensors if t.name == "both/backward_lstm/kernel")
    assert not tensor.passed
    # The reference reruns the call with the weights it is given: they no longer reproduce
    # what Keras computed, so it refuses to vouch for the call, and says why.
    assert all(e.witness != "numpy_reference" for e in tensor.witnesses)
    (skipped,) = report.not_witnessed
    assert skipped.layer == "both" and "do not reproduce Keras' output" in skipped.reason


def test_explain_witnesses_each_direction_or_says_why(bidirectional_lstm, relu_lstm, tf):
    model, x, y = bidirectional_lstm
    (both,) = [w for w in gradscope.explain(model, x=x, y=y).witnesses if w.layer == "both"]
    assert both.passed is True and "forward lstm_keras, backward lstm_keras" in both.witness
    assert both.max_abs_error is not None and both.max_abs_error < 1e-5
    model, x, y = relu_lstm
    (relu,) = gradscope.explain(model, x=x, y=y).witnesses
    assert relu.passed is None and "activation relu" in relu.detail


def test_a_passing_check_moves_every_tensor_jointly(regularized, tf):
    """One joint set of directions serves every tensor, each named in the report."""
    model, x, y = regularized
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed
    names = {t.name for t in report.tensors}
    assert {"gru/h0", "gru[1]/h0", "input x"} <= names
    for tensor in report.tensors:
        entry = _witness(report, tensor.name, "finite_differences")
        assert entry.detail.startswith("jointly with"), (tensor.name, entry.detail)
    # The text says that the one error in the column is the joint directions', for each.
    from conftest import render_text

    text = " ".join(render_text(report, 80).split())
    assert (f"finite diff.: {len(report.tensors)} tensors checked together, by 2 random "
            "directions moving every tensor at once") in text


def test_the_initial_states_of_a_layer_called_twice_are_told_apart(regularized, tf,
                                                                    monkeypatch):
    """Finite differences shift each call's zero states as Keras asks for them, counted apart
    from the engine's recorder: with the two calls' ∂L/∂h0 swapped, both fail, by name, and
    nothing else does."""
    from gradscope.keras.engine import KerasEngine

    run = KerasEngine.run

    def swapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = run(self, *args, **kwargs)
        states = result.state_gradients
        states["gru"], states["gru[1]"] = states["gru[1]"], states["gru"]
        return result

    monkeypatch.setattr(KerasEngine, "run", swapped)
    model, x, y = regularized
    report = gradscope.check(model, x=x, y=y)
    failed = {t.name for t in report.tensors
              if not _witness(report, t.name, "finite_differences").passed}
    assert failed == {"gru/h0", "gru[1]/h0"}


def test_a_wrong_backward_in_a_layer_without_weights_is_named(tf):
    """A layer of the user's own, with no weights and a tf.custom_gradient that halves its
    gradient: the failure shows at the tensors below it, and check names the layer itself,
    and no other."""
    import keras

    class HalfGradient(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            @tf.custom_gradient
            def squashed(x: Any) -> Any:
                y = tf.tanh(x)
                return y, lambda dy: 0.5 * dy * (1.0 - y * y)

            return squashed(x)

    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = HalfGradient(name="half")(keras.layers.Dense(3, name="below")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="above")(hidden))
    model.compile(loss="mse")
    rng = np.random.default_rng(4)
    report = gradscope.check(model, x=rng.standard_normal((6, 4)), y=rng.standard_normal((6, 2)))
    assert not report.summary.passed
    assert not _witness(report, "below/kernel", "finite_differences").passed
    assert _witness(report, "above/kernel", "finite_differences").passed
    assert [t.name for t in report.tensors if t.name.startswith("layer ")] == ["layer half"]
    own = _witness(report, "layer half", "own_backward")
    assert "0.5 times the differences'" in own.detail
    # The error said is that of the two numbers beside it (tried as a new user would: a
    # smaller retake's rounding allowance made it read 1.27e-01 beside 8.9e-01 and 6.0e-01).
    tape, differences, *typical = (float(n) for n in re.findall(r"-?\d\.\d+e[-+]\d+",
                                                                 own.detail))
    assert own.error == pytest.approx(abs(tape - differences) / max(abs(tape), *typical),
                                      rel=1e-3)
    # A layer call is not counted as a tensor.
    from conftest import render_text

    text = " ".join(render_text(report, 200).split())
    tensors = len(report.tensors) - 1
    assert f"Gradients checked ({tensors} tensors and 1 layer call's own backward," in text
    failed = len(report.summary.failed_tensors) - 1
    assert f"FAILED: {failed} of {tensors} tensors disagree: " in text
    assert text.endswith("; layer half's own backward disagrees too")
    # No recurrent layer: the NumPy reference compared nothing, and its tolerance is not
    # listed as if it had (the JSON keeps it).
    assert "numpy_reference" not in report.summary.witnesses
    assert "NumPy ref." not in text and "numpy_reference" in report.tolerances
    from gradscope.testing import diagnosis

    assert diagnosis(report).splitlines()[0] == (
        f"gradscope: model '{model.name}': {failed} of {tensors} tensors disagree; layer "
        "half's own backward disagrees too:")
    # In JUnit, the layer's own backward is a case of its layer's class (it was filed under
    # gradscope.check.model, apart from its weights; found tried as a new user would).
    import xml.etree.ElementTree as ET

    from gradscope.report.junit import junit_xml

    cases = {case.get("name"): case.get("classname")
             for case in ET.fromstring(junit_xml(report, "model")).iter("testcase")}
    assert cases["layer half"] == "gradscope.check.half"
    assert cases["below/kernel"] == "gradscope.check.below"


@pytest.mark.parametrize("fixture", ["regularized", "bidirectional_lstm"])
def test_the_numpy_reference_taken_in_slices_of_examples_is_the_same(fixture, request, tf,
                                                                      monkeypatch):
    """A big batch is taken a few examples at a time (what the reference holds stays small):
    with slices of 2 examples, the weights (penalties included) and the initial states of
    every call, both directions of a Bidirectional, agree as they do whole."""
    from gradscope.keras.check import numpy_reference as check

    model, x, y = request.getfixturevalue(fixture)
    whole = gradscope.check(model, x=x, y=y)
    monkeypatch.setattr(check, "REFERENCE_EXAMPLES", 2)
    sliced = gradscope.check(model, x=x, y=y)
    assert sliced.summary.passed

    def referenced(report: Any) -> dict[str, float]:
        return {t.name: e.error for t in report.tensors for e in t.witnesses
                if e.witness == "numpy_reference"}

    assert referenced(sliced).keys() == referenced(whole).keys() and referenced(whole)
    assert all(error < 1e-12 for error in referenced(sliced).values())


def test_one_wrong_element_of_a_wide_gradient_is_caught_through_its_projection(tf,
                                                                               monkeypatch):
    """The mutant: the float64 tape's gradient of a wide recurrent kernel (4·32 = 128 columns:
    the reference keeps it projected on random signs, :class:`gradscope.cells.numpy_bptt.Sketch`)
    is wrong in one element, by 1e-6 of the largest. The finite differences cannot see that
    (1e-5); the projected reference does, as it would unprojected."""
    import keras
    from keras import layers

    from gradscope.keras.engine import KerasEngine

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6, 3)), layers.LSTM(32, name="wide"),
                              layers.Dense(2, name="head")])
    model.compile(loss="mse")
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((4, 6, 3)), rng.standard_normal((4, 2))
    path = next(v.path for v in model.trainable_variables
                if v.path.endswith("wide/lstm_cell/recurrent_kernel"))
    name = "wide/recurrent_kernel"  # as explain names it; Keras' path beside it
    honest = gradscope.check(model, x=x, y=y)
    assert honest.summary.passed
    assert next(t for t in honest.tensors if t.name == name).path == path
    assert "random signs" in _witness(honest, name, "numpy_reference").detail
    assert _witness(honest, name, "numpy_reference").error < 1e-12
    run = KerasEngine.run

    def wrong_in_one_element(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = run(self, *args, **kwargs)
        gradient = result.gradients[path]
        gradient[7, 100] += 1e-6 * np.max(np.abs(gradient))
        return result

    monkeypatch.setattr(KerasEngine, "run", wrong_in_one_element)
    report = gradscope.check(model, x=x, y=y)
    assert not report.summary.passed and report.summary.failed_tensors == [name]
    assert _witness(report, name, "finite_differences").passed
    caught = _witness(report, name, "numpy_reference")
    assert not caught.passed and caught.error >= 1e-6 * (1 - 1e-9)


def test_examples_whose_gradients_are_all_zero_are_refused_not_passed(tf):
    """Every sample weight 0: the loss and every gradient are exactly 0, every witness agrees
    with 0, and a check that cannot fail would say PASSED; it is refused with the cause."""
    import keras

    from gradscope.errors import DataError

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4), keras.layers.Dense(2)])
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 5, 3)).astype(np.float32)
    y = rng.normal(size=(4, 2)).astype(np.float32)
    with pytest.raises(DataError, match="every sample weight of these examples is 0"):
        gradscope.check(model, x=x, y=y, sample_weight=np.zeros(4, np.float32))
    report = gradscope.check(model, x=x, y=y, sample_weight=np.ones(4, np.float32))
    assert report.summary.passed


CHECK_FROM_PYTHON = """
import gradscope, keras, numpy as np, tensorflow as tf

class WrongTanh(keras.layers.Layer):
    def call(self, x):
        @tf.custom_gradient
        def f(v):
            y = tf.tanh(v)
            return y, lambda dy: dy * (1.0 - y)  # the derivative is 1 - y²
        return f(x)

keras.utils.set_random_seed(0)
x_in = keras.Input((12, 3))
model = keras.Model(x_in, keras.layers.Dense(2)(keras.layers.GRU(4)(WrongTanh()(x_in))))
model.compile(loss="mse")
rng = np.random.default_rng(0)
report = gradscope.check(model, x=rng.normal(size=(4, 12, 3)).astype("float32"),
                         y=rng.normal(size=(4, 2)).astype("float32"))
print("passed", report.summary.passed)
"""


def test_check_from_python_writes_no_tensorflow_log_line() -> None:
    """In a script, a check whose witnesses run the float64 copy's functions (a wrong
    custom gradient: the layers are then checked on their own too) writes no TensorFlow log
    line: the graph optimiser's "Not handling type DT_DOUBLE" lines are silenced, as the
    CLI's are. (Lines TensorFlow writes when the script itself imports it come before.)"""
    import subprocess
    import sys

    from conftest import REPO

    done = subprocess.run([sys.executable, "-c", CHECK_FROM_PYTHON], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "passed False" in done.stdout
    assert "DT_DOUBLE" not in done.stderr and "W0000" not in done.stderr, done.stderr[-2000:]


def test_what_the_loss_does_not_reach_is_said_not_checked(tf, tmp_path):
    """Tried as a new user would: a cell whose call skips its recurrent term passed check,
    its recurrent kernel and h0 (which get no gradient) left out of the table and of the
    JUnit file without a word. They are said not checked, and are JUnit's skipped cases."""
    import keras

    from gradscope.report.junit import junit_xml

    class NoRecurrence(keras.layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = self.state_size = units

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")
            self.recurrent_kernel = self.add_weight(shape=(self.units, self.units),
                                                    name="recurrent_kernel")

        def call(self, x: Any, states: Any) -> Any:
            h = keras.ops.tanh(keras.ops.matmul(x, self.kernel))
            return h, [h]

    model = keras.Sequential([keras.Input((5, 3)), keras.layers.RNN(NoRecurrence(4), name="rnn"),
                              keras.layers.Dense(2)])
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    report = gradscope.check(model, x=rng.standard_normal((4, 5, 3)),
                             y=rng.standard_normal((4, 2)))
    unreached = [s.layer for s in report.not_witnessed]
    assert report.summary.passed
    assert {path for path in unreached if "recurrent_kernel" in path} and "rnn/h0" in unreached
    assert not any(t.name in unreached for t in report.tensors)
    text = render_text(report, 120)
    assert "not checked: rnn/h0: the loss does not reach it" in text
    assert junit_xml(report, "model").count("<skipped") == len(unreached) == 2


def test_tensors_no_witness_could_compare_are_not_counted_as_agreeing(tf):
    """Tried as a new user would: a tanh SimpleRNN at 6× an orthogonal kernel over 40 steps
    (chaotic: the finite differences of its weights do not settle as the step shrinks)
    read "PASSED: all 4 tensors agree", the JSON and JUnit counting its unwitnessed weights
    as passed, where a 1.5× too large bias gradient passed the same way. They are now said
    not witnessed, listed in the summary, and skipped JUnit cases."""
    import keras

    from gradscope.report.junit import junit_xml

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((40, 4)), keras.layers.SimpleRNN(24, name="chaos"),
                              keras.layers.Dense(1, name="out")])
    model.compile(loss="mse")
    kernel, _, bias = model.get_layer("chaos").get_weights()
    q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((24, 24)))
    model.get_layer("chaos").set_weights([kernel * 0.3, 6.0 * q, bias])
    rng = np.random.default_rng(0)
    report = gradscope.check(model, x=rng.standard_normal((4, 40, 4)),
                             y=rng.standard_normal((4, 1)))
    unwitnessed = report.summary.unwitnessed_tensors
    assert report.summary.passed and unwitnessed
    assert all("chaos" in name for name in unwitnessed)
    text = " ".join(render_text(report, 200).split())
    agree = report.summary.checked_tensors - len(unwitnessed)
    assert (f"PASSED: {agree} of {report.summary.checked_tensors} tensors agree with every "
            f"witness") in text
    assert f"{len(unwitnessed)} not witnessed (finite differences not resolved)" in text
    xml = junit_xml(report, "model")
    assert xml.count("<skipped") == len(unwitnessed) + len(report.not_witnessed)
    assert xml.count("no witness could compare it") == len(unwitnessed)


def test_a_softmax_whose_probabilities_reach_1_is_checked_on_its_logits(tf):
    """A classifier trained far (its probabilities within 1e-7 of 1 on some examples): fit's
    cross-entropy reads the softmax's logits, which Keras leaves on its output; check's tape
    watched a fresh copy of the output, without them, so Keras clipped the probabilities and
    those examples gave no gradient. Found tried as a new user would: a loss of 7.6e-6,
    "17 of 17 tensors disagree", the differences right. The copy keeps the logits: the
    check passes, and its loss is the logits' (fit's)."""
    import keras

    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(5, name="rnn"),
                              keras.layers.Dense(3, activation="softmax", name="head")])
    model.compile(loss="categorical_crossentropy")
    kernel, bias = model.get_layer("head").get_weights()
    x = np.random.default_rng(9).standard_normal((8, 6, 3)).astype("float32")
    model.get_layer("head").set_weights([kernel * 400, bias])
    probabilities = model.predict(x, verbose=0)
    assert np.max(probabilities) >= 1 - 1e-7  # saturated: Keras' clip would cut it
    y = np.eye(3, dtype="float32")[np.argmax(probabilities, axis=1)]
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed, report.summary.failed_tensors
    # The loss from the logits, in float64: Keras' clip would make each saturated example's
    # share -log(1 - 1e-7), about twice the whole of this one.
    logits = (np.asarray(model.get_layer("rnn")(x), np.float64) @ kernel.astype(np.float64)
              * 400 + bias)
    shares = np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) - (
        logits - logits.max(1, keepdims=True))[y.astype(bool)]
    assert report.loss.value == pytest.approx(float(np.mean(shares)), rel=1e-3)
