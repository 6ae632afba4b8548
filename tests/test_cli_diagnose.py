"""``gradscope diagnose``: exit codes, the JSON document and its schema, the text at 80
columns, and models refused before TensorFlow loads (YAML configs:
test_yaml_diagnose.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import render_text, run_gradscope, run_without_tensorflow

LAYER_KEYS = {"layer", "call", "lyapunov", "jacobian_norm", "verdict", "gates", "timescales",
              "horizon", "counterfactuals"}


def test_a_saved_model_of_keras_layers_none_recurrent_is_refused_before_tensorflow_loads(
        tmp_path: Path, tf: Any) -> None:
    """Its config shows that nothing is recurrent (a sequence model of Dense and pooling,
    one nested in TimeDistributed): refused in a fraction of a second, not after the model
    was loaded and run. With a layer of the user's own class, only the run can tell."""
    import keras
    import numpy as np

    inner = keras.Sequential([keras.layers.Dense(4)])
    inp = keras.Input((10, 3))
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.TimeDistributed(inner)(inp))
    model = keras.Model(inp, keras.layers.Dense(1)(pooled))
    model.compile(loss="mse")
    model.save(tmp_path / "dense.keras")
    np.savez(tmp_path / "batch.npz", x=np.zeros((4, 10, 3), "float32"),
             y=np.zeros((4, 1), "float32"))
    done = run_without_tensorflow("diagnose", str(tmp_path / "dense.keras"), "--data",
                                  str(tmp_path / "batch.npz"))
    assert done.returncode == 2, done.stderr
    assert "the model has no recurrent layer call, so there is nothing to diagnose" in " ".join(
        done.stderr.split())


def test_the_schema_names_the_keys_of_a_layer() -> None:
    done = run_without_tensorflow("schema", "diagnose")
    assert done.returncode == 0, done.stderr
    schema = json.loads(done.stdout)
    layer = schema["$defs"]["DiagnosedLayer"]["properties"]
    assert set(layer) >= LAYER_KEYS
    assert {"median", "max", "share_above_1"} <= set(
        schema["$defs"]["JacobianNorm"]["properties"])
    flow = schema["$defs"]["StateFlow"]["properties"]
    assert set(flow) == {"first", "last", "ratio", "flag"}
    assert "explain --flow" in flow["flag"]["description"]


def _saved(tmp_path: Path, tf: Any) -> Path:
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((12, 3))
    h = keras.layers.GRU(4, name="gru")(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.Adam(clipvalue=1e-4), loss="mse")
    path = tmp_path / "model.keras"
    model.save(path)
    return path


def test_json_then_text_at_80_columns(tmp_path: Path, tf: Any) -> None:
    path = _saved(tmp_path, tf)
    # One full run (--exponents 2: fewer columns than the state has numbers), its text drawn
    # from its JSON at 80 columns, as the command draws it.
    done = run_gradscope("diagnose", str(path), "--batch-size", "3", "--exponents", "2",
                         "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["command"] == "diagnose"
    (layer,) = report["layers"]
    assert set(layer) >= LAYER_KEYS
    assert set(layer["gates"]) == {"update", "reset"}
    assert set(layer["flow"]) == {"first", "last", "ratio", "flag"}
    assert [set(c) >= {"change", "horizon", "lyapunov_1"} for c in layer["counterfactuals"]] \
        == [True] * 3
    assert report["clipping"]["setting"] == "clipvalue=0.0001"
    from gradscope.report.models import DiagnoseReport

    text = render_text(DiagnoseReport.model_validate(report), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "gru: " in text and "Lyapunov exponents λ (nats/step, top 2)" in text
    assert "update-gate bias +1: horizon" in text
    skipped = run_gradscope("diagnose", str(path), "--batch-size", "3", "--json",
                            "--no-counterfactuals")
    assert json.loads(skipped.stdout)["layers"][0]["counterfactuals"] == []
    bad = run_gradscope("diagnose", str(path), "--exponents", "0")
    assert bad.returncode == 2
    # A change's λ₁ is its first column's where the layer takes fewer columns than its state
    # has numbers, and its line always names it so (found tried as a new user would: left
    # unsaid where the layer's own first column read as its λ₁, the change's "λ₁" was not
    # the changed copy's).
    fewer = len(layer["lyapunov"]) < layer["state_size"]
    for change in layer["counterfactuals"]:
        if change["applicable"] and change["kind"] != "clipping":
            assert change["first_column"] is fewer
    lines = render_text(DiagnoseReport.model_validate(report), 80).splitlines()
    at = next(k for k, line in enumerate(lines) if "update-gate bias +1" in line)
    assert ("λ₁ (first column) " in lines[at] + lines[at + 1]) is fewer
    # A ratio n/a both ways (no example's last step that ran gets a gradient) is left out.
    change = next(c for c in layer["counterfactuals"] if c["kind"] == "keep_bias")
    assert "carried" in lines[at] + lines[at + 1]
    change["flow"]["ratio"] = change["flow_before"]["ratio"] = None
    lines = render_text(DiagnoseReport.model_validate(report), 80).splitlines()
    at = next(k for k, line in enumerate(lines) if "update-gate bias +1" in line)
    assert "carried" not in lines[at] + lines[at + 1]
    # With 2 of its exponents, the layer takes fewer columns than its state: always said.
    assert fewer and "λ₁ (first column)" in " ".join(text.split())


def test_a_batch_whose_numbers_are_not_finite_says_where_the_first_was_born(
        tmp_path: Path, tf: Any) -> None:
    """A NaN in the data: no call is diagnosed (dynamics read from NaN mean nothing), the
    report says where the first NaN was born, the JSON is one valid document, and the exit
    code is 1, as explain's (a run whose gradient overflowed made the JSON writer fail)."""
    import numpy as np

    path = _saved(tmp_path, tf)
    x = np.random.default_rng(0).standard_normal((3, 12, 3)).astype(np.float32)
    x[1, 7, 0] = np.nan
    data = tmp_path / "batch.npz"
    np.savez(data, x=x, y=np.zeros((3, 1), np.float32))
    done = run_gradscope("diagnose", str(path), "--data", str(data), "--json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["layers"] == [] and report["nonfinite"] is not None
    assert [entry["layer"] for entry in report["not_diagnosed"]] == ["gru"]
    assert report["nonfinite"]["step"] == 7
    # The global norm is the one the clipping line reads: here none (the gradient is NaN).
    assert report["gradient_norm"] is None
    assert "a NaN or Inf in the loss or a gradient" in run_gradscope(
        "diagnose", "--help", env={"COLUMNS": "80"}).stdout
    text = run_gradscope("diagnose", str(path), "--data", str(data), env={"COLUMNS": "80"})
    assert text.returncode == 1, text.stderr
    assert "Where the first NaN or Inf was born" in text.stdout
    assert "no clipping makes it finite" in text.stdout
    assert max(len(line) for line in text.stdout.splitlines()) <= 80


def test_fail_on_exits_1_where_a_layer_has_that_mechanism_or_flag(tmp_path: Path, tf: Any) -> None:
    """For CI: a vanishing layer is an answer (exit 0) unless ``--fail-on vanishing`` asks
    for exit 1; stderr says which layer failed, and the JSON stays one document on stdout."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((12, 3))
    h = keras.layers.SimpleRNN(
        4, name="rnn", recurrent_initializer=keras.initializers.Orthogonal(gain=0.1))(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    model.compile(loss="mse")
    path = tmp_path / "fading.keras"
    model.save(path)
    args = ["diagnose", str(path), "--batch-size", "3", "--no-counterfactuals"]
    failed = run_gradscope(*args, "--json", "--fail-on", "exploding", "--fail-on", "vanishing")
    assert failed.returncode == 1, failed.stderr
    (layer,) = json.loads(failed.stdout)["layers"]
    assert layer["mechanism"] == "vanishing"
    assert "--fail-on exploding,vanishing: rnn (vanishing)" in failed.stderr
    passed = run_gradscope(*args, "--fail-on", "exploding")
    assert passed.returncode == 0, passed.stderr
    assert "--fail-on" not in passed.stderr
    # explain --flow fails on its own flags alike; without --flow there is nothing to read.
    flagged = run_gradscope("explain", str(path), "--batch-size", "3", "--flow",
                            "--fail-on", "vanishing")
    assert flagged.returncode == 1, flagged.stderr
    assert "gradscope explain: --fail-on vanishing: ∂L/∂rnn" in flagged.stderr
    assert "vanishing" in flagged.stdout
    refused = run_without_tensorflow("explain", str(path), "--fail-on", "vanishing")
    assert refused.returncode == 2 and "add --flow" in refused.stderr


def test_help_offers_only_the_batch_a_keras_model_takes() -> None:
    """Found tried as a new user would: ``diagnose --help`` listed --x/--y, which it always
    refused (a Keras model takes its batch as --data)."""
    done = run_without_tensorflow("diagnose", "--help")
    assert done.returncode == 0
    assert "--data FILE.npz" in done.stdout and "--x" not in done.stdout
    assert "without --data/--x" not in done.stdout
    assert run_without_tensorflow("diagnose", "m.keras", "--x", "x.npy").returncode == 2


def test_fail_on_cannot_pass_a_layer_nobody_read(capsys: Any) -> None:
    """Found tried as a new user would: a stack of cells that was not diagnosed let
    ``--fail-on vanishing`` exit 0. With --fail-on, a recurrent call not read is exit 2
    (not known), unless another one failed (exit 1); without --fail-on nothing changes."""
    from gradscope.cli import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, _failed_on

    unread = [("stk", "the cell could not be run step by step")]
    assert _failed_on("diagnose", (), [], unread) == EXIT_OK
    assert _failed_on("diagnose", ("vanishing",), [("gru", "holds")], unread) == EXIT_USAGE
    assert ("gradscope diagnose: --fail-on vanishing: not read, so not known: stk (the cell "
            "could not be run step by step)") in " ".join(capsys.readouterr().err.split())
    assert _failed_on("diagnose", ("vanishing",), [("gru", "vanishing")],
                      unread) == EXIT_PROBLEM
    assert _failed_on("diagnose", ("vanishing",), [("gru", "holds")], []) == EXIT_OK
