"""The Python API on a Keras model object in memory (a notebook's model): explain's gradients
are Keras' own GradientTape gradients on the same batch, check passes, and the user's object
is exactly as it was afterwards (weights, compiled state, dtype)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import gradscope
from gradscope.errors import ConfigError, DataError

RTOL = 1e-5


def _state(model: Any) -> dict[str, Any]:
    """Everything of the user's object gradscope must leave alone."""
    return {
        "weights": [np.array(w) for w in model.get_weights()],
        "compiled": model.compiled,
        "compile_loss": model._compile_loss,
        "loss": getattr(model, "loss", None),
        "optimizer": getattr(model, "optimizer", None),
        "dtype": model.dtype,
        "dtypes": [w.dtype for w in model.weights],
    }


def _assert_unchanged(model: Any, before: dict[str, Any]) -> None:
    after = _state(model)
    assert len(after["weights"]) == len(before["weights"])
    for old, new in zip(before["weights"], after["weights"], strict=True):
        np.testing.assert_array_equal(old, new)
    for key in ("compiled", "compile_loss", "loss", "optimizer", "dtype", "dtypes"):
        assert after[key] is before[key] or after[key] == before[key], key


def _tape(tf: Any, model: Any, x: Any, y: Any, loss: Any) -> tuple[float, dict[str, Any]]:
    """Keras' own tape on the user's object, called as a user calls it."""
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=False))
    gradients = tape.gradient(value, model.trainable_variables)
    return float(value), {v.path: tf.convert_to_tensor(g).numpy()
                          for v, g in zip(model.trainable_variables, gradients, strict=True)}


@pytest.fixture(scope="module")
def compiled_gru(tf: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """A Sequential GRU classifier, compiled with its optimizer, as in a course notebook."""
    import keras

    keras.utils.set_random_seed(3)
    # Named: Keras numbers unnamed layers across the process (gru_8 after other tests).
    model = keras.Sequential([keras.Input((7, 3)), keras.layers.GRU(5, name="gru"),
                              keras.layers.Dense(4, activation="softmax", name="dense")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    return model, rng.standard_normal((6, 7, 3)), rng.integers(0, 4, (6,))


@pytest.fixture(scope="module")
def two_inputs(tf: Any) -> tuple[Any, dict[str, Any], Any]:
    """A functional model, not compiled: two inputs (by name), a Lambda, an LSTM, one linear
    output unit (mse inferred); TF tensors as the batch."""
    import keras

    keras.utils.set_random_seed(4)
    # Two inputs of one shape, listed in the config in another order than Keras flattens
    # them (sorted keys): read in the config's order, they would be swapped silently.
    sequence = keras.Input((5, 2), name="sequence")
    extra = keras.Input((5, 2), name="extra")
    h = keras.layers.LSTM(4, name="lstm")(sequence)
    scaled = keras.layers.Lambda(lambda t: 2.0 * t, name="double")(h)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(extra)
    merged = keras.layers.Concatenate(name="merge")([scaled, pooled])
    out = keras.layers.Dense(1, name="head")(merged)
    model = keras.Model({"sequence": sequence, "extra": extra}, out)
    rng = np.random.default_rng(1)
    x = {"sequence": tf.constant(rng.standard_normal((4, 5, 2)), tf.float32),
         "extra": tf.constant(rng.standard_normal((4, 5, 2)), tf.float32)}
    return model, x, tf.constant(rng.standard_normal((4, 1)), tf.float32)


def test_explain_gives_keras_own_tape_gradients_and_leaves_the_model_alone(compiled_gru, tf):
    import keras

    model, x, y = compiled_gru
    before = _state(model)
    report = gradscope.explain(model, x=x, y=y)
    _assert_unchanged(model, before)
    loss, truth = _tape(tf, model, x.astype("float32"), y,
                        keras.losses.SparseCategoricalCrossentropy())
    assert report.loss.value == pytest.approx(loss, rel=RTOL)
    assert report.model.data == "supplied (x, y)" and report.model.batch_size == 6
    assert "compiled" in report.loss.name
    assert sorted(g.path for g in report.gradients) == sorted(truth)
    ours = report.to_dict()["gradients"]
    for entry in ours:
        expected = truth[entry["path"]]
        assert entry["stats"]["l2"] == pytest.approx(float(np.linalg.norm(expected)), rel=RTOL)
        assert entry["stats"]["max_abs"] == pytest.approx(float(np.abs(expected).max()),
                                                          rel=RTOL)
    assert [g.name for g in report.gradients][:3] == ["gru/kernel", "gru/recurrent_kernel",
                                                      "gru/bias"]


def test_explain_arrays_equal_the_tape_array_by_array(two_inputs, tf):
    """Through the engine itself (the arrays, not only their statistics), on a functional
    model that is not compiled: gradscope's loss lives beside the object, never in it."""
    import keras

    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.explain import prepare

    model, x, y = two_inputs
    before = _state(model)
    job = prepare(model, x=x, y=y)
    assert job.plan.outputs[0].loss == "mean_squared_error"
    engine = KerasEngine(job.source, job.outputs, job.plan)
    assert engine.model is model
    result = engine.run(job.batch.inputs, job.batch.targets or {})
    _assert_unchanged(model, before)
    assert not model.compiled and model._compile_loss is None
    loss, truth = _tape(tf, model, x, y, keras.losses.MeanSquaredError())
    assert result.loss == pytest.approx(loss, rel=RTOL)
    assert set(result.gradients) == set(truth)
    for path, expected in truth.items():
        np.testing.assert_allclose(result.gradients[path], expected, rtol=RTOL, atol=1e-7)
    report = gradscope.explain(model, x=x, y=y)
    lambda_layer = next(layer for layer in report.layers if layer.name == "double")
    assert lambda_layer.gradient_note == "no derivation for this layer type"
    assert not lambda_layer.derivation


def test_check_passes_on_a_live_model_and_leaves_it_alone(compiled_gru, two_inputs):
    for model, x, y in (compiled_gru, two_inputs):
        before = _state(model)
        report = gradscope.check(model, x=x, y=y, directions=1)
        assert report.summary.passed, report.summary.failed_tensors
        assert "numpy_reference" in report.summary.witnesses
        _assert_unchanged(model, before)


def test_training_mode_restores_the_moving_statistics(tf):
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6, 2)), keras.layers.GRU(3, return_sequences=True),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.5),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    before = _state(model)
    x = np.random.default_rng(2).standard_normal((5, 6, 2)) * 3 + 1
    report = gradscope.explain(model, x=x, training=True)
    assert report.model.mode == "training"
    assert report.model.data == "supplied (x; synthetic targets)"
    _assert_unchanged(model, before)


def test_a_custom_class_never_passes_for_the_built_in_layer_of_its_name(tf):
    """The user's own class called GRU: run, with its real gradient, but not explained as
    Keras' GRU (its code may do anything)."""
    import keras

    class GRU(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], 3), name="kernel")

        def call(self, inputs: Any) -> Any:
            return keras.ops.tanh(keras.ops.matmul(inputs, self.kernel))[:, -1]

    inputs = keras.Input((4, 2))
    model = keras.Model(inputs, keras.layers.Dense(2)(GRU(name="mine")(inputs)))
    report = gradscope.explain(model, batch_size=3)
    mine = next(layer for layer in report.layers if layer.name == "mine")
    assert mine.class_name.endswith(".GRU") and not mine.derivation
    assert mine.gradient_note == ("your layer: no derivation for this layer type (gradscope "
                                  "does not read your code)")
    weight = next(g for g in report.gradients if g.layer == "mine")
    assert weight.meaning.endswith("the shape its build made")
    assert weight.stats is not None and weight.stats.l2 > 0 and weight.formula is None
    assert not report.initial_state_gradients and not report.witnesses


def test_bad_arrays_are_named_in_one_line(compiled_gru, two_inputs, tmp_path):
    model, x, y = compiled_gru
    cases = [
        (dict(x=x[:, :, :2], y=y), "x has 2 along axis 2 but the input"),
        (dict(x=x, y=y[:3]), r"disagree on the batch size \(x 6, y 3\)"),
        (dict(x=x, y=np.zeros((6, 5))), "the output 'dense' have shape \\(6, 5\\)"),
        (dict(x=x, y=np.full((6,), 9)), "hold the class 9; the output has 4 classes"),
        (dict(x=[x, x], y=y), "x is a list of 2 arrays; the model has 1 input "),
        (dict(x=np.array(["a"] * 6), y=y), "x has dtype <U1"),
        (dict(y=y), "y= was given without x="),
        (dict(x=x, y=y, bogus=1), "bogus=: not an option for a Keras model"),
        (dict(x=x, y=y, imports=["my_layers"]), "imports=: not an option for a Keras model; "
         "expected .*; a saved model's code is given where it is loaded: "
         r"gradscope.load_model\(path, imports=\[...\]\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises((DataError, ConfigError), match=message) as caught:
            gradscope.explain(model, **kwargs)
        assert "\n" not in str(caught.value) and caught.value.exit_code == 2
    # From a file, as every other problem of the file is said: its name first (found tried
    # as a new user would: the class alone, after the file's other errors named it).
    model.save(tmp_path / "model.keras")
    np.savez(tmp_path / "labels.npz", x=x, y=np.full((6,), 9))
    with pytest.raises(DataError) as caught:
        gradscope.explain(str(tmp_path / "model.keras"), data=str(tmp_path / "labels.npz"))
    assert str(caught.value).startswith(f"{tmp_path / 'labels.npz'}: the targets of the output "
                                        "'dense' hold the class 9")
    functional, inputs, targets = two_inputs
    with pytest.raises(DataError, match=r"x\['sequnce'\]: .*did you mean 'sequence'"):
        gradscope.explain(functional, x={"sequnce": inputs["sequence"], "extra": 1}, y=targets)
    with pytest.raises(DataError, match="x is one array; the model has 2 inputs"):
        gradscope.explain(functional, x=inputs["sequence"], y=targets)


def test_models_gradscope_cannot_read_yet_are_refused(tf):
    import keras

    class Subclassed(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, inputs: Any) -> Any:
            return self.dense(inputs)

    model = Subclassed()  # never called: its graph, its call, cannot be looked on yet
    with pytest.raises(ConfigError, match="a subclassed model that is not built") as caught:
        gradscope.explain(model)
    assert caught.value.exit_code == 2
    unbuilt = keras.Sequential([keras.layers.GRU(2)])
    with pytest.raises(ConfigError, match="is not built"):
        gradscope.explain(unbuilt)


def test_reports_draw_themselves_in_a_notebook(compiled_gru, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("COLUMNS", "80")
    model, x, y = compiled_gru
    report = gradscope.explain(model, x=x, y=y, flow=True)
    html = report._repr_html_()
    assert html.startswith("<pre") and "gru/recurrent_kernel" in html
    assert "∂L/∂gru/h_t" in html or "gru" in html
    assert json.loads(report.to_json()) == report.to_dict()
    # In a script, print(report) prints what the terminal shows, at its width (80 here).
    text = str(report)
    assert text.startswith("gradscope explain") and "gru/recurrent_kernel" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert repr(report).startswith("KerasExplainReport(")
    figure = report.plot()
    assert len(figure.axes) >= 2  # the weights' ‖g‖ and the flow's norm curves
    assert figure._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    checked = gradscope.check(model, x=x, y=y, directions=1)
    assert "PASSED" in checked._repr_html_()
    assert checked.plot()._repr_png_()[:4] == b"\x89PNG"
    from gradscope.yaml.explain import explain as explain_spec

    spec = gradscope.load_spec({"input_size": 3, "time_steps": 6, "batch_size": 2,
                                "layers": [{"gru": 4}, {"dense": 2}]})
    yaml_report = explain_spec(spec, flow=True, heatmap=True, jacobians=True)
    assert "gru_1/w_ru" in yaml_report._repr_html_()
    titles = [axes.get_title() for axes in yaml_report.plot().axes]
    assert "gradient norms over time" in titles and "Jacobian spectrum ∂h_T/∂h_0" in titles
    assert any("log10 ‖∂h_t/∂x_s‖" in title for title in titles)
    shapes = gradscope.shapes(gradscope.load_spec(None))
    assert "Weights" in shapes._repr_html_()
    with pytest.raises(gradscope.errors.GradscopeError, match="holds no numbers to plot"):
        shapes.plot()


def test_check_on_a_live_model_catches_a_moved_weight_of_its_copy(compiled_gru):
    """The mutant: one weight of the float64 copy moved after the tape. check must fail and
    name it, and the move must not reach the user's object (the copy is its own)."""
    from gradscope.keras.check import check
    from gradscope.keras.explain import prepare

    model, x, y = compiled_gru
    before = _state(model)
    moved = []

    def move(copy: Any) -> None:
        variable = copy.trainable_variables[1]
        assert variable.dtype == "float64" and copy is not model
        variable.assign(variable + 1e-3)
        moved.append(variable.path)

    report = check(prepare(model, x=x, y=y), directions=1, after_autodiff=move)
    assert not report.summary.passed
    assert moved[0] in {t.path for t in report.tensors if t.name in report.summary.failed_tensors}
    _assert_unchanged(model, before)


def test_shapes_of_a_model_object_are_its_variables_and_its_saved_file(compiled_gru, two_inputs,
                                                                      tmp_path):
    """``gradscope.shapes(model)`` reads the object's config as a file's: every weight it
    derives has the shape of the model's own variable, and saving the model first changes
    nothing but the name (and how the compiled loss is described). The Lambda, refused in a
    file, is listed in memory as a layer without a derivation."""
    reports = {}
    for model in (compiled_gru[0], two_inputs[0]):
        before = _state(model)
        report = reports[model.name] = gradscope.shapes(model)
        _assert_unchanged(model, before)
        assert report.file == f"model '{model.name}' (in memory)"
        variables = {f"{layer.name}/{v.name}": list(v.shape)
                     for layer in model.layers for v in layer.weights}
        assert {w.name: w.shape for w in report.weights} == variables
        assert report.weight_count == sum(int(np.prod(v.shape)) for v in model.weights)
    assert reports[two_inputs[0].name].underived == ["double"]
    model = compiled_gru[0]
    path = tmp_path / "gru.keras"
    model.save(path)
    saved = gradscope.shapes(str(path)).to_dict()
    live = reports[model.name].to_dict()
    assert saved.pop("file") == str(path)
    assert live.pop("file") == f"model '{model.name}' (in memory)"
    assert saved.pop("loss").replace("saved with the compiled model",
                                     "the model's compiled loss") == live.pop("loss")
    assert live == saved
    # The title names the model once, as explain's does (found tried as a new user would:
    # "m.keras (model 'x', loaded with your code) (Subclassed 'x')").
    from conftest import render_text

    kind = reports[model.name].kind
    titles = {render_text(report, 100).splitlines()[0].split("  ", 1)[1]
              for report in (reports[model.name], gradscope.explain(model),
                             gradscope.shapes(gradscope.load_model(path)))}
    assert titles == {f"in memory ({kind} '{model.name}')",
                      f"gru.keras ({kind} '{model.name}')"}


def test_a_backward_direction_s_initial_state_is_carried_from_its_first_step(tf: Any) -> None:
    """With truncated BPTT (stateful=True), h0 of a direction that runs from the last step
    back is the grad_y of the state that direction left after the previous batch's first step
    (Keras' stateful go_backwards carries that one), not of h_T (said so of every direction
    before)."""
    import keras

    inputs = keras.Input(batch_shape=(2, 5, 3))
    both = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True,
                                                        stateful=True), name="both")(inputs)
    last = keras.layers.GRU(3, go_backwards=True, stateful=True, name="last")(both)
    model = keras.Model(inputs, keras.layers.Dense(2)(last))
    model.compile(loss="mse")
    rng = np.random.default_rng(3)
    report = gradscope.explain(model, x=rng.random((2, 5, 3), dtype=np.float32),
                               y=np.zeros((2, 2), np.float32))
    back = "(the one after its first step: this direction runs from the last step back)"
    said = {s.name: s.flows_to for s in report.initial_state_gradients}
    assert said["both/forward/h0"].endswith("previous batch's final h_T")
    assert said["both/forward/c0"].endswith("previous batch's final c_T")
    assert said["both/backward/h0"].endswith(f"previous batch's final h {back}")
    assert said["both/backward/c0"].endswith(f"previous batch's final c {back}")
    assert said["last/h0"].endswith(f"final h {back}")


def test_a_zero_initial_state_is_said_a_constant_and_a_wired_one_its_source(tf: Any) -> None:
    """A seq2seq model: the encoder starts from zeros, which no previous batch feeds, and its
    final states start the decoder. The encoder's ∂L/∂h0 goes nowhere, with no word of
    truncated BPTT (found tried as a new user would: it was said to be the grad_y of the
    previous batch's final h_T, which never reaches an encoder that starts from zeros); the
    decoder's goes back into the encoder's returned states."""
    import keras

    keras.utils.set_random_seed(4)
    source, target = keras.Input((6, 3), name="source"), keras.Input((5, 4), name="target")
    _, h, c = keras.layers.LSTM(8, return_state=True, name="encoder")(source)
    decoded = keras.layers.LSTM(8, return_sequences=True, name="decoder")(
        target, initial_state=[h, c])
    model = keras.Model([source, target], keras.layers.Dense(4, name="head")(decoded))
    model.compile(loss="mse")
    rng = np.random.default_rng(4)
    report = gradscope.explain(model, x=[rng.standard_normal((3, 6, 3)).astype("float32"),
                                         rng.standard_normal((3, 5, 4)).astype("float32")],
                               y=rng.standard_normal((3, 5, 4)).astype("float32"))
    said = {s.name: s for s in report.initial_state_gradients}
    for name in ("encoder/h0", "encoder/c0"):
        assert said[name].source.startswith("zeros")
        assert said[name].flows_to == ("nowhere: the zeros are a constant; a learned "
                                       "initial state, shared by the examples, would "
                                       "receive its sum over the batch")
        assert said[name].stats is not None and said[name].stats.l2 > 0
    for name, output in (("decoder/h0", 1), ("decoder/c0", 2)):
        assert said[name].source == f"wired from encoder's returned state (its output {output})"
        assert said[name].flows_to.startswith(
            f"back into encoder's returned state (its output {output})")


def test_a_stateful_bidirectional_layer_s_carried_states_have_their_gradients(tf: Any) -> None:
    """A stateful Bidirectional GRU starts the batch from what the previous one left, in each
    direction: ∂L/∂h0 of both, as Keras' tape gives them with those states as the initial
    ones (they were left out, with no word, while the loss used them), and the carried state
    is as it was after explain."""
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    series = rng.standard_normal((4, 13, 3)).astype("float32")
    inputs = keras.Input(batch_shape=(4, 6, 3))
    both = keras.layers.Bidirectional(
        keras.layers.GRU(5, stateful=True, return_sequences=True), name="both")(inputs)
    model = keras.Model(inputs, keras.layers.TimeDistributed(keras.layers.Dense(1))(both))
    model.compile(loss="mse")
    model.predict(series[:, :6], batch_size=4, verbose=0)  # the previous window
    x, y = series[:, 6:12], series[:, 7:13, :1]
    layer = model.get_layer("both")
    held = [np.array(v.numpy()) for v in layer.states]
    assert all(np.abs(h).max() > 0 for h in held)
    report = gradscope.explain(model, x=x, y=y)
    for before, variable in zip(held, layer.states, strict=True):
        np.testing.assert_array_equal(before, variable.numpy())
    starts = [tf.Variable(h) for h in held]
    with tf.GradientTape() as tape:
        sequence = layer(x, initial_state=starts)
        loss = model.compute_loss(x=x, y=y, y_pred=model.layers[-1](sequence))
    truth = tape.gradient(loss, starts)
    said = {s.name: s for s in report.initial_state_gradients}
    assert report.loss.value == pytest.approx(float(loss), rel=1e-5)
    for name, grad in zip(["both/forward/h0", "both/backward/h0"], truth, strict=True):
        assert said[name].source.startswith("carried")
        assert said[name].stats.l2 == pytest.approx(float(tf.norm(grad)), rel=1e-5), name
