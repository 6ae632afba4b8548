"""`check --against`: the correct hand-written BPTT passes, every classic bug is caught and
named, and bad targets are clean errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO, run_gradscope
from jsonschema import Draft202012Validator

from gradscope.errors import ConfigError
from gradscope.report.models import json_schema
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.check.context import CheckContext
from gradscope.yaml.check.user_backward import against_witness, load_against, not_returned
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import initial_params, synthetic_batch
from gradscope.yaml.engine import Engine

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
    # Either part of the gradient at t may be the one left out (what arrives from above, or
    # the carry): both are named.
    assert ("before the last step the gradient at t is what arrives from above at t plus "
            "what is carried from t+1, and one of them is not added") in x.detail
    inside = _failures(ctx, module, "drop_one_minus_u")["x"]
    assert inside.first_bad_step == 5 and "inside one step" in inside.detail


def test_every_wrong_tensor_is_named_by_the_mistake_it_equals(zoo):
    """Not only x: each weight and initial state of the no-carry BPTT equals, to rounding, the
    NumPy reference's BPTT without the carry."""
    ctx, module = zoo
    for name, result in _failures(ctx, module, "no_carry").items():
        assert f"your {name} equals the gradient with no carry from t+1 (relative error " \
            in result.detail, result.detail
    for name, result in _failures(ctx, module, "sum_loss").items():
        assert f"your {name} equals 24 × the right gradient: the gradient of the sum loss" \
            in result.detail or (ctx.shapes.spec.loss == "mse" and "72 ×" in result.detail)
    # The forward pass that slices r and u the other way round: the dense layer's gradients,
    # which the forward alone sets, are named; its backward then multiplies each gate's
    # gradient by the other's weights, which no model's gradient does, and is not named.
    swapped = _failures(ctx, module, "swap_ru")
    for name in ("dense_1/kernel", "dense_1/bias"):
        assert f"your {name} equals the gradient of a forward pass that reads reset gate r " \
            "and update gate u in each other's place (gate order)" in swapped[name].detail
    assert all("equals" not in swapped[name].detail for name in (*RECURRENT, *STATES, "x"))
    # A bug no known variant reproduces is not given a wrong name.
    for result in _failures(ctx, module, "drop_one_minus_u").values():
        assert "equals" not in result.detail and "largest disagreement" in result.detail


def test_recognisable_scale_and_shape_mistakes_get_hints(zoo):
    ctx, module = zoo
    assert "sum loss" in _failures(ctx, module, "sum_loss")["gru_1/w_ru"].detail
    assert "averaged" in _failures(ctx, module, "bias_averaged")["dense_1/bias"].detail
    swapped = _failures(ctx, module, "swap_w_ru_w_c")["gru_1/w_ru"]
    assert "shape (9, 4), expected (9, 8); that is the shape of gru_1/w_c" in swapped.detail
    off = _failures(ctx, module, "one_element_off")["dense_1/kernel"]
    assert "element (0, 0)" in off.detail


def test_names_not_returned_are_not_checked_and_unknown_names_fail(zoo):
    ctx, module = zoo
    results = against_witness(
        ctx, lambda p, x, y, h0: {"gru_1/w_ru": module.correct(p, x, y, h0)["gru_1/w_ru"],
                                  "gru_1/wru": 0})
    by_name = {r.tensor: r for r in results}
    assert set(by_name) == {"gru_1/w_ru", "gru_1/wru"}
    assert by_name["gru_1/w_ru"].passed
    assert not by_name["gru_1/wru"].passed
    assert "did you mean 'gru_1/w_ru'" in by_name["gru_1/wru"].detail
    assert not_returned(ctx, results) == [n for n in ctx.autodiff_gradients()
                                          if n != "gru_1/w_ru"]


@pytest.mark.parametrize("returned,fragments", [
    ({}, ["returned an empty dict", "expected one or more of: gru_1/w_ru, "]),
    ({"gru1/w_ru": 0, "dense/kernel": 1},
     ["returned only unknown names: 'gru1/w_ru' (did you mean 'gru_1/w_ru'?), 'dense/kernel'",
      ", gru_1/h0, gru_2/h0, x"]),
    ([1, 2], ["returned list; expected a dict of gradients keyed by name"]),
])
def test_returning_nothing_known_is_a_contract_error(zoo, returned, fragments):
    ctx, _ = zoo

    def backward(params, x, y, h0):
        return returned

    with pytest.raises(ConfigError) as caught:
        against_witness(ctx, backward)
    assert "test_yaml_check_user_backward.py:backward returned" in caught.value.message
    assert all(f in caught.value.message for f in fragments), caught.value.message
    assert caught.value.exit_code == 2 and "\n" not in caught.value.message


def test_a_raising_function_is_reported_at_its_line_in_the_users_file(zoo, tmp_path):
    ctx, _ = zoo
    user_file = tmp_path / "my_bptt.py"
    user_file.write_text(
        "import numpy as np\n"
        "\n"
        "def _step(params):\n"
        "    return np.dot(params['gru_1/w_ru'], params['gru_1/w_c'])\n"
        "\n"
        "def backward(params, x, y, h0):\n"
        "    return {'gru_1/w_ru': _step(params)}\n"
        "\n"
        "def three(params, x, y):\n"
        "    return {}\n")
    with pytest.raises(ConfigError) as caught:
        against_witness(ctx, load_against(f"{user_file}:backward"))
    # The exception is raised inside NumPy; the line reported is the user's.
    assert caught.value.message.startswith(
        f"--against: {user_file}:4 in _step (from backward): ValueError: shapes (9,8) and "
        "(9,4) not aligned")
    with pytest.raises(ConfigError) as caught:
        against_witness(ctx, load_against(f"{user_file}:three"))
    assert caught.value.message == (
        f"--against: {user_file}:9 in three: TypeError: three() takes 3 positional arguments "
        "but 4 were given")


def test_loader_errors_are_one_line_config_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import nonexistent_module_xyz\n")
    unparsable = tmp_path / "unparsable.py"
    unparsable.write_text("import numpy as np\n\ndef backward(params, x, y, h0)\n    pass\n")
    for target, fragment in [
        (f"{ZOO}", "expected FILE.py:FUNC"),
        (f"{tmp_path}/missing.py:f", "file not found"),
        (f"{ZOO}:corect", "did you mean 'correct'"),
        (f"{broken}:f", f"{broken}:1 (while importing it): ModuleNotFoundError: No module named"),
        (f"{unparsable}:backward", f"{unparsable}:3: SyntaxError: expected ':'"),
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
        signature = ("no carry from t+1" if mutant == "no_h_carry" else
                     "no carry of the cell state c from t+1")
        assert all(f"your {r.tensor} equals the gradient with {signature}" in r.detail
                   for r in results if not r.passed)


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


def _user_file(tmp_path, body):
    """A user's file that builds on the worked example, as a real module on disk."""
    user_file = tmp_path / "my_bptt.py"
    user_file.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('worked_example', {ZOO!r})\n"
        "example = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(example)\n"
        "\n"
        "def backward(params, x, y, h0):\n"
        f"    {body}\n")
    config = tmp_path / "c.yaml"
    config.write_text("input_size: 5\ntime_steps: 6\nbatch_size: 4\n"
                      "layers: [{gru: 4}, {gru: 3}, {dense: 3}]\n")
    return user_file, config


def _run(capsys, *args):
    from gradscope.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_weights_only_passes_and_lists_x_and_h0_as_not_returned(tmp_path, tf, capsys):
    user_file, config = _user_file(
        tmp_path, "grads = example.correct(params, x, y, h0)\n"
                  "    return {name: grads[name] for name in params}")
    code, out, _ = _run(capsys, "check", str(config), "--against", f"{user_file}:backward",
                        "--json", "--quiet")
    assert code == 0
    document = json.loads(out)
    Draft202012Validator(json_schema("check")).validate(document)
    assert document["against_not_returned"] == ["gru_1/h0", "gru_2/h0", "x"]
    checked = {t["name"] for t in document["tensors"]
               if any(w["witness"] == "against" for w in t["witnesses"])}
    assert checked == set(RECURRENT) | {"dense_1/kernel", "dense_1/bias"}
    code, out, _ = _run(capsys, "check", str(config), "--against", f"{user_file}:backward",
                        "--quiet")
    assert code == 0
    assert "not returned by --against (not checked by it): gru_1/h0, gru_2/h0, x\n" in out


def test_the_cli_says_in_one_line_when_nothing_known_is_returned(tmp_path, tf, capsys):
    user_file, config = _user_file(tmp_path, "return {'gru1/w_ru': 0}")
    code, out, err = _run(capsys, "check", str(config), "--against", f"{user_file}:backward",
                          "--quiet")
    assert code == 2 and out == ""
    assert err == (f"gradscope: error: --against: {user_file}:backward returned only unknown "
                   "names: 'gru1/w_ru' (did you mean 'gru_1/w_ru'?); expected one or more of: "
                   "gru_1/w_ru, gru_1/b_ru, gru_1/w_c, gru_1/b_c, gru_2/w_ru, gru_2/b_ru, "
                   "gru_2/w_c, gru_2/b_c, dense_1/kernel, dense_1/bias, gru_1/h0, gru_2/h0, x\n")


def test_the_real_cli_reports_a_raising_function_in_one_line(tmp_path):
    user_file, config = _user_file(tmp_path, "return {'x': x @ params['gru_1/w_c']}")
    result = run_gradscope("check", str(config), "--against", f"{user_file}:backward")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(
        f"gradscope: error: --against: {user_file}:7 in backward: ValueError: matmul: ")
    assert result.stderr.count("\n") == 1


def test_the_docs_lstm_worked_example_runs_from_the_clone(monkeypatch, tf, capsys):
    command = ("check tests/against/lstm_model.yaml --against "
               "tests/against/user_lstm_bptt.py:correct")
    assert f".venv/bin/gradscope {command}" in (REPO / "docs" / "check.md").read_text()
    monkeypatch.chdir(REPO)
    code, out, _ = _run(capsys, *command.split(), "--json", "--quiet")
    document = json.loads(out)
    assert code == 0 and document["summary"]["passed"] is True
    assert document["against_not_returned"] == []


def test_a_signature_of_zeros_is_not_matched_by_a_tiny_wrong_gradient():
    """Found tried as a new user would: an initial state's gradient of about 1e-28 (faded
    over 300 steps), returned under the other state's name, was named "the gradient with no
    carry of the cell state c from t+1 (relative error 4e-28)": that signature is zeros, and
    the difference from zeros was read as relative. A value of zeros still equals it."""
    from gradscope.yaml.check.variants import Signature, identify

    truth = 1e-28 * np.random.default_rng(0).standard_normal((4, 3))
    other = 2.6 * np.random.default_rng(1).standard_normal((4, 3)) * 1e-28
    no_carry = Signature("no_c_carry", "the gradient with no carry of the cell state c",
                         {"lstm_1/c0": np.zeros((4, 3))})
    assert identify("lstm_1/c0", other, truth, [no_carry], 1e-6) is None
    match = identify("lstm_1/c0", np.zeros((4, 3)), truth, [no_carry], 1e-6)
    assert match is not None and match[1] == 0.0


def test_a_gradient_flushed_to_0_below_float32s_range_is_said_so():
    """Found tried as a new user would: a backward that returned float32 had an initial
    state's gradient of 2e-83 flushed to 0, and was said to leave out a carry."""
    from gradscope.yaml.check.user_backward import _diagnose

    truth = 2e-83 * np.ones((4, 3))
    said = _diagnose(None, "lstm_2/h0", np.zeros((4, 3)), truth, {}, 1e-6)
    assert "below float32's smallest normal number" in said and "2.0e-83" in said
