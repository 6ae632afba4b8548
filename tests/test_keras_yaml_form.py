"""``gradscope spec MODEL.keras`` and ``--weights MODEL.keras``: a saved Keras model in the
YAML spec's terms, tried as a new user would.

The truth for a spec that is printed is Keras itself: the YAML model, run by gradscope's own
YAML engine with the file's weights, must have the loss and the gradients Keras' tape gives
the saved model on the same batch. Every layer the YAML spec cannot hold is refused by name,
before TensorFlow loads; and the witness that holds the spec's NumPy forward pass against
Keras' predictions must catch a misreading that the shapes alone do not show.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, run_gradscope, run_without_tensorflow


def _save(model, path: Path) -> str:
    model.save(path)
    return str(path)


@pytest.fixture(scope="module")
def saved(tf, tmp_path_factory):
    """A trained-looking GRU → LSTM → Dense classifier, saved, with a batch and Keras' tape."""
    import keras

    folder = tmp_path_factory.mktemp("spec_keras")
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((9, 5)),
        keras.layers.GRU(6, return_sequences=True, name="encoder"),
        keras.layers.LSTM(4, name="decoder"),
        keras.layers.Dense(3, name="head"),
    ])
    for weight in model.weights:  # biases away from zero, so that their layout matters
        weight.assign(weight.numpy() + np.random.default_rng(len(weight.path)).uniform(
            -0.3, 0.3, weight.shape))
    model.compile(loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, 9, 5)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 7)]
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x))
    gradients = tape.gradient(loss, model.trainable_weights)
    np.savez(folder / "batch.npz", x=x, y=y)
    return {"path": _save(model, folder / "model.keras"), "folder": folder, "x": x, "y": y,
            "loss": float(loss), "norms": {w.path: float(np.linalg.norm(g)) for w, g in
                                           zip(model.trainable_weights, gradients, strict=True)}}


def test_the_spec_names_the_layers_and_says_what_the_file_said(saved):
    import gradscope

    report = gradscope.infer_spec(saved["path"])
    assert report.format == "saved Keras model"
    assert report.config["layers"] == [
        {"gru": 6, "name": "encoder", "reset_after": True},
        {"lstm": 4, "name": "decoder", "return_sequences": False},
        {"dense": 3, "name": "head"},
    ]
    said = {item.key: (item.value, item.known) for item in report.inferences}
    assert said["time_steps"] == (9, True)
    assert said["loss"] == ("softmax_cross_entropy", True)
    assert said["batch_size"] == (32, False)  # the input leaves it open: a default
    assert gradscope.load_spec(report.config).input_size == 5


def test_the_yaml_engine_on_the_file_s_weights_has_keras_own_gradients(saved):
    """Two engines that share nothing but the weights: gradscope's YAML model (tf.scan over
    its own cells) against Keras' tape on the saved model."""
    import gradscope

    spec = gradscope.load_spec(gradscope.infer_spec(saved["path"]).config)
    report = gradscope.explain(spec, data={"x": saved["x"], "y": saved["y"]},
                               weights=saved["path"])
    assert report.weights.source == saved["path"]
    assert report.weights.format == "saved Keras model"
    assert report.weights.matched_by == "the spec's layer names"
    assert report.loss.value == pytest.approx(saved["loss"], rel=1e-6)
    ours: dict[str, float] = {}
    for gradient in report.gradients:
        layer = gradient.name.split("/")[0]
        ours[layer] = float(np.hypot(ours.get(layer, 0.0), gradient.stats.l2))
    for layer in ("encoder", "decoder", "head"):
        theirs = float(np.sqrt(sum(norm**2 for path, norm in saved["norms"].items()
                                   if f"/{layer}/" in f"/{path}")))
        assert ours[layer] == pytest.approx(theirs, rel=1e-5), layer


def test_the_cli_round_trip_spec_then_explain_with_weights(saved):
    folder = saved["folder"]
    written = folder / "model.yaml"
    done = run_gradscope("spec", saved["path"], "-q", "-o", str(written))
    assert done.returncode == 0, done.stderr
    # Its reasons are comments wrapped within 80 columns: read as one text.
    comments = " ".join(line.split("# ", 1)[1] for line in written.read_text().splitlines()
                        if "# " in line)
    assert "model.keras (saved Keras model)" in comments
    explained = run_gradscope("explain", str(written), "--weights", saved["path"], "--data",
                              str(folder / "batch.npz"), "--json", "-q")
    assert explained.returncode == 0, explained.stderr
    import json

    assert json.loads(explained.stdout)["loss"]["value"] == pytest.approx(saved["loss"],
                                                                          rel=1e-6)


def test_the_forward_witness_catches_a_model_read_the_wrong_way(saved, tf):
    """A mutant: the same weights, but the model runs backwards in time. Every shape is the
    same, so only the witness can tell; the spec must be refused."""
    import keras

    from gradscope.errors import ConfigError
    from gradscope.keras.yaml_form import read_saved_form
    from gradscope.yaml.inference import infer_spec
    from gradscope.yaml.weights import SavedArrays

    form = read_saved_form(saved["path"])
    model = keras.saving.load_model(saved["path"], compile=False)
    backwards = keras.Sequential([
        keras.Input((9, 5)),
        keras.layers.GRU(6, return_sequences=True, go_backwards=True),
        keras.layers.LSTM(4),
        keras.layers.Dense(3),
    ])
    backwards.set_weights(model.get_weights())
    mutant = dataclasses.replace(form, probe_predictions=np.asarray(backwards(form.probe_x)))
    with pytest.raises(ConfigError) as caught:
        infer_spec(SavedArrays(form.arrays, form.source), mutant)
    assert "does not compute what the model computes" in caught.value.message
    assert "refusing to print the spec of another model" in caught.value.message
    # The witness is not blind: the model read the right way passes it.
    assert infer_spec(SavedArrays(form.arrays, form.source), form).config["input_size"] == 5


REFUSED = {
    "relu": ("keras.layers.GRU(4, activation='relu', name='refused')",
             "layer 'refused' has activation 'relu'; the YAML spec's GRU has 'tanh'"),
    "backwards": ("keras.layers.LSTM(4, go_backwards=True, name='refused')",
                  "layer 'refused' has go_backwards True"),
    "dropout": ("keras.layers.SimpleRNN(4, dropout=0.5, name='refused')",
                "layer 'refused' has dropout 0.5"),
    "regularizer": ("keras.layers.GRU(4, kernel_regularizer='l2', name='refused')",
                    "layer 'refused' has a kernel_regularizer, which adds to the loss"),
    "bidirectional": ("keras.layers.Bidirectional(keras.layers.GRU(4), name='refused')",
                      "layer 'refused' is a Bidirectional"),
    "softmax head": ("keras.layers.GRU(4), "
                     "keras.layers.Dense(2, activation='softmax', name='refused')",
                     "has activation 'softmax'; the YAML spec's Dense has 'linear'"),
}


@pytest.fixture(scope="module")
def refused_models(tf, tmp_path_factory):
    import keras

    folder = tmp_path_factory.mktemp("spec_refused")
    paths = {}
    for case, (layers, _) in REFUSED.items():
        built = eval(f"[{layers}]", {"keras": keras})  # noqa: S307  (the table above)
        model = keras.Sequential([keras.Input((6, 3)), *built,
                                  *([] if len(built) > 1 else [keras.layers.Dense(2)])])
        paths[case] = _save(model, folder / f"{case.replace(' ', '_')}.keras")
    return paths


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_yaml_spec_cannot_hold_is_refused_by_name_before_tensorflow(refused_models,
                                                                            case):
    done = run_without_tensorflow("spec", refused_models[case])
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert REFUSED[case][1] in lines[0]
    assert lines[0].endswith(f"explain the model as it is: gradscope explain "
                             f"{Path(refused_models[case]).name}")


MODULE = textwrap.dedent('''
    import keras


    @keras.saving.register_keras_serializable("my_init")
    class Small(keras.initializers.Initializer):
        def __call__(self, shape, dtype=None):
            return keras.random.uniform(shape, -0.1, 0.1, dtype=dtype)
''')

BUILD = textwrap.dedent('''
    import sys
    import keras
    import my_init

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)),
                              keras.layers.GRU(4, kernel_initializer=my_init.Small()),
                              keras.layers.Dense(2)])
    model.compile(loss="mse")
    model.save(sys.argv[1])
''')


def test_import_loads_a_class_of_your_own_that_the_spec_does_not_need(tmp_path):
    """A GRU whose initializer is the user's class: without --import the refusal names it and
    the option to add; with it, the model loads and has a spec (an initializer does not
    change what the trained model computes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    (tmp_path / "my_init.py").write_text(MODULE)
    (tmp_path / "build.py").write_text(BUILD)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)

    assert run("build.py", "init.keras").returncode == 0
    refused = run_cli("spec", "init.keras", cwd=tmp_path)  # the class is not known here
    assert refused.returncode == 2
    assert "custom class 'my_init>Small'" in refused.stderr
    assert "add --import my_init" in refused.stderr
    done = run_cli("spec", "init.keras", "--import", "my_init", "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "- {gru: 4, name: gru" in done.stdout and "loss: mse" in done.stdout


def test_import_is_for_a_saved_model_only(saved):
    np.savez(saved["folder"] / "weights.npz", kernel=np.zeros((2, 2)))
    done = run_without_tensorflow("spec", str(saved["folder"] / "weights.npz"), "--import",
                                  "numpy")
    assert done.returncode == 2
    assert "--import is for a saved .keras model" in done.stderr
    assert "weights.npz is not one" in done.stderr


def test_the_api_refuses_imports_for_what_is_not_a_saved_model():
    import gradscope
    from gradscope.errors import GradscopeError

    with pytest.raises(GradscopeError) as caught:
        gradscope.infer_spec({"gru/kernel": np.zeros((3, 12))}, imports=["my_layers"])
    assert caught.value.exit_code == 2
    # Spelt as Python takes it (found tried as a new user would: it named the CLI's --import).
    assert caught.value.message.startswith("imports= is for a saved .keras model")
    assert "the arrays is not one" in caught.value.message


def test_time_distributed_dense_is_a_dense_at_every_step(tf, tmp_path):
    """A tagger (GRU over the sequence, then TimeDistributed(Dense)): its spec has a dense
    layer at every step, named after the wrapper, and the YAML engine on the file's weights
    has the loss Keras computes."""
    import keras

    import gradscope

    keras.utils.set_random_seed(6)
    model = keras.Sequential([
        keras.Input((7, 3)),
        keras.layers.GRU(5, return_sequences=True, name="tagger"),
        keras.layers.TimeDistributed(keras.layers.Dense(4), name="per_step"),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    path = _save(model, tmp_path / "tagger.keras")
    report = gradscope.infer_spec(path)
    assert report.config["layers"] == [{"gru": 5, "name": "tagger", "reset_after": True},
                                       {"dense": 4, "name": "per_step"}]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 7, 3)).astype("float32")
    labels = rng.integers(0, 4, (6, 7))
    y = np.eye(4, dtype="float32")[labels]
    keras_loss = float(model.compute_loss(x=x, y=labels, y_pred=model(x)))
    ours = gradscope.explain(gradscope.load_spec(report.config), data={"x": x, "y": y},
                             weights=path)
    assert ours.loss.value == pytest.approx(keras_loss, rel=1e-6)


@pytest.mark.parametrize(("compiled", "said", "known"), [
    ("loss=keras.losses.mean_squared_error", "mse", True),
    ("loss='mse', loss_weights=0.5", "the model was compiled with mean_squared_error × 0.5",
     False),
    ("loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)",
     "(label_smoothing 0.1)", False),
    ("loss=keras.losses.CategoricalCrossentropy()", "categorical_crossentropy, which", False),
])
def test_the_compiled_loss_is_the_yaml_loss_only_when_it_is_the_same(tf, tmp_path, compiled,
                                                                     said, known):
    """The loss is read as the Keras wing reads it: a loss function object, a loss weight,
    Keras' settings; only softmax cross-entropy from logits and mean squared error, unweighted
    and with Keras' defaults, are the YAML's; any other keeps the default, with the reason."""
    import keras

    import gradscope

    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(4), keras.layers.Dense(3)])
    eval(f"model.compile({compiled})", {"keras": keras, "model": model})  # noqa: S307
    report = gradscope.infer_spec(_save(model, tmp_path / "compiled.keras"))
    loss = next(item for item in report.inferences if item.key == "loss")
    assert loss.known is known
    assert said in (loss.value if known else loss.reason)
