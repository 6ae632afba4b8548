"""`check --against FUNC --layer NAME`: one recurrent layer's hand-written backward, given dh.

The acceptance test runs a course-layout tanh RNN backward (tests/against/rnn_course.py, under
the adapter of docs/check.md, tests/against/course_adapter.py) through `--layer --time-last`: the
right one passes, each of five classic bugs is caught and named by its signature, with and
without x returned. The truth gradscope hands the function (x, dh) is checked against a NumPy
forward pass written here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, render_text, run_without_tensorflow
from jsonschema import Draft202012Validator

from gradscope.cells.lstm import lstm_functions
from gradscope.errors import ConfigError
from gradscope.report.models import LayerCheckReport, json_schema
from gradscope.yaml.check.layer_backward import check_layer
from gradscope.yaml.config import load_spec

ADAPTER = REPO / "tests" / "against" / "course_adapter.py"
#: Two tanh RNNs (Keras layout below, TF1 block layout on top) under a dense head.
CONFIG = ("input_size: 4\ntime_steps: 6\nbatch_size: 3\nlayers:\n"
          "  - {type: simple_rnn, units: 5, layout: keras}\n"
          "  - {type: simple_rnn, units: 4}\n"
          "  - dense: 3\n")
WEIGHTS = {"simple_rnn_2/Wax", "simple_rnn_2/Waa", "simple_rnn_2/ba"}
ALL = {*WEIGHTS, "simple_rnn_2/x", "simple_rnn_2/h0"}
#: Each classic bug: the tensors it breaks, and the words that name its signature.
BUGS = {
    "no_carry": (ALL, "equals the gradient with no carry from t+1"),
    "tanh_one_minus_a": (ALL, "equals the gradient with the tanh derivative 1 − a instead of "
                              "1 − a²"),
    "a_next_for_a_prev": ({"simple_rnn_2/Waa"}, "equals the gradient with h_t in place of "
                                                "h_{t−1}"),
    "assign_not_add": (WEIGHTS, "equals the gradient of step t=0 only"),
    "divide_by_m": (WEIGHTS, "equals 1/3 × the right gradient: divided by the batch size B"),
}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("layer") / "course.yaml"
    path.write_text(CONFIG)
    return path


def _run(capsys, *args):
    from gradscope.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def _check(capsys, config, function, layer="simple_rnn_2"):
    code, out, _ = _run(capsys, "check", str(config), "--against", f"{ADAPTER}:{function}",
                        "--layer", layer, "--time-last", "--json", "--quiet")
    document = json.loads(out)
    Draft202012Validator(json_schema("check-layer")).validate(document)
    return code, document


def _against(document):
    """{tensor: the --against witness entry} for the tensors it checked."""
    return {t["name"]: w for t in document["tensors"] for w in t["witnesses"]
            if w["witness"] == "against"}


@pytest.mark.parametrize("function", ["backward", "correct_weights_only"])
def test_the_course_backward_passes_through_the_readme_adapter(capsys, config, tf, function):
    code, document = _check(capsys, config, function)
    assert code == 0 and document["summary"]["passed"] is True
    assert document["mode"] == "layer" and document["time_last"] is True
    checked = _against(document)
    assert set(checked) == (ALL if function == "backward" else WEIGHTS)
    assert document["against_not_returned"] == (
        [] if function == "backward" else ["simple_rnn_2/x", "simple_rnn_2/h0"])
    # The NumPy reference of the layer witnesses TF on every tensor, returned or not.
    assert all(any(w["witness"] == "numpy_reference" and w["passed"] for w in t["witnesses"])
               for t in document["tensors"])
    shapes = {a["name"]: a["shape"] for a in document["arguments"]}
    assert shapes == {"x": [5, 3, 6], "h0": [4, 3], "kernel": [9, 4], "bias": [4],
                      "Wax": [4, 5], "Waa": [4, 4], "ba": [4, 1], "dh": [4, 3, 6]}


@pytest.mark.parametrize("returns_x", [True, False], ids=["with_x", "weights_only"])
@pytest.mark.parametrize("bug", list(BUGS))
def test_each_classic_bug_is_caught_and_named_by_its_signature(capsys, config, tf, bug,
                                                               returns_x):
    wrong, signature = BUGS[bug]
    code, document = _check(capsys, config, bug if returns_x else f"{bug}_weights_only")
    assert code == 1
    expected = wrong if returns_x else wrong & WEIGHTS
    assert set(document["summary"]["failed_tensors"]) == expected
    checked = _against(document)
    for name in expected:
        assert f"your {name} {signature}" in checked[name]["detail"], checked[name]["detail"]
        assert "(relative error " in checked[name]["detail"]
    if bug == "no_carry" and returns_x:  # the time localisation is kept for x
        x = checked["simple_rnn_2/x"]
        assert x["first_bad_step"] == 4 and "wrong from t=T−2=4 backwards" in x["detail"]


def test_the_docs_hold_the_adapter_verbatim():
    adapter = ADAPTER.read_text()
    code = adapter[adapter.index("import numpy as np"):adapter.index("\n\n\n# -- for the tests")]
    assert len(code.splitlines()) <= 10
    assert f"```python\n{code}\n```" in (REPO / "docs" / "check.md").read_text()


def _numpy_model(params, x, y):
    """The config's model forward in NumPy, written here: the layer's input, and dh (the
    gradient of the mean softmax cross-entropy reaching h_t of simple_rnn_2 from the head)."""
    h1 = np.zeros((3, 5))
    h2 = np.zeros((3, 4))
    below, above = [], []
    for t in range(6):
        h1 = np.tanh(x[:, t] @ params["simple_rnn_1/kernel"]
                     + h1 @ params["simple_rnn_1/recurrent_kernel"] + params["simple_rnn_1/bias"])
        h2 = np.tanh(np.concatenate([h1, h2], axis=1) @ params["simple_rnn_2/kernel"]
                     + params["simple_rnn_2/bias"])
        below.append(h1)
        above.append(h2)
    logits = np.stack(above, axis=1) @ params["dense_1/kernel"] + params["dense_1/bias"]
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    d_logits = (e / e.sum(axis=-1, keepdims=True) - y) / (3 * 6)
    return np.stack(below, axis=1), d_logits @ params["dense_1/kernel"].T


def test_the_function_receives_the_real_layer_input_and_dh(tf):
    import yaml

    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.data import initial_params, synthetic_batch

    spec = load_spec(yaml.safe_load(CONFIG))
    algebra = model_shapes(spec)
    params = initial_params(algebra)
    batch = synthetic_batch(algebra)
    seen = {}

    def backward(x, h0, params, dh):
        seen.update(x=x, h0=h0, dh=dh, params=params)
        return {"h0": np.zeros_like(h0)}

    report = check_layer(spec, backward, "simple_rnn_2", time_last=True, params=params,
                         data=batch)
    assert isinstance(report, LayerCheckReport) and not report.summary.passed
    below, dh = _numpy_model(params, batch.x.astype(np.float64), batch.y.astype(np.float64))
    np.testing.assert_allclose(seen["x"], np.transpose(below, (2, 0, 1)), rtol=1e-12)
    np.testing.assert_allclose(seen["dh"], np.transpose(dh, (2, 0, 1)), rtol=1e-10, atol=1e-16)
    assert seen["h0"].shape == (4, 3)
    kernel = params["simple_rnn_2/kernel"]
    np.testing.assert_array_equal(seen["params"]["Wax"], kernel[:5].T)
    np.testing.assert_array_equal(seen["params"]["Waa"], kernel[5:].T)


@pytest.fixture(scope="module")
def lstm(tf):
    spec = load_spec({"input_size": 3, "time_steps": 5, "batch_size": 2, "seed": 1,
                      "layers": [{"lstm": 4}, {"dense": 2}], "loss": "mse"})
    return spec, lstm_functions("block")


def _lstm_backward(forward_backward, swap_i_f=False):
    forward, backward = forward_backward

    def function(x, h0, params, dh):
        _, cache = forward(params, x, h0["h0"], h0["c0"])
        d_x, (d_h0, d_c0), d_params = backward(params, cache, dh)
        if swap_i_f:  # the gates packed [f | j | i | o]
            u = d_h0.shape[1]
            for name in ("kernel", "bias"):
                g = d_params[name].copy()
                g[..., :u], g[..., 2 * u:3 * u] = d_params[name][..., 2 * u:3 * u], \
                    d_params[name][..., :u]
                d_params[name] = g
        return {"x": d_x, "h0": d_h0, "c0": d_c0, **d_params}

    return function


def test_an_lstm_layer_gets_h0_and_c0_and_a_gate_swap_is_named(lstm):
    spec, functions = lstm
    report = check_layer(spec, _lstm_backward(functions), "lstm_1")
    assert report.summary.passed and report.against_not_returned == []
    assert [t.name for t in report.tensors] == ["lstm_1/kernel", "lstm_1/bias", "lstm_1/x",
                                                "lstm_1/h0", "lstm_1/c0"]
    swapped = check_layer(spec, _lstm_backward(functions, swap_i_f=True), "lstm_1")
    assert swapped.summary.failed_tensors == ["lstm_1/kernel", "lstm_1/bias"]
    for tensor in swapped.tensors[:2]:
        detail = next(w.detail for w in tensor.witnesses if w.witness == "against")
        assert detail.startswith(f"your {tensor.name} equals the gradient with the column "
                                 "blocks input gate i and forget gate f swapped"), detail


def test_a_forward_pass_that_reads_two_gates_in_each_others_place_is_named(lstm):
    """A user whose LSTM reads the forget gate where the input gate is (and the other way
    round), forward and backward alike: every tensor is wrong, and each is named, whether the
    backward writes each gate's gradient where its forward read the gate or packs them in the
    usual column order."""
    spec, (forward, backward) = lstm

    def swap(value):
        u = value.shape[-1] // 4  # lstm_block packs [i | j | f | o]
        out = value.copy()
        out[..., :u], out[..., 2 * u:3 * u] = value[..., 2 * u:3 * u], value[..., :u]
        return out

    def theirs(packed):
        def function(x, h0, params, dh):
            swapped = {name: swap(value) for name, value in params.items()}
            _, cache = forward(swapped, x, h0["h0"], h0["c0"])
            d_x, (d_h0, d_c0), d_params = backward(swapped, cache, dh)
            return {"x": d_x, "h0": d_h0, "c0": d_c0,
                    **{name: value if packed else swap(value)
                       for name, value in d_params.items()}}
        return function

    for packed in (False, True):
        report = check_layer(spec, theirs(packed), "lstm_1")
        assert report.summary.failed_tensors == ["lstm_1/kernel", "lstm_1/bias", "lstm_1/x",
                                                 "lstm_1/h0", "lstm_1/c0"]
        for tensor in report.tensors:
            detail = next(w.detail for w in tensor.witnesses if w.witness == "against")
            assert f"your {tensor.name} equals the gradient of a forward pass that reads " \
                "input gate i and forget gate f in each other's place (gate order)" in detail
            weight = tensor.name in ("lstm_1/kernel", "lstm_1/bias")
            assert ("packed in the usual column order" in detail) == (packed and weight), detail


def test_the_layer_report_renders_within_the_width(lstm):
    spec, functions = lstm
    correct = _lstm_backward(functions)

    def no_c0(x, h0, params, dh):
        out = correct(x, h0, params, dh)
        return {"kernel": out["kernel"] * 2, "c0": out["c0"]}

    report = check_layer(spec, no_c0, "lstm_1")
    for width in (60, 80, 120):
        text = render_text(report, width)
        assert max(len(line) for line in text.splitlines()) <= width
        assert "not returned (not checked): lstm_1/bias, lstm_1/x, lstm_1/h0" in \
            " ".join(text.split())
    assert "FAILED: 1 of 5 tensors disagree: lstm_1/kernel" in render_text(report, 80)


def test_contract_errors_name_the_function(lstm):
    spec, _ = lstm
    with pytest.raises(ConfigError) as caught:
        check_layer(spec, lambda x, h0, params, dh: {"w_ru": 0}, "lstm_1")
    assert "returned only unknown names: 'w_ru'; expected one or more of: kernel, bias, x, " \
           "h0, c0" in caught.value.message


@pytest.mark.parametrize("args,message", [
    (["--layer", "simple_rnn_1"], "--layer simple_rnn_1 checks your backward of one layer; "
                                  "expected it together with --against FILE.py:FUNC"),
    (["--against", f"{ADAPTER}:backward", "--time-last"],
     "--time-last lays out the arrays of the one-layer backward that --layer checks as "
     "(features, batch, time); expected it together with --layer NAME"),
    (["--against", f"{ADAPTER}:backward", "--layer", "rnn_2"],
     "--layer rnn_2: the model has no layer of that name; expected one of the recurrent "
     "layers: simple_rnn_1, simple_rnn_2"),
    (["--against", f"{ADAPTER}:backward", "--layer", "dense_1"],
     "--layer dense_1 is a dense layer; --layer checks a recurrent layer's backward: expected "
     "one of the recurrent layers: simple_rnn_1, simple_rnn_2"),
    (["--against", f"{ADAPTER}:backward", "--layer", "simple_rnn_1", "--chunks", "2"],
     "--chunks does not go with --layer"),
])
def test_argument_errors_exit_2_in_one_line_before_tensorflow(config, args, message):
    result = run_without_tensorflow("check", str(config), *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"gradscope: error: {message}")
    assert result.stderr.count("\n") == 1


def test_the_layer_schema_is_published_without_tensorflow():
    result = run_without_tensorflow("schema", "check-layer")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert schema["properties"]["mode"]["const"] == "layer"
    assert {"arguments", "tensors", "against_not_returned", "time_last"} <= set(
        schema["required"])
