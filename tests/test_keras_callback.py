"""gradscope.keras.GradientFlow during model.fit and a custom loop, its TensorBoard event files,
and `gradscope watch` reading them back.

The truth every recorded number is held to is Keras' own: the model's layers' cells unrolled
by hand in eager mode under one GradientTape, on the batch fit trained on at that step (fit
runs unshuffled, so batch k is rows 8k…8k+7) and with the weights the model had right then
(a callback after GradientFlow keeps them). A zero tensor added to every h_t makes ∂L/∂h_t the
total gradient at h_t, recurrence included, without any gradscope code.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pytest
from conftest import REPO, render_text, run_gradscope, run_without_tensorflow, tensorboard_events

import gradscope
from gradscope.dynamics import FLOW_FACTOR
from gradscope.errors import ConfigError

BATCH, STEPS, FEATURES = 8, 6, 3
EPOCHS, EVERY = 2, 2
ROWS = 3 * BATCH  # 3 batches an epoch: observations after batches 2, 4 and 6


def _model(keras, compiled: bool = True):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((STEPS, FEATURES)),
        keras.layers.GRU(5, return_sequences=True, name="gru_a"),
        keras.layers.GRU(3, name="gru_b"),
        keras.layers.Dense(2, name="out"),
    ], name="flow_model")
    if compiled:
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return model


def _data():
    generator = np.random.default_rng(0)
    x = generator.normal(size=(ROWS, STEPS, FEATURES)).astype("float32")
    y = generator.normal(size=(ROWS, 2)).astype("float32")
    return x, y


def _direct(tf, keras, model, weights, x, y):
    """Keras' cells unrolled under one tape: (loss, ‖∂L/∂w‖ per weight, ‖∂L/∂h0‖ per layer,
    per-step ‖∂L/∂h_t‖ per layer)."""
    copy = keras.models.clone_model(model)
    copy.set_weights(weights)
    gru_a, gru_b, dense = copy.layers
    batch = x.shape[0]
    x, y = tf.constant(x), tf.constant(y)
    with tf.GradientTape() as tape:
        h0 = {"gru_a": tf.zeros((batch, 5)), "gru_b": tf.zeros((batch, 3))}
        shifts = {"gru_a": [tf.zeros((batch, 5)) for _ in range(STEPS)],
                  "gru_b": [tf.zeros((batch, 3)) for _ in range(STEPS)]}
        tape.watch(list(h0.values()) + shifts["gru_a"] + shifts["gru_b"])
        state, sequence = h0["gru_a"], []
        for t in range(STEPS):
            state = gru_a.cell(x[:, t], [state], training=False)[0] + shifts["gru_a"][t]
            sequence.append(state)
        state = h0["gru_b"]
        for t in range(STEPS):
            state = gru_b.cell(sequence[t], [state], training=False)[0] + shifts["gru_b"][t]
        loss = tf.reduce_mean(tf.square(dense(state) - y))
    grads, state_grads, shift_grads = tape.gradient(
        loss, [copy.trainable_variables, h0, shifts])
    return (float(loss), [float(tf.norm(g)) for g in grads],
            {k: float(tf.norm(g)) for k, g in state_grads.items()},
            {k: [float(tf.norm(g)) for g in v] for k, v in shift_grads.items()})


def _carried(tf, keras, model, weights, x, y):
    """Per layer, how much of ∂L/∂h its recurrence carries back from t=T−1 to t=0, by hand:
    the cells unrolled under one tape, with a zero tensor added to every h_t (its gradient
    is the total at h_t); what the loss puts on h at t=T−1 is then carried back to t=0
    alone, by a second gradient of h_(T−1) seeded with it, and the ratio is ‖that at t=0‖ /
    ‖it at T−1‖. For the top layer, whose gradient enters at its last step only, that is
    ‖∂L/∂h_0‖ / ‖∂L/∂h_(T−1)‖; the layer below is fed by it at every step."""
    copy = keras.models.clone_model(model)
    copy.set_weights(weights)
    gru_a, gru_b, dense = copy.layers
    batch = x.shape[0]
    x, y = tf.constant(x), tf.constant(y)
    zeros = {name: [tf.zeros((batch, units)) for _ in range(STEPS)]
             for name, units in (("gru_a", 5), ("gru_b", 3))}
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([*zeros["gru_a"], *zeros["gru_b"]])
        state, sequence = tf.zeros((batch, 5)), []
        for t in range(STEPS):
            state = gru_a.cell(x[:, t], [state], training=False)[0] + zeros["gru_a"][t]
            sequence.append(state)
        state = tf.zeros((batch, 3))
        for t in range(STEPS):
            state = gru_b.cell(sequence[t], [state], training=False)[0] + zeros["gru_b"][t]
        last = {"gru_a": sequence[-1], "gru_b": state}
        loss = tf.reduce_mean(tf.square(dense(state) - y))
    totals = tape.gradient(loss, zeros)
    ratios = {}
    for name in ("gru_a", "gru_b"):
        back = tape.gradient(last[name], zeros[name][0], output_gradients=totals[name][-1])
        ratios[name] = float(tf.norm(back) / tf.norm(totals[name][-1]))
    return ratios


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tf):
    import keras

    from gradscope.keras import GradientFlow

    log_dir = tmp_path_factory.mktemp("runs") / "gru"
    model = _model(keras)
    x, y = _data()
    weights: dict[int, list[np.ndarray]] = {}

    class KeepWeights(keras.callbacks.Callback):
        count = 0

        def on_train_batch_end(self, batch, logs=None):
            self.count += 1
            weights[self.count] = self.model.get_weights()

    flow = GradientFlow(every=EVERY, log_dir=log_dir)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[flow, KeepWeights()])
    truth = {}
    for step in (2, 4, 6):
        rows = slice(((step - 1) % 3) * BATCH, ((step - 1) % 3 + 1) * BATCH)
        truth[step] = _direct(tf, keras, model, weights[step], x[rows], y[rows])
    ratios = {step: _carried(tf, keras, model, weights[step],
                             x[((step - 1) % 3) * BATCH:((step - 1) % 3 + 1) * BATCH],
                             y[((step - 1) % 3) * BATCH:((step - 1) % 3 + 1) * BATCH])
              for step in (2, 4, 6)}
    return {"flow": flow, "model": model, "log_dir": log_dir, "truth": truth,
            "ratios": ratios}


def test_history_equals_keras_own_tape_at_each_observed_step(fitted):
    history = fitted["flow"].history
    # A float32 model: the mixed-precision passes were never made, nothing was recorded.
    assert fitted["flow"]._mixed_precision.watch is None
    assert history.mixed_precision is None
    # per_example=False (the default): no per-example record, nothing recorded.
    assert fitted["flow"]._per_example is None and history.per_example is None
    truth = fitted["truth"]
    assert [o.step for o in history.observations] == [2, 4, 6]
    assert [o.epoch for o in history.observations] == [0, 1, 1]
    # Each weight named as explain and check name it (its Keras path was
    # sequential/gru_a/gru_cell/kernel).
    assert [w.weight for w in history.weights] == [
        "gru_a/kernel", "gru_a/recurrent_kernel", "gru_a/bias",
        "gru_b/kernel", "gru_b/recurrent_kernel", "gru_b/bias", "out/kernel", "out/bias"]
    assert [r.layer for r in history.recurrent] == ["gru_a", "gru_b"]
    for index, step in enumerate((2, 4, 6)):
        loss, weight_norms, h0_norms, profiles = truth[step]
        assert history.observations[index].loss == pytest.approx(loss, rel=1e-5)
        for series, expected in zip(history.weights, weight_norms, strict=True):
            assert series.norms[index] == pytest.approx(expected, rel=1e-5), series.weight
        for series in history.recurrent:
            assert series.initial_state_norms["h0"][index] == pytest.approx(
                h0_norms[series.layer], rel=1e-5)
            assert series.profiles[index] == pytest.approx(profiles[series.layer], rel=1e-5)
            ratio = fitted["ratios"][step][series.layer]
            assert series.ratios[index] == pytest.approx(ratio, rel=1e-4)
            expected_flag = ("vanishing" if ratio < 1 / FLOW_FACTOR else
                             "exploding" if ratio > FLOW_FACTOR else None)
            assert series.flags[index] == expected_flag
        # gru_b gets its gradient at its last step only: its ratio is the profile's ends.
        profile = profiles["gru_b"]
        gru_b = next(series for series in history.recurrent if series.layer == "gru_b")
        assert gru_b.ratios[index] == pytest.approx(profile[0] / profile[-1], rel=1e-4)


def test_event_files_hold_every_tag_with_the_tape_values(fitted, tf):
    values, plugins = tensorboard_events(tf, fitted["log_dir"])
    truth = fitted["truth"]
    paths = [w.weight for w in fitted["flow"].history.weights]  # explain's names
    for step in (2, 4, 6):
        loss, weight_norms, h0_norms, profiles = truth[step]
        assert values["gradscope/loss"][step] == pytest.approx(loss, rel=1e-5)
        for path, expected in zip(paths, weight_norms, strict=True):
            value = values[f"gradient_norm/{path}"][step]
            assert np.isfinite(value) and value == pytest.approx(expected, rel=1e-5), path
        for layer in ("gru_a", "gru_b"):
            assert values[f"initial_state_gradient/{layer}/h0"][step] == pytest.approx(
                h0_norms[layer], rel=1e-5)
            profile = profiles[layer]
            ratio = fitted["ratios"][step][layer]
            assert values[f"flow_ratio/{layer}"][step] == pytest.approx(ratio, rel=1e-4)
            assert values[f"flow_flag/{layer}"][step] == (
                -1.0 if ratio < 1e-2 else 1.0 if ratio > 1e2 else 0.0)
            np.testing.assert_allclose(values[f"flow_profile_values/{layer}"][step], profile,
                                       rtol=1e-5)
            # The heatmap: TensorBoard's image summary, [width, height, PNG of each row so far].
            image = values[f"flow_profile/{layer}"][step]
            assert plugins[f"flow_profile/{layer}"] == "images"
            assert image[2][:8] == b"\x89PNG\r\n\x1a\n"
    assert plugins[f"gradient_norm/{paths[0]}"] == "scalars"
    assert plugins["initial_state_gradient/gru_a/h0"] == "scalars"
    assert not any(tag.startswith(("mixed_precision/", "gradscope/mixed", "per_example/",
                                   "gradscope/per_example")) for tag in values)


def test_tensorboard_own_reader_files_each_tag_under_its_dashboard(fitted):
    """The event files as a stock TensorBoard loads them (its plugin event accumulator, which
    migrates each value to its data class): scalars on the scalars dashboard, the heatmaps on
    the images dashboard, every observed step, and gradscope's own tensors under its plugin."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.compat.proto import summary_pb2

    accumulator = EventAccumulator(str(fitted["log_dir"]), size_guidance={"tensors": 0})
    accumulator.Reload()
    scalars = set(accumulator.PluginTagToContent("scalars"))
    images = set(accumulator.PluginTagToContent("images"))
    paths = [w.weight for w in fitted["flow"].history.weights]  # explain's names
    assert {f"gradient_norm/{p}" for p in paths} | {"gradscope/loss"} <= scalars
    assert images == {"flow_profile/gru_a", "flow_profile/gru_b"}
    for tag in sorted(scalars):
        assert accumulator.SummaryMetadata(tag).data_class == summary_pb2.DATA_CLASS_SCALAR
        assert [e.step for e in accumulator.Tensors(tag)] == [2, 4, 6], tag
    for tag in sorted(images):
        assert (accumulator.SummaryMetadata(tag).data_class
                == summary_pb2.DATA_CLASS_BLOB_SEQUENCE)
        assert [e.step for e in accumulator.Tensors(tag)] == [2, 4, 6], tag
    assert "flow_profile_values/gru_a" in accumulator.PluginTagToContent("gradscope")


def test_fit_is_unchanged_by_the_callback(fitted, tf):
    """The same model trained without the callback ends with the same weights: the observed
    steps ran Keras' own step function on the same batches."""
    import keras

    model = _model(keras)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    for ours, theirs in zip(fitted["model"].get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_report_fits_the_width_and_names_every_layer(fitted):
    history = fitted["flow"].history
    for width in (60, 80, 120):
        text = render_text(history, width)
        assert max(len(line) for line in text.splitlines()) <= width, width
        for name in ("gru_a ‖∂L/∂h0‖", "gru_b ∂L/∂s carried back", "gru_a (step 6)"):
            assert name in text
    assert json.loads(history.to_json())["observations"][0]["step"] == 2
    assert "gru_a ‖∂L/∂h0‖" in history._repr_html_()  # how a notebook shows it


def test_report_prints_the_history(fitted, capsys):
    fitted["flow"].report(width=80)
    printed = capsys.readouterr().out
    assert printed.startswith("gradient flow during training  model 'flow_model'")
    assert "3 observations, steps 2–6" in printed


def test_watch_reads_the_run_back_without_tensorflow(fitted):
    history = fitted["flow"].history
    result = run_without_tensorflow("watch", str(fitted["log_dir"]), "--json")
    assert result.returncode == 0, result.stderr
    read = json.loads(result.stdout)
    assert [o["step"] for o in read["observations"]] == [2, 4, 6]
    assert read["every"] == EVERY and read["loss"].startswith("mean_squared_error")
    for ours, theirs in zip(history.weights, read["weights"], strict=True):
        assert theirs["weight"] == ours.weight
        np.testing.assert_allclose(theirs["norms"], ours.norms, rtol=1e-6)  # float32 scalars
    for ours, theirs in zip(history.recurrent, read["recurrent"], strict=True):
        assert theirs["layer"] == ours.layer and theirs["flags"] == ours.flags
        np.testing.assert_allclose(theirs["profiles"], ours.profiles, rtol=1e-12)
        np.testing.assert_allclose(theirs["initial_state_norms"]["h0"],
                                   ours.initial_state_norms["h0"], rtol=1e-6)
    text = run_gradscope("watch", str(fitted["log_dir"]), env={"COLUMNS": "80"})
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    # The folder follows the title, on the next line when the two do not fit 80 columns.
    summary = next(i for i, line in enumerate(lines) if line.startswith("3 observations"))
    title = " ".join(line.strip() for line in lines[:summary])
    assert title.split() == ["gradient", "flow", "during", "training", str(fitted["log_dir"])]
    assert lines[summary].startswith("3 observations, steps 2–6 · one pass every 2 batches")
    assert "each pass in inference mode" in " ".join(" ".join(lines).split())
    assert max(len(line) for line in lines) <= 80
    assert "\x1b[" not in text.stdout
    rows = [line for line in lines if line.startswith("gru_a ‖∂L/∂h0‖")]
    assert len(rows) == 1 and len(rows[0].split()[2]) == 3  # one sparkline mark per pass


def test_watch_refuses_in_one_line(tmp_path):
    missing = run_without_tensorflow("watch", str(tmp_path / "nowhere"))
    empty = run_without_tensorflow("watch", str(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    (other / "events.out.tfevents.1.host").write_bytes(b"")
    foreign = run_without_tensorflow("watch", str(other), "--json")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "events.out.tfevents.2.host").write_bytes(b"not a record, not a CRC")
    corrupt = run_without_tensorflow("watch", str(broken))
    (tmp_path / "a_file.txt").write_text("")
    a_file = run_without_tensorflow("watch", str(tmp_path / "a_file.txt"))
    for result, says in ((missing, "no such folder"), (a_file, "is a file, not a folder"),
                         (empty, "no TensorBoard event files"),
                         (foreign, "hold no gradscope events"),
                         (corrupt, "not a readable event file (failed header crc32 check)")):
        assert result.returncode == 2, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and says in lines[0], result.stderr
    assert json.loads(foreign.stdout)["error"]["where"] == str(other)


@pytest.mark.parametrize("folder", [123, ["runs"]])
def test_a_log_dir_that_is_no_path_is_a_clear_error(folder, tf):
    """Found tried as a new user would: GradientFlow(log_dir=123) raised Python's own
    TypeError from pathlib."""
    from gradscope.keras import GradientFlow

    with pytest.raises(ConfigError, match=r"GradientFlow\(log_dir=.*\): expected a folder's "
                                          r"path, a str or a pathlib.Path"):
        GradientFlow(log_dir=folder)


def test_without_tensorboard_a_clear_message(tmp_path, monkeypatch, tf):
    import subprocess

    from gradscope.keras import GradientFlow

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"GradientFlow\(log_dir=\.\.\.\) needs tensorboard, "
                                          r"which is not installed; install it with: .* -m pip "
                                          r"install tensorboard"):
        GradientFlow(log_dir=tmp_path)
    code = ("import sys\nsys.modules['tensorboard'] = None\nfrom gradscope.cli import main\n"
            f"main(['watch', {str(tmp_path)!r}])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line for line in result.stderr.splitlines()
                                          if line.startswith("gradscope: error: gradscope "
                                                             "watch needs tensorboard")]
    assert len(result.stderr.splitlines()) == 1


def test_importing_the_callback_leaves_tensorflow_to_be_configured():
    """Found tried as a new user would: ``from gradscope.keras import GradientFlow`` started
    TensorFlow's runtime (a silenced op), and a program that then set up its devices or
    threads (``tf.config``: two logical CPUs for MirroredStrategy, GPU memory growth) got
    "cannot be modified after being initialized". Importing it starts nothing."""
    import subprocess

    code = ("from gradscope.keras import GradientFlow\nimport tensorflow as tf\n"
            "cpu = tf.config.list_physical_devices('CPU')[0]\n"
            "tf.config.set_logical_device_configuration(\n"
            "    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
            "tf.config.threading.set_intra_op_parallelism_threads(1)\n"
            "print(len(tf.config.list_logical_devices('CPU')))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2"]


def test_custom_loop_with_observe(tf):
    import keras

    from gradscope.keras import GradientFlow

    model = _model(keras, compiled=False)
    with pytest.raises(ConfigError, match="is not compiled"):
        GradientFlow(model=model).observe(*_data())
    flow = GradientFlow(model=model, loss="mse")
    optimizer = keras.optimizers.SGD(0.5)
    x, y = _data()
    for step in range(3):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[rows], training=True) - y[rows]))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables, strict=True))
        if step != 1:
            flow.observe(x[rows], y[rows], step=10 * (step + 1))
            truth = _direct(tf, keras, model, model.get_weights(), x[rows], y[rows])
            index = len(flow.history.observations) - 1
            assert flow.history.observations[index].loss == pytest.approx(truth[0], rel=1e-5)
            for series, expected in zip(flow.history.weights, truth[1], strict=True):
                assert series.norms[index] == pytest.approx(expected, rel=1e-5)
            for series in flow.history.recurrent:
                assert series.profiles[index] == pytest.approx(truth[3][series.layer],
                                                               rel=1e-5)
    assert [o.step for o in flow.history.observations] == [10, 30]
    flow.observe(x[:BATCH], y[:BATCH])
    assert flow.history.observations[-1].step == 31
    assert flow.history.loss.startswith("mean_squared_error")
    # Found tried as a new user would: a step before the last was recorded after it (the
    # report said "steps 10–5"; watch, ordering by step, put it elsewhere). Refused; and no
    # fit ran, so no "one pass every 50 batches" (every is fit's).
    with pytest.raises(ConfigError, match=r"observe\(step=5\): the steps observed go "
                                          r"forward, and step 31 is recorded; expected a step "
                                          r"after 31 \(or none: 32\)"):
        flow.observe(x[:BATCH], y[:BATCH], step=5)
    assert [o.step for o in flow.history.observations] == [10, 30, 31]
    assert flow.history.every is None
    text = " ".join(render_text(flow.history, 80).split())
    assert "3 observations, steps 10–31" in text and "one pass every" not in text


def test_masks_and_a_cell_of_your_own_are_recorded_as_the_stepped_cell_gives_them(tf):
    """Every recurrent call is recorded, masked steps, a cell of the user's with a tuple state
    and both directions of a Bidirectional LSTM included: each profile and ratio against the
    cell the model holds stepped in tf.scan (gradscope/keras/stepped.py, itself held to
    hand-written unrolls), fed Keras' own ∂L/∂(the call's outputs); the ratio reads the whole
    state, [h, c] for an LSTM."""
    import keras
    from keras import layers as L

    from gradscope.keras import GradientFlow
    from gradscope.keras.engine import call_label
    from gradscope.keras.flow import carried_ratio, per_step_norms
    from gradscope.keras.probed_flow import back_ratio_of, processing_ran
    from gradscope.keras.stepped import carried_back, step_call

    class PairCell(L.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units, self.state_size = units, (units, units)

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")

        def call(self, inputs: Any, states: Any) -> Any:
            h, c = states
            c = 0.8 * c + keras.ops.tanh(inputs @ self.kernel + h)
            h = keras.ops.tanh(c)
            return h, (h, c)

    keras.utils.set_random_seed(4)
    x_in = keras.Input((STEPS, FEATURES))
    masked = L.Masking()(x_in)
    mine = L.RNN(PairCell(3), return_sequences=True, name="mine")(masked)
    both = L.Bidirectional(L.LSTM(2), name="both")(mine)
    model = keras.Model(x_in, L.Dense(2)(L.Concatenate()([both, L.GRU(2, name="gru")(masked)])))
    model.compile(loss="mse")
    x, y = _data()
    x, y = x[:BATCH], y[:BATCH]
    x[0, -2:] = 0.0
    x[1, :3] = 0.0
    flow = GradientFlow(model=model)
    flow.observe(x, y, step=1)
    history = flow.history
    assert history.not_analysed == []
    assert [r.layer for r in history.recurrent] == ["mine", "both/forward", "both/backward",
                                                     "gru"]
    assert list(history.recurrent[0].initial_state_norms) == ["states[0]", "states[1]"]
    assert list(history.recurrent[1].initial_state_norms) == ["h0", "c0"]
    engine = flow._engine
    result = engine.run({model.inputs[0].name: x}, {engine.output_names[0]: y},
                        watch_outputs=True)
    series = {r.layer: r for r in history.recurrent}
    for call in result.calls:
        if not call.states:
            continue
        label = call_label(call.layer, call.index)
        stepped = step_call(engine, call, result.output_gradients[label], False)
        assert not isinstance(stepped, str), stepped
        assert stepped.totals is not None and stepped.direct is not None
        for index, (direction, totals, direct) in enumerate(zip(
                stepped.directions, stepped.totals, stepped.direct, strict=True)):
            recorded = series[direction.label]
            assert recorded.profiles[0] == pytest.approx(per_step_norms(totals[0]), rel=1e-4)
            whole = np.concatenate(totals, axis=-1)
            above = np.concatenate([direct, *(np.zeros_like(t) for t in totals[1:])], axis=-1)
            # Where each example's steps ran: the mask, as explain reads it.
            ran = processing_ran(call.mask, whole.shape[1], direction.backwards)
            # "mine" returns its sequence: what arrives at each example's last step is
            # carried back alone (a gradient from above enters at every step).
            back = carried_back(stepped, index)
            ratio = carried_ratio(whole, above, ran) if back is None else back_ratio_of(back, ran)
            assert (back is None) == (direction.label != "mine")
            assert recorded.ratios[0] == pytest.approx(ratio, rel=1e-4)
            assert recorded.backwards == direction.backwards


def test_heatmap_rows_are_observations_and_columns_time_steps():
    from gradscope.keras.summaries import MISSING, VIRIDIS, profile_image

    image, description = profile_image([[1e-4, 1e-3, 1e-2], None, [1e-2, 1e-1, 1.0]])
    assert image.shape[0] == 1 and image.shape[3] == 3 and image.dtype == np.uint8
    height, width = image.shape[1:3]
    assert width >= 320 and height >= 160 and width % 3 == 0 and height % 3 == 0
    cell = (height // 3, width // 3)
    corner = {(r, c): image[0, r * cell[0], c * cell[1]] for r in range(3) for c in range(3)}
    assert corner[(0, 0)].tolist() == VIRIDIS[0].tolist()  # 1e-4: the smallest
    assert corner[(2, 2)].tolist() == VIRIDIS[-1].tolist()  # 1.0: the largest
    assert corner[(0, 2)].tolist() == corner[(2, 0)].tolist()  # both 1e-2
    assert corner[(1, 1)].tolist() == MISSING.tolist()  # not analysed
    assert "one row per observation" in description


def test_watch_json_follows_its_schema_and_help_has_an_example(fitted):
    from jsonschema import Draft202012Validator

    schema = json.loads(run_without_tensorflow("schema", "watch").stdout)
    document = json.loads(run_without_tensorflow("watch", str(fitted["log_dir"]),
                                                 "--json").stdout)
    Draft202012Validator(schema).validate(document)
    Draft202012Validator(schema).validate(fitted["flow"].history.to_dict())
    assert "Example" in run_gradscope("watch", "--help").stdout


def test_steps_per_execution_and_a_short_last_batch_train_as_without_it(tf):
    """Two steps per execution and a last batch of 3 rows: the observed executions replay
    batches of unequal size (fit's own spec through a generator) and of a free batch axis;
    the weights end as a fit without the callback leaves them, and every observation is
    Keras' own tape on the last batch of its execution."""
    import keras

    from gradscope.keras import GradientFlow

    x, y = _data()
    x, y = np.concatenate([x, x[:3]]), np.concatenate([y, y[:3]])  # batches 8, 8, 8, 3
    models = []
    weights: dict[int, list[np.ndarray]] = {}
    for watched in (False, True):
        model = _model(keras)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse", steps_per_execution=2)
        callbacks: list[Any] = []
        if watched:
            flow = GradientFlow(every=2)

            class KeepWeights(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    weights[batch] = self.model.get_weights()

            callbacks = [flow, KeepWeights()]
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
        models.append(model)
    for plain, ours in zip(models[0].get_weights(), models[1].get_weights(), strict=True):
        np.testing.assert_array_equal(plain, ours)
    history = flow.history
    assert [o.batch_size for o in history.observations] == [BATCH, 3]
    # Keras numbers the batch of a 2-step execution by its last step: 1 and 3.
    for index, (batch, rows) in enumerate(((1, slice(8, 16)), (3, slice(24, 27)))):
        loss, weight_norms, _, profiles = _direct(tf, keras, models[1], weights[batch],
                                                  x[rows], y[rows])
        assert history.observations[index].loss == pytest.approx(loss, rel=1e-5)
        for series, expected in zip(history.weights, weight_norms, strict=True):
            assert series.norms[index] == pytest.approx(expected, rel=1e-5)
        for series in history.recurrent:
            assert series.profiles[index] == pytest.approx(profiles[series.layer], rel=1e-5)


def test_an_observation_reads_the_weights_its_step_left_while_training_moves_them(tf):
    """In fit the pass runs on the worker, beside training, from a copy of the weights its
    step left. Held back until fit has trained every batch, each observation must still be
    Keras' own tape on its own step's weights, not on those the last step left."""
    import threading

    import keras

    from gradscope.keras import GradientFlow

    x, y = _data()
    flow = GradientFlow(every=EVERY)
    model = _model(keras)
    weights: dict[int, list[np.ndarray]] = {}
    held = threading.Event()

    class HoldTheWorker(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            weights[batch] = self.model.get_weights()
            if batch == 0:  # after the warm-up: the worker waits until training has ended
                flow._settle_warm_up()
                flow._submit(held.wait, pending=False)

        def on_train_end(self, logs=None):
            held.set()

    # Placed before the flow: its on_train_end opens the worker before the flow waits for it.
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[HoldTheWorker(), flow])
    assert flow._pass.beside
    assert [o.step for o in flow.history.observations] == [2]
    loss, weight_norms, _, profiles = _direct(tf, keras, model, weights[1], x[8:16], y[8:16])
    last, _, _, _ = _direct(tf, keras, model, weights[2], x[8:16], y[8:16])
    assert loss != pytest.approx(last, rel=1e-5)  # the step after it moved the weights
    assert flow.history.observations[0].loss == pytest.approx(loss, rel=1e-5)
    assert [s.norms[0] for s in flow.history.weights] == pytest.approx(weight_norms, rel=1e-5)
    for series in flow.history.recurrent:
        assert series.profiles[0] == pytest.approx(profiles[series.layer], rel=1e-5)


def test_a_layer_that_reads_its_variable_outside_keras_is_observed_between_two_steps(tf):
    """A layer that reads its TensorFlow variable itself, past Keras (``kernel._value``),
    would read training's moving weights from the worker: the trace shows it (the variable
    captured), and that model's observations run between two steps, as Keras' tape has
    them."""
    import keras

    from gradscope.keras import GradientFlow

    class Raw(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], 2), name="kernel")

        def call(self, inputs):
            return tf.matmul(inputs, tf.convert_to_tensor(self.kernel._value))

    x, y = _data()
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((STEPS, FEATURES)), keras.layers.GRU(4), Raw()])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    taped: list[Any] = []

    class Tape(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == EVERY - 1:  # the observed step's weights, by Keras' own tape
                with tf.GradientTape() as tape:
                    loss = keras.losses.mean_squared_error(
                        y[8:16], self.model(x[8:16], training=False))
                    loss = tf.reduce_mean(loss)
                grads = tape.gradient(loss, self.model.trainable_weights)
                taped.extend([float(loss), sorted(float(tf.norm(g)) for g in grads)])

    flow = GradientFlow(every=EVERY)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[Tape(), flow])
    assert flow._pass.function is not None and not flow._pass.beside
    assert flow.history.observations[0].loss == pytest.approx(taped[0], rel=1e-5)
    norms = sorted(s.norms[0] for s in flow.history.weights)
    assert norms == pytest.approx(taped[1], rel=1e-5)
    # Traced at a custom loop's observe (no warm-up): the same, from the first pass on.
    taped.clear()
    tape = Tape()
    tape.set_model(model)
    tape.on_train_batch_end(EVERY - 1)
    loop = GradientFlow(model=model)
    loop.observe(x[8:16], y[8:16])
    assert loop.history.observations[0].loss == pytest.approx(taped[0], rel=1e-5)
    norms = sorted(s.norms[0] for s in loop.history.weights)
    assert norms == pytest.approx(taped[1], rel=1e-5)


def test_the_pass_is_traced_beside_training_and_only_when_an_observation_follows(tf):
    import keras

    from gradscope.keras import GradientFlow

    x, y = _data()
    flow = GradientFlow(every=2)
    model = _model(keras)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[flow])
    assert flow._pass.trace["thread"].startswith("gradscope-GradientFlow")
    # It began within the first step, once Keras ran its compiled step (its own trace done).
    assert (flow._pass.trace["gate"], flow._pass.trace["began_after"]) == ("compiled", 0)
    assert len(flow.history.observations) == 1
    # fit's batches all have BATCH rows, so its spec and the trace have a static batch axis;
    # a batch of another size is traced for again and gives the tape's numbers all the same.
    # The pass takes the weights first (it reads those, not the variables: it ran beside
    # training), then the inputs.
    assert flow._pass.beside
    assert flow._pass.concrete.structured_input_signature[0][1][0].shape[0] == BATCH
    flow.observe(x[:2], y[:2])
    loss, weight_norms, _, profiles = _direct(tf, keras, model, model.get_weights(), x[:2],
                                              y[:2])
    history = flow.history
    assert history.observations[-1].loss == pytest.approx(loss, rel=1e-5)
    assert [s.norms[-1] for s in history.weights] == pytest.approx(weight_norms, rel=1e-5)
    for series in history.recurrent:
        assert series.profiles[-1] == pytest.approx(profiles[series.layer], rel=1e-5)
    # Three batches and every=5: no observation, so nothing is traced at all.
    idle = GradientFlow(every=5)
    _model(keras).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[idle])
    assert "thread" not in idle._pass.trace and idle.history.observations == []
    # Said as what happened, not as if one were to come (found tried as a new user would).
    text = " ".join(render_text(idle.history, 80).split())
    assert "no observations: 3 batches trained, fewer than every=5" in text
    assert "yet" not in text


def test_watch_reads_a_fit_that_observed_nothing(tf, tmp_path):
    """Found tried as a new user would: a fit shorter than every wrote nothing, and watch said
    "no such folder" of the log_dir it was given. The run's description is written at the end
    of fit: watch reads a run with no observations. Found again: watch then said only "no
    observations" where report() said why ("2 batches trained, fewer than every=5"); the
    description written at fit's end holds the batches trained, and watch says the same."""
    import keras

    from gradscope.keras import GradientFlow

    x, y = _data()
    flow = GradientFlow(every=5, log_dir=tmp_path / "idle")
    _model(keras).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[flow])
    watched = gradscope.watch(tmp_path / "idle")
    assert watched.observations == [] and watched.every == 5
    assert watched.loss == flow.history.loss
    assert watched.batches == flow.history.batches == ROWS // BATCH < 5
    result = run_without_tensorflow("watch", str(tmp_path / "idle"))
    assert result.returncode == 0, result.stderr
    assert "no observations" in result.stdout and "one pass every 5 batches" in result.stdout
    said = f"no observations: {ROWS // BATCH} batches trained, fewer than every=5"
    assert said in " ".join(result.stdout.split())
    assert said in " ".join(render_text(flow.history, 80).split())


def test_keras_and_the_worker_never_trace_the_model_at_once(tf):
    """Keras' layers keep state from the start of a call to its end (a recurrent cell its
    dropout masks), so Keras' trace of its step and the worker's trace beside it must not
    be inside the model's call at once. Found in a loaded run of the suite: the warm-up's
    gate opened on a long compiled call inside Keras' trace (here a layer's), the worker
    traced the pass meanwhile, and Keras' trace took the worker's recurrent dropout mask: a
    TypeError out of fit ("defined in FuncGraph(name=stateless), which is out of scope").
    The model's call is one thread's at a time during fit, and is the model's own again
    after it."""
    import threading

    import keras

    from gradscope.keras import GradientFlow

    main = threading.get_ident()
    events: list[tuple[int, str]] = []

    @tf.function
    def slow(m):
        return tf.while_loop(lambda i, a: i < 600, lambda i, a: (i + 1, tf.tanh(a @ a)),
                             (tf.constant(0), m))[1]

    start = tf.random.normal((200, 200), stddev=0.05)
    slow(start)  # traced now: inside Keras' trace it runs compiled

    class Marked(keras.layers.Layer):
        def call(self, x):
            events.append((threading.get_ident(), "in"))
            if threading.get_ident() == main:
                with tf.init_scope():  # a long compiled call, eagerly, inside Keras' trace
                    slow(start)
            events.append((threading.get_ident(), "out"))
            return x

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((STEPS, FEATURES)), Marked(),
                              keras.layers.GRU(5, recurrent_dropout=0.2), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    own = model.call
    x, y = _data()
    flow = GradientFlow(every=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[flow])
    assert len({thread for thread, _ in events}) == 2  # Keras' trace and the worker's
    inside: set[int] = set()
    for thread, what in events:
        if what == "in":
            assert not inside - {thread}, events  # another thread is inside the call
            inside.add(thread)
        else:
            inside.discard(thread)
    assert "call" not in model.__dict__ and model.call == own
    assert len(flow.history.observations) == 1


def test_the_warm_up_gate_opens_at_compiled_code_while_the_step_runs(tf):
    """A thread traces a function that, in the middle of its trace, runs a short compiled call
    eagerly (as Keras does when it creates the optimizer's variables), then runs a slow
    traced function. The gate stays shut through the short call and opens while the slow
    function runs; it opens at once when released, and when the step is not running. Only
    the watched thread's innermost frame is read (walking back from it can crash CPython
    3.11)."""
    import threading

    from gradscope.keras.callback import _native_call

    @tf.function
    def slow(m):
        return tf.while_loop(lambda i, a: i < 400, lambda i, a: (i + 1, tf.tanh(a @ a)),
                             (tf.constant(0), m))[1]

    start = tf.random.normal((200, 200), stddev=0.05)
    traced = threading.Event()

    @tf.function
    def step(m):
        with tf.init_scope():
            tf.tanh(start)  # a short compiled call, run eagerly, inside the trace
        traced.set()
        return slow(m)

    began, finished, stepping = threading.Event(), threading.Event(), threading.Event()

    def caller():
        stepping.set()
        began.set()
        step(start)
        finished.set()
        stepping.clear()

    thread = threading.Thread(target=caller)
    thread.start()
    began.wait()
    reason = _native_call(thread.ident, threading.Event(), stepping)
    assert reason == "compiled"
    assert traced.is_set() and not finished.is_set()
    thread.join()

    released = threading.Event()
    released.set()
    assert _native_call(threading.get_ident(), released, stepping) == "released"
    assert _native_call(threading.get_ident(), threading.Event(), stepping) == "left"


def test_the_pass_goes_without_grappler_on_its_own_thread_only(tf):
    """The pass's function call options drop Grappler on the thread that runs it; any other
    thread (the training steps) keeps TensorFlow's defaults, and so does this one after."""
    import threading

    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    from gradscope._tf import without_grappler

    def disabled() -> bool:
        config = config_pb2.ConfigProto()
        config.ParseFromString(context.context().function_call_options.config_proto_serialized)
        return config.graph_options.rewrite_options.disable_meta_optimizer

    elsewhere: list[bool] = []
    with without_grappler():
        assert disabled()
        other = threading.Thread(target=lambda: elsewhere.append(disabled()))
        other.start()
        other.join()
    assert elsewhere == [False]
    assert not disabled()


def test_an_error_beside_training_is_raised_on_the_training_thread(tf):
    import keras

    from gradscope.keras import GradientFlow

    class Failing(GradientFlow):
        def _record(self, *args, **kwargs):
            raise RuntimeError("recording failed")

    x, y = _data()
    model = _model(keras)
    own = model.call
    with pytest.raises(RuntimeError, match="recording failed"):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Failing(every=2)])
    # Keras calls no on_train_end after a fit that raised: the next fit, with another
    # GradientFlow, takes the model's own call and train function back, not the wrappers.
    assert "call" in model.__dict__
    flow = GradientFlow(every=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[flow])
    assert "call" not in model.__dict__ and model.call == own
    assert not hasattr(model.train_function, "_gradscope_wraps")
    assert len(flow.history.observations) == 1


def test_a_train_function_replaced_during_fit_is_said_not_silently_unobserved(tf):
    """The observations are taken in fit's train function (GradientFlow is async_safe, so
    Keras does not wait for each step's logs): where something replaces it during fit, the
    batch owed an observation was not seen, and fit says so at the next batch."""
    import keras

    from gradscope.errors import ConfigError
    from gradscope.keras import GradientFlow

    class Replacing(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                self.model.train_function = self.model.train_function._gradscope_wraps

    x, y = _data()
    flow = GradientFlow(every=2)
    assert flow.async_safe and not GradientFlow(every=2, stop_on_nan=True).async_safe
    assert not GradientFlow(diagnose_every=4).async_safe
    with pytest.raises(ConfigError, match="the batch fit trained on was not seen"):
        _model(keras).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                          callbacks=[flow, Replacing()])


@pytest.mark.parametrize("diagnosed", [False, True])
def test_a_recurrent_dropout_fit_trains_as_without_the_callback(tf, diagnosed):
    """A recurrent cell with dropout draws its masks from its seed generator at every call,
    even in inference mode: the callback's passes beside training (the warm-up, the
    diagnosis copy's witness) must leave that seed where training left it, so that the
    weights end bit for bit as a fit without the callback leaves them."""
    import keras

    from gradscope.keras import GradientFlow

    x, y = _data()
    x, y = np.concatenate([x, x]), np.concatenate([y, y])  # 6 batches
    ends = []
    for watched in (False, True):
        keras.utils.set_random_seed(4)
        model = keras.Sequential([
            keras.Input((STEPS, FEATURES)),
            keras.layers.LSTM(4, dropout=0.2, recurrent_dropout=0.2, name="lstm"),
            keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        flow = (GradientFlow(every=100, diagnose_every=2) if diagnosed else
                GradientFlow(every=3))
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[flow] if watched else [])
        ends.append(model.get_weights())
    for plain, ours in zip(*ends, strict=True):
        np.testing.assert_array_equal(plain, ours)
    if diagnosed:
        assert flow.history.diagnosis_steps == [2, 4, 6]
    else:
        assert [o.step for o in flow.history.observations] == [3, 6]


def test_batches_handed_back_through_one_fed_iterator_train_the_same(tf):
    """With stop_on_nan every batch is handed back to Keras' step: through one tf.data
    iterator of fit's spec, fed a batch at a time (not a new iterator each, 5–15 ms a step;
    not the list, whose one-step function rounded a GRU with recurrent dropout otherwise
    than fit, found tried as a new user would). The weights end bit for bit as a fit without
    the callback leaves them, the epoch's last, shorter batch too (the other tests of this
    file that compare weights replay without recurrent dropout)."""
    import keras

    from gradscope.keras import GradientFlow

    rng = np.random.default_rng(1)
    x = rng.standard_normal((12 * BATCH + 3, STEPS, FEATURES)).astype("float32")
    y = rng.standard_normal((len(x), 1)).astype("float32")
    ends = []
    for watched in (False, True):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((STEPS, FEATURES)),
                                  keras.layers.GRU(12, recurrent_dropout=0.2),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        flow = GradientFlow(every=7, stop_on_nan=True, diagnose_every=11)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[flow] if watched else [])
        ends.append(model.get_weights())
    assert flow._fed is not None and flow._fed.iterator is not None
    for plain, ours in zip(*ends, strict=True):
        np.testing.assert_array_equal(plain, ours)
    assert [o.step for o in flow.history.observations] == [7, 14, 21]
    assert flow.history.diagnosis_steps == [11, 22]


def test_a_generator_s_end_of_data_is_keras_own_call_and_trains_the_same(tf):
    """A dataset of unknown length ends with a call of Keras' step on the spent iterator,
    which Keras counts (found tried as a new user would: where that call fell on an observed
    step, here the 4th of an epoch of 3, the callback raised StopIteration itself, the
    optimizer's count ended short, and Adam's steps of the next epoch moved)."""
    import keras

    from gradscope.keras import GradientFlow

    x, y = _data()

    def batches():
        for first in range(0, len(x), BATCH):
            yield x[first:first + BATCH], y[first:first + BATCH]

    spec = (tf.TensorSpec((None, STEPS, FEATURES), tf.float32), tf.TensorSpec((None, 2),
                                                                              tf.float32))
    ends = []
    for watched in (False, True):
        model = _model(keras)
        model.compile(optimizer="adam", loss="mse")
        data = tf.data.Dataset.from_generator(batches, output_signature=spec)
        model.fit(data, epochs=2, verbose=0,
                  callbacks=[GradientFlow(every=4)] if watched else [])
        ends.append((int(model.optimizer.iterations.numpy()), model.get_weights()))
    assert ends[0][0] == ends[1][0]
    for plain, ours in zip(ends[0][1], ends[1][1], strict=True):
        np.testing.assert_array_equal(plain, ours)


def test_a_subclassed_model_is_observed_and_trained_as_without_the_callback(tf):
    """A subclassed keras.Model has no ``inputs``: the callback names its inputs from the
    graph explain reads (found tried as a new user would: fit raised AttributeError). Its
    observations are made, and its weights end as a fit without the callback leaves them."""
    import keras

    from gradscope.keras import GradientFlow

    class Tagger(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.gru = keras.layers.GRU(4, name="gru")
            self.out = keras.layers.Dense(2, name="out")

        def call(self, x):
            return self.out(self.gru(x))

    def trained(callbacks: list[Any]) -> Any:
        keras.utils.set_random_seed(3)
        model = Tagger()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        x, y = _data()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return model

    flow = GradientFlow(every=EVERY)
    observed = trained([flow])
    assert [o.step for o in flow.history.observations] == [2]
    assert [r.layer for r in flow.history.recurrent] == ["gru"]
    for ours, theirs in zip(observed.get_weights(), trained([]).get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_a_padded_batch_is_observed_with_its_mask_as_explain_reads_it(tf):
    """Behind Embedding(mask_zero), sequences of 5 to 20 tokens padded after them: the
    callback's carried ratio is the one diagnose (and explain's flag) reads on the same batch
    and weights. Found tried as a new user would: the callback's traced pass kept no mask,
    so every padded step counted, and it recorded ×5.03e-02 and no flag where explain
    flagged ×2.31e-06."""
    import keras

    import gradscope
    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(5)
    steps, lengths = 20, [20, 5, 14, 9]
    model = keras.Sequential([keras.Input((steps,), dtype="int32"),
                              keras.layers.Embedding(30, 4, mask_zero=True, name="embed"),
                              keras.layers.GRU(6, name="gru"), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(2)
    x = np.zeros((len(lengths), steps), "int32")
    for row, length in enumerate(lengths):
        x[row, :length] = rng.integers(1, 30, size=length)
    y = rng.standard_normal((len(lengths), 1)).astype("float32")
    flow = GradientFlow(model=model)
    flow.observe(x, y, step=0)
    flow.close()
    (recorded,) = flow.history.recurrent
    truth = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0].flow
    assert truth is not None and truth.ratio is not None
    assert recorded.ratios[0] == pytest.approx(truth.ratio, rel=1e-5)


def test_steps_per_execution_numbers_the_steps_as_the_optimizer_counts_them(tf):
    """With steps_per_execution=2 over 3 batches an epoch, Keras names an execution by its
    last step as if whole (batch 3 of an epoch of 3): the callback numbers each observation
    by the steps trained, as optimizer.iterations counts them (found tried as a new user
    would: steps 3, 6, 9, 12 for 8 steps trained)."""
    import keras

    from gradscope.keras import GradientFlow

    model = _model(keras, compiled=False)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse", steps_per_execution=2)
    x, y = _data()

    class Iterations(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.seen.append(int(self.model.optimizer.iterations))

    flow, iterations = GradientFlow(every=1), Iterations()
    # every=1 below 2 steps per execution: one observation per execution, and it says so
    # (found tried as a new user would: diagnose_every=2 at 4 per execution gave as many as
    # 4 did, under "one every 2 batches").
    with pytest.warns(UserWarning, match=r"GradientFlow\(every=1\): the model runs 2 steps "
                                         "per execution"):
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[flow, iterations])
    assert iterations.seen == [2, 3, 5, 6]
    assert [o.step for o in flow.history.observations] == iterations.seen
    # An epoch's last execution runs one batch: it is observed only where that batch is
    # (found tried as a new user would: step 3 was observed for a 4 it never reached).
    flow = GradientFlow(every=2)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[flow])
    assert [o.step for o in flow.history.observations] == [2, 5, 6]
    # every=3 at 2 steps per execution: the executions that hold 3 and 6 end at 4 and 6, and
    # it says so (found tried as a new user would: neither fit nor the report said a word).
    flow = GradientFlow(every=3)
    with pytest.warns(UserWarning, match=r"GradientFlow\(every=3\): .* the last batch of an "
                                         r"execution that holds a multiple of 3 \(batches 4, "
                                         r"6, 10, 12, …\)"):
        model.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=BATCH,
                  epochs=1, shuffle=False, verbose=0, callbacks=[flow])
    assert [o.step for o in flow.history.observations] == [4, 6]
    text = " ".join(render_text(flow.history, 80).split())
    assert "one pass asked every 3 batches · taken at steps 4, 6 (with steps_per_execution" \
        in text


def test_watch_of_a_log_dir_written_twice_reads_the_newest_run_and_says_so(tf, tmp_path):
    """A training cell run again into the same log_dir writes a second run beside the first,
    its steps starting again: watch reads the newest run alone and says an earlier one was
    left out (found tried as a new user would: the two mixed, with null ratios and a wrong
    last step)."""
    import keras

    from gradscope import watch
    from gradscope.keras import GradientFlow

    x, y = _data()
    flows = []
    for epochs in (EPOCHS, 1):
        model = _model(keras)
        flow = GradientFlow(every=EVERY, log_dir=tmp_path)
        model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[flow])
        flow.close()
        flows.append(flow)
    read = watch(tmp_path)
    newest = flows[-1].history
    assert [o.step for o in read.observations] == [o.step for o in newest.observations] == [2]
    for ours, theirs in zip(read.recurrent, newest.recurrent, strict=True):
        assert ours.ratios == pytest.approx(theirs.ratios, rel=1e-6)
    assert read.source.endswith("(its newest run: 1 earlier run written to the same folder "
                                "left out; give each run its own log_dir)")


def test_a_train_step_of_its_own_with_no_compiled_loss_is_refused_before_training(tf):
    """Found tried as a new user would: keras.io's "customizing fit" model, compiled with an
    optimizer alone and its loss in its own train_step. GradientFlow ran the whole fit, then
    raised from its end that "fit has nothing to minimise". It is refused before the first
    step, naming GradientFlow(loss=...), with which it diagnoses."""
    import keras

    from gradscope.errors import ConfigError
    from gradscope.keras import GradientFlow

    class Own(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = keras.layers.GRU(3, name="gru")
            self.out = keras.layers.Dense(1, name="d")
            self.loss_fn = keras.losses.MeanSquaredError()

        def call(self, x):
            return self.out(self.rnn(x))

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.loss_fn(y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            return {"loss": loss}

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 5, 2)).astype("float32")
    y = x[:, :2, 0].sum(1, keepdims=True)
    keras.utils.set_random_seed(1)
    model = Own()
    model.compile(optimizer="sgd")
    model(x[:1])
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ConfigError, match=r"its own train_step .* GradientFlow\(loss=NAME\)"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[GradientFlow(every=1000, diagnose_every=1)])
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    flow = GradientFlow(every=1000, diagnose_every=1, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[flow])
    assert flow.history.diagnosis_steps == [1, 2]
