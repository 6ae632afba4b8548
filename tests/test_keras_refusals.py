"""Never a wrong answer: a saved Keras model that gradscope cannot read exactly is refused
(exit 2, one line naming why) from its config.json alone, before TensorFlow is imported.

The first four models were once read as a single chain in the order Keras lists their layers:
two gave wrong gradients and a PASSED check, two crashed with an internal error. Keras now runs
them (tests/test_keras_engine.py compares every zoo model with Keras' own tape): here explain
and check give Keras' numbers for them. A Lambda layer or a custom class is refused by every
command, and its code never runs.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import run_gradscope, run_without_tensorflow


def _saved(folder: Path, name: str, build) -> Path:
    path = folder / f"{name}.keras"
    build().save(path)
    return path


def _seq_gru():
    """Input 'seq' (5, 2) → GRU 3 → Dense 'out' 1, compiled with mse."""
    import keras

    model = keras.Sequential([keras.Input((5, 2), name="seq"), keras.layers.GRU(3),
                              keras.layers.Dense(1, name="out")])
    model.compile(loss="mse")
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory, tf):
    import keras
    from keras import layers

    folder = tmp_path_factory.mktemp("refused")

    def two_heads():
        x = keras.Input((7, 5))
        h = layers.GRU(4, return_sequences=True, name="gru")(x)
        return keras.Model(x, [layers.Dense(3, name="head_a")(h),
                               layers.Dense(2, name="head_b")(h)])

    def encoder_decoder():
        x = keras.Input((7, 5))
        sequence, state = layers.GRU(4, return_sequences=True, return_state=True,
                                     name="encoder")(x)
        decoded = layers.GRU(4, return_sequences=True, name="decoder")(sequence,
                                                                      initial_state=state)
        return keras.Model(x, layers.Dense(3, name="out")(decoded))

    def return_state_two_outputs():
        x = keras.Input((7, 5))
        last, state = layers.GRU(4, return_state=True, name="gru")(x)
        return keras.Model(x, [layers.Dense(2, name="out")(last), state])

    def parallel_branches():
        x = keras.Input((7, 5))
        a, b = layers.GRU(4, name="branch_a")(x), layers.GRU(3, name="branch_b")(x)
        return keras.Model(x, layers.Dense(2, name="out")(layers.Concatenate()([a, b])))

    def with_lambda():
        # The marker path is a constant inside the lambda's own bytecode, as a user's would be.
        touch = eval(f"lambda t: (open({str(folder / 'lambda_ran')!r}, 'w').close(), t)[1]")
        return keras.Sequential([
            keras.Input((7, 5)), layers.GRU(4, return_sequences=True),
            layers.Lambda(touch, name="touch"),
        ])

    @keras.saving.register_keras_serializable(package="userpackage")
    class Scaled(layers.Layer):
        def call(self, inputs):
            return 2.0 * inputs

    def custom_layer():
        return keras.Sequential([keras.Input((7, 5)), layers.GRU(4, return_sequences=True),
                                 Scaled(name="scaled")])

    builders = {"two_heads": two_heads, "encoder_decoder": encoder_decoder,
                "return_state_two_outputs": return_state_two_outputs,
                "parallel_branches": parallel_branches, "with_lambda": with_lambda,
                "custom_layer": custom_layer}
    paths = {name: _saved(folder, name, build) for name, build in builders.items()}
    (folder / "lambda_ran").unlink()  # Keras ran the lambda once, building the model here
    return folder, paths


FORMERLY_MISREAD = ["two_heads", "encoder_decoder", "return_state_two_outputs",
                    "parallel_branches"]
LAMBDA = "layer 'touch' is a Lambda: it holds Python code"


def _assert_refused(result, path, reason):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"gradscope: error: {path}: ")
    assert reason in lines[0]


@pytest.mark.parametrize("command", ["explain", "check", "shapes"])
def test_a_lambda_is_refused_and_never_runs(models, command):
    folder, paths = models
    _assert_refused(run_without_tensorflow(command, str(paths["with_lambda"])),
                    paths["with_lambda"], LAMBDA)
    assert not (folder / "lambda_ran").exists()


@pytest.mark.parametrize("command", ["explain", "check", "shapes"])
def test_a_custom_class_is_refused_before_tensorflow(models, command):
    _, paths = models
    _assert_refused(run_without_tensorflow(command, str(paths["custom_layer"])),
                    paths["custom_layer"], "layer 'scaled' is a custom class")


@pytest.mark.parametrize("name", FORMERLY_MISREAD)
def test_the_formerly_misread_models_give_keras_numbers(models, name, tf):
    """explain's loss equals Keras' own on the same batch, and check passes."""
    import keras

    from gradscope.keras.check import check
    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.explain import explain, prepare

    _, paths = models
    job = prepare(str(paths[name]), batch_size=3)
    report = explain(job)
    engine = KerasEngine(str(paths[name]), job.outputs, job.plan)
    from gradscope.keras.data import synthetic_targets

    targets = synthetic_targets(job.plan, engine.output_shapes(job.batch.inputs), job.seed)
    model = keras.saving.load_model(paths[name], compile=False, safe_mode=True)
    x = next(iter(job.batch.inputs.values()))
    predictions = model(x, training=False)
    predictions = predictions if isinstance(predictions, list | tuple) else [predictions]
    truth = 0.0
    for entry, prediction in zip(job.plan.outputs, predictions, strict=True):
        if entry.loss == "categorical_crossentropy":
            loss = keras.losses.CategoricalCrossentropy(from_logits=entry.from_logits)
        else:
            loss = keras.losses.MeanSquaredError()
        truth += float(loss(targets[entry.output], prediction))
    assert report.loss.value == pytest.approx(truth, rel=1e-5)
    assert check(job, directions=1).summary.passed


def test_a_file_that_is_not_a_model_is_refused_in_one_line(tmp_path):
    fake = tmp_path / "notes.keras"
    fake.write_text("not a zip")
    result = run_gradscope("explain", str(fake))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"gradscope: error: {fake}: not a zip archive; expected a "
                                     "model saved by Keras 3 with model.save('model.keras')")
    # What a model.save that raised leaves behind (found tried as a new user would).
    fake.write_bytes(b"")
    result = run_gradscope("explain", str(fake))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gradscope: error: {fake}: the file is empty (0 bytes: did model.save raise while "
        "writing it?); expected a model saved by Keras 3 with model.save('model.keras')")


def test_every_problem_of_a_data_file_is_listed_at_once(tmp_path, tf):
    """--data for a .keras model: unknown arrays (with a hint), a missing input and a missing
    target, a misshapen input, sample weights for an output the model does not have and a
    batch size the arrays disagree on, all in one error, before TensorFlow is imported."""
    import keras
    from keras import layers

    sequence = keras.Input((7, 5), name="seq")
    tokens = keras.Input((7,), name="tokens", dtype="int32")
    merged = layers.Concatenate()([sequence, layers.Embedding(10, 5, name="emb")(tokens)])
    hidden = layers.GRU(4, return_sequences=True, name="gru")(merged)
    model = keras.Model([sequence, tokens], [layers.Dense(3, name="out_a")(hidden),
                                             layers.Dense(2, name="out_b")(hidden)])
    path = tmp_path / "two_by_two.keras"
    model.save(path)
    data = tmp_path / "bad.npz"
    np.savez(data, seq=np.zeros((3, 8, 6), np.float32), tokenz=np.zeros((3, 7), np.int32),
             out_a=np.zeros((2, 7, 3), np.float32), y=np.zeros((3, 7, 3), np.float32),
             **{"sample_weight/out_c": np.ones(3, np.float32)})
    result = run_without_tensorflow("explain", str(path), "--data", str(data))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line.strip() for line in result.stderr.strip().splitlines()]
    assert lines[0] == f"gradscope: error: {data}: 7 problems, one per line:"
    expected = [
        # Every axis that differs (found tried as a new user would: the first alone).
        "seq has 8 along axis 1 and 6 along axis 2 but the input 'seq' expects 7 and 5: "
        "(batch, 7, 5)",
        "has no array for the input 'tokens' (found out_a, sample_weight/out_c, seq, tokenz, "
        "y); expected arrays named seq, tokens",
        "has no targets for the output 'out_b' (found out_a, sample_weight/out_c, seq, "
        "tokenz, y); expected arrays named out_a, out_b",
        "unknown array 'tokenz' (did you mean 'tokens'?); expected the inputs seq, tokens and "
        "the outputs out_a, out_b",
        "array 'sample_weight/out_c' weighs an output the model does not have; expected "
        "sample_weight or sample_weight/NAME for an output NAME of out_a, out_b",
        "unknown array 'y' (y names the output of a model with one); expected the inputs",
        "the arrays disagree on the batch size (seq 3, out_a 2)",
    ]
    for fragment in expected:
        assert sum(fragment in line for line in lines[1:]) == 1, (fragment, lines)
    assert "unknown array 'sample_weight" not in result.stderr
    # One problem alone is its own one-line message, as before.
    alone = tmp_path / "sample_weight.npz"
    np.savez(alone, seq=np.zeros((3, 7, 5), np.float32), tokens=np.zeros((3, 7), np.int32),
             out_a=np.zeros((3, 7, 3), np.float32), out_b=np.zeros((3, 7, 2), np.float32),
             sample_weight=np.ones(3, np.float32), **{"sample_weight/out_a": np.ones(3)})
    assert _refused("explain", str(path), "--data", str(alone)) == (
        f"gradscope: error: {alone}: has both sample_weight (every output) and "
        "sample_weight/NAME arrays; expected one or the other")
    # Weights whose shape is not the leading axes of their targets': said before TensorFlow
    # loads (Keras' loss raised a 400-character TensorFlow error on them).
    shaped = tmp_path / "weights_shape.npz"
    np.savez(shaped, seq=np.zeros((3, 7, 5), np.float32), tokens=np.zeros((3, 7), np.int32),
             out_a=np.zeros((3, 7, 3), np.float32), out_b=np.zeros((3, 7, 2), np.float32),
             **{"sample_weight/out_b": np.ones((3, 5), np.float32)})
    assert _refused("explain", str(path), "--data", str(shaped)) == (
        f"gradscope: error: {shaped}: sample_weight/out_b has shape (3, 5), which does not fit "
        "the targets out_b (3, 7, 2); expected one weight per example (3,), or the leading "
        "axes of the targets' shape (per example and step, for targets per step)")
    # One array saved by np.save (found tried as a new user would: "internal error:
    # TypeError: … context manager protocol", exit 1), and --x alone, which a YAML config
    # takes with --y: each said in one line, with what a .keras model takes.
    single = tmp_path / "x_only.npy"
    np.save(single, np.zeros((3, 7, 5), np.float32))
    assert _refused("explain", str(path), "--data", str(single)) == (
        f"gradscope: error: {single}: is a single array (an .npy file, as np.save writes it); "
        "expected an .npz archive of arrays named after the model's inputs and outputs (x and "
        "y for one of each), as np.savez writes it")
    assert _refused("explain", str(path), "--x", str(single)) == (
        "gradscope: error: --x and --y go together: give both (a YAML config's; a .keras "
        "model takes --data FILE.npz)")


def _refused(*args: str) -> str:
    """The one line on stderr of a command refused with exit 2 before TensorFlow loads."""
    result = run_without_tensorflow(*args)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


def test_time_steps_for_a_model_that_fixes_its_time_axis_is_refused_before_tensorflow(models):
    """Found tried as a new user would: --time-steps 3 on a model whose input fixes 7 steps ran
    7 steps, with no word. Refused, before TensorFlow; its own length is taken."""
    _, paths = models
    result = run_without_tensorflow("diagnose", str(paths["two_heads"]), "--time-steps", "3")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert re.fullmatch(r"gradscope: error: --time-steps 3: the model's inputs fix their time "
                        r"axis \('input_layer\w*' 7 steps\); --time-steps is for a time axis "
                        r"that is None", line), line


@pytest.mark.parametrize("command", ["explain", "check", "shapes"])
def test_a_keras_file_without_its_weights_is_refused_before_tensorflow(models, command,
                                                                       tmp_path):
    _, paths = models
    saved = zipfile.ZipFile(paths["two_heads"])
    assert "model.weights.h5" in saved.namelist()
    path = tmp_path / "no_weights.keras"
    with zipfile.ZipFile(path, "w") as archive:
        for name in saved.namelist():
            if name != "model.weights.h5":
                archive.writestr(name, saved.read(name))
    result = run_without_tensorflow(command, str(path))
    _assert_refused(result, path, "the file has no weights: model.weights.h5 is missing from "
                                  "the archive (it holds config.json, metadata.json)")
    assert "--loss" not in result.stderr and "Traceback" not in result.stderr


def test_sample_weights_that_do_not_fit_their_targets_are_refused_in_python(tf):
    """``sample_weight=`` of shape (4, 7) for targets (4, 2): one sentence, not Keras' loss
    raising a TensorFlow error; one weight per example is taken."""
    import keras

    import gradscope
    from gradscope.errors import DataError

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4), keras.layers.Dense(2)])
    model.compile(loss="mse")
    x, y = np.zeros((4, 5, 3), np.float32), np.zeros((4, 2), np.float32)
    with pytest.raises(DataError, match=r"sample_weight has shape \(4, 7\), which does not "
                                        r"fit the targets y \(4, 2\)"):
        gradscope.explain(model, x=x, y=y, sample_weight=np.ones((4, 7), np.float32))
    assert gradscope.explain(model, x=x, y=y, sample_weight=np.ones(4, np.float32)).gradients


def test_arrays_under_other_names_are_said_once(tmp_path, tf):
    """Found tried as a new user would: a one-input, one-output model given arrays named
    'inputs' and 'targets' read "4 problems": the missing input and output, each naming
    both arrays found, then each array again as unknown. An unknown array that no name is
    near is said once, in the lines that list what was found."""
    import keras

    path = _saved(tmp_path, "model", _seq_gru)
    data = tmp_path / "batch.npz"
    np.savez(data, inputs=np.zeros((2, 5, 2), np.float32),
             targets=np.zeros((2, 1), np.float32))
    result = run_without_tensorflow("explain", str(path), "--data", str(data))
    assert result.returncode == 2, result.stderr
    lines = [line.strip() for line in result.stderr.strip().splitlines()]
    assert lines[0] == f"gradscope: error: {data}: 2 problems, one per line:"
    assert [line.split(" (found ")[0] for line in lines[1:]] == [
        "has no array for the input 'seq'", "has no targets for the output 'out'"]
    assert all("(found inputs, targets)" in line for line in lines[1:])
    assert lines[1].endswith("expected arrays named seq (or x)")
    # An input named x is not offered as "x (or x)" (found tried as a new user would).
    named_x = keras.Sequential([keras.Input((5, 2), name="x"), keras.layers.GRU(3),
                                keras.layers.Dense(1, name="y")])
    named_x.compile(loss="mse")
    named_x.save(path)
    result = run_without_tensorflow("explain", str(path), "--data", str(data))
    lines = [line.strip() for line in result.stderr.strip().splitlines()]
    assert lines[1].endswith("expected arrays named x") and lines[2].endswith("named y")
    # An array named as model.inputs[0].name names it in the user's session (found tried as
    # a new user would: refused without a word of why).
    np.savez(data, keras_tensor_3=np.zeros((2, 5, 2), np.float32),
             y=np.zeros((2, 1), np.float32))
    result = run_without_tensorflow("explain", str(path), "--data", str(data))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("keras_tensor… is the name Keras gives an input's tensor in "
                               "one session (model.inputs[i].name), which the saved model "
                               "does not keep: name each array after its input layer") == 1


def test_a_file_of_more_than_the_batch_says_what_it_read_and_where_the_rest_goes(tmp_path,
                                                                                 tf):
    """Found tried as a new user would: a file holding the batch as x and y and a validation
    split beside it was told "expected the inputs seq and the outputs out", names it had not
    used. Each unknown array says x and y are read too, and the last where the rest goes."""
    path = _saved(tmp_path, "model", _seq_gru)
    data = tmp_path / "dataset.npz"
    np.savez(data, x=np.zeros((2, 5, 2), np.float32), y=np.zeros((2, 1), np.float32),
             x_val=np.zeros((1, 5, 2), np.float32), y_val=np.zeros((1, 1), np.float32))
    result = run_without_tensorflow("explain", str(path), "--data", str(data))
    assert result.returncode == 2, result.stderr
    lines = [line.strip() for line in result.stderr.strip().splitlines()]
    assert lines == [
        f"gradscope: error: {data}: 2 problems, one per line:",
        "unknown array 'x_val'; expected the inputs seq (or x) and the outputs out (or y)",
        "unknown array 'y_val'; expected the inputs seq (or x) and the outputs out (or y); "
        "the file holds the one batch gradscope reads: keep other arrays (a validation "
        "split, say) in another"]


def test_an_input_of_other_dimensions_is_said_with_its_file(tmp_path, tf):
    """Found tried as a new user would: of the errors in an .npz, the one of an input with
    too few dimensions alone was said without the file's name."""
    path = _saved(tmp_path, "model", _seq_gru)
    data = tmp_path / "batch.npz"
    np.savez(data, seq=np.zeros((2, 5), np.float32), out=np.zeros((2, 1), np.float32))
    result = run_without_tensorflow("explain", str(path), "--data", str(data))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"gradscope: error: {data}: seq has 2 dimensions (2, 5); "
                                     "the input 'seq' expects 3: (batch, 5, 2)")
