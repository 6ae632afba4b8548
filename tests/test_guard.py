"""The resource guard's estimate is the whole process's peak memory, TensorFlow included.

No TensorFlow run here: the estimate is pure Python, and a refusal happens before TensorFlow is
imported. bench/memory_estimate.py compares the estimate with measured peaks.
"""

from __future__ import annotations

import pytest
from conftest import run_without_tensorflow

from gradscope.guard import BASELINE_TERM, PROCESS_BASELINE, estimate, parse_size
from gradscope.yaml.config import load_spec

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
