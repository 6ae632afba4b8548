"""Supplied batches: they override the synthetic one, and every mismatch is named."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_gradscope

from gradscope.errors import DataError
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import load_batch, validate_batch

SPEC = load_spec({"input_size": 6, "time_steps": 5, "batch_size": 4,
                  "layers": [{"gru": 3}, {"lstm": 2}, {"dense": 3}]})
rng = np.random.default_rng(0)


def _arrays(batch=4, steps=5, features=6, classes=3, **extra):
    return {"x": rng.standard_normal((batch, steps, features)),
            "y": np.eye(classes)[rng.integers(0, classes, (batch, steps))], **extra}


def test_sizes_come_from_the_data_and_states_default_to_zeros():
    spec, batch = validate_batch(SPEC, _arrays(batch=7, steps=9, **{"lstm_1/c0": np.ones((7, 2))}))
    assert (spec.batch_size, spec.time_steps) == (7, 9)
    assert batch.x.shape == (7, 9, 6) and batch.x.dtype == np.float32
    assert set(batch.initial_states) == {"gru_1/h0", "lstm_1/h0", "lstm_1/c0"}
    assert not batch.initial_states["gru_1/h0"].any()
    assert batch.initial_states["lstm_1/c0"].all()


@pytest.mark.parametrize("arrays,fragment,where", [
    (_arrays(features=5), "x has 5 features per step but the config says input_size 6", "x"),
    (_arrays(classes=4), "y has 4 along its outputs axis (dimension 2) but dense_1 has 3 units",
     "y"),
    ({"x": rng.standard_normal((4, 6)), "y": np.zeros((4, 3))}, "x has 2 dimensions", "x"),
    ({**_arrays(), "y": np.eye(3)[rng.integers(0, 3, (3, 5))]},
     "y has 3 along its batch axis (dimension 0) but x has 4", "y"),
    ({"x": rng.standard_normal((4, 5, 6))}, "has no array 'y'", "y"),
    (_arrays(**{"gru_3/h0": np.zeros((4, 3))}), "unknown array 'gru_3/h0' (did you mean",
     "gru_3/h0"),
    (_arrays(**{"gru_1/h0": np.zeros((4, 5))}), "gru_1/h0 has shape (4, 5); expected (4, 3)",
     "gru_1/h0"),
    ({**_arrays(), "y": np.full((4, 5, 3), 0.5)}, "sums to 1.5", "y"),
    ({**_arrays(), "x": np.array([["a"]])}, "x has dtype <U1", "x"),
])
def test_mismatches_name_the_array_the_dimension_and_both_numbers(arrays, fragment, where):
    with pytest.raises(DataError) as caught:
        validate_batch(SPEC, arrays)
    assert fragment in caught.value.message
    assert caught.value.where == where
    assert "\n" not in caught.value.message


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_name_the_array_and_the_first_bad_index(value):
    arrays = _arrays()
    arrays["x"][1, 2, 3] = value
    arrays["x"][3, 0, 0] = value
    with pytest.raises(DataError, match=r"x has a non-finite value .* at index \(1, 2, 3\)"):
        validate_batch(SPEC, arrays)


def test_pickled_arrays_are_refused_without_being_loaded(tmp_path):
    target = tmp_path / "marker"
    evil = tmp_path / "x.npy"

    class Boom:
        def __reduce__(self):
            return (open, (str(target), "w"))

    np.save(evil, np.array([Boom()], dtype=object), allow_pickle=True)
    np.save(tmp_path / "y.npy", np.zeros((1, 1, 3)))
    with pytest.raises(DataError, match="pickled Python objects"):
        load_batch(SPEC, x=evil, y=tmp_path / "y.npy")
    assert not target.exists()


def test_cli_supplied_data_is_used_and_errors_exit_2(tmp_path):
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    np.savez(good, **_arrays(batch=2, steps=3))
    np.savez(bad, **_arrays(features=7))
    config = tmp_path / "c.yaml"
    config.write_text("input_size: 6\ntime_steps: 5\nbatch_size: 4\n"
                      "layers: [{gru: 3}, {lstm: 2}, {dense: 3}]\n")
    ok = run_gradscope("explain", str(config), "--data", str(good), "--json")
    assert ok.returncode == 0, ok.stderr
    assert '"batch_size": 2' in ok.stdout and '"time_steps": 3' in ok.stdout
    failed = run_gradscope("explain", str(config), "--data", str(bad))
    assert failed.returncode == 2
    # The file named (found tried as a new user would: it was not, for this error).
    assert (f"{bad}: x has 7 features per step but the config says input_size 6"
            in failed.stderr)
    assert "Traceback" not in failed.stderr and len(failed.stderr.splitlines()) == 1
