"""``--import MODULE_OR_FILE`` and ``--unsafe``: a saved model whose classes are the user's own
code, tried as a new user would: the model is built and saved by the user's own script (a
separate process, which registers the class), then gradscope runs in a fresh process from the
folder that holds the module. Without --import, the refusal names the class, its module and
the option to add; with it, the custom layer's weight has Keras' own gradient (against a tape
taken by the user's script) and check verifies it; a wrong tf.custom_gradient in it is
caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

MODULE = textwrap.dedent('''
    import keras
    import tensorflow as tf


    @keras.saving.register_keras_serializable("my_layers")
    class ScaledTanh(keras.layers.Layer):
        def __init__(self, wrong_by=1.0, **kwargs):
            super().__init__(**kwargs)
            self.wrong_by = wrong_by

        def build(self, shape):
            self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

        def call(self, x):
            wrong_by = self.wrong_by

            @tf.custom_gradient
            def scaled(v, scale):
                y = tf.tanh(v * scale)

                def backward(dy):
                    inner = dy * (1.0 - y * y)
                    dscale = tf.reduce_sum(inner * v, axis=tf.range(tf.rank(v) - 1))
                    return inner * scale, dscale * wrong_by

                return y, backward

            return scaled(x, tf.cast(self.scale, x.dtype))

        def get_config(self):
            return {**super().get_config(), "wrong_by": self.wrong_by}
''')

BUILD = textwrap.dedent('''
    import json, sys
    import numpy as np
    import keras, tensorflow as tf
    import my_layers

    wrong_by = float(sys.argv[1])
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 3))
    h = keras.layers.GRU(4, name="gru")(my_layers.ScaledTanh(wrong_by, name="scaled")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    model.compile(loss="mse")
    model.save(sys.argv[2])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8, 3)).astype("float32")
    y = rng.standard_normal((5, 2)).astype("float32")
    np.savez(sys.argv[3], x=x, y=y)
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    norms = {v.path: float(np.linalg.norm(g)) for v, g in zip(model.trainable_variables, grads)}
    json.dump({"loss": float(loss), "norms": norms}, open(sys.argv[4], "w"))
''')

LAMBDA = textwrap.dedent('''
    import sys
    import keras
    model = keras.Sequential([keras.Input((6, 2)), keras.layers.Lambda(lambda v: v * 2.0),
                              keras.layers.GRU(3), keras.layers.Dense(1)])
    model.compile(loss="mse")
    model.save(sys.argv[1])
''')


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.pop("COLUMNS", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def _python(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=folder, env=_env(),
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def _gradscope(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in ``folder``, in this process: the user's module is forgotten after each run,
    and the models were saved by another process (``project``), so no class of theirs is
    known here but by --import."""
    return run_cli(*args, cwd=folder, env={"TF_CPP_MIN_LOG_LEVEL": "3"})


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's folder: their module, and two saved models (a right and a wrong custom
    gradient), each with its batch and the tape's numbers."""
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "my_layers.py").write_text(MODULE)
    (folder / "build.py").write_text(BUILD)
    for name, wrong_by in [("right", "1.0"), ("wrong", "0.5")]:
        done = _python(folder, "build.py", wrong_by, f"{name}.keras", f"{name}.npz",
                       f"{name}.json")
        assert done.returncode == 0, done.stderr
    return folder


def test_without_import_the_refusal_names_the_class_and_the_option(project):
    done = _gradscope(project, "explain", "right.keras")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "custom class 'my_layers>ScaledTanh' (module my_layers)" in lines[0]
    assert "add --import my_layers" in lines[0]


def test_from_python_the_refusals_name_the_python_form_of_the_option(project, tmp_path):
    """The same refusals in Python name ``gradscope.load_model(…, imports=[…])`` (and
    ``unsafe=True``), which Python takes, not the CLI's flags (found tried as a new user would:
    ``gradscope.explain("right.keras")`` advised ``add --import my_layers``)."""
    import gradscope
    from gradscope.errors import ConfigError

    for call in (gradscope.shapes, gradscope.explain, gradscope.check):
        with pytest.raises(ConfigError) as refused:
            call(str(project / "right.keras"))
        message = str(refused.value)
        assert "--import" not in message, message
        assert (f"load it with gradscope.load_model('{project / 'right.keras'}', "
                "imports=['my_layers']) (the module that defines it; or the path of its .py "
                "file), and pass the model") in message, message
    (project / "other.py").write_text("import keras\n")
    with pytest.raises(ConfigError) as wrong:
        gradscope.load_model(project / "right.keras", imports=[str(project / "other.py")])
    assert str(wrong.value).endswith(
        f"after imports=['{project / 'other.py'}']: import the module that defines and "
        "registers it (imports=['my_layers'], or imports=['path/to/its_file.py'])")
    with pytest.raises(ConfigError) as missing:
        gradscope.load_model(project / "right.keras", imports=["no_such_module"])
    assert str(missing.value).startswith("imports=['no_such_module']: no module named")
    (tmp_path / "lam.py").write_text(LAMBDA)
    assert _python(tmp_path, "lam.py", "lam.keras").returncode == 0
    with pytest.raises(ConfigError) as code:
        gradscope.explain(str(tmp_path / "lam.keras"))
    assert "--unsafe" not in str(code.value)
    assert (f"or load it with gradscope.load_model('{tmp_path / 'lam.keras'}', unsafe=True) "
            "if you trust the file (it runs the code stored in it), and pass the model"
            ) in str(code.value)
    (tmp_path / "my_losses.py").write_text(LOSS)
    assert _python(tmp_path, "my_losses.py", "m.keras").returncode == 0
    with pytest.raises(ConfigError) as loss:
        gradscope.explain(str(tmp_path / "m.keras"))
    assert str(loss.value).endswith(
        f"its saved loss cannot be rebuilt: load it with gradscope.load_model("
        f"'{tmp_path / 'm.keras'}', imports=['MODULE']) (the module that registers it), and "
        "pass the model, or pass loss=NAME to use another loss")


@pytest.mark.parametrize("how", ["my_layers", "./my_layers.py"])
def test_with_import_the_custom_layer_has_keras_own_gradient(project, how):
    done = _gradscope(project, "explain", "right.keras", "--import", how, "--data",
                      "right.npz", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    truth = json.loads((project / "right.json").read_text())
    assert report["loss"]["value"] == pytest.approx(truth["loss"], rel=1e-6)
    ours = {g["path"]: g["stats"]["l2"] for g in report["gradients"]}
    assert ours["scaled/scale"] == pytest.approx(truth["norms"]["scaled/scale"], rel=1e-5)
    assert report["model"]["file"] == "right.keras"
    # The loss saved in the file is said as it is without --import, where Keras is not used.
    assert report["loss"]["name"] == "mean_squared_error (saved with the compiled model)"
    scale = next(g for g in report["gradients"] if g["path"] == "scaled/scale")
    assert scale["shape"] == [3]


def test_check_verifies_the_custom_layer_and_catches_a_wrong_custom_gradient(project):
    right = _gradscope(project, "check", "right.keras", "--import", "my_layers", "--data",
                       "right.npz", "--json")
    assert right.returncode == 0, right.stderr
    names = {t["name"]: t["passed"] for t in json.loads(right.stdout)["tensors"]}
    assert names["scaled/scale"] is True
    wrong = _gradscope(project, "check", "wrong.keras", "--import", "my_layers", "--data",
                       "wrong.npz", "--json")
    assert wrong.returncode == 1
    report = json.loads(wrong.stdout)
    assert report["summary"]["failed_tensors"] == ["scaled/scale"]


def test_a_lambda_needs_unsafe_which_says_it_runs_the_file_s_code(tmp_path):
    (tmp_path / "lam.py").write_text(LAMBDA)
    assert _python(tmp_path, "lam.py", "lam.keras").returncode == 0
    refused = _gradscope(tmp_path, "explain", "lam.keras")
    assert refused.returncode == 2 and "pass --unsafe" in refused.stderr
    done = _gradscope(tmp_path, "explain", "lam.keras", "--unsafe", "-q")
    assert done.returncode == 0, done.stderr
    help_text = " ".join(_gradscope(tmp_path, "explain", "--help").stdout.split())
    assert "runs the Python code stored inside the file" in help_text


def test_import_errors_are_one_line_and_yaml_configs_refuse_it(project):
    missing = _gradscope(project, "explain", "right.keras", "--import", "no_such_module")
    assert missing.returncode == 2
    assert "--import no_such_module: no module named 'no_such_module'" in missing.stderr
    yaml_config = _gradscope(project, "explain", "--import", "my_layers")
    assert yaml_config.returncode == 2 and "for a saved .keras model" in yaml_config.stderr
    # A module that defines nothing the file needs: the class and its module, in one short
    # line (it was Keras' message, with the whole serialised config).
    (project / "other.py").write_text("import keras\n")
    wrong = _gradscope(project, "explain", "right.keras", "--import", "other.py")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        "gradscope: error: right.keras: Keras could not find the class 'ScaledTanh' (module "
        "my_layers) the file names, after --import other.py: import the module that defines "
        "and registers it (--import my_layers, or --import path/to/its_file.py)"]


LOSS = textwrap.dedent('''
    import sys
    import keras


    @keras.saving.register_keras_serializable("my_losses")
    def doubled_mse(y_true, y_pred):
        return 2.0 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


    if __name__ == "__main__":
        import my_losses

        model = keras.Sequential([keras.Input((5, 2)), keras.layers.GRU(3),
                                  keras.layers.Dense(1)])
        model.compile(loss=my_losses.doubled_mse)
        model.save(sys.argv[1])
''')


def test_a_saved_loss_of_your_own_is_read_with_import_and_said_as_a_saved_one(tmp_path):
    """Without --import, the refusal names the function and both ways out, in one short line
    (not Keras' advice and config); with it, the header says the loss as for a built-in one."""
    (tmp_path / "my_losses.py").write_text(LOSS)
    assert _python(tmp_path, "my_losses.py", "m.keras").returncode == 0
    refused = _gradscope(tmp_path, "explain", "m.keras")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "gradscope: error: m.keras: Keras cannot load it safely: Could not locate function "
        "'my_losses>doubled_mse'; its saved loss cannot be rebuilt: add --import MODULE (the "
        "module that registers it), or pass --loss NAME to use another loss")
    done = _gradscope(tmp_path, "explain", "m.keras", "--import", "my_losses", "-q")
    assert done.returncode == 0, done.stderr
    assert "loss = " in done.stdout
    assert ": my_losses>doubled_mse (saved with the compiled model)\n" in done.stdout


@pytest.mark.parametrize(("source", "said"), [
    ("no_such_module", "no module named 'no_such_module' on the Python path"),
    ("no_such_package.layers", "no module named 'no_such_package' on the Python path"),
    ("no/such_file.py", "no such file"),
])
def test_an_import_python_cannot_find_is_refused_before_tensorflow_loads(source, said):
    """Found tried as a new user would: a misspelt --import took 5.6 s to be refused, after
    TensorFlow loaded. Python's finder sees it first, importing nothing."""
    from conftest import run_without_tensorflow

    refused = run_without_tensorflow("explain", "tests/bad_inputs/not_a_zip.keras",
                                     "--import", source)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"gradscope: error: --import {source}: {said}"
        + (" (the current folder included)" if "module" in said else "")
        + "; expected a dotted module name or a path to a .py file"]


UNNAMED = textwrap.dedent('''
    import keras


    @keras.saving.register_keras_serializable("unnamed")
    class Gain(keras.layers.Layer):
        """Its __init__ takes **kw, not **kwargs, and it has no get_config: Keras saves it
        with no name, and names it anew as it loads it."""

        def __init__(self, **kw):
            super().__init__(**kw)

        def build(self, shape):
            self.gain = self.add_weight(shape=(shape[-1],), initializer="ones", name="gain")

        def call(self, x):
            return x * self.gain
''')


def test_a_sequential_layer_saved_without_a_name_is_named_as_keras_names_it(tmp_path):
    """Found tried as a new user would: such a layer ended "internal error: KeyError:
    'module.Passthrough'" (gradscope's graph named it by its class, Keras by its own counters,
    which the user's process had moved). In Python (its names moved) and on the command line,
    its gradient is Keras' tape's."""
    import keras
    import numpy as np
    import tensorflow as tf

    import gradscope

    (tmp_path / "unnamed_layers.py").write_text(UNNAMED)
    sys.path.insert(0, str(tmp_path))
    try:
        import unnamed_layers

        for _ in range(3):  # the process's counters move on: the next is gain_3 or later
            unnamed_layers.Gain()
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5, 2)), unnamed_layers.Gain(),
                                  keras.layers.GRU(3), unnamed_layers.Gain(),
                                  keras.layers.Dense(1)], name="seq")
        model.compile(loss="mse")
        first, second = (layer.name for layer in model.layers[::2])
        assert first not in ("gain", "gain_1") and second not in ("gain", "gain_1")
        model.save(tmp_path / "m.keras")
        x = np.random.default_rng(0).standard_normal((4, 5, 2)).astype("float32")
        y = np.ones((4, 1), "float32")
        np.savez(tmp_path / "m.npz", x=x, y=y)
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x))
        truth = [float(np.linalg.norm(g)) for g in
                 tape.gradient(loss, [model.layers[0].gain, model.layers[2].gain])]
        live = gradscope.explain(model, x=x, y=y).to_dict()
        norms = {g["path"]: g["stats"]["l2"] for g in live["gradients"]}
        assert [norms[f"seq/{first}/gain"], norms[f"seq/{second}/gain"]
                ] == pytest.approx(truth, rel=1e-5)
        loaded = gradscope.explain(gradscope.load_model(tmp_path / "m.keras",
                                                        imports=["unnamed_layers"]),
                                   x=x, y=y).to_dict()
        assert len(loaded["gradients"]) == len(live["gradients"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("unnamed_layers", None)
    done = _gradscope(tmp_path, "explain", "m.keras", "--import", "unnamed_layers", "--data",
                      "m.npz", "--json")
    assert done.returncode == 0, done.stderr
    norms = {g["path"]: g["stats"]["l2"] for g in json.loads(done.stdout)["gradients"]}
    assert [norms["gain/gain"], norms["gain_1/gain"]] == pytest.approx(truth, rel=1e-5)
