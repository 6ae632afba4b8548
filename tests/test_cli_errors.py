"""Bad input from the command line: exit 2, one line on stderr, never a traceback; with
--json, exactly one error object on stdout. And the help is the documentation of the contract."""

from __future__ import annotations

import json

import pytest
from conftest import run_gradscope


@pytest.fixture()
def configs(tmp_path):
    files = {
        "typo.yaml": "input_sise: 4\ntime_steps: 3\nbatch_size: 2\nlayers: [{gru: 2}]\n",
        "dense_first.yaml": "input_size: 4\ntime_steps: 3\nbatch_size: 2\n"
                            "layers: [{dense: 2}, {gru: 2}]\n",
        "broken.yaml": "input_size: [4\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("args,fragment", [
    (["shapes", "{dir}/missing.yaml"], "file not found"),
    (["shapes", "{dir}"], "is a directory"),
    (["shapes", "{dir}/typo.yaml"], "did you mean 'input_size'"),
    (["shapes", "{dir}/dense_first.yaml"], "found a dense layer first"),
    (["shapes", "{dir}/broken.yaml"], "not valid YAML"),
    (["shapes", "--bogus"], "No such option"),
    (["explain", "{dir}/typo.yaml"], "did you mean 'input_size'"),
    (["check", "{dir}/dense_first.yaml"], "found a dense layer first"),
    (["check", "--chunks", "0"], "--chunks 0: expected K ≥ 2"),
    # Tried as a new user would: one chunk has no boundary, and its check passed on nothing.
    (["check", "--chunks", "1"], "--chunks 1: expected K ≥ 2"),
])
def test_bad_input_exits_2_with_one_clear_line(configs, args, fragment):
    args = [a.replace("{dir}", str(configs)) for a in args]
    result = run_gradscope(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["shapes", "explain", "check"])
def test_json_errors_are_one_object_on_stdout(configs, command):
    result = run_gradscope(command, str(configs / "typo.yaml"), "--json")
    assert result.returncode == 2
    document = json.loads(result.stdout)
    assert set(document) == {"error"}
    assert "input_sise" in document["error"]["message"]
    assert document["error"]["where"] == "input_sise"


def test_help_documents_exit_codes_examples_and_version():
    main = run_gradscope("--help")
    assert main.returncode == 0
    for line in ["0  all good", "1  a check found a problem", "2  usage, config or data error"]:
        assert line in main.stdout
    for command in ["shapes", "explain", "check", "schema"]:
        text = run_gradscope(command, "--help").stdout
        assert "Example" in text, command
    check_help = run_gradscope("check", "--help").stdout
    assert "  finite differences   1e-5     2e-3" in check_help  # the tolerance table
    version = run_gradscope("--version")
    assert version.returncode == 0 and "gradscope, version" in version.stdout


def test_check_help_writes_its_tolerances_from_the_one_table(monkeypatch):
    """check --help's table is drawn from gradcheck.TOLERANCES: a value changed there is
    the value shown, and every witness has its row."""
    from gradscope import cli, gradcheck

    changed = {**gradcheck.TOLERANCES, "tbptt_carry": {
        "float64": gradcheck.Tolerance(3e-8), "float32": gradcheck.Tolerance(7e-4)}}
    monkeypatch.setattr(gradcheck, "TOLERANCES", changed)
    lines = cli._tolerance_help().splitlines()
    assert "  TBPTT carry          3e-8     7e-4     --chunks" in lines
    shown = [line.split()[0] for line in lines if line.startswith("  ")][1:]
    assert len(shown) == len(changed) - len(cli.NOT_WITNESSES)
    assert all(len(line) <= 78 for line in lines)


def test_a_huge_config_is_refused_before_tensorflow_is_imported(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    config = tmp_path / "huge.yaml"
    config.write_text("input_size: 100000\ntime_steps: 100000\nbatch_size: 32\n"
                      "layers: [{gru: 100000}, {dense: 3}]\n")
    code = (
        "import sys\nfrom gradscope.cli import main\n"
        f"try:\n    main(['explain', {str(config)!r}])\nexcept SystemExit as e:\n"
        "    assert e.code == 2, e.code\n"
        "assert 'tensorflow' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "more than the limit" in result.stderr
    assert "the largest term is" in result.stderr


def test_max_memory_is_checked_for_check_too(tmp_path):
    result = run_gradscope("check", "--max-memory", "10M")
    assert result.returncode == 2
    assert "finite differences" in result.stderr


def test_plot_without_matplotlib_names_an_install_line_that_works(tmp_path):
    """matplotlib hidden for real (an import of it fails) as in an environment without it.

    Whether the CLI checks for matplotlib before TensorFlow or after the explain run, the
    outcome must be the same: exit 2, one line naming a pip of the running interpreter, no
    traceback, no file, nothing on stdout."""
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from conftest import REPO

    config = tmp_path / "tiny.yaml"
    config.write_text("input_size: 3\ntime_steps: 4\nbatch_size: 2\n"
                      "layers: [{gru: 2}, {dense: 2}]\n")
    picture = tmp_path / "flow.png"
    code = (
        "import sys\nsys.modules['matplotlib'] = None\n"
        "from gradscope.cli import main\n"
        f"main(['explain', {str(config)!r}, '--flow', '--plot', {str(picture)!r}])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradscope: error: --plot needs matplotlib")
    assert "gradscope[" not in lines[0]  # that name on the registry is another project
    command = shlex.split(lines[0].split("install it with: ", 1)[1])
    assert command[1:] == ["-m", "pip", "install", "matplotlib"]
    # The named interpreter is the one that ran gradscope (relative paths are from the cwd),
    # and it has pip.
    python = Path(REPO, command[0])
    assert os.path.samefile(python, sys.executable)
    assert subprocess.run([str(python), "-m", "pip", "--version"],
                          capture_output=True).returncode == 0
    assert not picture.exists()


def test_a_saved_model_given_as_data_is_named_a_model(tmp_path):
    """``--data model.keras`` (the model where its arrays go): one line naming a saved Keras
    model, exit 2, before TensorFlow loads; it listed config.json, metadata.json and
    model.weights.h5 as unknown arrays (found tried as a new user would)."""
    import zipfile

    archive = tmp_path / "model.keras"
    with zipfile.ZipFile(archive, "w") as written:
        for name in ("config.json", "metadata.json", "model.weights.h5"):
            written.writestr(name, "{}")
    result = run_gradscope("explain", "--data", str(archive))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gradscope: error: {archive}: is a saved Keras model (model.save), not arrays; "
        "expected an .npz archive with x and y (or use --x and --y), as np.savez writes it"]


def test_an_error_whose_value_goes_on_over_lines_says_so():
    """Found tried as a new user would: a custom gradient's TypeError ended its one line at
    "numpy=", where the tf.Variable's repr goes on over the next lines; and its cause said it
    again. The unfinished "numpy=" is left out and "…" says it goes on, once."""
    from gradscope.errors import first_line

    said = ("@tf.custom_gradient grad_fn must accept keyword argument 'variables', since "
            "function uses variables: [<tf.Variable 'var_cell/r:0' shape=(4, 4) "
            "dtype=float32, numpy=\narray([[1., 0.],\n       [0., 1.]], dtype=float32)>]")
    try:
        try:
            raise TypeError(said)
        except TypeError as inner:
            raise ValueError("VarCell.call(): " + said) from inner
    except ValueError as exc:
        line = first_line(exc)
    assert line == ("VarCell.call(): @tf.custom_gradient grad_fn must accept keyword "
                    "argument 'variables', since function uses variables: [<tf.Variable "
                    "'var_cell/r:0' shape=(4, 4) dtype=float32 …")


def test_a_sentence_keras_wraps_over_several_lines_is_said_whole():
    """Found tried as a new user would: the TensorFlow tutorial's subclassed text model, which
    Keras cannot rebuild from its config: the reason stopped at "must override
    `get_config()` in", Keras' sentence going on over two more lines; its example after it
    is left out."""
    from gradscope.errors import first_line

    said = ("\nObject MyModel was created by passing\nnon-serializable argument values in "
            "`__init__()`,\nand therefore the object must override `get_config()` in\norder "
            "to be serializable. Please implement `get_config()`.\n\nExample:\n\n\n"
            "class CustomLayer(keras.layers.Layer):\n    def __init__(self, arg1, **kwargs):\n")
    assert first_line(TypeError(said)) == (
        "Object MyModel was created by passing non-serializable argument values in "
        "`__init__()`, and therefore the object must override `get_config()` in order to be "
        "serializable. Please implement `get_config()`.")


def test_keras_shape_inference_s_advice_is_left_for_the_layer_and_its_error():
    """Found tried as a new user would: a VAE's float64 copy failed in Keras' shape inference,
    whose message wraps the layer's error in three sentences of advice; the reason check gave
    ran to six lines. One clause: the layer, its class and its own error."""
    from gradscope.errors import first_line

    said = ("Could not automatically infer the output shape / dtype of 'sampling' (of type "
            "Sampling). Either the `Sampling.call()` method is incorrect, or you need to "
            "implement the `Sampling.compute_output_spec() / compute_output_shape()` method. "
            "Error encountered:\n\nInput 'y' of 'Mul' Op has type float32 that does not match "
            "type float64 of argument 'x'.")
    try:
        try:
            raise ValueError("x: Tensor conversion requested dtype float32")
        except ValueError as inner:
            raise TypeError(said) from inner
    except TypeError as exc:
        line = first_line(exc)
    assert line == ("Keras cannot infer the output of 'sampling' (Sampling): Input 'y' of "
                    "'Mul' Op has type float32 that does not match type float64 of argument "
                    "'x'.")
