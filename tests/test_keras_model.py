"""A saved Keras 3 model with a None time axis: --time-steps sizes its synthetic batch."""

from __future__ import annotations

import json

import pytest
from conftest import run_gradscope


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tf):
    import keras

    folder = tmp_path_factory.mktemp("models")
    inputs = keras.Input((None, 5))
    hidden = keras.layers.SimpleRNN(4, name="rnn")(inputs)
    functional = keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden))
    paths = {"functional": folder / "functional.keras"}
    functional.save(paths["functional"])
    return paths, None, functional


def test_cli_explains_a_functional_model_given_its_missing_time_steps(saved):
    paths, _, functional = saved
    missing = run_gradscope("explain", str(paths["functional"]))
    assert missing.returncode == 2
    assert "its axis 1 is None; pass --time-steps" in missing.stderr
    result = run_gradscope("explain", str(paths["functional"]), "--time-steps", "7",
                           "--batch-size", "2", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["source"] == "keras"
    assert [layer["name"] for layer in document["layers"]] == ["rnn", "out"]
    assert [g["shape"] for g in document["gradients"]] == [
        list(v.shape) for v in functional.weights]
    assert "sum over the batch" in document["gradients"][-1]["meaning"]
