"""``gradscope.testing`` in a user's own suite: pytest is run on the example test file
(examples/test_my_gradients.py) as a user would run it, and the helpers are held to their
word here: the user's objects stay as they were, a wrong gradient raises AssertionError
carrying the diagnosis, and a right one passes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

EXAMPLE = REPO / "examples" / "test_my_gradients.py"


def test_pytest_passes_on_the_example_test_file():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(EXAMPLE)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "5 passed" in done.stdout


@pytest.fixture(scope="module")
def gru_model(tf):
    import keras

    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((7, 3)), keras.layers.GRU(4, name="gru"),
                              keras.layers.Dense(2, name="head")])
    model.compile(loss="mse")
    rng = np.random.default_rng(1)
    return (model, rng.standard_normal((5, 7, 3)).astype("float32"),
            rng.standard_normal((5, 2)).astype("float32"))


def test_assert_gradients_passes_and_leaves_the_model_as_it_was(gru_model):
    from gradscope.testing import assert_gradients

    model, x, y = gru_model
    before = [w.copy() for w in model.get_weights()]
    report = assert_gradients(model, x, y)
    assert report.summary.passed and report.summary.checked_tensors >= 6
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    assert model.dtype_policy.name == "float32"


def test_a_wrong_tape_raises_with_the_diagnosis(gru_model, monkeypatch):
    """The mutant: the tape's gradient of the GRU kernel halved before the witnesses see it
    (what a wrong custom gradient does). The AssertionError names the tensor and the witness;
    both witnesses catch it."""
    from gradscope.keras.engine import KerasEngine
    from gradscope.testing import assert_gradients

    model, x, y = gru_model
    original = KerasEngine.run

    def halved(engine, *args, **kwargs):
        # Before either witness starts: the NumPy reference runs on a thread of its own.
        autodiff = original(engine, *args, **kwargs)
        for path in autodiff.gradients:
            if path.endswith("gru_cell/kernel"):
                autodiff.gradients[path] = autodiff.gradients[path] * 0.5
        return autodiff

    monkeypatch.setattr(KerasEngine, "run", halved)
    with pytest.raises(AssertionError) as raised:
        assert_gradients(model, x, y)
    message = str(raised.value)
    assert "gru/kernel · finite diff.: relative error" in message
    assert "gru/kernel · NumPy ref." in message
    assert "1 of" in message


def test_check_layer_copies_the_layer_and_checks_a_cell_over_time(tf):
    import keras

    from gradscope.testing import check_layer

    x = np.random.default_rng(2).standard_normal((3, 5, 2)).astype("float32")
    layer = keras.layers.SimpleRNN(3, return_sequences=True, name="rnn")
    layer.build((None, 5, 2))
    before = [w.copy() for w in layer.get_weights()]
    report = check_layer(layer, x)
    assert {t.name for t in report.tensors} >= {"rnn/kernel", "input inputs"}
    assert all(np.array_equal(a, b) for a, b in zip(before, layer.get_weights(), strict=True))
    assert not layer._inbound_nodes  # the user's layer was never called
    cell = check_layer(keras.layers.GRUCell(3, name="cell"), x)
    assert any(t.name.endswith("kernel") for t in cell.tensors)
