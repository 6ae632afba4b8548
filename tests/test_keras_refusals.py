"""Never a wrong answer: a saved Keras model that gradscope cannot read exactly is refused
(exit 2, one line naming why) from its config.json alone, before TensorFlow is imported.

The first four models were once read as a single chain in the order Keras lists their layers:
two gave wrong gradients and a PASSED check, two crashed with an internal error. ``explain``
now runs them through Keras itself (tests/test_keras_engine.py compares them with Keras' own
tape); ``check`` still refuses them until it reads any graph too. A Lambda layer is refused by
both, and its code never runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_gradscope, run_without_tensorflow


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


CHECK_REFUSES = {
    "two_heads": "1 input(s) and 2 output(s)",
    "encoder_decoder": "layer 'encoder' returns its states",
    "return_state_two_outputs": "1 input(s) and 2 output(s)",
    "parallel_branches": "feeds several layers (branch_a, branch_b)",
}
LAMBDA = "layer 'touch' is a Lambda: it holds Python code"


def _assert_refused(result, path, reason):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"gradscope: error: {path}: ")
    assert reason in lines[0]


@pytest.mark.parametrize("name", sorted(CHECK_REFUSES))
def test_check_refuses_what_is_not_a_chain_before_tensorflow(models, name):
    _, paths = models
    _assert_refused(run_without_tensorflow("check", str(paths[name])), paths[name],
                    CHECK_REFUSES[name])


@pytest.mark.parametrize("command", ["explain", "check", "shapes"])
def test_a_lambda_is_refused_and_never_runs(models, command):
    folder, paths = models
    _assert_refused(run_without_tensorflow(command, str(paths["with_lambda"])),
                    paths["with_lambda"], LAMBDA)
    assert not (folder / "lambda_ran").exists()


@pytest.mark.parametrize("name", sorted(CHECK_REFUSES))
def test_explain_reads_the_formerly_misread_models(models, name):
    _, paths = models
    result = run_gradscope("explain", str(paths[name]), "--batch-size", "3", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads(result.stdout)
    assert document["source"] == "keras" and document["loss"]["value"] > 0
    assert all(g["stats"]["l2"] > 0 for g in document["gradients"])


def test_a_file_that_is_not_a_model_is_refused_in_one_line(tmp_path):
    fake = tmp_path / "notes.keras"
    fake.write_text("not a zip")
    result = run_gradscope("explain", str(fake))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"gradscope: error: {fake}: not a zip archive; expected a "
                                     "model saved by Keras 3 with model.save('model.keras')")
