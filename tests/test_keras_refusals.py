"""Never a wrong answer: a saved Keras model that gradscope cannot read exactly is refused
(exit 2, one line naming why) from its config.json alone, before TensorFlow is imported.

The first four models were once read as a single chain in the order Keras lists their layers:
two gave wrong gradients and a PASSED check, two crashed with an internal error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_gradscope


def _saved(folder: Path, name: str, build) -> Path:
    path = folder / f"{name}.keras"
    build().save(path)
    return path


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

    builders = {"two_heads": two_heads, "encoder_decoder": encoder_decoder,
                "return_state_two_outputs": return_state_two_outputs,
                "parallel_branches": parallel_branches, "with_lambda": with_lambda}
    paths = {name: _saved(folder, name, build) for name, build in builders.items()}
    (folder / "lambda_ran").unlink()  # Keras ran the lambda once, building the model here
    return folder, paths


REASONS = {
    "two_heads": "1 input(s) and 2 output(s)",
    "encoder_decoder": "layer 'encoder' returns its states",
    "return_state_two_outputs": "1 input(s) and 2 output(s)",
    "parallel_branches": "feeds several layers (branch_a, branch_b)",
    "with_lambda": "layer 'touch' is a Lambda: it holds Python code",
}


@pytest.mark.parametrize("command", ["explain", "check"])
@pytest.mark.parametrize("name", sorted(REASONS))
def test_refused_before_tensorflow_is_imported(models, name, command):
    folder, paths = models
    result = run_gradscope(command, str(paths[name]), env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"gradscope: error: {paths[name]}: ")
    assert REASONS[name] in errors[0]
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]
    assert not any(module.split(".")[0] in {"tensorflow", "keras"} for module in imported)
    assert not (folder / "lambda_ran").exists()


def test_a_file_that_is_not_a_model_is_refused_in_one_line(tmp_path):
    fake = tmp_path / "notes.keras"
    fake.write_text("not a zip")
    result = run_gradscope("explain", str(fake))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"gradscope: error: {fake}: not a zip archive; expected a "
                                     "model saved by Keras 3 with model.save('model.keras')")
