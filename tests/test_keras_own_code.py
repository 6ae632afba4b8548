"""The user's own code, exactly: the loss is what ``fit`` minimises (``compute_loss``), never a
term gradscope made up, and every random draw of a training-mode run is the documented seed's,
whatever code was imported first.

- A model compiled with no loss (``compile(optimizer=…)``) trains on its ``add_loss`` terms
  alone: explain's loss and gradients equal Keras' own tape of ``compute_loss``, with or
  without targets, from Python and from the CLI; given targets are said to be unused.
- An output compiled with ``None`` needs no target.
- A model compiled with no loss that adds none is refused (exit 2), as ``fit`` refuses it.
- ``--training`` gives the same numbers with and without ``--import``, run after run, and the
  user's own model object keeps its dropout seeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_keras_numbers, keras_tape_norms, run_cli, run_gradscope

import gradscope
from gradscope.errors import ConfigError

RTOL = 1e-5

#: A registered layer whose loss is its own add_loss (the OCR example's CTCLayer pattern).
MODULE = textwrap.dedent('''
    import keras


    @keras.saving.register_keras_serializable("own_code")
    class Sampling(keras.layers.Layer):
        # keras.io's VAE draw: its noise in float32 whatever the means' dtype.
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            mean, log_var = inputs
            noise = keras.random.normal(shape=keras.ops.shape(mean), seed=self.seed_generator)
            return mean + keras.ops.exp(0.5 * log_var) * noise


    @keras.saving.register_keras_serializable("own_code")
    class Penalty(keras.layers.Layer):
        """Adds the mean squared distance of its two inputs, and passes the first on."""

        def call(self, prediction, target):
            self.add_loss(keras.ops.mean(keras.ops.square(prediction - target)))
            return prediction
''')

#: A subclassed model as a user registers and saves it (the --import path).
TUTORIAL = textwrap.dedent('''
    import keras
    from keras import layers


    @keras.saving.register_keras_serializable("own_code")
    class Tutorial(keras.Model):
        def __init__(self, units=5, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.encoder = layers.GRU(units, return_sequences=True, return_state=True,
                                      dropout=0.2)
            self.decoder = layers.LSTM(units)
            self.head = layers.Dense(2)

        def call(self, x, training=False):
            sequence, state = self.encoder(x, training=training)
            return self.head(self.decoder(sequence, initial_state=[state, state],
                                          training=training))

        def get_config(self):
            return {**super().get_config(), "units": self.units}
''')

BUILD = textwrap.dedent('''
    import sys
    import numpy as np
    import keras
    import tracked_layers

    keras.utils.set_random_seed(0)
    x = keras.Input((6, 3), name="x")
    target = keras.Input((2,), name="target")
    h = keras.layers.GRU(5, dropout=0.3, recurrent_dropout=0.2, name="gru")(x)
    h = keras.layers.Dropout(0.4, name="drop")(h)
    out = tracked_layers.Penalty(name="penalty")(keras.layers.Dense(2, name="head")(h), target)
    model = keras.Model([x, target], out)
    model.compile(optimizer="adam")
    model.save(sys.argv[1])
    import tutorial
    keras.utils.set_random_seed(1)
    subclassed = tutorial.Tutorial()
    subclassed(np.zeros((2, 6, 3), "float32"))
    subclassed.compile(loss="mse")
    subclassed.save("tutorial.keras")
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((5, 6, 3)).astype("float32"),
              "target": rng.standard_normal((5, 2)).astype("float32")}
    np.savez(sys.argv[2], **arrays)
    np.savez(sys.argv[3], **arrays, y=np.zeros((5, 2), "float32"))
    keras.utils.set_random_seed(2)
    h = keras.layers.GRU(5, name="gru")(x)
    drawn = tracked_layers.Sampling(name="sampling")([keras.layers.Dense(2, name="mean")(h),
                                                     keras.layers.Dense(2, name="log_var")(h)])
    vae = keras.Model(x, keras.layers.Dense(2, name="head")(drawn))
    vae.compile(loss="mse")
    vae.save("vae.keras")
    np.savez("vae.npz", x=arrays["x"], y=rng.standard_normal((5, 2)).astype("float32"))
''')


def _tape_norms(model: Any, x: Any, y: Any) -> tuple[float, dict[str, float]]:
    """Keras' own loss and gradient norms, as conftest's ``keras_tape_norms``, for a model
    some of whose weights get no gradient (behind a stop_gradient): those are left out."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=False), training=False)
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), {v.path: float(np.linalg.norm(g))
                         for v, g in zip(model.trainable_variables, grads, strict=True)
                         if g is not None}


def _sequences(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of 4 sequences of 6 steps of 3 features, and targets for 2 outputs."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, 6, 3)).astype("float32"),
            rng.standard_normal((4, 2)).astype("float32"))


def _explained_exactly(model: Any, x: Any, y: Any) -> Any:
    """explain's report of the model, once its loss and gradients are held to Keras' tape."""
    loss, truth = keras_tape_norms(model, x, y)
    report = gradscope.explain(model, x=x, y=y)
    assert_keras_numbers(report, loss, truth)
    return report


def _penalised(keras: Any) -> Any:
    """The model of BUILD, in memory, with the layer defined here."""

    class Penalty(keras.layers.Layer):
        def call(self, prediction: Any, target: Any) -> Any:
            self.add_loss(keras.ops.mean(keras.ops.square(prediction - target)))
            return prediction

    keras.utils.set_random_seed(7)
    x = keras.Input((6, 3), name="x")
    target = keras.Input((2,), name="target")
    h = keras.layers.LSTM(4, name="lstm")(x)
    out = Penalty(name="penalty")(keras.layers.Dense(2, name="head")(h), target)
    return keras.Model([x, target], out)


@pytest.fixture(scope="module")
def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal((5, 6, 3)).astype("float32"),
            "target": rng.standard_normal((5, 2)).astype("float32")}


def test_add_loss_alone_is_the_loss_with_or_without_targets(tf: Any, batch: Any) -> None:
    import keras

    model = _penalised(keras)
    model.compile(optimizer="adam")
    loss, truth = keras_tape_norms(model, batch, None)
    unread = np.full((5, 2), 100.0, "float32")  # read by nothing: it would dominate any MSE
    without = gradscope.explain(model, x=batch)
    given = gradscope.explain(model, x=batch, y=unread)
    for report in (without, given):
        assert_keras_numbers(report, loss, truth)
        assert report.loss.source == "compiled" and report.loss.outputs == []
        assert [term.kind for term in report.loss.terms] == ["added"]
        assert "targets are not read" in report.loss.name
    assert not any("not used" in w for w in without.warnings)
    assert any("targets given for penalty are not used" in w for w in given.warnings)
    checked = gradscope.check(model, x=batch, y=unread)
    assert checked.summary.passed and checked.loss.value == pytest.approx(loss, rel=RTOL)


def test_an_output_compiled_with_none_needs_no_target(tf: Any, tmp_path: Path) -> None:
    import keras

    keras.utils.set_random_seed(8)
    x = keras.Input((6, 3), name="x")
    h = keras.layers.GRU(4, name="gru")(x)
    model = keras.Model(x, [keras.layers.Dense(2, name="scored")(h),
                            keras.layers.Dense(3, name="unscored")(h)])
    model.compile(optimizer="adam", loss=["mse", None])
    path = tmp_path / "two_heads.keras"
    model.save(path)
    rng = np.random.default_rng(4)
    inputs = rng.standard_normal((4, 6, 3)).astype("float32")
    scored = rng.standard_normal((4, 2)).astype("float32")
    np.savez(tmp_path / "scored.npz", x=inputs, scored=scored)
    with tf.GradientTape() as tape:
        total = model.compute_loss(x=inputs, y=[scored, None], y_pred=model(inputs))
    grads = tape.gradient(total, model.trainable_variables)
    loss = float(total)
    truth = {v.path: float(np.linalg.norm(g))
             for v, g in zip(model.trainable_variables, grads, strict=True) if g is not None}
    assert len(truth) == len(model.trainable_variables) - 2  # the unscored head's
    done = run_gradscope("explain", str(path), "--data", str(tmp_path / "scored.npz"), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["loss"]["value"] == pytest.approx(loss, rel=RTOL)
    assert [o["output"] for o in report["loss"]["outputs"]] == ["scored"]
    ours = {g["path"]: g["stats"]["l2"] for g in report["gradients"] if g["stats"]}
    assert ours == pytest.approx(truth, rel=RTOL)


def test_compiled_with_no_loss_and_nothing_added_is_refused(tf: Any) -> None:
    import keras

    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(3), keras.layers.Dense(1)])
    model.compile(optimizer="adam")
    with pytest.raises(ConfigError, match="compiled with no loss and adds none"):
        gradscope.explain(model, x=np.ones((2, 6, 3), "float32"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> Path:
    """BUILD run by the user's own script, in its own process."""
    folder = tmp_path_factory.mktemp("own_code")
    (folder / "tracked_layers.py").write_text(MODULE)
    (folder / "tutorial.py").write_text(TUTORIAL)
    (folder / "build.py").write_text(BUILD)
    done = subprocess.run([sys.executable, "build.py", "model.keras", "data.npz", "y.npz"],
                          cwd=folder, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-2000:]
    return folder


def _cli(folder: Path, *args: str, process: bool = False) -> dict[str, Any]:
    """The CLI's JSON in ``folder``: in this process, or with ``process`` in a new one (where
    Keras names a subclassed model's unnamed layers afresh)."""
    done = (subprocess.run([sys.executable, "-m", "gradscope", *args, "--json"], cwd=folder,
                           capture_output=True, text=True, timeout=600) if process
            else run_cli(*args, "--json", cwd=folder))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_cli_add_loss_model_and_training_mode_seeded_with_import(saved: Path) -> None:
    """The add_loss model from a file with --import: the targets in y.npz are unused, and in
    training mode every run, imported or not, draws the same dropout."""
    inference = _cli(saved, "explain", "model.keras", "--import", "tracked_layers", "--data",
                     "data.npz")
    unused = _cli(saved, "explain", "model.keras", "--import", "tracked_layers", "--data", "y.npz")
    assert inference["loss"]["value"] == unused["loss"]["value"]
    assert any("not used" in w for w in unused["warnings"])
    trained = _cli(saved, "explain", "model.keras", "--import", "tracked_layers", "--data",
                   "data.npz", "--training")
    assert trained["loss"]["value"] != inference["loss"]["value"]
    # The same draws in this process, from the model loaded with the user's code: every
    # path, and every run, is the seed's.
    again = _in_process(saved, "tracked_layers", "model.keras", "data.npz")
    assert again.loss.value == pytest.approx(trained["loss"]["value"], rel=1e-12)
    assert [g.stats.l2 for g in again.gradients if g.stats] == pytest.approx(
        [g["stats"]["l2"] for g in trained["gradients"] if g["stats"]], rel=1e-12)


def test_cli_a_copy_whose_shape_inference_fails_is_checked_in_the_models_dtype(
        saved: Path) -> None:
    """Found tried as a new user would: keras.io's VAE draw (its noise in float32 beside the
    float64 copy's means) failed Keras' shape inference of the copy, an internal error
    (exit 1), before the copy's call that falls back to the model's dtype and says why. Now
    it falls back there too: checked in float32, the layer and its error named."""
    report = _cli(saved, "check", "vae.keras", "--import", "tracked_layers", "--data",
                  "vae.npz")
    assert report["summary"]["passed"] and report["dtype"] == "float32"
    assert ("Keras' shape inference of its float64 copy fails (Keras cannot infer the output "
            "of 'sampling' (Sampling)") in report["dtype_reason"], report["dtype_reason"]


def _in_process(folder: Path, module: str, model: str, data: str | None = None) -> Any:
    """``explain --training`` of a saved model through the API, with the user's module."""
    sys.path.insert(0, str(folder))
    try:
        loaded = gradscope.load_model(folder / model, imports=[module])
        return gradscope.explain(loaded, data=None if data is None else str(folder / data),
                                 training=True)
    finally:
        sys.path.remove(str(folder))


def test_training_mode_on_a_model_object_is_seeded_and_leaves_its_seeds(tf: Any) -> None:
    """The user's own object, whose dropout seeds have moved (it was called in training mode
    before): every run draws the seed's dropout, and the object's seed states are its own
    afterwards."""
    import keras

    keras.utils.set_random_seed(10)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(4, dropout=0.3),
                              keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    model.compile(loss="mse")
    x = np.random.default_rng(5).standard_normal((4, 6, 3)).astype("float32")
    y = np.zeros((4, 2), "float32")
    first = gradscope.explain(model, x=x, y=y, training=True)
    model(x, training=True)  # the user trains on: the seed states move
    states = [np.array(v.numpy()) for v in model.non_trainable_variables]
    again = gradscope.explain(model, x=x, y=y, training=True)
    assert first.loss.value == again.loss.value
    assert [g.stats for g in first.gradients] == [g.stats for g in again.gradients]
    after = [np.array(v.numpy()) for v in model.non_trainable_variables]
    assert all(np.array_equal(a, b) for a, b in zip(states, after, strict=True))


# -- check in the model's own dtype, where the user's code does not run in float64 -----------


def _own_layers(keras: Any, wrong_by: float = 1.0) -> dict[str, Any]:
    """Layers written as users write them: a sub-layer made in ``__init__`` with
    ``dtype="float32"`` (as mixed-precision guides advise for an output), a loss computed by
    ``ops.ctc_loss`` (float32 inside), a regulariser Keras cannot rebuild from its config, and
    a gradient of the user's own (``wrong_by`` ≠ 1 plants a wrong one)."""
    import tensorflow as tf
    from keras import layers, ops

    class Block(layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.project = layers.Dense(units, dtype="float32")  # not in the config
            self.pool = layers.GlobalAveragePooling1D()

        def call(self, x: Any) -> Any:
            @tf.custom_gradient
            def scaled(v: Any) -> Any:
                return 2.0 * v, lambda dy: 2.0 * wrong_by * dy

            return self.pool(scaled(self.project(x)))

    class CTC(layers.Layer):
        def call(self, labels: Any, probabilities: Any) -> Any:
            batch, steps = ops.shape(probabilities)[0], ops.shape(probabilities)[1]
            loss = ops.ctc_loss(labels, probabilities, ops.full((batch,), 2, "int32"),
                                ops.full((batch,), steps, "int32"))
            self.add_loss(ops.mean(loss))
            return probabilities

    @tf.custom_gradient
    def tapped(v: Any) -> Any:
        return v, lambda dy: wrong_by * dy

    class Tap(layers.Layer):
        """Passes its input on; its gradient is ``wrong_by`` times the truth."""

        def call(self, x: Any) -> Any:
            return tapped(x)

    def orthogonal(w: Any) -> Any:
        return 0.01 * ops.sum(ops.square(ops.matmul(ops.transpose(w), w)
                                         - wrong_by * ops.eye(w.shape[1])))

    return {"Block": Block, "CTC": CTC, "Tap": Tap, "orthogonal": orthogonal}


def _not_float64(kind: str, wrong_by: float = 1.0) -> tuple[Any, dict[str, Any], Any]:
    import keras
    from keras import layers

    own = _own_layers(keras, wrong_by)
    keras.utils.set_random_seed(11)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 6, 3)).astype("float32")
    inputs = keras.Input((6, 3), name="x")
    if kind == "sub_layers":
        h = layers.GRU(5, return_sequences=True, name="gru")(inputs)
        model = keras.Model(inputs, layers.Dense(2, name="head")(own["Block"](4, name="block")(h)))
        model.compile(loss="mse")
        return model, {"x": x}, rng.standard_normal((4, 2)).astype("float32")
    if kind == "ctc":
        labels = keras.Input((2,), dtype="int32", name="labels")
        h = layers.GRU(5, return_sequences=True, name="gru")(inputs)
        probabilities = layers.Dense(4, activation="softmax", name="head")(
            own["Tap"](name="tap")(h))
        model = keras.Model([inputs, labels], own["CTC"](name="ctc")(labels, probabilities))
        model.compile(optimizer="adam")
        return model, {"x": x, "labels": rng.integers(1, 4, (4, 2)).astype("int32")}, None
    assert kind == "regulariser"
    h = layers.GRU(5, recurrent_regularizer=own["orthogonal"], name="gru")(inputs)
    model = keras.Model(inputs, layers.Dense(2, name="head")(h))
    model.compile(loss="mse")
    return model, {"x": x}, rng.standard_normal((4, 2)).astype("float32")


def test_sub_layers_made_without_a_dtype_are_checked_in_float64(tf: Any) -> None:
    """A sub-layer made in ``__init__`` without a dtype (no config reaches it) is made in
    float64 in the copy too: check builds the copy under a float64 default policy."""
    import keras
    from keras import layers

    class Block(layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.project = layers.Dense(units)
            self.pool = layers.GlobalAveragePooling1D()

        def call(self, x: Any) -> Any:
            return self.pool(self.project(x))

    keras.utils.set_random_seed(24)
    inputs = keras.Input((6, 3), name="x")
    h = layers.GRU(5, return_sequences=True, name="gru")(inputs)
    model = keras.Model(inputs, layers.Dense(2, name="head")(Block(4, name="block")(h)))
    model.compile(loss="mse")
    rng = np.random.default_rng(25)
    x = rng.standard_normal((4, 6, 3)).astype("float32")
    report = gradscope.check(model, x=x, y=rng.standard_normal((4, 2)).astype("float32"))
    assert report.summary.passed and report.dtype == "float64" and report.dtype_reason is None


@pytest.mark.parametrize(("kind", "why"), [
    ("sub_layers", "block/dense"), ("ctc", "does not resolve float64 steps"),
    ("regulariser", "cannot rebuild it in float64")])
def test_check_runs_in_the_models_dtype_where_its_code_is_not_float64(tf: Any, kind: str,
                                                                      why: str) -> None:
    """Each correct model passes, checked in float32 with the reason and the cost said; its
    loss and gradients are those of Keras' own tape (explain), and gradscope.testing agrees
    (assert_gradients is gradscope.check with the same seed, raising where it fails: its
    report is check's, read here, not a second check of the same model)."""
    from gradscope.testing import assert_gradients

    model, x, y = _not_float64(kind)
    loss = _explained_exactly(model, x, y).loss.value
    report = assert_gradients(model, x, y)  # raises with check's diagnosis where one fails
    assert report.summary.passed
    assert report.dtype == "float32" and why in (report.dtype_reason or "")
    assert "2e-03" in (report.dtype_reason or "")
    assert report.tolerances["finite_differences"] == 2e-3
    assert report.loss.value == pytest.approx(loss, rel=RTOL)
    if kind == "sub_layers":  # the layer alone, as gradscope.testing.check_layer checks it
        from gradscope.testing import check_layer

        alone = check_layer(model.get_layer("block"), np.ones((3, 6, 5), "float32"))
        assert alone.summary.passed and alone.dtype == "float32"


def test_integers_no_embedding_reads_are_not_drawn_for_check(tf: Any) -> None:
    """Found tried as a new user would: a correct CTC model's labels, drawn 0–9 for a
    synthetic batch (no Embedding says their range), gave a negative loss, said nowhere, and
    check failed its correct gradients. explain says what it drew; check refuses (it passes on
    the user's own labels: test_check_runs_in_the_models_dtype_where_its_code_is_not_float64)."""
    from gradscope.errors import DataError

    model, x, _ = _not_float64("ctc")
    drawn = gradscope.explain(model, batch_size=4)
    assert "labels drawn 0–9: no Embedding gives its range" in drawn.model.data
    with pytest.raises(DataError, match=r"input 'labels' holds integers that no Embedding "
                                        r"reads: a synthetic batch draws them 0–9"):
        gradscope.check(model, batch_size=4)
    # Its whole loss an add_loss term: no example has a share of it (found tried as a new
    # user would: refused with "'str' object has no attribute '_type_enum'").
    with pytest.raises(ConfigError, match=r"per_example=True: the model's loss is its added "
                                          r"terms alone \(add_loss, regularizers\), which "
                                          r"belong to no example"):
        gradscope.explain(model, x=x, per_example=True)


def test_check_in_float32_still_catches_a_wrong_gradient(tf: Any) -> None:
    """A planted wrong gradient in a layer of the user's own (its custom_gradient 1.5 times too
    large) fails check in float32, naming the weight below it, and the test helper raises."""
    from gradscope.testing import assert_gradients

    model, x, y = _not_float64("sub_layers", wrong_by=1.5)
    report = gradscope.check(model, x=x, y=y)
    assert report.dtype == "float32" and not report.summary.passed
    assert any(name.startswith("block/dense") for name in report.summary.failed_tensors), \
        report.summary.failed_tensors
    assert not any(name.startswith("head/") for name in report.summary.failed_tensors)
    with pytest.raises(AssertionError):
        assert_gradients(model, x, y)


def test_check_in_float32_measures_the_losss_rounding_and_catches_a_wrong_gradient(
        tf: Any) -> None:
    """A CTC loss (about 14 here, float32 inside): a fixed bound on its rounding would allow
    errors of several times a gradient. check measures the rounding on the model, says it,
    and a gradient 1.5 times too large below the head fails, named as explain names it, the
    model's own path beside."""
    model, x, y = _not_float64("ctc", wrong_by=1.5)
    report = gradscope.check(model, x=x, y=y)
    assert report.dtype == "float32" and "measured on the model" in (report.dtype_reason or "")
    assert not report.summary.passed
    paths = {v.path for v in model.trainable_variables}
    path_of = {t.name: t.path for t in report.tensors}
    weights = [name for name in report.summary.failed_tensors if path_of[name]]
    assert weights and {path_of[name] for name in weights} <= paths, (weights, sorted(paths))
    assert any(name.startswith("gru/") for name in weights)


def test_a_state_gradient_that_underflows_in_float32_passes_and_a_lost_one_fails(
        tf: Any) -> None:
    """Found tried as a new user would: a subclassed model (checked in float32: Keras cannot
    copy it) whose LSTM's forget gate is shut (bias −4) over 40 steps: the tape's ∂L/∂h0 is
    exactly 0 (its backward pass underflows), the float64 NumPy reference's about 1e-39, and
    the correct gradients failed with a relative error of 5.6e+261. Below float32's smallest
    normal number over its epsilon the error is taken against that scale; a gradient lost
    above it still fails."""
    import keras

    from gradscope.gradcheck import underflow_scale
    from gradscope.keras.check.numpy_reference import _compare

    class Shut(keras.Model):
        def __init__(self, sizes: Any) -> None:  # a dict: Keras cannot copy it
            super().__init__()
            self.lstm = keras.layers.LSTM(sizes["units"], unit_forget_bias=False, name="lstm")
            self.head = keras.layers.Dense(1, name="head")

        def call(self, x: Any) -> Any:
            return self.head(self.lstm(x))

    keras.utils.set_random_seed(0)
    model = Shut({"units": 4})
    model.compile(loss="mse")
    x = np.random.default_rng(0).standard_normal((4, 40, 3)).astype("float32")
    model(x[:1])
    kernel, recurrent, bias = model.lstm.get_weights()
    bias[4:8] = -4.0  # Keras' columns [i | f | c | o]
    model.lstm.set_weights([kernel, recurrent, bias])
    report = gradscope.check(model, x=x, y=np.ones((4, 1), "float32"))
    assert report.dtype == "float32"
    assert report.summary.passed, report.summary.failed_tensors
    found = {t.name: {w.witness: w for w in t.witnesses} for t in report.tensors}
    for state in ("lstm/h0", "lstm/c0"):
        reference = found[state]["numpy_reference"]
        assert reference.passed and "flushes what underflows to 0" in reference.detail
    # The scale holds a gradient the tape lost where float32 holds it: not hidden.
    floor = underflow_scale("float32")
    assert floor == pytest.approx(np.finfo(np.float32).tiny / np.finfo(np.float32).eps)
    lost = _compare("h0", np.full(3, 1e-30), np.zeros(3, np.float32), 1e-4, dtype="float32")
    assert not lost.passed and lost.error == pytest.approx(1e-30 / floor)
    assert _compare("h0", np.full(3, 5e-39), np.zeros(3), 1e-4, dtype="float32").passed
    assert not _compare("h0", np.full(3, 5e-39), np.zeros(3), 1e-4, dtype="float64").passed


def test_a_wrong_gradient_on_the_float64_copy_is_not_taken_for_low_precision(tf: Any) -> None:
    """A model that does run in float64 and has a wrong gradient fails in float64: the
    precision probe compares two finite differences, no gradient, so it cannot be fooled."""
    import keras
    import tensorflow as tf_

    @tf_.custom_gradient
    def doubled(v: Any) -> Any:
        return 2.0 * v, lambda dy: 3.0 * dy

    class Wrong(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            return doubled(x)

    keras.utils.set_random_seed(13)
    inputs = keras.Input((6, 3), name="x")
    h = keras.layers.GRU(4, name="gru")(Wrong(name="wrong")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    model.compile(loss="mse")
    x = np.random.default_rng(14).standard_normal((4, 6, 3)).astype("float32")
    report = gradscope.check(model, x=x, y=np.zeros((4, 2), "float32"))
    assert report.dtype == "float64" and report.dtype_reason is None
    assert not report.summary.passed
    assert {"input x", "layer wrong"} <= set(report.summary.failed_tensors)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float64"])
def test_any_dtype_policy_is_explained_exactly_and_checked(tf: Any, policy: str) -> None:
    """Under a mixed policy the recurrent cells compute in float16 or bfloat16: explain's
    NumPy cross-check takes its tolerance from that dtype (it once raised an internal error),
    and its numbers are Keras' own tape's; a float64 model's witnesses use float64's."""
    import keras

    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(15)
        inputs = keras.Input((6, 3), name="x")
        h = keras.layers.LSTM(6, return_sequences=True, name="lstm")(inputs)
        h = keras.layers.GRU(5, name="gru")(h)
        model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32", name="head")(h))
        model.compile(loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    x = np.random.default_rng(16).standard_normal((4, 6, 3)).astype("float32")
    y = np.random.default_rng(17).standard_normal((4, 2)).astype("float32")
    report = _explained_exactly(model, x, y)
    witnessed = {w.layer: w for w in report.witnesses}
    assert witnessed["lstm"].passed and witnessed["gru"].passed
    expected = {"mixed_float16": 1e-2, "mixed_bfloat16": 6e-2, "float64": 1e-9}[policy]
    assert witnessed["lstm"].tolerance == expected
    checked = gradscope.check(model, x=x, y=y)
    assert checked.summary.passed and checked.dtype == "float64"


# -- stop_gradient: check verifies the model as written -------------------------------------


def _stopped(wrong_by: float = 1.0, in_cell: bool = False) -> tuple[Any, np.ndarray, Any]:
    """A GRU whose sequence feeds a residual branch the gradient is stopped at (the pattern of
    target networks and straight-through tricks), and a Dense head whose own gradient is
    ``wrong_by`` times the truth. ``in_cell``: the stop inside a custom cell's step."""
    import keras
    import tensorflow as tf
    from keras import layers, ops

    class Residual(layers.Layer):
        def call(self, a: Any, b: Any) -> Any:
            return a + ops.stop_gradient(b)

    @tf.custom_gradient
    def scaled(v: Any) -> Any:
        return v, lambda dy: wrong_by * dy

    class Head(layers.Layer):
        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], 2), name="kernel")

        def call(self, x: Any) -> Any:
            return scaled(ops.matmul(x, self.kernel))

    class StoppedCell(layers.Layer):
        state_size = 4

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], 4), name="kernel")

        def call(self, x: Any, states: Any) -> Any:
            h = ops.tanh(ops.matmul(x, self.kernel) + ops.stop_gradient(states[0]))
            return h, [h]

    keras.utils.set_random_seed(18)
    inputs = keras.Input((6, 3), name="x")
    if in_cell:
        h = layers.RNN(StoppedCell(), name="rnn")(inputs)
    else:
        sequence = layers.GRU(5, return_sequences=True, name="gru")(inputs)
        h = layers.GlobalAveragePooling1D(name="pool")(
            Residual(name="residual")(sequence, layers.Dense(5, name="branch")(sequence)))
    model = keras.Model(inputs, Head(name="head")(h))
    model.compile(loss="mse")
    rng = np.random.default_rng(19)
    return (model, rng.standard_normal((4, 6, 3)).astype("float32"),
            rng.standard_normal((4, 2)).astype("float32"))


def test_a_stopped_gradient_is_held_and_named_and_mutants_are_still_caught(tf: Any) -> None:
    model, x, y = _stopped()
    loss, truth = _tape_norms(model, x, y)
    assert_keras_numbers(gradscope.explain(model, x=x, y=y), loss, truth)
    report = gradscope.check(model, x=x, y=y)
    failing = [(t.name, w.detail) for t in report.tensors for w in t.witnesses if not w.passed]
    assert report.summary.passed, failing
    assert len(report.held_fixed) == 1 and "layer 'residual'" in report.held_fixed[0]
    wrong, x, y = _stopped(wrong_by=1.3)
    caught = gradscope.check(wrong, x=x, y=y)
    assert not caught.summary.passed and caught.held_fixed
    assert {"gru/kernel", "head/kernel"} & set(caught.summary.failed_tensors)


def test_a_stop_inside_a_cells_step_is_refused_by_check_and_explained(tf: Any) -> None:
    model, x, y = _stopped(in_cell=True)
    loss, truth = _tape_norms(model, x, y)
    assert_keras_numbers(gradscope.explain(model, x=x, y=y), loss, truth)
    with pytest.raises(ConfigError, match="stop_gradient in layer 'stopped_cell.*recurrent"):
        gradscope.check(model, x=x, y=y)


# -- wrappers of the user's code ------------------------------------------------------------


def _wrapped(keras: Any, wrong_by: float) -> Any:
    """Bidirectional(RNN(a cell of the user's own)) and TimeDistributed(a layer of the user's
    own); ``wrong_by`` ≠ 1 plants a wrong gradient into h_{t−1} in the cell."""
    import tensorflow as tf
    from keras import layers, ops

    @tf.custom_gradient
    def carried(h: Any) -> Any:
        return h, lambda dy: wrong_by * dy

    @keras.saving.register_keras_serializable(f"own_code_{wrong_by:g}")
    class TinyCell(layers.Layer):
        state_size = 4

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], 4), name="kernel")
            self.recurrent = self.add_weight(shape=(4, 4), name="recurrent")

        def call(self, x: Any, states: Any) -> Any:
            h = ops.tanh(ops.matmul(x, self.kernel)
                         + ops.matmul(carried(states[0]), self.recurrent))
            return h, [h]

    class Scale(layers.Layer):
        def build(self, shape: Any) -> None:
            self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

        def call(self, x: Any) -> Any:
            return x * self.scale

        def compute_output_shape(self, shape: Any) -> Any:
            return shape

    keras.utils.set_random_seed(20)
    inputs = keras.Input((6, 3), name="x")
    h = layers.TimeDistributed(Scale(name="scale"), name="per_step")(inputs)
    h = layers.Bidirectional(layers.RNN(TinyCell(), name="tiny"), name="both")(h)
    model = keras.Model(inputs, layers.Dense(2, name="head")(h))
    model.compile(loss="mse")
    return model


def test_wrappers_of_your_code_are_listed_as_yours_and_checked(tf: Any) -> None:
    import keras

    model = _wrapped(keras, 1.0)
    x, y = _sequences(21)
    report = _explained_exactly(model, x, y)
    notes = {layer.name: layer for layer in report.layers}
    assert not notes["both"].derivation and notes["both"].gradient_note.startswith("your layer")
    assert not notes["per_step"].derivation
    assert notes["per_step"].gradient_note.startswith("your layer")
    assert gradscope.check(model, x=x, y=y).summary.passed
    wrong = _wrapped(keras, 1.5)
    caught = gradscope.check(wrong, x=x, y=y)
    assert not caught.summary.passed
    # Each direction's cell apart, by the model's own paths (in the float64 copy both
    # directions' cells were built under one path).
    paths = {v.path for v in wrong.trainable_variables}
    path_of = {t.name: t.path for t in caught.tensors}
    failed = [path_of[name] for name in caught.summary.failed_tensors
              if path_of[name] in paths]
    assert any("forward" in name and name.endswith("recurrent") for name in failed), failed
    assert any("backward" in name and name.endswith("recurrent") for name in failed), failed


def test_a_registered_loss_is_named_by_its_registered_name(tf: Any) -> None:
    import keras
    from keras import ops

    @keras.saving.register_keras_serializable("own_code_losses")
    def doubled_mse(y_true: Any, y_pred: Any) -> Any:
        return 2.0 * ops.mean(ops.square(y_true - y_pred), axis=-1)

    keras.utils.set_random_seed(22)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(3), keras.layers.Dense(2)])
    model.compile(loss=doubled_mse)
    x, y = _sequences(23)
    report = _explained_exactly(model, x, y)
    assert report.loss.name.startswith("own_code_losses>doubled_mse")


# -- subclassed models ----------------------------------------------------------------------


def _subclassed(keras: Any, wrong_by: float = 1.0, own_loss: bool = False) -> Any:
    """The style of TensorFlow's tutorials: layers made in ``__init__``, a ``call`` that
    computes between them (a scaling, a sum of two layers' outputs), an encoder state wired
    into the next layer. ``wrong_by`` ≠ 1 plants a wrong gradient below the head;
    ``own_loss``: the class writes its own ``compute_loss`` (an L2 term on the head)."""
    import tensorflow as tf
    from keras import layers, ops

    @tf.custom_gradient
    def passed(v: Any) -> Any:
        return v, lambda dy: wrong_by * dy

    class Tutorial(keras.Model):
        def __init__(self, units: int = 5, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.encoder = layers.GRU(units, return_sequences=True, return_state=True,
                                      name="encoder")
            self.decoder = layers.LSTM(units, name="decoder")
            self.head = layers.Dense(2, name="head")

        def call(self, x: Any) -> Any:
            sequence, state = self.encoder(x / 2.0)
            h = self.decoder(sequence, initial_state=[state, state])
            return self.head(passed(h + state))

        if own_loss:
            def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                             sample_weight: Any = None, training: bool = True) -> Any:
                loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
                return loss + 0.1 * ops.sum(ops.square(self.head.kernel))

    keras.utils.set_random_seed(26)
    model = Tutorial()
    model(np.zeros((1, 6, 3), "float32"))
    model.compile(loss="mse")
    return model


def test_a_subclassed_model_is_explained_from_its_own_call_and_checked(tf: Any) -> None:
    import keras

    model = _subclassed(keras)
    x, y = _sequences(27)
    report = _explained_exactly(model, x, y)
    assert [layer.name for layer in report.layers] == ["encoder", "decoder", "head"]
    assert any("Tutorial.call computes between them" in w for w in report.warnings)
    assert report.layers[0].class_name == "GRU" and report.layers[0].derivation
    states = {s.name: s for s in report.initial_state_gradients}
    assert states["encoder/h0"].stats is not None
    assert states["encoder/h0"].source.startswith("zeros")
    assert all(w.passed for w in report.witnesses)
    checked = gradscope.check(model, x=x, y=y)
    assert checked.summary.passed and checked.dtype == "float64"
    wrong = _subclassed(keras, wrong_by=1.4)
    caught = gradscope.check(wrong, x=x, y=y)
    assert not caught.summary.passed
    failed = caught.summary.failed_tensors
    assert not any(name.endswith("head/kernel") for name in failed), failed
    assert any(name.startswith(("encoder/", "decoder/")) for name in failed), failed
    # The model's own paths beside the names.
    assert ({t.path for t in caught.tensors if t.name in failed}
            & {v.path for v in wrong.trainable_variables})


def test_a_subclassed_model_of_token_ids_is_read_with_whole_numbers(tf: Any,
                                                                   tmp_path: Path) -> None:
    """A subclassed model whose call one-hot encodes its int32 ids (``tf.one_hot`` takes no
    float): its graph is read from a symbolic call with the data's dtype. Found tried as a new
    user would: read from float32 ids, explain refused it (exit 2) and GradientFlow stopped
    fit at its first observation."""
    import keras

    from gradscope.keras import GradientFlow

    class OneHot(keras.Model):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.gru = keras.layers.GRU(4, name="gru")
            self.head = keras.layers.Dense(2, name="head")

        def call(self, ids: Any) -> Any:
            return self.head(self.gru(tf.one_hot(ids, 9)))

    ids = np.random.default_rng(29).integers(0, 9, size=(16, 5)).astype("int32")
    y = np.random.default_rng(30).normal(size=(16, 2)).astype("float32")
    keras.utils.set_random_seed(29)
    model = OneHot()
    model(ids[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    report = _explained_exactly(model, ids[:8], y[:8])
    assert [layer.name for layer in report.layers] == ["gru", "head"]
    # Its batch from a data file (as the CLI gives it, --data), on a model not read before.
    fresh = OneHot()
    fresh(ids[:1])
    fresh.set_weights(model.get_weights())
    fresh.compile(loss="mse")
    np.savez(tmp_path / "ids.npz", x=ids[:8], y=y[:8])
    assert gradscope.explain(fresh, str(tmp_path / "ids.npz")).loss.value == pytest.approx(
        report.loss.value, rel=1e-6)
    # check's float64 copy is built on int32 ids too (found tried as a new user would: built
    # on float64 zeros, it failed, and check ran in float32).
    checked = gradscope.check(fresh, x=ids[:8], y=y[:8])
    assert checked.summary.passed and checked.dtype == "float64", checked.dtype_reason
    # With no batch of the user's, a model not read before is read from float32 ids: refused,
    # saying how to give their dtype.
    unread = OneHot()
    unread(ids[:1])
    unread.compile(loss="mse")
    with pytest.raises(ConfigError, match=r"its inputs read as float32, as no batch of yours "
                                          r"gave their dtypes: given one, x=… in Python"):
        gradscope.explain(unread)
    flow = GradientFlow(every=2)
    model.fit(ids, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[flow])
    assert [o.step for o in flow.history.observations] == [2]


TOKENS = textwrap.dedent('''
    import keras


    @keras.saving.register_keras_serializable("own_code")
    class Tokens(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embedding = keras.layers.Embedding(20, 4)
            self.lstm = keras.layers.LSTM(5)
            self.head = keras.layers.Dense(3)

        def call(self, ids):
            return self.head(self.lstm(self.embedding(ids)))
''')


def test_shapes_of_a_subclassed_model_of_token_ids_gives_them_as_integers(
        tf: Any, tmp_path: Path) -> None:
    """A subclassed model declares no input dtype: an input its Embedding reads holds token
    ids, as explain feeds it. Found tried as a new user would: ``shapes`` listed the ids of a
    saved tokens model (``--import``) as float32, where explain said int32."""
    import keras

    (tmp_path / "tokens.py").write_text(TOKENS)
    sys.path.insert(0, str(tmp_path))
    try:
        import tokens  # type: ignore[import-not-found]

        model = tokens.Tokens()
        model(np.zeros((2, 7), "int32"))
        model.compile(loss="sparse_categorical_crossentropy")
        model.save(tmp_path / "tokens.keras")
        assert [(i.name, i.dtype) for i in gradscope.shapes(model).inputs] == [("x", "int32")]
        explained = gradscope.explain(model, batch_size=4)
        assert [i.dtype for i in explained.model.inputs] == ["int32"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("tokens", None)
    done = run_cli("shapes", "tokens.keras", "--import", "tokens", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["inputs"] == [
        {"name": "x", "shape": [None, 7], "dtype": "int32"}]
    # A subclassed model of floats keeps its policy's dtype.
    assert gradscope.shapes(_subclassed(keras)).inputs[0].dtype == "float32"


def test_a_subclassed_models_own_compute_loss_is_the_loss(tf: Any) -> None:
    import keras

    model = _subclassed(keras, own_loss=True)
    x, y = _sequences(28)
    report = _explained_exactly(model, x, y)
    assert "Tutorial.compute_loss" in report.loss.name
    assert gradscope.check(model, x=x, y=y).summary.passed


def test_a_functional_subclass_that_keeps_call_is_a_functional_model(tf: Any) -> None:
    import keras

    class Plain(keras.Model):
        pass

    keras.utils.set_random_seed(29)
    inputs = keras.Input((6, 3), name="x")
    model = Plain(inputs, keras.layers.Dense(2, name="head")(keras.layers.GRU(4)(inputs)))
    model.compile(loss="mse")
    x = np.random.default_rng(30).standard_normal((4, 6, 3)).astype("float32")
    y = np.zeros((4, 2), "float32")
    report = _explained_exactly(model, x, y)
    assert report.model.kind == "Functional"


def test_cli_a_saved_subclassed_model_needs_its_code_and_is_explained_with_it(saved: Path
                                                                            ) -> None:
    refused = subprocess.run([sys.executable, "-m", "gradscope", "explain", "tutorial.keras"],
                             cwd=saved, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2
    assert "own class 'own_code>Tutorial'" in refused.stderr and "--import tutorial" in \
        refused.stderr
    explained = _cli(saved, "explain", "tutorial.keras", "--import", "tutorial", process=True)
    assert explained["model"]["kind"] == "Subclassed"
    assert [layer["name"] for layer in explained["layers"]] == ["gru", "lstm", "dense"]
    trained = _cli(saved, "explain", "tutorial.keras", "--import", "tutorial", "--training")
    assert trained["loss"]["value"] != explained["loss"]["value"]
    again = _in_process(saved, "tutorial", "tutorial.keras")
    assert again.loss.value == pytest.approx(trained["loss"]["value"], rel=1e-12)
    checked = run_cli("check", "tutorial.keras", "--import", "tutorial", "--json", cwd=saved)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert json.loads(checked.stdout)["summary"]["passed"]


def test_gradient_flow_during_fit_takes_the_added_losses_alone(tf: Any, batch: Any) -> None:
    """fit on a model compiled with no loss gives batches without targets: GradientFlow
    records the loss fit minimises, the add_loss terms, as compute_loss gives it."""
    import keras

    from gradscope.keras import GradientFlow

    model = _penalised(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    flow = GradientFlow(every=1)
    model.fit(batch, epochs=1, batch_size=5, verbose=0, shuffle=False, callbacks=[flow])
    loss, _ = keras_tape_norms(model, batch, None)  # after the update, as the flow sees it
    (observation,) = flow.history.observations
    assert observation.loss == pytest.approx(loss, rel=RTOL)


# -- a planted wrong gradient in each kind ---------------------------------------------------


@pytest.mark.parametrize("kind", ["add_loss alone", "mixed_float16", "relu LSTM",
                                  "training mode"])
def test_each_kind_fails_a_planted_wrong_gradient_and_passes_without_it(tf: Any,
                                                                         kind: str) -> None:
    """A Tap whose gradient is 1.5 times the truth sits between the recurrent layer and the
    head: check fails the recurrent layer's weights below it, never the head's, and passes
    the same model without the error."""
    import keras
    from keras import layers

    def build(wrong_by: float) -> Any:
        own = _own_layers(keras, wrong_by)
        if kind == "mixed_float16":
            keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            keras.utils.set_random_seed(31)
            inputs = keras.Input((6, 3), name="x")
            recurrent = (layers.LSTM(5, activation="relu", name="rnn") if kind == "relu LSTM"
                         else layers.GRU(5, dropout=0.3, name="rnn") if kind == "training mode"
                         else layers.GRU(5, name="rnn"))
            h = own["Tap"](name="tap")(recurrent(inputs))
            out = layers.Dense(2, dtype="float32", name="head")(h)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return keras.Model(inputs, out)

    rng = np.random.default_rng(32)
    x = rng.standard_normal((4, 6, 3)).astype("float32")
    y = rng.standard_normal((4, 2)).astype("float32")
    for wrong_by in (1.0, 1.5):
        model = build(wrong_by)
        if kind == "add_loss alone":
            target = keras.Input((2,), name="target")
            penalised = own_penalty(keras)(model.output, target)
            model = keras.Model([model.input, target], penalised)
            model.compile(optimizer="sgd")
            batch, targets = {"x": x, "target": y}, None
        else:
            model.compile(loss="mse")
            batch, targets = x, y
        report = gradscope.check(model, x=batch, y=targets, training=kind == "training mode")
        failed = report.summary.failed_tensors
        if wrong_by == 1.0:
            assert report.summary.passed, failed
            continue
        assert not report.summary.passed
        assert any("/rnn/" in name or name.startswith("rnn/") for name in failed), failed
        assert not any(name.endswith("head/kernel") for name in failed), failed


def test_a_small_loss_is_checked_as_closely_as_a_large_one(tf: Any) -> None:
    """A loss weight of 1e-8: a gradient 1% wrong below a Tap failed no tensor, its
    disagreement under 64 epsilons of 1 (found tried as a new user would: at a loss weight of
    1e-6, a weight's gradient 5% wrong, exit 0). Its rounding is measured: the wrong
    gradient fails, the right one passes."""
    import keras
    from keras import layers

    rng = np.random.default_rng(33)
    x = rng.standard_normal((4, 6, 3)).astype("float32")
    y = rng.standard_normal((4, 2)).astype("float32")
    for wrong_by in (1.0, 1.01):
        keras.utils.set_random_seed(34)
        inputs = keras.Input((6, 3), name="x")
        h = _own_layers(keras, wrong_by)["Tap"](name="tap")(layers.GRU(5, name="rnn")(inputs))
        model = keras.Model(inputs, layers.Dense(2, name="head")(h))
        model.compile(loss="mse", loss_weights=[1e-8])
        report = gradscope.check(model, x=x, y=y)
        assert report.loss.value < 1e-7
        failed = report.summary.failed_tensors
        if wrong_by == 1.0:
            assert report.summary.passed, failed
            continue
        assert any(name.startswith("rnn/") for name in failed), failed
        assert not any(name.startswith("head/") for name in failed), failed


def own_penalty(keras: Any) -> Any:
    """A layer whose loss is its add_loss: the mean squared distance of its two inputs."""
    from keras import ops

    class Penalty(keras.layers.Layer):
        def call(self, prediction: Any, target: Any) -> Any:
            self.add_loss(ops.mean(ops.square(prediction - target)))
            return prediction

    return Penalty(name="penalty")


def test_a_subclassed_model_without_get_config_is_checked_in_its_own_dtype(tf: Any) -> None:
    """The tutorials' models take arguments in __init__ and write no get_config: Keras cannot
    serialise them, so there is no float64 copy; check runs on the model itself and says so."""
    import keras

    class NoConfig(keras.Model):
        def __init__(self, units: int) -> None:
            super().__init__()
            self.gru = keras.layers.GRU(units)
            self.head = keras.layers.Dense(2)

        def call(self, x: Any) -> Any:
            return self.head(self.gru(x))

    keras.utils.set_random_seed(33)
    model = NoConfig(5)
    x, y = _sequences(34)
    model(x)
    model.compile(loss="mse")
    explained = _explained_exactly(model, x, y)
    # A call that only chains its layers is not said to compute anything between them.
    said = " ".join(explained.warnings)
    assert "NoConfig.call computed nothing outside them" in said
    assert "has no explanation" not in said
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed and report.dtype == "float32"
    assert "get_config" in (report.dtype_reason or "")


def test_tutorial_style_subclassed_models_are_checked_in_float64_by_their_own_names(
        tf: Any) -> None:
    """A call that adds its input to a layer's output (x + gru(x)), a Bidirectional made in
    __init__, and a loss function of the user's own, in memory and unregistered (the NMT
    tutorial's masked_loss): the float64 copy is built by a call in float64 and takes the
    function from memory, so check runs in float64; it names layers, states and the input as
    explain does."""
    import keras
    from keras import layers, ops

    def masked_loss(y_true: Any, y_pred: Any) -> Any:
        return ops.mean(ops.square(y_true - y_pred), axis=-1)

    class Residual(keras.Model):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.gru = layers.GRU(3, return_sequences=True)
            self.both = layers.Bidirectional(layers.LSTM(2))
            self.head = layers.Dense(2)

        def call(self, x: Any) -> Any:
            return self.head(self.both(x + self.gru(x)))

    keras.utils.set_random_seed(35)
    model = Residual()
    x, y = _sequences(36)
    model(x)
    model.compile(loss=masked_loss)
    explained = _explained_exactly(model, x, y)
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed and report.dtype == "float64", report.dtype_reason
    named = {t.name for t in report.tensors}
    assert {s.name for s in explained.initial_state_gradients} <= named
    assert {g.name for g in explained.gradients if g.stats} <= named
    assert ({(g.name, g.path) for g in explained.gradients if g.stats}
            <= {(t.name, t.path) for t in report.tensors})
    assert "input x" in named


def test_a_subclassed_models_own_weight_is_listed_with_its_gradient(tf: Any) -> None:
    import keras

    class Scaled(keras.Model):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.scale = self.add_weight(shape=(3,), initializer="ones", name="scale")
            self.gru = keras.layers.GRU(4)
            self.head = keras.layers.Dense(2)

        def call(self, x: Any) -> Any:
            return self.head(self.gru(x * self.scale))

    keras.utils.set_random_seed(37)
    model = Scaled()
    x, y = _sequences(38)
    model(x)
    model.compile(loss="mse")
    report = _explained_exactly(model, x, y)  # every weight, the model's own included
    (own,) = [g for g in report.gradients if g.path.endswith("/scale")]
    assert own.layer == "Scaled.call" and own.stats is not None


def test_a_masking_layer_is_not_blamed_for_a_wrong_gradient_above_it(tf: Any) -> None:
    """With masked steps in the batch, a wrong gradient above the GRU fails the GRU's weights;
    the Masking layer's own backward holds the masked steps fixed, and is not blamed."""
    import keras

    own = _own_layers(keras, 1.5)
    keras.utils.set_random_seed(39)
    inputs = keras.Input((6, 3), name="x")
    h = keras.layers.GRU(4, name="gru")(keras.layers.Masking(name="masking")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(own["Tap"](name="tap")(h)))
    model.compile(loss="mse")
    x, y = _sequences(40)
    x[1, -2:] = 0.0
    failed = gradscope.check(model, x=x, y=y).summary.failed_tensors
    assert any("gru/" in name for name in failed), failed
    assert "layer masking" not in failed


def test_a_witness_error_that_is_not_a_number_fails_and_the_json_holds(tf: Any) -> None:
    """A weight of the copy made NaN after the tape: every difference through it is NaN. The
    report fails those tensors, and its JSON (which allows no NaN) is written."""
    import json

    import keras

    keras.utils.set_random_seed(41)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(3, name="gru"),
                              keras.layers.Dense(2, name="head")])
    model.compile(loss="mse")
    x, y = _sequences(42)

    def poisoned(copy: Any) -> None:
        kernel = copy.get_layer("head").kernel
        kernel.assign(np.full(kernel.shape, np.nan))

    report = gradscope.check(model, x=x, y=y, after_autodiff=poisoned)
    assert not report.summary.passed
    document = json.loads(report.to_json())
    errors = [w["error"] for t in document["tensors"] for w in t["witnesses"]]
    assert None in errors
