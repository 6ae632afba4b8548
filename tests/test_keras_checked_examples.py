"""check on a large batch takes at most 16 of its examples (``--examples``): the ones that
differ (a mask's shortest and longest, the smallest and largest sample weight) and the rest
drawn with the seed. The truth: Keras' own loss on exactly those examples, and mutants that
must still be caught."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import keras_tape, run_gradscope, run_without_tensorflow
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradscope
from gradscope.errors import ConfigError
from gradscope.keras.checked_examples import DEFAULT_EXAMPLES, choose, examples_option
from gradscope.keras.explain import prepare

STEPS, FEATURES = 6, 3


@pytest.fixture(scope="module")
def masked(tf: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """Masking → LSTM → Dense, saved: padded steps are all-zero features."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(61)
    model = keras.Sequential([keras.Input((STEPS, FEATURES), name="x"),
                              layers.Masking(0.0, name="pad"), layers.LSTM(4, name="lstm"),
                              layers.Dense(2, name="head")])
    model.compile(loss="mse")
    path = tmp_path_factory.mktemp("examples") / "masked.keras"
    model.save(path)
    return model, path


def _batch(size: int, lengths: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, STEPS, FEATURES)).astype("float32")
    for row, length in enumerate(lengths):
        x[row, length:] = 0.0
    return x, rng.standard_normal((size, 2)).astype("float32")


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 60), most=st.integers(1, 40), seed=st.integers(0, 3),
       data=st.data())
def test_the_sample_keeps_the_examples_that_differ(masked, size, most, seed, data):
    _, path = masked
    lengths = np.array(data.draw(st.lists(st.integers(1, STEPS), min_size=size,
                                          max_size=size)))
    weights = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                                          min_size=size, max_size=size)), "float32")
    x, y = _batch(size, lengths)
    job = prepare(str(path), x=x, y=y, sample_weight=weights, seed=seed)
    chosen = choose(job, most)
    assert chosen.of == size and chosen.checked == min(size, most)
    if size <= most:
        assert chosen.indices is None
        return
    indices = np.array(chosen.indices)
    assert list(indices) == sorted(set(indices)) and indices.min() >= 0 and indices.max() < size
    assert chosen == choose(job, most), "the sample is the seed's, every time"
    if most >= 4:  # room for every picked example
        if lengths.min() < lengths.max():
            assert lengths[indices].min() == lengths.min()
            assert lengths[indices].max() == lengths.max()
        if weights.min() < weights.max():
            assert weights[indices].min() == weights.min()
            assert weights[indices].max() == weights.max()


def test_check_runs_on_exactly_the_examples_it_names(masked, tf):
    """The loss check reports is Keras' own loss on those examples and no others; a wrong
    gradient is still caught on them."""
    model, _ = masked
    size = 40
    x, y = _batch(size, np.arange(size) % STEPS + 1, seed=3)
    report = gradscope.check(model, x=x, y=y, directions=1)
    examples = report.examples
    assert examples is not None and (examples.checked, examples.of) == (DEFAULT_EXAMPLES, size)
    assert report.summary.passed
    rows = examples.indices
    assert rows is not None and len(rows) == DEFAULT_EXAMPLES
    loss, _ = keras_tape(model, x[rows], y[rows])
    assert report.loss.value == pytest.approx(loss, rel=1e-5)
    assert report.loss.value != pytest.approx(keras_tape(model, x, y)[0], rel=1e-3)
    assert 0 in rows and STEPS - 1 in rows, "the shortest and longest after masking are in"

    def mutate(copy: Any) -> None:
        kernel = copy.get_layer("head").kernel
        kernel.assign(kernel.numpy() * 1.01)

    mutated = gradscope.check(model, x=x, y=y, directions=1, after_autodiff=mutate)
    assert not mutated.summary.passed

    whole = gradscope.check(model, x=x, y=y, directions=1, examples="all")
    assert whole.examples is not None and whole.examples.indices is None
    assert whole.examples.checked == size
    assert whole.loss.value == pytest.approx(keras_tape(model, x, y)[0], rel=1e-5)


def test_the_examples_are_named_in_the_json_and_the_text(masked, tmp_path):
    _, path = masked
    x, y = _batch(12, np.arange(12) % STEPS + 1, seed=4)
    data = tmp_path / "batch.npz"
    np.savez(data, x=x, head=y)
    result = run_gradscope("check", str(path), "--data", str(data), "--examples", "5",
                           "--directions", "1", "--json", "-q")
    assert result.returncode == 0, result.stderr
    examples = json.loads(result.stdout)["examples"]
    assert examples["checked"] == 5 and examples["of"] == 12 and len(examples["indices"]) == 5
    assert any("fewest kept steps of input x" in p for p in examples["picked"])
    junit = tmp_path / "gradients.xml"
    text = run_gradscope("check", str(path), "--data", str(data), "--examples", "5",
                         "--directions", "1", "--junit", str(junit), env={"COLUMNS": "80"})
    assert text.returncode == 0, text.stderr
    flat = " ".join(text.stdout.split())
    assert "checked on 5 of the 12 examples" in flat
    # How to check every one, said for the command line and for Python alike.
    assert 'every one: --examples all, or examples="all" in Python' in flat
    picked = examples["picked"]
    # Indices and the count drawn told apart (found tried as a new user would).
    assert ("in Python): " + "; ".join(f"example {p}" for p in picked)
            + f"; {5 - len(picked)} others drawn with the seed") in flat
    fewest = next(p for p in picked if "(the fewest kept steps of input x)" in p)
    assert f"example {fewest}" in flat
    import xml.etree.ElementTree as ET

    (prop,) = [p for p in ET.parse(junit).iter("property") if p.get("name") == "examples"]
    assert prop.get("value") == "5 of 12: " + " ".join(map(str, examples["indices"]))


def test_the_test_helper_passes_examples_on(masked, tf):
    from gradscope.testing import assert_gradients

    model, _ = masked
    x, y = _batch(10, np.arange(10) % STEPS + 1, seed=5)
    report = assert_gradients(model, x, y, examples=3)
    assert report.examples is not None and report.examples.checked == 3


@pytest.mark.parametrize(("args", "message"), [
    (["--examples", "0"], "--examples 0: expected a whole number of examples (1 or more) or "
                          "'all'"),
    (["--examples", "some"], "--examples some: expected a whole number"),
])
def test_a_bad_count_is_refused_before_tensorflow(masked, args, message):
    _, path = masked
    result = run_without_tensorflow("check", str(path), *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_yaml_config_refuses_examples():
    result = run_without_tensorflow("check", "--examples", "4")
    assert result.returncode == 2
    assert "--examples is for Keras models" in result.stderr


def test_examples_in_python():
    assert examples_option(None) == DEFAULT_EXAMPLES
    assert examples_option("all") is None and examples_option("7") == 7
    for wrong in (0, -1, 2.5, True, "many"):
        with pytest.raises(ConfigError, match="examples="):
            examples_option(wrong)


def test_the_memory_guard_counts_the_examples_check_takes(masked):
    _, path = masked
    large = gradscope.estimate_memory(str(path), "check", batch_size=512, time_steps=STEPS)
    default = gradscope.estimate_memory(str(path), "check", batch_size=DEFAULT_EXAMPLES,
                                        time_steps=STEPS)
    every = gradscope.estimate_memory(str(path), "check", batch_size=512, time_steps=STEPS,
                                      examples="all")
    assert sum(large.values()) == sum(default.values()) < sum(every.values())


def test_a_model_with_a_fixed_batch_is_checked_whole(tf, tmp_path):
    import keras
    from keras import layers

    model = keras.Sequential([keras.Input(batch_shape=(40, STEPS, FEATURES)),
                              layers.GRU(3, stateful=True), layers.Dense(1)])
    model.compile(loss="mse")
    path = tmp_path / "stateful.keras"
    model.save(path)
    job = prepare(str(path))
    chosen = choose(job, DEFAULT_EXAMPLES)
    assert chosen.indices is None and chosen.checked == 40
    assert chosen.whole_because is not None and "fixes the batch size" in chosen.whole_because
