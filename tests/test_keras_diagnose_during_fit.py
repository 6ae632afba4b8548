"""GradientFlow(diagnose_every=N): the dynamics each diagnosis records during model.fit, in
TensorBoard's event files and in `gradscope watch`.

The truth is the diagnose API run afterwards on the same weights (kept by a callback after
GradientFlow at each diagnosed step) and the same batch (fit runs unshuffled, so batch k is
rows 8k…8k+7): an independent path (its own engine, its own run), itself held to QR of
Keras' own step Jacobians in test_keras_diagnose.py. (Its MirroredStrategy case is in
test_keras_distributed.py.)
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from conftest import render_text, run_gradscope, run_without_tensorflow, tensorboard_events

from gradscope.errors import ConfigError

BATCH, STEPS, FEATURES, BATCHES = 8, 7, 3, 4
DIAGNOSE_EVERY = 2  # diagnoses after batches 2 and 4
#: Under XLA (a fit of many diagnoses) the Lyapunov scan orders its float32 sums its own way:
#: the exponents are diagnose's to float32 rounding (a step's log is 1e-7 off at most; a
#: wrong weight or batch moves them by far more). Else they are diagnose's own numbers.
ROUNDING = {"rtol": 1e-5, "atol": 1e-7}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tf):
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(5)
    # A bias of 2.5 saturates many gate values above 0.9: the shares are not all 0.
    saturating = keras.initializers.Constant(2.5)
    model = keras.Sequential([
        keras.Input((STEPS, FEATURES)),
        keras.layers.GRU(5, return_sequences=True, bias_initializer=saturating, name="gru"),
        keras.layers.SimpleRNN(4, return_sequences=True, name="simple"),
        keras.layers.LSTM(3, bias_initializer=saturating, name="lstm"),
        keras.layers.Dense(2, name="out"),
    ], name="diagnosed_model")
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * BATCHES, STEPS, FEATURES)).astype("float32")
    y = rng.standard_normal((BATCH * BATCHES, 2)).astype("float32")
    weights: dict[int, list[np.ndarray]] = {}

    class KeepWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            weights[batch + 1] = self.model.get_weights()

    log_dir = tmp_path_factory.mktemp("runs") / "diagnosed"
    flow = GradientFlow(every=3, log_dir=log_dir, diagnose_every=DIAGNOSE_EVERY,
                        diagnose_exponents=3, diagnose_horizon=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow, KeepWeights()])
    flow.close()
    return {"flow": flow, "model": model, "x": x, "y": y, "weights": weights,
            "log_dir": log_dir}


def _truth(fitted, step):
    import gradscope

    model = fitted["model"]
    model.set_weights(fitted["weights"][step])
    rows = slice((step - 1) * BATCH, step * BATCH)
    try:
        return gradscope.diagnose(model, x=fitted["x"][rows], y=fitted["y"][rows],
                                  exponents=3, counterfactuals=False)
    finally:
        model.set_weights(fitted["weights"][BATCHES])


def test_each_diagnosis_equals_diagnose_on_the_same_weights_and_batch(fitted):
    history = fitted["flow"].history
    assert history.diagnose_every == DIAGNOSE_EVERY and history.diagnose_exponents == 3
    assert history.diagnosis_steps == [2, 4] and history.batches == BATCHES
    assert [o.step for o in history.observations] == [3]  # the flow keeps its own every
    series = {s.call: s for s in history.diagnoses}
    assert list(series) == ["gru", "simple", "lstm"]
    saturated = 0.0
    for index, step in enumerate(history.diagnosis_steps):
        report = _truth(fitted, step)
        truth = {layer.call: layer for layer in report.layers}
        for call, entry in series.items():
            expected = truth[call]
            # The note says what diagnose warns of λ₁ (over 7 steps: whether it settled).
            warned = [w for w in report.warnings if w.startswith(f"{call}: λ₁ has not settled")]
            assert (entry.lyapunov_note[index] is not None) == bool(warned)
            np.testing.assert_allclose(entry.lyapunov[index], expected.lyapunov, rtol=1e-9)
            assert entry.horizon_predicted[index] == pytest.approx(expected.horizon.predicted,
                                                                   rel=1e-9)
            assert entry.horizon_measured[index] == expected.horizon.measured
            assert entry.horizon_window[index] == expected.horizon.window
            if expected.gates is None:
                assert entry.gates[index] is None
                assert entry.gates_note == expected.gates_note
                continue
            assert entry.gates[index] == expected.gates
            saturated = max(saturated, *(g.above_0_9 for g in expected.gates.values()))
    assert series["simple"].gates_note == "a SimpleRNN cell has no gates"
    assert saturated > 0.2  # the shares compared are not all zero


def test_event_files_hold_the_diagnose_tags(fitted, tf):
    history = fitted["flow"].history
    values, _ = tensorboard_events(tf, fitted["log_dir"])
    gru = next(s for s in history.diagnoses if s.call == "gru")
    for rank in (1, 2, 3):
        recorded = [v[rank - 1] for v in gru.lyapunov]
        np.testing.assert_allclose([values[f"diagnose/gru/lyapunov_{rank}"][s]
                                    for s in (2, 4)], recorded, rtol=1e-6)  # float32
    np.testing.assert_allclose([values["diagnose/gru/gate_update_above_0_9"][s]
                                for s in (2, 4)],
                               [g["update"].above_0_9 for g in gru.gates], rtol=1e-6)
    for tag in ("diagnose/lstm/gate_forget_below_0_1", "diagnose/lstm/horizon_predicted",
                "diagnose/simple/lyapunov_1"):
        assert set(values[tag]) == {2, 4}, tag
    assert not any(t.startswith("diagnose/simple/gate_") for t in values)


def test_watch_shows_the_diagnoses(fitted):
    history = fitted["flow"].history
    result = run_without_tensorflow("watch", str(fitted["log_dir"]), "--json")
    assert result.returncode == 0, result.stderr
    read = json.loads(result.stdout)
    ours = history.to_dict()
    for key in ("diagnose_every", "diagnose_exponents", "diagnosis_steps", "diagnoses",
                "not_diagnosed"):
        assert read[key] == ours[key], key  # written as JSON: exact
    text = run_gradscope("watch", str(fitted["log_dir"]), env={"COLUMNS": "100"})
    assert text.returncode == 0, text.stderr
    gru = next(s for s in history.diagnoses if s.call == "gru")
    lines = text.stdout.splitlines()
    lead = next(line for line in lines if line.startswith("gru (GRUCell) at step 4"))
    assert f"λ₁ {gru.lyapunov[-1][0]:+.3g} nats/step" in lead
    # Each exponent by its name; and the diagnose that gives them, with as many columns.
    assert f"(λ₂ {gru.lyapunov[-1][1]:+.3g}, λ₃ {gru.lyapunov[-1][2]:+.3g})" in lead
    assert read["diagnose_examples"] == 8
    assert ("\nas gradscope diagnose --exponents 3 reads them, on up to 8 examples of each "
            "batch, evenly spaced\n") in text.stdout
    assert f"at step 2 λ₁ was {gru.lyapunov[0][0]:+.3g}" in lead
    shares = gru.gates[-1]["update"]
    from gradscope.formats import share

    assert (f"update {share(shares.below_0_1)} / {share(shares.above_0_9)}" in text.stdout
            and "gates (share < 0.1 / > 0.9)" in text.stdout)
    assert "gates: a SimpleRNN cell has no gates" in text.stdout
    assert f"horizon predicted from λ₁: {gru.horizon_predicted[-1]:.3g} steps" in text.stdout
    # Narrow, a wrapped line hangs under its first words, never at the first column.
    narrow = run_gradscope("watch", str(fitted["log_dir"]), env={"COLUMNS": "60"}).stdout
    section = narrow.split("spaced\n")[1].split("\n\n")[0]
    for line in section.splitlines():
        assert len(line) <= 60 and (line.startswith((" ", "gru (", "simple (", "lstm ("))), line
    # A long call's label on a line of its own, its words under it (found tried as a new
    # user would: they hung in a column of 20 under the label, "-0.486" alone on a line).
    long = "decoder_gated_recurrent_unit_layer_number_two_long"
    renamed = history.model_copy(update={"diagnoses": [
        s.model_copy(update={"call": long}) if s.call == "gru" else s
        for s in history.diagnoses]})
    block = render_text(renamed, 80).split(f"{long} (GRUCell):\n")[1].split("\n\n")[0]
    lines = block.split("\n  gates")[0].splitlines()
    assert lines[0].startswith(f"  at step 4: λ₁ {gru.lyapunov[-1][0]:+.3g} nats/step"), lines
    assert f"  at step 2 λ₁ was {gru.lyapunov[0][0]:+.3g}" in lines, lines  # whole, wrapped
    assert lines[-1].startswith("  horizon predicted"), lines


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "4"])
def test_invalid_diagnose_every_is_a_clear_error(value):
    from gradscope.keras import GradientFlow

    with pytest.raises(ConfigError, match=r"GradientFlow\(diagnose_every=.*\): expected a "
                                          r"whole number of batches ≥ 1, or None"):
        GradientFlow(diagnose_every=value)
    with pytest.raises(ConfigError, match=r"GradientFlow\(diagnose_exponents=.*\): expected "
                                          r"a whole number ≥ 1"):
        GradientFlow(diagnose_every=4, diagnose_exponents=value)


def test_numpy_whole_numbers_are_taken_as_python_ints(tf):
    """Found tried as a new user would: GradientFlow(diagnose_every=np.int64(8)), an N
    computed with NumPy (len(x) // 32 // 10), was refused as "expected a whole number"; it
    is taken, as a Python int (the history's JSON holds it). NumPy's bools and floats are
    still refused."""
    from gradscope.keras import GradientFlow

    flow = GradientFlow(every=np.int64(50), diagnose_every=np.int64(8),
                        diagnose_exponents=np.int32(2), diagnose_examples=np.uint8(4))
    taken = (flow.every, flow.diagnose_every, flow.diagnose_exponents, flow.diagnose_examples)
    assert taken == (50, 8, 2, 4) and all(type(v) is int for v in taken)
    for value in (np.bool_(True), np.float64(8.0)):
        with pytest.raises(ConfigError, match=r"diagnose_every=.*: expected a whole number"):
            GradientFlow(diagnose_every=value)


def test_a_custom_loop_diagnoses_the_model_itself_at_the_steps_observe_divides(tf):
    import keras

    import gradscope
    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5, 2)), keras.layers.GRU(4), keras.layers.Dense(1)])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5, 2)).astype("float32")
    y = rng.standard_normal((6, 1)).astype("float32")
    flow = GradientFlow(model=model, loss="mse", diagnose_every=2)
    flow.observe(x, y)  # step 1: not diagnosed
    flow.observe(x, y)  # step 2
    model.compile(loss="mse")
    truth = gradscope.diagnose(model, x=x, y=y, exponents=1, counterfactuals=False).layers[0]
    history = flow.history
    assert history.diagnosis_steps == [2]
    np.testing.assert_allclose(history.diagnoses[0].lyapunov[0], truth.lyapunov, rtol=1e-9)
    assert history.diagnoses[0].gates == [truth.gates]


def _twin_and_truth(model, seed):
    """A batch of 5 sequences of (6, 2) for ``model`` (compiled here with mse), the model's
    copy witnessed on it, and what diagnose reads of its first recurrent call."""
    import gradscope
    from gradscope.keras.diagnosis_twin import make_twin

    model.compile(loss="mse")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 6, 2)).astype("float32")
    y = rng.standard_normal((5, 1)).astype("float32")
    twin = make_twin(model, None, {"x": x})
    assert twin is not None
    truth = gradscope.diagnose(model, x=x, y=y, exponents=1, counterfactuals=False).layers[0]
    return x, y, twin, truth


def test_a_functional_model_is_diagnosed_on_its_copy(tf, monkeypatch):
    """Keras' copy of a functional model renames its input layer: the copy still serves (the
    diagnoses of fit then run beside training), and reads what diagnose reads on the model,
    under XLA too (as a fit of many diagnoses scans)."""
    import keras

    from gradscope.keras.diagnose import trajectory

    monkeypatch.setattr(trajectory, "_shared", collections.OrderedDict())

    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 2))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GRU(4)(inputs)))
    x, y, twin, truth = _twin_and_truth(model, 2)
    assert [layer.name for layer in twin.model.layers][1:] == [
        layer.name for layer in model.layers][1:]
    for compiled, close in ((False, {"rtol": 1e-9}), (True, ROUNDING)):
        readings, skipped = twin.read(model.get_weights(), {"x": x}, {"y": y}, None, 1, False,
                                      compiled)
        assert not skipped and readings[0].call == truth.call
        np.testing.assert_allclose(readings[0].lyapunov, truth.lyapunov, **close)
        assert readings[0].gates == truth.gates
    # The graph's stepping and scan (the scan the process's: trajectory.shared_function),
    # then XLA's one function (one_function.py).
    traced = sorted((key[0], key[-1]) for key in [*twin.engine._traces, *trajectory._shared]
                    if key[0] in ("lyapunov scan", "stepped", "one loop"))
    assert traced == [("lyapunov scan", False), ("stepped", False)]
    assert _in_one_function(twin.cache) == [truth.call]


def test_reads_of_a_copy_with_dropout_leave_its_moved_state_and_agree_each_time(tf):
    """A cell with dropout draws its masks even in inference mode, moving its seed generator:
    the copy's reads do not put that state back (nothing reads it), and each read still
    reads what diagnose reads on the model; the model's own state is not touched."""
    import keras

    from gradscope.keras.whole_model import moved_variables

    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((6, 2)),
                              keras.layers.GRU(4, dropout=0.3, recurrent_dropout=0.3,
                                               name="gru"),
                              keras.layers.Dense(1, name="out")])
    x, y, twin, truth = _twin_and_truth(model, 6)
    own = [np.array(v.numpy()) for v in moved_variables(model)]
    copied = [np.array(v.numpy()) for v in moved_variables(twin.model)]
    for _ in range(3):
        readings, skipped = twin.read(model.get_weights(), {"x": x}, {"y": y}, None, 1,
                                      False, True)
        assert not skipped
        np.testing.assert_allclose(readings[0].lyapunov, truth.lyapunov, **ROUNDING)
        assert readings[0].gates == truth.gates
    assert _in_one_function(twin.cache) == [truth.call]
    for value, variable in zip(own, moved_variables(model), strict=True):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert any(not np.array_equal(variable.numpy(), value)
               for value, variable in zip(copied, moved_variables(twin.model), strict=True))


def test_a_model_with_no_recurrent_layer_says_so(tf):
    """Found tried as a new user would: diagnose exited 0 on a model with no recurrent layer
    (a CI job passed on nothing), and a fit's diagnoses recorded nothing, with no word. The
    command refuses (exit 2); the diagnoses say why each found nothing."""
    import keras

    import gradscope
    from gradscope.keras import GradientFlow

    model = keras.Sequential([keras.Input((5, 2)), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    x = np.zeros((4, 5, 2), "float32")
    y = np.zeros((4, 1), "float32")
    with pytest.raises(ConfigError, match="the model has no recurrent layer call, so there is "
                                          "nothing to diagnose"):
        gradscope.diagnose(model, x=x, y=y)
    flow = GradientFlow(model=model, loss="mse", diagnose_every=1)
    flow.observe(x, y)
    (skipped,) = flow.history.not_diagnosed
    assert (skipped.layer, skipped.reason, skipped.steps) == (
        "the model", "it has no recurrent layer call: nothing to diagnose", [1])


_STATEFUL_BATCH, _STATEFUL_STEPS = 4, 9


def _stateful_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * _STATEFUL_BATCH, _STATEFUL_STEPS, 2)).astype("float32") + 1.0
    return x, x[:, -2:, 0].sum(1, keepdims=True)


def _stateful_trained(keras, *callbacks, per_execution=1):
    """A stateful GRU fitted an epoch on :func:`_stateful_data` with ``callbacks``."""
    x, y = _stateful_data()
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((_STATEFUL_STEPS, 2), batch_size=_STATEFUL_BATCH),
                              keras.layers.GRU(4, stateful=True, name="gru"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", steps_per_execution=per_execution)
    model.fit(x, y, batch_size=_STATEFUL_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


@pytest.fixture(scope="module")
def stateful_plain(tf):
    """The fits without GradientFlow of :func:`_stateful_trained`, each fitted once for the
    cases that share it: by steps_per_execution, its weights, its carried state after the
    epoch, and the carried state as each batch started (seen one step at a time by a
    callback that only reads it: with steps_per_execution 1, every batch's)."""
    import keras

    class Start(keras.callbacks.Callback):  # the carried state as each batch starts
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[np.ndarray] = []

        def on_train_batch_begin(self, index, logs=None):
            self.seen.append(self.model.get_layer("gru").states[0].numpy().copy())

    fits = {}

    def plain(per_execution):
        if per_execution not in fits:
            start = Start()
            model = _stateful_trained(keras, start, per_execution=per_execution)
            fits[per_execution] = (model.get_weights(),
                                   model.get_layer("gru").states[0].numpy().copy(), start.seen)
        return fits[per_execution]

    return plain


@pytest.fixture(scope="module")
def stateful_diagnosed(tf):
    """The exponents diagnose finds for a fitted :func:`_stateful_trained` on the last batch,
    from a given carried state: each diagnosed once for the cases whose weights and state are
    the same (bit for bit: keyed by their bytes)."""
    import gradscope

    found = {}

    def lyapunov(model, state):
        key = (state.tobytes(), *(w.tobytes() for w in model.get_weights()))
        if key not in found:
            model.get_layer("gru").states[0].assign(state)
            x, y = _stateful_data()
            found[key] = gradscope.diagnose(
                model, x=x[-_STATEFUL_BATCH:], y=y[-_STATEFUL_BATCH:], exponents=4,
                counterfactuals=False).layers[0].lyapunov
        return found[key]

    return lyapunov


@pytest.mark.parametrize("per_execution", [1, 2])
def test_a_stateful_layer_is_read_from_the_state_its_batch_started_from(
        tf, per_execution, stateful_plain, stateful_diagnosed):
    """Found tried as a new user would: a stateful GRU's diagnosis during fit stepped its
    batch from the state the step left (after the batch), not the one the batch started
    from: λ₁ -0.44035 against -0.44091. The observation and the diagnosis now rerun the
    batch from its own start; training keeps its state (the step's, given back after).
    With steps_per_execution 2, the start of an execution's last batch was not seen, and
    the state after it was read: the steps before it now run first, as Keras runs them."""
    import keras

    from gradscope.keras import GradientFlow

    flow = GradientFlow(every=4, diagnose_every=4, diagnose_exponents=4)
    model = _stateful_trained(keras, flow, per_execution=per_execution)
    assert flow.history.diagnosis_steps == [4]
    after = model.get_layer("gru").states[0].numpy().copy()
    # training itself is untouched: its weights and its carried state
    plain_weights, plain_state, _ = stateful_plain(per_execution)
    assert np.array_equal(plain_state, after)
    assert all(np.array_equal(a, b) for a, b in zip(plain_weights, model.get_weights(),
                                                    strict=True))
    _, _, seen = stateful_plain(1)  # each batch's start, seen one step at a time
    assert len(seen) == 4
    recorded = flow.history.diagnoses[0].lyapunov[-1]
    np.testing.assert_allclose(recorded, stateful_diagnosed(model, seen[3]), rtol=1e-6)
    moved = stateful_diagnosed(model, after)
    assert not np.allclose(recorded, moved, rtol=1e-4)  # the state after it reads otherwise


def test_a_fit_that_diagnoses_without_observing_describes_its_run_first_and_last(tmp_path,
                                                                                 tf):
    """Found measuring the callback's cost: a fit that diagnosed and never observed built the
    whole history at every diagnosis, to write the run's description again (the same each
    time, and longer to build each time). It is written at the first diagnosis, and again at
    fit's end with the batches trained; watch reads the run."""
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((STEPS, FEATURES)), keras.layers.GRU(3, name="gru"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).standard_normal((BATCH * 3, STEPS, FEATURES)).astype(
        "float32")
    flow = GradientFlow(every=100, diagnose_every=1, log_dir=tmp_path)
    model.fit(x, x[:, 0, :1], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow])
    flow.close()
    values, _ = tensorboard_events(tf, tmp_path)
    assert set(values["gradscope/run"]) == {1, 3}
    assert set(values["diagnose/gru/lyapunov_1"]) == {1, 2, 3}
    read = json.loads(run_without_tensorflow("watch", str(tmp_path), "--json").stdout)
    assert read["diagnosis_steps"] == [1, 2, 3] and read["observations"] == []
    assert read["batches"] == 3
    assert read["diagnoses"] == flow.history.to_dict()["diagnoses"]


def test_a_fit_shorter_than_diagnose_every_says_why_it_has_no_diagnosis(tf):
    """Found tried as a new user would: a fit of 4 batches at diagnose_every=100 printed the
    section's title and nothing under it."""
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((STEPS, FEATURES)), keras.layers.GRU(3),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * BATCHES, STEPS, FEATURES)).astype("float32")
    flow = GradientFlow(every=2, diagnose_every=100)
    model.fit(x, x[:, 0, :1], batch_size=BATCH, epochs=1, verbose=0, callbacks=[flow])
    text = " ".join(render_text(flow.history, 80).split())
    assert ("Dynamics across training (0 diagnoses, one every 100 batches) as gradscope "
            "diagnose --exponents 1 reads them, on up to 8 examples of each batch, evenly spaced "
            f"no diagnoses: {BATCHES} batches trained, fewer than diagnose_every=100") in text
    assert "yet" not in text


def test_a_fit_of_many_diagnoses_compiles_for_one_batch_size(tf, monkeypatch):
    """A fit of at least 50 diagnoses scans under XLA, which compiles for one batch size:
    an epoch's last, shorter batch is read as a graph, traced once, and not compiled again
    (found tried as a new user would: about 1 s more a fit). Its reading is diagnose's own,
    to the last bits."""
    import keras

    import gradscope
    from gradscope.keras import GradientFlow
    from gradscope.keras.diagnose import trajectory

    monkeypatch.setattr(trajectory, "_shared", collections.OrderedDict())

    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5, 2)), keras.layers.GRU(3, name="gru"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8 * 50 + 3, 5, 2)).astype("float32")
    y = rng.standard_normal((8 * 50 + 3, 1)).astype("float32")
    flow = GradientFlow(every=1000, diagnose_every=1)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[flow])
    assert flow.history.diagnosis_steps == list(range(1, 52))
    # XLA's one function (one_function.py), and the last batch's scan as a graph (the
    # process's: trajectory.shared_function).
    traced = sorted(key[0] for key in [*flow._twin.engine._traces, *trajectory._shared]
                    if key[0] in ("lyapunov scan", "one loop"))
    assert traced == ["lyapunov scan"]
    assert _in_one_function(flow._twin.cache) == ["gru"]
    truth = gradscope.diagnose(model, x=x[-3:], y=y[-3:], exponents=1,
                               counterfactuals=False).layers[0]
    (series,) = flow.history.diagnoses
    np.testing.assert_allclose(series.lyapunov[-1], truth.lyapunov, rtol=1e-9)


def test_a_diagnosis_reads_evenly_spaced_examples_with_the_weights_its_step_left(tf):
    """diagnose_examples=3 of batches of 10: each diagnosis is diagnose's own on rows 0, 4
    and 9 of its batch, with the weights its step left. After the first (held here until it
    ends), each diagnosis reads the model's weights as its step left them (copied into the
    copy's variables in one traced function, then read beside training): a stale copy would
    read the weights of the step before. The third is taken while the worker is still busy
    (a job of 0.5 s given to it after the second): it is queued with copies of the weights
    its step left, and training does not wait."""
    import time

    import keras

    import gradscope
    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((6, 2)),
                              keras.layers.LSTM(3, return_sequences=True, name="lstm"),
                              keras.layers.GRU(2, name="gru"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((30, 6, 2)).astype("float32")
    y = rng.standard_normal((30, 1)).astype("float32")
    flow = GradientFlow(every=1000, diagnose_every=1, diagnose_examples=3)
    weights, ready = {}, {}

    class KeepWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ready[batch + 1] = getattr(flow._twin, "ready", False)
            weights[batch + 1] = self.model.get_weights()
            flow.history  # noqa: B018  (waits for the first diagnosis, beside training)
            if batch + 1 == 2:
                flow._submit(time.sleep, 0.5)  # the worker busy at the third diagnosis

    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow, KeepWeights()])
    assert ready == {1: False, 2: True, 3: True}
    series = {s.call: s for s in flow.history.diagnoses}
    for index, step in enumerate(flow.history.diagnosis_steps):
        if not ready[step]:
            continue  # beside training, as the other tests of this file read it
        model.set_weights(weights[step])
        rows = (step - 1) * 10 + np.array([0, 4, 9])
        truth = gradscope.diagnose(model, x=x[rows], y=y[rows], exponents=1,
                                   counterfactuals=False)
        for layer in truth.layers:
            np.testing.assert_allclose(series[layer.call].lyapunov[index], layer.lyapunov,
                                       rtol=1e-9)
            assert series[layer.call].gates[index] == layer.gates


def test_a_copy_whose_outputs_are_not_the_model_s_leaves_the_diagnoses_to_the_model(tf):
    """A layer of the user's whose scale is set after it is made (not in its config): Keras'
    copy computes otherwise, its witness on the worker fails, and each diagnosis is read on
    the model itself, holding the weights its step left: diagnose's own, on the same rows."""
    import keras

    import gradscope
    from gradscope.keras import GradientFlow

    class Scaled(keras.layers.Layer):
        scale = 1.0

        def call(self, x):
            return x * self.scale

    keras.utils.set_random_seed(9)
    scaled = Scaled(name="scaled")
    scaled.scale = 3.0
    model = keras.Sequential([keras.Input((5, 2)), scaled, keras.layers.GRU(3, name="gru"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    rng = np.random.default_rng(9)
    x = rng.standard_normal((20, 5, 2)).astype("float32")
    y = rng.standard_normal((20, 1)).astype("float32")
    flow = GradientFlow(every=1000, diagnose_every=1, diagnose_examples=None)
    weights = []

    class KeepWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            weights.append(self.model.get_weights())

    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow, KeepWeights()])
    assert flow._twin is False
    series = {s.call: s for s in flow.history.diagnoses}
    assert flow.history.diagnosis_steps == [1, 2]
    for index, step in enumerate(flow.history.diagnosis_steps):
        model.set_weights(weights[step - 1])
        truth = gradscope.diagnose(model, x=x[(step - 1) * 10:step * 10],
                                   y=y[(step - 1) * 10:step * 10], exponents=1,
                                   counterfactuals=False)
        (layer,) = truth.layers
        np.testing.assert_allclose(series["gru"].lyapunov[index], layer.lyapunov, rtol=1e-9)
        assert series["gru"].gates[index] == layer.gates


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_invalid_diagnose_examples_is_a_clear_error(value):
    from gradscope.keras import GradientFlow

    with pytest.raises(ConfigError, match="diagnose_examples"):
        GradientFlow(diagnose_every=4, diagnose_examples=value)


def _three_cells(keras):
    keras.utils.set_random_seed(8)
    model = keras.Sequential([
        keras.Input((7, 3)),
        keras.layers.LSTM(4, return_sequences=True, go_backwards=True, name="lstm"),
        keras.layers.GRU(3, return_sequences=True, reset_after=False, name="gru"),
        keras.layers.SimpleRNN(2, name="simple"), keras.layers.Dense(1)])
    model.compile(loss="mse")
    for layer in model.layers[:2]:  # gates spread to both ends: each pair (x_t, h_(t−1)) counts
        layer.cell.recurrent_kernel.assign(3 * layer.cell.recurrent_kernel.numpy())
    rng = np.random.default_rng(8)
    return (model, 2 * rng.standard_normal((5, 7, 3)).astype("float32"),
            rng.standard_normal((5, 1)).astype("float32"))


def test_a_fit_s_compiled_diagnosis_steps_and_scans_each_layer_in_one_loop(tf):
    """Under XLA (a fit of many diagnoses), a Keras LSTM (go_backwards), GRU (reset_before)
    and SimpleRNN are each read in one loop (one_loop.py): the step linearised by hand steps
    the state and carries the columns at once; the whole diagnosis is one function
    (one_function.py). Their exponents are diagnose's to float32 rounding, their gates
    diagnose's exactly."""
    import keras

    import gradscope

    model, x, y = _three_cells(keras)
    twin, readings, skipped = _read_compiled(model, x, y, 3)
    assert not skipped
    assert len(_in_one_function(twin.cache, exponents=3)) == 3
    assert not [key for key in twin.engine._traces if key[0] in ("stepped", "lyapunov")]
    truth = gradscope.diagnose(model, x=x, y=y, exponents=3, counterfactuals=False)
    for ours, theirs in zip(readings, truth.layers, strict=True):
        assert ours.call == theirs.call
        np.testing.assert_allclose(ours.lyapunov, theirs.lyapunov, **ROUNDING)
        assert ours.gates == theirs.gates and ours.gates_note == theirs.gates_note


def test_a_model_not_read_in_one_function_is_read_call_by_call_each_gru_in_one_loop(tf):
    """A Bidirectional's two directions are read the general way: the model is not read in
    one function (one_function.py), and its GRU call is read in one loop of its own
    (one_loop.py); every reading is still diagnose's."""
    import keras

    import gradscope

    keras.utils.set_random_seed(9)
    model = keras.Sequential([
        keras.Input((6, 3)),
        keras.layers.Bidirectional(keras.layers.GRU(3, return_sequences=True), name="both"),
        keras.layers.GRU(4, name="gru"), keras.layers.Dense(1)])
    model.compile(loss="mse")
    x = np.random.default_rng(9).standard_normal((5, 6, 3)).astype("float32")
    y = np.zeros((5, 1), "float32")
    twin, readings, skipped = _read_compiled(model, x, y, 1)
    assert not skipped
    assert twin.cache[("one function", True, 1)] is False
    assert [key[0] for key in twin.engine._traces if key[0] == "one loop"] == ["one loop"]
    truth = gradscope.diagnose(model, x=x, y=y, exponents=1, counterfactuals=False)
    assert [r.call for r in readings] == [layer.call for layer in truth.layers]
    for ours, theirs in zip(readings, truth.layers, strict=True):
        assert ours.gates == theirs.gates
        np.testing.assert_allclose(ours.lyapunov, theirs.lyapunov, **ROUNDING)


def test_diagnoses_at_the_last_batch_of_each_execution_are_not_said_to_be_every_batch(tf):
    """Found tried as a new user would: diagnose_every=1 at 2 steps per execution diagnosed
    steps 2, 4 and 6 (fit shows the callback each execution's last batch; warned), and the
    report said "every batch". It says what was asked and where they were taken."""
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(12)
    model = keras.Sequential([keras.Input((4, 2)), keras.layers.GRU(3), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((24, 4, 2)).astype("float32")
    flow = GradientFlow(every=100, diagnose_every=1)
    with pytest.warns(UserWarning, match="diagnose_every=1"):
        model.fit(x, x[:, 0, :1], batch_size=4, epochs=1, verbose=0, callbacks=[flow])
    assert flow.history.diagnosis_steps == [2, 4, 6]
    text = " ".join(render_text(flow.history, 80).split())
    assert ("Dynamics across training (3 diagnoses, asked every batch)" in text
            and "taken at steps 2, 4, 6 (with steps_per_execution above 1, fit shows the "
            "callback the last batch of each execution)" in text)
    assert "every batch)" not in text.replace("asked every batch)", "")


def test_diagnoses_off_the_multiples_are_said_whatever_their_count() -> None:
    """Found tried as a new user would: at 2 steps per execution and diagnose_every=3, the
    diagnoses at 4, 6, 10, 12 were as many as at 3, 6, 9, 12, and nothing was said; and a
    custom loop's steps were given fit's reason."""
    from gradscope.report.history_text import _taken_at

    assert _taken_at([3, 6, 9, 12], 3, True) is None
    assert _taken_at([4, 6, 10, 12], 3, True) == (
        "taken at steps 4, 6, 10, … (with steps_per_execution above 1, fit shows the callback "
        "the last batch of each execution)")
    assert _taken_at([0, 3, 4, 11], 1, False) == (
        "taken at steps 0, 3, 4, … (the steps observe() was given)")


def test_a_batch_that_is_not_finite_says_so_and_leaves_the_one_function_to_the_next(tf):
    """A batch whose own outputs are NaN (found tried as a new user would: weights a NaN had
    reached read as "the stepped cell does not reproduce Keras' output (max |error| nan >
    nan)") is not diagnosed, and says that Keras' own output is not finite; the next finite
    batch is read in one function again (one_function.py), as diagnose reads it."""
    import keras

    import gradscope
    from gradscope.keras.diagnosis_twin import make_twin

    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((5, 2)), keras.layers.GRU(3, name="gru"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 5, 2)).astype("float32")
    y = np.zeros((4, 1), "float32")
    twin = make_twin(model, None, {"x": x})
    bad = x.copy()
    bad[1, 2, 0] = np.nan
    readings, skipped = twin.read(model.get_weights(), {"x": bad}, {"y": y}, None, 1, False,
                                  True)
    assert not readings
    ((call, reason),) = skipped
    assert call == "gru" and reason.startswith("Keras' own output 0 is not finite on this "
                                               "batch (3 of 12 values NaN or Inf")
    readings, skipped = twin.read(None, {"x": x}, {"y": y}, None, 1, False, True)
    assert not skipped and _in_one_function(twin.cache) == ["gru"]
    truth = gradscope.diagnose(model, x=x, y=y, exponents=1, counterfactuals=False)
    np.testing.assert_allclose(readings[0].lyapunov, truth.layers[0].lyapunov, **ROUNDING)


def test_a_loop_whose_trajectory_is_not_keras_own_leaves_the_call_to_the_general_path(
        tf, monkeypatch):
    """The one loop's trajectory is gradscope's algebra of the cell, held to Keras' own
    output: a planted algebra that steps 1% off is caught, and the call is read the general
    way (stepped through the layer's own cell), still diagnose's numbers."""
    import keras

    import gradscope
    from gradscope.keras import stepped

    made = stepped.linearised

    def off(engine, layer, dtype="float64"):
        found = made(engine, layer, dtype)
        if found is None:
            return None

        def linear(states, x_t, weights=None):
            after, apply = found.linear(states, x_t, weights)
            return [1.01 * a for a in after], apply

        def step_linear(states, projected_t, step_weights):
            after, apply = found.step_linear(states, projected_t, step_weights)
            return [1.01 * a for a in after], apply

        return stepped.Linearised(linear, found.weights, found.projected, step_linear,
                                  found.key + " off")

    monkeypatch.setattr(stepped, "linearised", off)
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((7, 3)), keras.layers.LSTM(4, name="lstm"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    x = np.random.default_rng(8).standard_normal((5, 7, 3)).astype("float32")
    y = np.zeros((5, 1), "float32")
    twin, readings, skipped = _read_compiled(model, x, y, 1)
    assert not skipped
    assert twin.cache[("one function", True, 1)] is False  # read the other way from now on
    assert [key[0] for key in twin.engine._traces if key[0] == "stepped"] == ["stepped"]
    monkeypatch.setattr(stepped, "linearised", made)
    truth = gradscope.diagnose(model, x=x, y=y, exponents=1, counterfactuals=False)
    for ours, theirs in zip(readings, truth.layers, strict=True):
        assert ours.gates == theirs.gates
        np.testing.assert_allclose(ours.lyapunov, theirs.lyapunov, **ROUNDING)


def test_a_shuffled_py_dataset_trains_in_the_same_order_with_diagnoses(tf):
    """Keras shuffles a PyDataset's batches at each epoch with Python's global generator, from
    which Keras' layers draw their seeds as they are made: the copy the diagnoses read is made
    with that generator's state put back (found tried as a new user would: a fit with
    diagnose_every=2 trained its second epoch in another order)."""
    import keras

    from gradscope.keras import GradientFlow

    rng = np.random.default_rng(10)
    x = rng.standard_normal((48, 5, 2)).astype("float32")
    y = rng.standard_normal((48, 1)).astype("float32")

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return x[index * 12:(index + 1) * 12], y[index * 12:(index + 1) * 12]

    ends = []
    for flow in (None, GradientFlow(every=100, diagnose_every=2)):
        keras.utils.set_random_seed(10)
        model = keras.Sequential([keras.Input((5, 2)), keras.layers.GRU(3),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        model.fit(Batches(), epochs=2, shuffle=True, verbose=0,
                  callbacks=[flow] if flow else [])
        ends.append(model.get_weights())
    assert flow.history.diagnosis_steps == [2, 4, 6, 8]
    for plain, ours in zip(*ends, strict=True):
        np.testing.assert_array_equal(plain, ours)


def _in_one_function(cache, exponents=1):
    """The labels of the calls a fit's diagnosis read in one function (one_function.py)."""
    kept = cache[("one function", True, exponents)]
    assert kept is not False
    return [label for label, _ in kept[1]["calls"]]


def _read_compiled(model, x, y, exponents):
    """The model's copy (witnessed on ``x``) and its reading of ``(x, y)`` under XLA, as a
    fit of many diagnoses reads it."""
    from gradscope.keras.diagnosis_twin import make_twin

    twin = make_twin(model, None, {"x": x})
    readings, skipped = twin.read(model.get_weights(), {"x": x}, {"y": y}, None, exponents,
                                  False, True)
    return twin, readings, skipped


@pytest.mark.parametrize(("largest", "said"), [
    # exp(39 × −0.0568) = 0.109, above 10 × the ratio 7.41e-4: the loss reads faster directions
    (-0.0568, "reads λ₁ -0.0568 per step, a horizon predicted at 122 steps (λ₁ has not settled "
              "over these 40 steps: the second half reads -0.031), past the 40 steps: λ₁'s rate "
              "keeps ×1.09e-01 over the 39 steps carried back, and the loss reads the state "
              "along directions that fade faster than its most lasting one"),
    # exp(39 × −0.17) = 1.32e-3, within 10 × the ratio: one fading, read two ways
    (-0.17, "reads λ₁ -0.17 per step, a horizon predicted at 40.6 steps, past the 40 steps: "
            "λ₁'s rate keeps ×1.32e-03 over the 39 steps carried back, about the flag's: one "
            "fading, read two ways on either side of 10³"),
    # a horizon of 36.9 steps, within the 40: the two agree, and nothing is reconciled
    (-0.187, "reads λ₁ -0.187 per step, a horizon predicted at 36.9 steps"),
])
def test_a_vanishing_flag_is_read_beside_the_diagnosis_nearest_it(largest, said):
    """Found tried as a new user would: the training report flagged an LSTM vanishing at step
    50 (∂L/∂s carried back over 40 steps keeps 7.41e-4) beside a horizon of 66.8 steps
    predicted at step 96, and said nothing of how the two meet. The flag now names the
    diagnosis nearest its step (48, of 8, 48 and 96), and where its horizon reaches past the
    sequence, why the two part, as diagnose's note does."""
    import math

    from gradscope.report.models import FlowHistoryReport

    predicted = math.log(1e3) / -largest
    report = FlowHistoryReport.model_validate({
        "source": "model 'm'", "loss": "mse", "mode": "inference", "every": 50,
        "flag_factor": 1000.0, "method": "m", "weights": [], "not_analysed": [],
        "observations": [{"step": 50, "loss": 1.0}, {"step": 100, "loss": 1.0}],
        "recurrent": [{"layer": "lstm", "class_name": "LSTM", "units": 4,
                       "initial_state_norms": {}, "profiles": [[1.0] * 40, [1.0] * 40],
                       "ratios": [7.41e-4, 2e-3], "flags": ["vanishing", None]}],
        "diagnose_every": 8, "diagnosis_steps": [8, 48, 96],
        "diagnoses": [{"call": "lstm", "class_name": "LSTM", "cell": "LSTMCell",
                       "lyapunov": [[-0.5], [largest], [-0.1]], "gates": [None] * 3,
                       "horizon_predicted": [13.8, predicted, 69.1],
                       "horizon_measured": [None] * 3, "horizon_window": [None] * 3,
                       # the note diagnose gives an unsettled λ₁, carried with it
                       "lyapunov_note": [None, None if largest != -0.0568 else
                                         "λ₁ has not settled over these 40 steps: the "
                                         "second half reads -0.031", None]}]})
    if largest == -0.187:
        # A λ₁ not finite at step 48 is passed over: the nearest finite one is step 8's.
        nan = report.model_copy(deep=True)
        nan.diagnoses[0].lyapunov[1] = [float("nan")]
        assert ("the diagnosis nearest it, at step 8, reads λ₁ -0.5 per step" in
                " ".join(render_text(nan, 80).split()))
    text = " ".join(render_text(report, 80).split())
    assert ("lstm: vanishing gradients at 1 of 2 observations, the last at step 50 (carried "
            "back from each example's last step that ran to its first, ∂L/∂s, every state and "
            "example joined, keeps 7.41e-04 × the norm it started with; flagged beyond a "
            "factor 1000); the "
            f"diagnosis nearest it, at step 48, {said}") in text
    assert ("past the" in said) == ("past the" in text)
    # ‖∂L/∂h0‖ and the profile's t=0 told apart (found tried as a new user would).
    assert ("‖∂L/∂h_t‖ over the time steps, at the last observation h_t: the state after step "
            "t (‖∂L/∂h0‖ above: the initial state, before t=0)") in text
