"""``keras.layers.RNN(your_cell)``, tried as a new user would: a cell of the user's own class gets
∂L/∂h0 as Keras' own tape gives it, check verifies it, and a wrong backward in the cell is
placed in time, step by step, with no NumPy version of the cell."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gradscope

STEPS, BATCH, FEATURES, UNITS = 10, 4, 3, 5


def _cell_class() -> Any:
    import keras
    import tensorflow as tf

    class CarryCell(keras.layers.Layer):
        """h_t = tanh(x_t·W + h_{t−1}·U), with a hand-written gradient through h_{t−1}:
        ``wrong_by`` scales it where the step's first feature is above 0.5 (everywhere when
        ``everywhere``)."""

        def __init__(self, units: int, wrong_by: float = 1.0, everywhere: bool = True,
                     **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units, self.wrong_by, self.everywhere = units, wrong_by, everywhere
            self.state_size = units
            self.output_size = units

        def build(self, input_shape: Any) -> None:
            self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
            self.recurrent = self.add_weight(shape=(self.units, self.units),
                                             name="recurrent_kernel")

        def call(self, x: Any, states: Any) -> Any:
            h = states[0]
            scale = (tf.ones_like(x[:, :1]) if self.everywhere
                     else tf.cast(x[:, :1] > 0.5, x.dtype))
            factor = 1.0 + (self.wrong_by - 1.0) * scale

            @tf.custom_gradient
            def carried(h: Any) -> Any:
                return tf.identity(h), lambda dy: dy * factor

            new = tf.tanh(x @ self.kernel + carried(h) @ self.recurrent)
            return new, [new]

        def get_config(self) -> dict[str, Any]:
            return {**super().get_config(), "units": self.units, "wrong_by": self.wrong_by,
                    "everywhere": self.everywhere}

    return CarryCell


def _model(tf: Any, wrong_by: float = 1.0, everywhere: bool = True,
           backwards: bool = False) -> tuple[Any, Any, Any]:
    import keras

    keras.utils.set_random_seed(5)
    inputs = keras.Input((STEPS, FEATURES))
    rnn = keras.layers.RNN(_cell_class()(UNITS, wrong_by, everywhere), name="rnn",
                           go_backwards=backwards)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(rnn(inputs)))
    model.compile(loss="mse")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype("float32")
    x[:, :, 0] = 0.0
    x[:, :4, 0] = 1.0  # the marker: the first four steps
    return model, x, rng.standard_normal((BATCH, 2)).astype("float32")


def _entry(report: Any, tensor: str, witness: str) -> Any:
    entry = next(t for t in report.tensors if t.name == tensor)
    return next(e for e in entry.witnesses if e.witness == witness)


def test_the_initial_state_gradient_is_keras_own(tf):
    """∂L/∂h0 of the RNN over the cell: the norm Keras' tape gives, with h0 an explicit zero
    input of the same layer."""
    import keras

    model, x, y = _model(tf)
    report = gradscope.explain(model, x=x, y=y)
    state = next(s for s in report.initial_state_gradients if s.name == "rnn/h0")
    h0 = tf.zeros((BATCH, UNITS))
    with tf.GradientTape() as tape:
        tape.watch(h0)
        hidden = model.get_layer("rnn")(tf.constant(x), initial_state=[h0])
        loss = keras.losses.MeanSquaredError()(y, model.get_layer("head")(hidden))
    truth = tape.gradient(loss, h0).numpy()
    assert state.stats.l2 == pytest.approx(float(np.linalg.norm(truth)), rel=1e-5)
    assert "your cell" in state.source or "zeros" in state.source
    # The layer is said with its cell and its state (it read "RNN" alone).
    layer = next(entry for entry in report.layers if entry.name == "rnn")
    kind = type(model.get_layer("rnn").cell)
    cell = f"{kind.__module__}.{kind.__name__}"
    assert layer.summary == (f"RNN over the cell {cell}, a state of {UNITS} numbers an "
                             "example; returns its last output")


def test_the_gradients_header_claims_a_shape_check_only_for_the_derived_shapes(tf):
    """The cell's weights have no derivation, so no algebra checked their shapes: the header
    says how many were checked (found tried as a new user would: it said "every shape
    checked against gradscope's algebra" above "no derivation for this layer type")."""
    from conftest import render_text

    model, x, y = _model(tf)
    report = gradscope.explain(model, x=x, y=y)
    derived = [g for g in report.gradients if g.formula is not None]
    assert 0 < len(derived) < len(report.gradients)
    text = " ".join(render_text(report, 80).split())
    assert "every shape checked" not in text
    assert (f"Gradients of the loss ({len(report.gradients)} tensors; every value is Keras' "
            f"own; the shapes of the {len(derived)} with a derivation checked against "
            "gradscope's algebra)") in text
    assert "no derivation for this layer type" in text


def test_check_verifies_the_cell_and_its_initial_state(tf):
    model, x, y = _model(tf)
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed
    assert _entry(report, "rnn/h0", "finite_differences").detail.startswith("jointly")


def test_a_backward_wrong_at_every_step_is_said_so_with_its_factor(tf):
    model, x, y = _model(tf, wrong_by=0.5)
    report = gradscope.check(model, x=x, y=y)
    assert not report.summary.passed
    assert not _entry(report, "rnn/h0", "finite_differences").passed
    steps = _entry(report, "rnn/h0", "cell_steps")
    assert not steps.passed
    assert "into h_(t−1): wrong at every step" in steps.detail
    assert "off by a factor 0.5" in steps.detail
    assert "into x_t: right at every step" in steps.detail
    assert steps.first_bad_step == STEPS - 1
    assert "go_backwards" not in steps.detail
    # A layer that reads its steps from the last: which order t counts in is said (found
    # tried as a new user would: "t=19" read either way).
    model, x, y = _model(tf, wrong_by=0.5, backwards=True)
    backwards = _entry(gradscope.check(model, x=x, y=y), "rnn/h0", "cell_steps")
    assert not backwards.passed and backwards.first_bad_step == STEPS - 1
    assert backwards.detail.endswith(
        "; t counts the steps in the order the layer runs them (go_backwards: t=0 is the "
        f"last input step, t={STEPS - 1} the first)")


def test_behind_a_mask_the_cell_steps_say_why_they_are_not_run(tf):
    """Found tried as a new user would: a masked custom cell's report left the step-by-step
    witness out without a word; the wrong backward is still caught by the others."""
    import keras

    keras.utils.set_random_seed(5)
    inputs = keras.Input((STEPS, FEATURES))
    masked = keras.layers.Masking()(inputs)
    rnn = keras.layers.RNN(_cell_class()(UNITS, 0.5, True), name="rnn")
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(rnn(masked)))
    model.compile(loss="mse")
    _, x, y = _model(tf)
    x[0, -3:] = 0.0  # the last three steps of the first example masked
    report = gradscope.check(model, x=x, y=y)
    assert not report.summary.passed
    (said,) = [w for w in report.not_witnessed if w.witness == "cell_steps"]
    assert said.layer == "rnn" and said.reason.startswith("the input is masked")


def test_a_backward_that_drops_the_recurrence_has_an_error_of_order_one(tf):
    """Found tried as a new user would: where the tape's ∂/∂h_(t−1) is exactly 0 (a custom
    gradient that drops the recurrence), the cell steps' relative error read 1.32e+10, against
    rounding; against what the differences find it is of order 1, and the factor says 0."""
    model, x, y = _model(tf, wrong_by=0.0)
    steps = _entry(gradscope.check(model, x=x, y=y), "rnn/h0", "cell_steps")
    assert not steps.passed and steps.error is not None and 0.5 <= steps.error <= 10.0
    assert "off by a factor 0" in steps.detail


def test_a_backward_wrong_in_the_first_steps_is_placed_in_time(tf):
    """Wrong only where the marker is on (t = 0…3): the gradient matches from the last step
    back to t = 4, and is wrong from t = 3 backwards; the diagnosis says so."""
    from gradscope.testing import diagnosis

    model, x, y = _model(tf, wrong_by=0.5, everywhere=False)
    report = gradscope.check(model, x=x, y=y)
    steps = _entry(report, "rnn/h0", "cell_steps")
    assert not steps.passed and steps.first_bad_step == 3
    assert "matches at t=4…9, wrong from t=3 backwards (4 of 4 steps)" in steps.detail
    assert "first wrong step counting back: t=3" in diagnosis(report)


def test_a_wrong_weight_gradient_is_blamed_on_that_weight_alone(tf):
    """Tried as a new user would: a cell whose own gradient makes the recurrent kernel's 1.01×
    too large, and nothing else. The cell steps name that weight, with its factor; the input
    kernel, whose gradient is right, passes (one direction over every weight at once blamed
    both, 'first wrong step t=0', with a factor 0.981 of neither)."""
    import keras

    class WrongRecurrentCell(keras.layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = self.state_size = self.output_size = units

        def build(self, input_shape: Any) -> None:
            self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
            self.recurrent = self.add_weight(shape=(self.units, self.units),
                                             name="recurrent_kernel")

        def call(self, x: Any, states: Any) -> Any:
            @tf.custom_gradient
            def carried(h: Any, u: Any) -> Any:
                return h @ u, lambda dy: (dy @ tf.transpose(u),
                                          1.01 * tf.transpose(h) @ dy)

            new = tf.tanh(x @ self.kernel + carried(states[0], tf.convert_to_tensor(
                self.recurrent)))
            return new, [new]

    keras.utils.set_random_seed(5)
    inputs = keras.Input((STEPS, FEATURES))
    rnn = keras.layers.RNN(WrongRecurrentCell(UNITS), name="rnn")
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(rnn(inputs)))
    model.compile(loss="mse")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype("float32")
    report = gradscope.check(model, x=x, y=rng.standard_normal((BATCH, 2)).astype("float32"))
    cell = "rnn"  # explain's name; Keras' path rnn/wrong_recurrent_cell/… beside it
    assert report.summary.failed_tensors == [f"{cell}/recurrent_kernel"]
    kernel = _entry(report, f"{cell}/kernel", "cell_steps")
    recurrent = _entry(report, f"{cell}/recurrent_kernel", "cell_steps")
    assert kernel.passed and not recurrent.passed
    assert recurrent.error == pytest.approx(0.01, rel=0.05)
    assert recurrent.first_bad_step is None
    assert "into recurrent_kernel: wrong, off by a factor 1.01" in recurrent.detail
    assert "into kernel: right" in recurrent.detail
    assert "into h_(t−1): right at every step" in recurrent.detail


def test_the_flow_over_a_cell_is_the_numpy_bptt_of_the_same_layer(tf):
    """RNN(GRUCell), run step by step under one tape, gives at every step the ‖∂L/∂h_t‖ that
    gradscope's NumPy BPTT gives the GRU layer with the same weights."""
    import keras

    def model(recurrent: Any) -> Any:
        inputs = keras.Input((STEPS, FEATURES))
        built = keras.Model(inputs, keras.layers.Dense(2, name="head")(recurrent(inputs)))
        built.compile(loss="mse")
        return built

    keras.utils.set_random_seed(8)
    layer = model(keras.layers.GRU(UNITS, return_sequences=True, name="gru"))
    cell = model(keras.layers.RNN(keras.layers.GRUCell(UNITS), return_sequences=True,
                                  name="rnn"))
    cell.set_weights(layer.get_weights())
    rng = np.random.default_rng(9)
    x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype("float32")
    y = rng.standard_normal((BATCH, STEPS, 2)).astype("float32")

    def norms(built: Any, what: str) -> np.ndarray:
        flow = gradscope.explain(built, x=x, y=y, flow=True).gradient_flow
        return np.array(next(s.norms for s in flow.sequences if s.what == what))

    assert norms(cell, "∂L/∂rnn/h_t") == pytest.approx(norms(layer, "∂L/∂gru/h_t"), rel=1e-4)


def test_the_flow_over_your_cell_has_every_step(tf):
    model, x, y = _model(tf)
    flow = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow
    found = next(s for s in flow.sequences if s.what == "∂L/∂rnn/h_t")
    assert len(found.norms) == STEPS and found.norms[-1] > 0
    assert not [n for n in flow.not_analysed if n.layer == "rnn"]


def test_a_row_that_holds_only_what_step_t_plus_1_reads_is_said_in_the_heading(tf):
    """Found tried as a new user would: a stack of cells' states read "(as step t+1 reads
    it)" under a heading that called every row the total."""
    import keras
    from conftest import render_text

    keras.utils.set_random_seed(3)
    inputs = keras.Input((STEPS, FEATURES))
    stacked = keras.layers.RNN([keras.layers.GRUCell(3), keras.layers.LSTMCell(2)],
                               name="stacked")
    model = keras.Model(inputs, keras.layers.Dense(2)(stacked(inputs)))
    model.compile(loss="mse")
    _, x, y = _model(tf)
    report = gradscope.explain(model, x=x, y=y, flow=True)
    assert any("(as step t+1 reads it)" in s.what for s in report.gradient_flow.sequences)
    text = " ".join(render_text(report, 80).split())
    assert "a row marked (as step t+1 reads it) holds only that part" in text
    # Each state named by its cell, in Keras' flat order (found tried as a new user would:
    # states[0] … states[2]), its initial state as its flow row is.
    assert [s.what.split(" (")[0] for s in report.gradient_flow.sequences
            if s.kind == "state"] == ["∂L/∂stacked/cells[0]/h_t", "∂L/∂stacked/cells[1]/h_t",
                                      "∂L/∂stacked/cells[1]/c_t"]
    assert [g.name for g in report.initial_state_gradients] == [
        "stacked/cells[0]/h0", "stacked/cells[1]/h0", "stacked/cells[1]/c0"]


def test_a_backward_scaled_into_h_t_minus_1_is_a_change_of_slope_in_the_flow(tf):
    """The flow runs the cell the model holds, its backward included: where the mutant
    halves the gradient into h_{t−1} (at t = 0…3), each step back from t = 3 halves the
    total ∂L/∂h_t against the honest cell's, and nothing changes after t = 3."""
    honest, x, y = _model(tf)
    mutant, _, _ = _model(tf, wrong_by=0.5, everywhere=False)

    def flow(model: Any) -> np.ndarray:
        found = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow
        assert not found.not_analysed
        return np.array(next(s.norms for s in found.sequences if s.what == "∂L/∂rnn/h_t"))

    ratio = flow(mutant) / flow(honest)
    np.testing.assert_allclose(ratio[3:], 1.0, rtol=1e-5)
    np.testing.assert_allclose(ratio[:3], [0.125, 0.25, 0.5], rtol=1e-5)


@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_a_chaotic_cell_is_witnessed_step_by_step(tf, factor):
    """Found tried as a new user would: a cell at 6× an orthogonal kernel over 40 steps (the
    whole sequence amplifies every perturbation: the finite differences of its weights do not
    settle) passed check with a tanh derivative 1.5× too large, its weights unwitnessed (and
    once fell to float32 as if it computed in a lower precision). Each step of the cell, on
    its own, amplifies nothing: it witnesses the right cell and catches the wrong one."""
    import keras

    @tf.custom_gradient
    def tanh(x: Any) -> Any:
        y = tf.tanh(x)
        return y, lambda dy: dy * (1 - y * y) * factor

    class Chaotic(keras.layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = self.state_size = units

        def build(self, shape: Any) -> None:
            self.w = self.add_weight(shape=(shape[-1], self.units), name="w")
            self.u = self.add_weight(shape=(self.units, self.units), name="u",
                                     initializer=keras.initializers.Orthogonal(6.0, seed=3))

        def call(self, x: Any, states: Any) -> Any:
            h = tanh(0.3 * keras.ops.matmul(x, self.w) + keras.ops.matmul(states[0], self.u))
            return h, [h]

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((40, 4)), keras.layers.RNN(Chaotic(24), name="rnn"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    report = gradscope.check(model, x=rng.standard_normal((4, 40, 4)),
                             y=rng.standard_normal((4, 1)))
    assert report.dtype == "float64"
    by_steps = [e for t in report.tensors for e in t.witnesses if e.witness == "cell_steps"]
    assert by_steps  # where the differences did not settle, or failed
    if factor == 1.0:  # every tensor witnessed, the unsettled ones by the steps
        assert report.summary.passed and not report.summary.unwitnessed_tensors
        assert all(e.passed for e in by_steps)
    else:
        assert not report.summary.passed and not any(e.passed for e in by_steps)


def test_the_cells_of_a_stack_are_named_by_their_place_whatever_keras_numbered(tf):
    """RNN(StackedRNNCells([GRUCell, GRUCell])): each cell's weights by its place,
    ``stacked/cells[1]/kernel``, in explain and check alike. Keras numbers the cells' scopes
    as it makes them (gru_cell, gru_cell_1, and gru_cell_2 … when the model is built again in
    the same notebook), and the first one's left out read ``stacked/kernel``, as if the whole
    layer's (found tried as a new user would)."""
    import keras

    def build() -> Any:
        keras.utils.set_random_seed(6)
        stack = keras.layers.StackedRNNCells([keras.layers.GRUCell(3),
                                              keras.layers.GRUCell(2)])
        model = keras.Sequential([
            keras.Input((5, 2)), keras.layers.RNN(stack, return_sequences=True, name="stacked"),
            keras.layers.RNN(keras.layers.SimpleRNNCell(2), name="plain"),
            keras.layers.Dense(1, name="head")])
        model.compile(loss="mse")
        return model

    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((4, 5, 2)), rng.standard_normal((4, 1))
    first, again = build(), build()
    assert [v.path for v in first.weights] != [v.path for v in again.weights]  # Keras' numbers
    names = [[g.name for g in gradscope.explain(model, x=x, y=y).gradients]
             for model in (first, again)]
    # And a cell alone, numbered too (simple_rnn_cell_1 the second time): its scope left out.
    parts = ("kernel", "recurrent_kernel", "bias")
    expected = ([f"stacked/cells[{k}]/{part}" for k in (0, 1) for part in parts]
                + [f"plain/{part}" for part in parts] + ["head/kernel", "head/bias"])
    assert names == [expected, expected]
    checked = gradscope.check(again, x=x, y=y)
    assert checked.summary.passed
    assert [t.name for t in checked.tensors if t.path] == expected
