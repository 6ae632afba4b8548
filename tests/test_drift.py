"""``gradscope diff``: real explain reports of real models, compared across a change of the
model (its units, its weights), with identical reports as the golden no-drift case. Edited
copies of a real report stand for what a small model cannot be made to do on demand (a NaN,
a flipped flag). The property: a norm scaled by f drifts exactly when |f − 1| / max(1, f)
exceeds rtol."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import render_text, run_cli, run_gradscope, run_without_tensorflow
from hypothesis import given, settings
from hypothesis import strategies as st

import gradscope
from gradscope.errors import ConfigError


@pytest.fixture(scope="module")
def seed_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed model's explain report, written by the CLI as CI would."""
    path = tmp_path_factory.mktemp("diff") / "base.json"
    done = run_gradscope("explain", "--flow", "--json", "-o", str(path))
    assert done.returncode == 0, done.stderr
    return path


def _write(folder: Path, name: str, document: dict[str, Any]) -> Path:
    path = folder / name
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def test_the_same_model_and_data_explained_twice_do_not_drift(seed_json, tmp_path):
    again = tmp_path / "new.json"
    assert run_gradscope("explain", "--flow", "--json", "-o", str(again)).returncode == 0
    done = run_without_tensorflow("diff", str(seed_json), str(again))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NO DRIFT" in done.stdout


def test_fewer_units_change_shapes_and_are_named(tf, seed_json, tmp_path):
    """A real change of the model: the second GRU's units 32 → 16."""
    spec = gradscope.load_spec(None).model_dump()
    spec["layers"] = [dict(layer, units=16) if layer["name"] == "gru_2" else layer
                      for layer in spec["layers"]]
    changed = _write(tmp_path, "new.json", gradscope.explain(spec, flow=True).to_dict())
    done = run_without_tensorflow("diff", str(seed_json), str(changed), "--json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    kinds = {(c["tensor"], c["kind"]) for c in report["changes"]}
    assert ("gru_2/w_ru", "shape") in kinds
    assert ("dense_1/kernel", "shape") in kinds
    assert ("gru_1/w_ru", "shape") not in kinds  # the first layer keeps its shapes
    assert report["drifted"] is True
    # The verdict counts the changes by kind (it said "13 changes beyond rtol", most of them
    # shapes), and at 80 columns, where the values go under the detail, they are labelled.
    shapes = sum(c["kind"] == "shape" for c in report["changes"])
    norms = sum(c["kind"] == "norm" for c in report["changes"])
    text = run_cli("diff", str(seed_json), str(changed), env={"COLUMNS": "80"}).stdout
    verdict = " ".join(text[text.index("DRIFT"):].split())
    assert verdict == (f"DRIFT: {len(report['changes'])} changes: {shapes} of another shape; "
                       f"{norms} ‖g‖ and the loss beyond rtol 0.0001 (exit 1)")
    narrow = render_text(gradscope.diff(seed_json, changed), 60).splitlines()
    values = [line.split() for line in narrow if line.startswith(" ") and "→" in line]
    assert len(values) == len(report["changes"])
    assert all(words[0] in ("loss", "‖g‖") for words in values), narrow


def test_new_weights_drift_beyond_rtol_and_not_within_a_wide_one(tf, tmp_path):
    """A Keras model, and the same model with its weights moved by 1% (a commit that changed
    an initializer, say): ‖g‖ and the loss drift; with --rtol 0.5 nothing does."""
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((12, 3)), keras.layers.GRU(5, name="gru"),
                              keras.layers.Dense(2, name="head")])
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 12, 3)).astype("float32")
    y = rng.standard_normal((6, 2)).astype("float32")
    base = gradscope.explain(model, x=x, y=y)
    model.set_weights([w * 1.01 for w in model.get_weights()])
    new = gradscope.explain(model, x=x, y=y)
    report = gradscope.diff(base, new)
    kinds = {(c.tensor, c.kind) for c in report.changes}
    assert report.drifted and ("loss", "loss") in kinds
    assert ("gru/kernel", "norm") in kinds
    assert not gradscope.diff(base, new, rtol=0.5).drifted
    assert not gradscope.diff(base, base).drifted
    # The data by its contents (found tried as a new user would): the same batch under two
    # file names is the same data; another batch under the same name is refused, not drift.
    from gradscope.errors import ConfigError

    np.savez(tmp_path / "a.npz", x=x, y=y)
    np.savez(tmp_path / "b.npz", x=x, y=y)
    named = [gradscope.explain(model, data=str(tmp_path / name)) for name in ("a.npz", "b.npz")]
    assert named[0].model.data != named[1].model.data
    assert not gradscope.diff(*named).drifted
    np.savez(tmp_path / "b.npz", x=1.5 * x, y=y)
    with pytest.raises(ConfigError, match=r"its batch's arrays differ from the base report's "
                                          r"\(model\.data \"supplied \(.*b\.npz\)\""):
        gradscope.diff(named[0], gradscope.explain(model, data=str(tmp_path / "b.npz")))


def test_a_loss_that_became_n_a_is_named(seed_json, tmp_path):
    """Found tried as a new user would: a report whose loss is n/a (not finite: a float32
    config that overflows) listed no loss change against one whose loss was a number."""
    document = json.loads(seed_json.read_text())
    edited = copy.deepcopy(document)
    edited["loss"]["value"] = None
    done = run_without_tensorflow("diff", str(seed_json),
                                  str(_write(tmp_path, "new.json", edited)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the loss was {document['loss']['value']:.6g}, is n/a (not finite)" in " ".join(
        done.stdout.split())


def test_a_layer_the_user_renamed_is_hinted_not_paired(seed_json):
    """A layer renamed in the code (gru_1 → encoder): its tensors share nothing of their names,
    so they are removed and added, each added one with the hint of the removed tensor of its
    shape and ‖g‖ (found tried as a new user would: identical norms, unremarked). One whose
    ‖g‖ moved beyond rtol gets no hint."""
    document = json.loads(seed_json.read_text())
    edited = copy.deepcopy(document)
    for entry in edited["gradients"]:
        entry["name"] = entry["name"].replace("gru_1/", "encoder/")
    moved = next(e for e in edited["gradients"] if e["name"] == "encoder/b_c")
    moved["stats"]["l2"] *= 1.01
    report = gradscope.diff(document, edited)
    added = {c.tensor: c.detail for c in report.changes if c.kind == "added"}
    assert added["encoder/w_ru"].endswith("; the shape and ‖g‖ of the removed gru_1/w_ru "
                                          "(a layer renamed?)")
    assert added["encoder/b_c"] == "new in the model"
    assert {c.tensor for c in report.changes if c.kind == "removed"} >= {"gru_1/w_ru"}


def test_values_that_became_nan_or_inf_and_flags_that_flip_are_named(seed_json, tmp_path):
    document = json.loads(seed_json.read_text())
    edited = copy.deepcopy(document)
    edited["gradients"][0]["stats"]["nonfinite"] = 3
    # The seed's first GRU is flagged vanishing (what its recurrence carries back): the
    # edited report has no flag there.
    flags = edited["gradient_flow"]["flags"]
    assert any(f["what"] == "∂L/∂gru_1/h_t" and f["kind"] == "vanishing" for f in flags)
    edited["gradient_flow"]["flags"] = [f for f in flags if f["what"] != "∂L/∂gru_1/h_t"]
    done = run_without_tensorflow("diff", str(seed_json),
                                  str(_write(tmp_path, "new.json", edited)))
    assert done.returncode == 1
    assert "nonfinite" in done.stdout and "3 values NaN or Inf" in done.stdout
    assert "flag vanishing → none" in done.stdout


@pytest.mark.parametrize("field, value", [
    (("model", "batch_size"), 8),
    (("model", "seed"), 1),
    (("model", "data"), "batch.npz"),
])
def test_reports_of_other_data_are_refused_naming_the_field(seed_json, tmp_path, field, value):
    document = json.loads(seed_json.read_text())
    document[field[0]][field[1]] = value
    done = run_without_tensorflow("diff", str(seed_json),
                                  str(_write(tmp_path, "new.json", document)))
    assert done.returncode == 2
    assert f"{'.'.join(field)} is" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value, words", [
    (float("nan"), "gradients.0.stats.l2 is not a finite number"),
    ("abc", "gradients.0.stats.l2: Input should be a valid number"),
    # null only where no value is finite (a gradient all NaN has no norm)
    (None, "gradients.0.stats: Value error, a statistic is null, yet no entry is NaN or Inf"),
])
def test_a_report_whose_values_gradscope_would_not_write_is_refused(seed_json, tmp_path,
                                                                     value, words):
    """Tried as a new user would: an l2 of NaN read "NO DRIFT" (exit 0), one of "abc" "no
    gradient now" (exit 1). A document is held to the report model it claims to be."""
    document = json.loads(seed_json.read_text())
    document["gradients"][0]["stats"]["l2"] = value
    done = run_without_tensorflow("diff", str(seed_json),
                                  str(_write(tmp_path, "new.json", document)))
    assert done.returncode == 2, done.stdout
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_what_is_not_an_explain_report_is_refused(seed_json, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    check = _write(tmp_path, "check.json", {"schema_version": "1", "command": "check"})
    for other, words in [(bad, "not JSON"), (check, "a 'check' report"),
                         (tmp_path / "missing.json", "no such file")]:
        done = run_without_tensorflow("diff", str(seed_json), str(other))
        assert done.returncode == 2, other
        assert words in done.stderr
    with pytest.raises(ConfigError, match="expected a number > 0"):
        gradscope.diff(seed_json, seed_json, rtol=0)
    # Found tried as a new user would: an empty dict was "a None report".
    with pytest.raises(ConfigError,
                       match=r"new report: no command field \(not a gradscope report\)"):
        gradscope.diff(seed_json, {})
    listed = tmp_path / "list.json"
    listed.write_text("[]", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"list\.json: a list; expected an explain report"):
        gradscope.diff(seed_json, listed)


@settings(max_examples=40, deadline=None)
@given(factor=st.floats(min_value=0.5, max_value=2.0), rtol=st.sampled_from([1e-6, 1e-4, 1e-2]))
def test_a_scaled_norm_drifts_exactly_beyond_rtol(seed_json, factor, rtol):
    document = json.loads(seed_json.read_text())
    edited = copy.deepcopy(document)
    base = edited["gradients"][0]["stats"]["l2"]
    edited["gradients"][0]["stats"]["l2"] = base * factor
    report = gradscope.diff(document, edited, rtol=rtol)
    relative = abs(base * factor - base) / max(abs(base), abs(base * factor))
    assert report.drifted == (relative > rtol)
    assert [c.kind for c in report.changes] == (["norm"] if relative > rtol else [])


def test_a_weight_keras_names_otherwise_is_paired_and_compared(tf):
    """The same weight under another path (Keras numbers what it names, and a cell's weights
    may carry the cell's name: ``rnn/kernel`` or ``rnn/minimal_rnn_cell_1/kernel``) is one
    tensor renamed, its ‖g‖ compared; where the pairing is not the only one (two weights of a
    layer with the same last part and shape), or the shape differs, it is removed + added."""
    import keras

    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.SimpleRNN(4, name="rnn"),
                              keras.layers.Dense(2, name="head")])
    model.compile(loss="mse")
    rng = np.random.default_rng(1)
    base = gradscope.explain(model, x=rng.standard_normal((3, 6, 3)).astype("float32"),
                             y=np.zeros((3, 2), "float32")).to_dict()
    new = copy.deepcopy(base)
    entry = next(g for g in new["gradients"] if g["name"] == "rnn/kernel")
    entry["name"] = "rnn/simple_rnn_cell_1/kernel"
    entry["stats"]["l2"] *= 1.01
    report = gradscope.diff(base, new)
    assert [(c.tensor, c.kind) for c in report.changes] == [
        ("rnn/simple_rnn_cell_1/kernel", "renamed"), ("rnn/simple_rnn_cell_1/kernel", "norm")]
    assert report.changes[0].detail.startswith("was rnn/kernel: the same layer's kernel and "
                                               "shape")
    # Narrow: the kind whole on its line, a long name folded after a "/" (the column
    # shrank to "re" for both removed and renamed, and names broke mid-word).
    lines = render_text(report, 60).splitlines()
    assert max(len(line) for line in lines) <= 60
    at = next(k for k, line in enumerate(lines) if "renamed" in line.split())
    assert lines[at].split()[0] == "rnn/simple_rnn_cell_1/"
    assert lines[at + 1].split()[0] == "kernel", lines
    assert report.compared_tensors == len(base["gradients"]) + len(
        base["initial_state_gradients"])
    assert report.drifted
    # Two candidates of one kind: no guess.
    twice = copy.deepcopy(new)
    extra = copy.deepcopy(next(g for g in twice["gradients"] if g["name"].endswith("/kernel")
                               and g["name"].startswith("rnn/")))
    extra["name"] = "rnn/other_cell/kernel"
    twice["gradients"].append(extra)
    kinds = {(c.tensor, c.kind) for c in gradscope.diff(base, twice).changes}
    assert {("rnn/kernel", "removed"), ("rnn/simple_rnn_cell_1/kernel", "added"),
            ("rnn/other_cell/kernel", "added")} <= kinds
    # Another shape: not the same weight.
    reshaped = copy.deepcopy(new)
    moved = next(g for g in reshaped["gradients"] if g["name"] == "rnn/simple_rnn_cell_1/kernel")
    moved["shape"] = [moved["shape"][0] + 1, moved["shape"][1]]
    kinds = {(c.tensor, c.kind) for c in gradscope.diff(base, reshaped).changes}
    assert {("rnn/kernel", "removed"), ("rnn/simple_rnn_cell_1/kernel", "added")} <= kinds


def test_a_bidirectional_s_renamed_inner_layer_pairs_each_direction_with_its_own(tf):
    """The inner layer of a Bidirectional renamed (``LSTM(name="enc")`` → ``"encoder"``):
    each direction's weights pair with that direction's (they share the layer, last part and
    shape across directions, and were left unpaired)."""
    import keras

    def explained(name: str, input_name: str | None = "x") -> dict[str, Any]:
        keras.utils.set_random_seed(5)
        model = keras.Sequential([
            keras.Input((5, 3), name=input_name),  # "x": as a fresh process names it
            keras.layers.Bidirectional(keras.layers.LSTM(4, name=name), name="both"),
            keras.layers.Dense(2, name="head")])
        model.compile(loss="mse")
        rng = np.random.default_rng(2)
        return gradscope.explain(model, x=rng.standard_normal((3, 5, 3)).astype("float32"),
                                 y=np.zeros((3, 2), "float32")).to_dict()

    base, new = explained("enc"), explained("encoder")
    report = gradscope.diff(base, new)
    renamed = {c.tensor: c.detail for c in report.changes if c.kind == "renamed"}
    assert {c.kind for c in report.changes} == {"renamed"}, report.changes
    # Names alone changed: no drift, exit 0, and said so (it read "DRIFT: 6 changes" and
    # failed CI; found tried as a new user would).
    assert not report.drifted
    text = " ".join(render_text(report, 80).split())
    assert text.endswith(f"NO DRIFT: every gradient, its shape and the loss agree within rtol "
                         f"0.0001; {len(report.changes)} tensors under another name, compared "
                         "as one")
    for way in ("forward", "backward"):
        assert renamed[f"both/{way}_encoder/kernel"].startswith(f"was both/{way}_enc/kernel")
    assert not any(c.kind in ("added", "removed") for c in report.changes)
    # The same arrays given to an input Keras numbered otherwise are the same data: refused
    # for the inputs' names, not as "its batch's arrays differ".
    numbered = [explained("enc", input_name=None) for _ in range(2)]
    assert numbered[0]["model"]["inputs"] != numbered[1]["model"]["inputs"]
    with pytest.raises(ConfigError, match=r"model\.inputs is"):
        gradscope.diff(*numbered)
