"""The resource guard's estimate is the whole process's peak memory, TensorFlow included.

No TensorFlow run here: the estimate is pure Python, and a refusal happens before TensorFlow is
imported. bench/memory_estimate.py compares the estimate with measured peaks.
"""

from __future__ import annotations

import pytest
from conftest import run_without_tensorflow

from gradscope.guard import BASELINE_TERM, PROCESS_BASELINE, parse_size
from gradscope.yaml.config import load_spec
from gradscope.yaml.memory import estimate

#: Peak RSS of a process that only imports TensorFlow 2.21 and runs one op (measured).
TENSORFLOW_IMPORT_PEAK = 549 << 20


@pytest.mark.parametrize("command,across_time", [
    ("explain", False), ("explain", True), ("check", False),
])
def test_the_seed_estimate_includes_tensorflow_itself(command, across_time):
    terms = estimate(load_spec(), command, across_time)
    assert terms[BASELINE_TERM] == PROCESS_BASELINE >= TENSORFLOW_IMPORT_PEAK
    assert sum(terms.values()) > TENSORFLOW_IMPORT_PEAK
    assert all(value > 0 for value in terms.values())


def test_check_and_across_time_estimate_more_than_explain():
    spec = load_spec()
    plain = sum(estimate(spec, "explain").values())
    assert sum(estimate(spec, "explain", across_time=True).values()) > plain
    assert sum(estimate(spec, "check").values()) > plain


@pytest.mark.parametrize("command", ["explain", "check"])
def test_twenty_megabytes_is_refused_for_the_seed_model_before_tensorflow(command):
    assert parse_size("20M") == 20 << 20
    result = run_without_tensorflow(command, "--max-memory", "20M")  # exit 99 if TF loaded
    assert result.returncode == 2, result.stderr
    assert "more than the limit 20.0 MiB" in result.stderr
    assert "TensorFlow itself takes about 620.0 MiB" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def long_lstm(tmp_path_factory, tf):
    """A saved Keras model of user size: LSTM 256 → LSTM 256 → Dense 10 over 1000 steps."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1000, 64)),
                              keras.layers.LSTM(256, return_sequences=True),
                              keras.layers.LSTM(256), keras.layers.Dense(10)])
    model.compile(loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    path = tmp_path_factory.mktemp("guard") / "lstm.keras"
    model.save(path)
    return path


@pytest.mark.parametrize("command", ["explain", "check"])
def test_a_keras_model_over_the_limit_is_refused_before_tensorflow(long_lstm, command):
    result = run_without_tensorflow(command, str(long_lstm), "--max-memory", "1G")
    assert result.returncode == 2, result.stderr  # 99: TensorFlow was imported
    assert f"this {command} would need about" in result.stderr
    assert "more than the limit 1.0 GiB" in result.stderr
    assert "activations the recurrent layers keep" in result.stderr or command == "explain"


def test_the_keras_estimate_grows_with_steps_units_and_batch(long_lstm):
    import gradscope

    def total(command, **options):
        return sum(gradscope.estimate_memory(str(long_lstm), command, **options).values())

    explain = total("explain")
    assert PROCESS_BASELINE < explain < total("check", examples="all")
    assert total("check") < total("check", examples="all")  # on 16 of the 32 examples
    assert total("explain", batch_size=128) > 2 * (explain - PROCESS_BASELINE)
    # Measured (bench/memory_estimate.py): 1593 MiB at batch 32; within 1.5× either way.
    assert 1593 / 1.5 < explain / (1 << 20) < 1593 * 1.5


def test_jacobians_add_their_term_and_are_refused_over_the_limit(long_lstm):
    """``--jacobians`` reads one call at a time: its rerun in float64 and the tangents of
    its [h, c], in blocks; a limit between explain's estimate and this one refuses it."""
    import gradscope

    plain = gradscope.estimate_memory(str(long_lstm), "explain")
    terms = gradscope.estimate_memory(str(long_lstm), "explain", across_time=True)
    term = terms.pop("the state Jacobians of one recurrent call (--jacobians)")
    probes = terms.pop("the per-step state gradients of --flow (its probes)")
    assert terms == plain and term > 64 << 20  # the (32, 512, 512) Jacobian alone
    # --flow's zero per state and step, its gradient and the total read from it.
    batch, steps, states = 32, 1000, 2 * 2 * 256
    assert probes == 3 * batch * steps * states * 4
    limit = sum(plain.values()) + term // 2
    result = run_without_tensorflow("explain", str(long_lstm), "--jacobians",
                                    "--max-memory", str(limit))
    assert result.returncode == 2, result.stderr  # 99: TensorFlow was imported
    assert "this explain would need about" in result.stderr


def test_estimate_memory_is_what_the_guard_holds_against_the_limit():
    """The public estimate is the guard's: a limit just under its sum is refused before
    anything runs; with a flow across time it is larger; a command other than explain or
    check is refused in one line."""
    import gradscope
    from gradscope.errors import ConfigError

    terms = gradscope.estimate_memory(None, "check")
    assert set(terms) and all(value > 0 for value in terms.values())
    total = sum(terms.values())
    with pytest.raises(ConfigError) as caught:
        gradscope.check(None, max_memory=total - 1)
    assert "this check would need about" in caught.value.message
    across = sum(gradscope.estimate_memory(None, "explain", across_time=True).values())
    assert across > sum(gradscope.estimate_memory(None, "explain").values())
    with pytest.raises(ConfigError) as refused:
        gradscope.estimate_memory(None, "train")
    assert refused.value.message == "command='train': expected 'explain' or 'check'"
