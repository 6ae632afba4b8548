"""`check --against`: the correct hand-written BPTT passes, every classic bug is caught and
named, and bad targets are clean errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO, run_gradscope

from gradscope.algebra import model_shapes
from gradscope.data import initial_params, synthetic_batch
from gradscope.errors import ConfigError
from gradscope.model import Engine
from gradscope.spec import load_spec
from gradscope.witnesses.context import CheckContext
from gradscope.witnesses.user_backward import against_witness, load_against

ZOO = str(REPO / "tests" / "against" / "user_gru_bptt.py")
RECURRENT = [f"gru_{k}/{w}" for k in (1, 2) for w in ("w_ru", "b_ru", "w_c", "b_c")]
STATES = ["gru_1/h0", "gru_2/h0"]


def _context(loss: str) -> CheckContext:
    spec = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 4, "loss": loss,
                      "layers": [{"gru": 4}, {"gru": 3}, {"dense": 3}], "dtype": "float64"})
    algebra = model_shapes(spec)
    params = initial_params(algebra)
    batch = synthetic_batch(algebra)
    rng = np.random.default_rng(4)
    for value in batch.initial_states.values():
        value[...] = rng.standard_normal(value.shape)
    engine = Engine(algebra)
    return CheckContext(algebra, params, batch, engine, engine.run(params, batch))


@pytest.fixture(scope="module", params=["softmax_cross_entropy", "mse"])
def zoo(request, tf):
    namespace = load_against(f"{ZOO}:correct").__globals__  # the loaded file's module
    namespace["LOSS"] = request.param
    return _context(request.param), SimpleNamespace(**namespace)


def _failures(ctx, module, name):
    results = against_witness(ctx, getattr(module, name))
    return {r.tensor: r for r in results if not r.passed}


def test_the_correct_backward_passes_every_tensor(zoo):
    ctx, module = zoo
    results = against_witness(ctx, module.correct)
    assert {r.tensor for r in results} == {*ctx.params, *STATES, "x"}
    assert all(r.passed for r in results), [(r.tensor, r.error) for r in results if not r.passed]


@pytest.mark.parametrize("mutant,expected", [
    ("no_carry", {*RECURRENT, *STATES, "x"}),
    ("swap_ru", {*RECURRENT, "dense_1/kernel", "dense_1/bias", *STATES, "x"}),
    ("drop_one_minus_u", {*RECURRENT, *STATES, "x"}),
    ("dense_last_step_only", {"dense_1/kernel"}),
    ("sum_loss", {*RECURRENT, "dense_1/kernel", "dense_1/bias", *STATES, "x"}),
    ("bias_averaged", {"dense_1/bias"}),
    ("doc_plus_u", {*RECURRENT, *STATES, "x"}),
    ("swap_w_ru_w_c", {"gru_1/w_ru", "gru_1/w_c", "gru_2/w_ru", "gru_2/w_c"}),
    ("one_element_off", {"dense_1/kernel"}),
])
def test_every_mutant_is_caught_and_the_wrong_tensors_are_named(zoo, mutant, expected):
    ctx, module = zoo
    assert set(_failures(ctx, module, mutant)) == expected


def test_a_missing_carry_is_located_in_time_with_its_hint(zoo):
    ctx, module = zoo
    x = _failures(ctx, module, "no_carry")["x"]
    assert x.first_bad_step == 4  # T−2: the last step is right
    assert "the gradient carried from t+1 is not added" in x.detail
    inside = _failures(ctx, module, "drop_one_minus_u")["x"]
    assert inside.first_bad_step == 5 and "inside one step" in inside.detail


def test_recognisable_scale_and_shape_mistakes_get_hints(zoo):
    ctx, module = zoo
    assert "sum loss" in _failures(ctx, module, "sum_loss")["gru_1/w_ru"].detail
    assert "averaged" in _failures(ctx, module, "bias_averaged")["dense_1/bias"].detail
    swapped = _failures(ctx, module, "swap_w_ru_w_c")["gru_1/w_ru"]
    assert "shape (9, 4), expected (9, 8); that is the shape of gru_1/w_c" in swapped.detail
    off = _failures(ctx, module, "one_element_off")["dense_1/kernel"]
    assert "element (0, 0)" in off.detail


def test_missing_unknown_and_crashing_functions_are_reported(zoo):
    ctx, module = zoo
    partial = {r.tensor: r for r in against_witness(
        ctx, lambda p, x, y, h0: {"gru_1/w_ru": module.correct(p, x, y, h0)["gru_1/w_ru"],
                                  "gru_1/wru": 0})}
    assert partial["gru_1/w_ru"].passed
    assert "did you mean 'gru_1/w_ru'" in partial["gru_1/wru"].detail
    assert partial["dense_1/kernel"].detail == "missing from the returned dict"
    assert "x" not in partial  # x is optional
    crash = against_witness(ctx, lambda *args: 1 / 0)
    assert crash[0].tensor == "<call>" and "ZeroDivisionError" in crash[0].detail


def test_loader_errors_are_one_line_config_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import nonexistent_module_xyz\n")
    for target, fragment in [
        (f"{ZOO}", "expected FILE.py:FUNC"),
        (f"{tmp_path}/missing.py:f", "file not found"),
        (f"{ZOO}:corect", "did you mean 'correct'"),
        (f"{broken}:f", "raised ModuleNotFoundError"),
        (f"{tmp_path}:f", "expected a Python file"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_against(target)
        assert fragment in caught.value.message and "\n" not in caught.value.message


def test_cli_exit_codes_for_against(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("input_size: 5\ntime_steps: 6\nbatch_size: 4\n"
                      "layers: [{gru: 4}, {gru: 3}, {dense: 3}]\n")
    good = run_gradscope("check", str(config), "--against", f"{ZOO}:correct")
    assert good.returncode == 0, good.stdout[-1500:] + good.stderr
    bad = run_gradscope("check", str(config), "--against", f"{ZOO}:no_carry", "--json")
    assert bad.returncode == 1
    document = json.loads(bad.stdout)
    assert document["summary"]["passed"] is False
    assert "x" in document["summary"]["failed_tensors"]
    usage = run_gradscope("check", str(config), "--against", f"{ZOO}:nope")
    assert usage.returncode == 2 and "has no function 'nope'" in usage.stderr


LSTM_ZOO = str(REPO / "tests" / "against" / "user_lstm_bptt.py")
LSTM_WEIGHTS = [f"lstm_{k}/{w}" for k in (1, 2) for w in ("kernel", "bias")]
LSTM_STATES = [f"lstm_{k}/{s}" for k in (1, 2) for s in ("h0", "c0")]


@pytest.fixture(scope="module")
def lstm_zoo(tf):
    spec = load_spec({"input_size": 4, "time_steps": 5, "batch_size": 3, "dtype": "float64",
                      "layers": [{"lstm": 3}, {"lstm": 2}, {"dense": 3}]})
    algebra = model_shapes(spec)
    params = initial_params(algebra)
    batch = synthetic_batch(algebra)
    rng = np.random.default_rng(6)
    for value in batch.initial_states.values():
        value[...] = rng.standard_normal(value.shape)
    engine = Engine(algebra)
    ctx = CheckContext(algebra, params, batch, engine, engine.run(params, batch))
    return ctx, SimpleNamespace(**load_against(f"{LSTM_ZOO}:correct").__globals__)


@pytest.mark.parametrize("mutant,expected", [
    ("correct", set()),
    ("no_h_carry", {*LSTM_WEIGHTS, *LSTM_STATES, "x"}),
    ("no_c_carry", {*LSTM_WEIGHTS, *LSTM_STATES, "x"}),
    ("no_tanh_derivative", {*LSTM_WEIGHTS, *LSTM_STATES, "x"}),
    ("swap_i_f", {*LSTM_WEIGHTS, *LSTM_STATES, "x"}),
    ("no_forget_bias", {*LSTM_WEIGHTS, "dense_1/kernel", "dense_1/bias", *LSTM_STATES, "x"}),
    ("sum_loss", {*LSTM_WEIGHTS, "dense_1/kernel", "dense_1/bias", *LSTM_STATES, "x"}),
    ("one_element_off", {"lstm_1/kernel"}),
])
def test_lstm_zoo_is_caught_with_h0_and_c0(lstm_zoo, mutant, expected):
    ctx, module = lstm_zoo
    results = against_witness(ctx, getattr(module, mutant))
    assert {r.tensor for r in results} == {*ctx.params, *LSTM_STATES, "x"}
    assert {r.tensor for r in results if not r.passed} == expected
    if mutant in ("no_h_carry", "no_c_carry"):
        x = next(r for r in results if r.tensor == "x")
        assert x.first_bad_step == 3 and "carried from t+1" in x.detail


@pytest.mark.parametrize("mutant", ["correct", "no_carry", "swap_ru", "drop_one_minus_u",
                                    "dense_last_step_only", "sum_loss", "bias_averaged",
                                    "doc_plus_u", "swap_w_ru_w_c", "one_element_off"])
def test_every_mutant_makes_the_cli_exit_1_and_the_correct_one_0(mutant, tmp_path, tf, capsys):
    from gradscope.cli import main

    config = tmp_path / "c.yaml"
    config.write_text("input_size: 5\ntime_steps: 6\nbatch_size: 4\n"
                      "layers: [{gru: 4}, {gru: 3}, {dense: 3}]\n")
    load_against(f"{ZOO}:correct").__globals__["LOSS"] = "softmax_cross_entropy"
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(config), "--against", f"{ZOO}:{mutant}", "--json", "--quiet"])
    document = json.loads(capsys.readouterr().out)
    assert exit_info.value.code == (0 if mutant == "correct" else 1)
    against_failures = [t["name"] for t in document["tensors"]
                        if any(w["witness"] == "against" and not w["passed"]
                               for w in t["witnesses"])]
    assert bool(against_failures) == (mutant != "correct")
    assert set(against_failures) == set(document["summary"]["failed_tensors"])
