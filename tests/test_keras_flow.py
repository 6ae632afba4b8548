"""explain MODEL.keras --flow / --jacobians: the recurrent analysis inside any graph.

Independent truth, computed here and never by gradscope:
- ‖∂L/∂h_t‖ with the recurrence: each recurrent layer is unrolled step by step in a Python loop
  over Keras' own cells (float64 twins with the same weights), a zero probe is added to every
  h_t, and one tape gives ∂L/∂probe_t: the total gradient arriving at h_t.
- ∂h_T/∂h_0: the Jacobian of a float64 twin of the Keras layer itself,
  ``layer(x, initial_state=h0)``, with return_state on, its rows from one tape's backward
  pass over copies of every example (a copy per row: conftest's ``rows_by_copies``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_jacobian_summary, copied, rows_by_copies, run_gradscope

import gradscope

T, F, B = 5, 3, 4


def _twin(layer: Any, shape: tuple[Any, ...] | None = None, **overrides: Any) -> Any:
    """A float64 copy of a Keras layer with the same weights (``shape``: its input's, for a
    layer never called in the graph itself, such as a Bidirectional's directions)."""
    config = {**layer.get_config(), "dtype": "float64", **overrides}
    twin = type(layer).from_config(config)
    if shape is None:
        shape = (layer.input.shape if not isinstance(layer.input, list)
                 else layer.input[0].shape)
    twin.build(shape)
    twin.set_weights([np.asarray(w, np.float64) for w in layer.get_weights()])
    return twin


def _save(model: Any, path: Path, inputs: dict[str, np.ndarray], target: np.ndarray) -> tuple[
        str, str]:
    model.compile(loss="mse")
    model.save(path)
    data = path.with_suffix(".npz")
    np.savez(data, **inputs, y=target)
    return str(path), str(data)


def _explain(path: str, data: str) -> Any:
    from gradscope.keras.explain import explain, prepare

    return explain(prepare(path, data=data), flow=True, jacobians=True)


def _unroll(tf: Any, cell: Any, x: Any, states: list[Any], probes: list[Any]) -> tuple[
        Any, list[Any]]:
    """h_t = cell(x_t, state_{t−1}) + probe_t, step by step; returns the sequence and the
    final states (h_T with its probe)."""
    outputs = []
    for t in range(x.shape[1]):
        h, new_states = cell(x[:, t], states)
        h = h + probes[t]
        states = [h, *list(new_states)[1:]]
        outputs.append(h)
    return tf.stack(outputs, axis=1), states


def _norms(gradients: list[Any]) -> np.ndarray:
    return np.array([float(np.sqrt(np.sum(np.asarray(g, np.float64) ** 2))) for g in gradients])


def _sequence(report: Any, what: str) -> np.ndarray:
    assert report.gradient_flow is not None
    found = [s for s in report.gradient_flow.sequences if s.what == what]
    assert len(found) == 1, [s.what for s in report.gradient_flow.sequences]
    return np.array(found[0].norms)


def _jacobian_truth(tf: Any, layer: Any, x: np.ndarray, states: list[np.ndarray]) -> np.ndarray:
    """Keras' own layer (a float64 twin, go_backwards as the layer has it) on x in input
    order: ∂(final states)/∂(initial states) per example."""
    twin = _twin(layer, (None, *x.shape[1:]), return_state=True, return_sequences=False)
    initial = tf.constant(np.concatenate(states, axis=1))
    size = int(initial.shape[1])

    def final(copies: Any) -> Any:
        out = twin(copied(tf, x, size), initial_state=list(tf.split(copies, len(states), axis=1)))
        return tf.concat(list(out[1:]), axis=1)

    return rows_by_copies(tf, initial, size, final)


def _assert_jacobian(report: Any, target: str, truth: np.ndarray) -> None:
    assert report.state_jacobians is not None
    entry = next(e for e in report.state_jacobians.entries if e.target == target)
    assert_jacobian_summary(entry, truth, rtol=1e-5, smallest_atol=1e-6)


def test_gru_chain_flow_and_jacobians(tmp_path: Path) -> None:
    import keras
    import tensorflow as tf
    from keras import layers as L

    keras.utils.set_random_seed(1)
    x_in = keras.Input((T, F), name="x")
    first = L.GRU(4, return_sequences=True, name="first")
    second = L.SimpleRNN(3, name="second")
    dense = L.Dense(2, name="out")
    model = keras.Model(x_in, dense(second(first(x_in))))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    y = rng.normal(size=(B, 2)).astype(np.float32)
    report = _explain(*_save(model, tmp_path / "chain.keras", {"x": x}, y))

    one, two, head = _twin(first), _twin(second), _twin(dense)
    x64 = tf.constant(x, tf.float64)
    probes_1 = [tf.zeros((B, 4), tf.float64) for _ in range(T)]
    probes_2 = [tf.zeros((B, 3), tf.float64) for _ in range(T)]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x64, probes_1, probes_2])
        seq_1, _ = _unroll(tf, one.cell, x64, [tf.zeros((B, 4), tf.float64)], probes_1)
        seq_2, _ = _unroll(tf, two.cell, seq_1, [tf.zeros((B, 3), tf.float64)], probes_2)
        loss = tf.reduce_mean((head(seq_2[:, -1]) - y.astype(np.float64)) ** 2)
    d_1, d_2, d_x = tape.gradient(loss, [probes_1, probes_2, x64])
    np.testing.assert_allclose(_sequence(report, "∂L/∂first/h_t"), _norms(d_1), rtol=1e-5)
    np.testing.assert_allclose(_sequence(report, "∂L/∂second/h_t"), _norms(d_2), rtol=1e-5)
    np.testing.assert_allclose(_sequence(report, "∂L/∂x_t"),
                               _norms([d_x[:, t] for t in range(T)]), rtol=1e-5)
    # the recurrence is in: the totals are not just what arrives from above
    assert _sequence(report, "∂L/∂second/h_t")[0] > 0
    assert report.gradient_flow is not None and report.gradient_flow.not_analysed == []

    _assert_jacobian(report, "first/h_T",
                     _jacobian_truth(tf, first, x.astype(np.float64), [np.zeros((B, 4))]))
    _assert_jacobian(report, "second/h_T",
                     _jacobian_truth(tf, second, np.asarray(seq_1), [np.zeros((B, 3))]))


def test_encoder_decoder_wired_state(tmp_path: Path) -> None:
    import keras
    import tensorflow as tf
    from keras import layers as L

    keras.utils.set_random_seed(2)
    x_in = keras.Input((T, F), name="x")
    encoder = L.GRU(4, return_sequences=True, return_state=True, name="encoder")
    decoder = L.GRU(4, return_sequences=True, name="decoder")
    dense = L.Dense(3, name="out")
    sequence, state = encoder(x_in)
    model = keras.Model(x_in, dense(decoder(sequence, initial_state=state)))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    y = rng.normal(size=(B, T, 3)).astype(np.float32)
    report = _explain(*_save(model, tmp_path / "ed.keras", {"x": x}, y))

    enc, dec, head = _twin(encoder), _twin(decoder), _twin(dense)
    x64 = tf.constant(x, tf.float64)
    probes_e = [tf.zeros((B, 4), tf.float64) for _ in range(T)]
    probes_d = [tf.zeros((B, 4), tf.float64) for _ in range(T)]
    with tf.GradientTape() as tape:
        tape.watch([probes_e, probes_d])
        seq_e, (h_e,) = _unroll(tf, enc.cell, x64, [tf.zeros((B, 4), tf.float64)], probes_e)
        seq_d, _ = _unroll(tf, dec.cell, seq_e, [h_e], probes_d)
        loss = tf.reduce_mean((head(seq_d) - y.astype(np.float64)) ** 2)
    d_e, d_d = tape.gradient(loss, [probes_e, probes_d])
    encoder_norms = _sequence(report, "∂L/∂encoder/h_t")
    np.testing.assert_allclose(encoder_norms, _norms(d_e), rtol=1e-5)
    np.testing.assert_allclose(_sequence(report, "∂L/∂decoder/h_t"), _norms(d_d), rtol=1e-5)

    _assert_jacobian(report, "decoder/h_T",
                     _jacobian_truth(tf, decoder, np.asarray(seq_e), [np.asarray(h_e)]))


def test_lstm_encoder_decoder_with_wired_cell_state(tmp_path: Path) -> None:
    import keras
    import tensorflow as tf
    from keras import layers as L

    keras.utils.set_random_seed(3)
    source, target = keras.Input((T, F), name="source"), keras.Input((T - 1, 2), name="target")
    encoder = L.LSTM(4, return_state=True, name="encoder")
    decoder = L.LSTM(4, return_sequences=True, name="decoder")
    dense = L.Dense(3, name="out")
    _, h, c = encoder(source)
    model = keras.Model([source, target], dense(decoder(target, initial_state=[h, c])))
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(B, T, F)).astype(np.float32)
    xt = rng.normal(size=(B, T - 1, 2)).astype(np.float32)
    y = rng.normal(size=(B, T - 1, 3)).astype(np.float32)
    report = _explain(*_save(model, tmp_path / "lstm.keras", {"source": xs, "target": xt}, y))

    enc, dec, head = _twin(encoder), _twin(decoder), _twin(dense)
    probes_e = [tf.zeros((B, 4), tf.float64) for _ in range(T)]
    probes_d = [tf.zeros((B, 4), tf.float64) for _ in range(T - 1)]
    xt64 = tf.constant(xt, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([probes_e, probes_d, xt64])
        zeros = tf.zeros((B, 4), tf.float64)
        _, states = _unroll(tf, enc.cell, tf.constant(xs, tf.float64), [zeros, zeros], probes_e)
        seq_d, _ = _unroll(tf, dec.cell, xt64, states, probes_d)
        loss = tf.reduce_mean((head(seq_d) - y.astype(np.float64)) ** 2)
    d_e, d_d, d_xt = tape.gradient(loss, [probes_e, probes_d, xt64])
    np.testing.assert_allclose(_sequence(report, "∂L/∂encoder/h_t"), _norms(d_e), rtol=1e-5)
    np.testing.assert_allclose(_sequence(report, "∂L/∂decoder/h_t"), _norms(d_d), rtol=1e-5)
    np.testing.assert_allclose(_sequence(report, "∂L/∂target_t"),
                               _norms([d_xt[:, t] for t in range(T - 1)]), rtol=1e-5)

    _assert_jacobian(report, "encoder/[h_T, c_T]",
                     _jacobian_truth(tf, encoder, xs.astype(np.float64),
                                     [np.zeros((B, 4)), np.zeros((B, 4))]))
    _assert_jacobian(report, "decoder/[h_T, c_T]",
                     _jacobian_truth(tf, decoder, xt.astype(np.float64),
                                     [np.asarray(s) for s in states]))


def test_go_backwards_and_bidirectional(tmp_path: Path) -> None:
    import keras
    import tensorflow as tf
    from keras import layers as L

    keras.utils.set_random_seed(5)
    x_in = keras.Input((T, F), name="x")
    backwards = L.GRU(3, go_backwards=True, return_sequences=True, name="backwards")
    both = L.Bidirectional(L.LSTM(2, return_sequences=True), name="both")
    product = L.Bidirectional(L.GRU(2), merge_mode="mul", name="product")
    dense = L.Dense(2, name="out")
    pooled = L.GlobalAveragePooling1D()(both(backwards(x_in)))
    model = keras.Model(x_in, dense(L.Concatenate()([pooled, product(x_in)])))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    y = rng.normal(size=(B, 2)).astype(np.float32)
    report = _explain(*_save(model, tmp_path / "bi.keras", {"x": x}, y))
    assert report.gradient_flow is not None
    assert report.gradient_flow.not_analysed == []

    back = _twin(backwards)
    both_f = _twin(both.forward_layer, (None, T, 3))
    both_b = _twin(both.backward_layer, (None, T, 3))
    prod_f = _twin(product.forward_layer, (None, T, F))
    prod_b = _twin(product.backward_layer, (None, T, F))
    head = _twin(dense)
    x64 = tf.constant(x, tf.float64)

    def zeros(units: int, steps: int = T) -> list[Any]:
        return [tf.zeros((B, units), tf.float64) for _ in range(steps)]

    probes = {"backwards": zeros(3), "both/forward": zeros(2), "both/backward": zeros(2),
              "product/forward": zeros(2), "product/backward": zeros(2)}
    with tf.GradientTape() as tape:
        tape.watch(list(probes.values()))
        # processing order: a go_backwards layer reads x_T … x_1 and returns its steps so
        seq_back, _ = _unroll(tf, back.cell, x64[:, ::-1], zeros(3, 1), probes["backwards"])
        z = zeros(2, 1)[0]
        seq_f, _ = _unroll(tf, both_f.cell, seq_back, [z, z], probes["both/forward"])
        seq_b, _ = _unroll(tf, both_b.cell, seq_back[:, ::-1], [z, z], probes["both/backward"])
        merged = tf.concat([seq_f, seq_b[:, ::-1]], axis=-1)
        _, (h_f,) = _unroll(tf, prod_f.cell, x64, [z], probes["product/forward"])
        _, (h_b,) = _unroll(tf, prod_b.cell, x64[:, ::-1], [z], probes["product/backward"])
        features = tf.concat([tf.reduce_mean(merged, axis=1), h_f * h_b], axis=-1)
        loss = tf.reduce_mean((head(features) - y.astype(np.float64)) ** 2)
    truths = dict(zip(probes, tape.gradient(loss, list(probes.values())), strict=True))
    for name, truth in truths.items():
        np.testing.assert_allclose(_sequence(report, f"∂L/∂{name}/h_t"), _norms(truth),
                                   rtol=1e-5, err_msg=name)
    flows = {s.source: s for s in report.gradient_flow.sequences if s.kind == "state"}
    assert flows["backwards"].backwards and flows["both/backward"].backwards
    assert not flows["both/forward"].backwards

    _assert_jacobian(report, "backwards/h_T",
                     _jacobian_truth(tf, backwards, x.astype(np.float64), [np.zeros((B, 3))]))
    inner = np.asarray(seq_back)
    for name, layer in (("both/forward", both.forward_layer),
                        ("both/backward", both.backward_layer)):
        _assert_jacobian(report, f"{name}/[h_T, c_T]",
                         _jacobian_truth(tf, layer, inner, [np.zeros((B, 2))] * 2))
    _assert_jacobian(report, "product/backward/h_T",
                     _jacobian_truth(tf, product.backward_layer, x.astype(np.float64),
                                     [np.zeros((B, 2))]))


def test_calls_the_cells_do_not_model_are_read_from_the_pass(
        tmp_path: Path) -> None:
    """Masked steps, another activation, another gate function, training-mode recurrent
    dropout: read from the probed loops of the pass itself, as every call is (their numbers
    are held to a tape in test_keras_stepped.py)."""
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(4)
    x_in = keras.Input((T, F), name="x")
    masked = L.GRU(4, name="masked")(L.Masking()(x_in))
    relu = L.SimpleRNN(4, activation="relu", name="relu")(x_in)
    hard = L.Bidirectional(L.LSTM(2, recurrent_activation="hard_sigmoid"), name="hard")(x_in)
    plain = L.GRU(2, name="plain")(x_in)
    model = keras.Model(x_in, L.Dense(2)(L.Concatenate()([masked, relu, hard, plain])))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    x[0, -2:] = 0.0
    report = _explain(*_save(model, tmp_path / "odd.keras", {"x": x},
                             rng.normal(size=(B, 2)).astype(np.float32)))
    assert report.gradient_flow is not None and report.state_jacobians is not None
    assert not report.gradient_flow.not_analysed and not report.state_jacobians.not_analysed
    assert [s.what for s in report.gradient_flow.sequences] == [
        "∂L/∂masked/h_t", "∂L/∂masked/x_t", "∂L/∂relu/h_t", "∂L/∂relu/x_t",
        "∂L/∂hard/forward/h_t", "∂L/∂hard/backward/h_t", "∂L/∂hard/x_t", "∂L/∂plain/h_t",
        "∂L/∂plain/x_t", "∂L/∂x_t"]
    assert [e.target for e in report.state_jacobians.entries] == [
        "masked/h_T", "relu/h_T", "hard/forward/[h_T, c_T]", "hard/backward/[h_T, c_T]",
        "plain/h_T"]
    assert "from the pass's own backward" in report.gradient_flow.method
    assert "stepped" not in report.gradient_flow.method

    keras.utils.set_random_seed(5)
    x_in = keras.Input((T, F), name="x")
    dropped = L.GRU(3, recurrent_dropout=0.3, name="dropped")(x_in)
    model = keras.Model(x_in, L.Dense(2)(dropped))
    path, data = _save(model, tmp_path / "dropped.keras", {"x": x},
                       rng.normal(size=(B, 2)).astype(np.float32))
    from gradscope.keras.explain import explain, prepare

    found = explain(prepare(path, data=data, training=True), flow=True)
    assert found.gradient_flow is not None and not found.gradient_flow.not_analysed


def test_a_mask_that_keeps_every_step_is_the_plain_recurrence(tmp_path: Path) -> None:
    import keras
    import tensorflow as tf
    from keras import layers as L

    keras.utils.set_random_seed(6)
    x_in = keras.Input((T, F), name="x")
    gru = L.GRU(3, return_sequences=True, name="gru")
    dense = L.Dense(2, name="out")
    model = keras.Model(x_in, dense(gru(L.Masking()(x_in))))
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, T, F)).astype(np.float32)  # no step is all zeros
    y = rng.normal(size=(B, T, 2)).astype(np.float32)
    report = _explain(*_save(model, tmp_path / "kept.keras", {"x": x}, y))
    twin, head = _twin(gru), _twin(dense)
    probes = [tf.zeros((B, 3), tf.float64) for _ in range(T)]
    with tf.GradientTape() as tape:
        tape.watch(probes)
        sequence, _ = _unroll(tf, twin.cell, tf.constant(x, tf.float64),
                              [tf.zeros((B, 3), tf.float64)], probes)
        loss = tf.reduce_mean((head(sequence) - y.astype(np.float64)) ** 2)
    np.testing.assert_allclose(_sequence(report, "∂L/∂gru/h_t"),
                               _norms(tape.gradient(loss, probes)), rtol=1e-5)


def test_a_padded_batch_says_how_many_examples_ran_each_step_and_marks_one_none_ran(
        ) -> None:
    """Sequences of 1 to 3 steps of 5, padded after them: no example runs steps 3 and 4. Each
    state norm is over the examples that ran its step (examples_ran, the mask's count), and
    the text marks the last step "–", not 0 (found tried as a new user would: "at t=T−1 0"
    where the loss reads each example's last state that ran)."""
    import keras
    from conftest import render_text
    from keras import layers as L

    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((T, F), name="x"), L.Masking(name="masking"),
                              L.GRU(3, name="gru"), L.Dense(1, name="out")])
    model.compile(loss="mse")
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, T, F)).astype(np.float32) + 2.0  # no step is all zeros
    lengths = np.array([2, 3, 3, 1])
    x[np.arange(T)[None, :] >= lengths[:, None]] = 0.0
    report = gradscope.explain(model, x=x, y=rng.normal(size=(B, 1)).astype(np.float32),
                               flow=True)
    assert report.gradient_flow is not None
    (state,) = [s for s in report.gradient_flow.sequences if s.what == "∂L/∂gru/h_t"]
    ran = (np.arange(T)[None, :] < lengths[:, None]).sum(axis=0)
    assert state.examples_ran == ran.tolist() == [4, 3, 2, 0, 0]
    assert state.norms[3] == state.norms[4] == 0 and state.norms[2] > 0
    text = " ".join(render_text(report, 100).split())
    assert "‖∂L/∂gru/h_t‖" in text and "a mask skips some examples' steps: a step's norm is " \
        "over the examples that ran it, and – marks one that none ran" in text
    row = next(line for line in render_text(report, 100).splitlines()
               if line.startswith("‖∂L/∂gru/h_t‖"))
    assert row.split()[-1] == "–" and row.split()[-2] != "–"


def test_vanishing_gradient_is_flagged_through_the_cli(tmp_path: Path) -> None:
    """A SimpleRNN whose recurrent kernel shrinks the state tenfold per step, read at its last
    step only: ∂L/∂h_t vanishes towards t = 0, and the CLI says so at 80 columns."""
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(7)
    rnn = L.SimpleRNN(3, name="rnn")
    model = keras.Sequential([keras.Input((8, F)), rnn, L.Dense(1)])
    kernel, _, bias = rnn.get_weights()
    rnn.set_weights([kernel, 0.1 * np.eye(3, dtype=np.float32), bias])
    path, data = _save(model, tmp_path / "fading.keras",
                       {"x": np.ones((B, 8, F), np.float32)}, np.ones((B, 1), np.float32))
    result = run_gradscope("explain", path, "--data", data, "--flow", "--jacobians",
                           env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    text = " ".join(lines)
    assert "State Jacobians ∂h_T/∂h_0" in text and "rnn/h_T" in text
    assert "‖∂L/∂rnn/h_t‖" in text
    assert "⚠ ∂L/∂rnn/h_t: carried back through the recurrence from t=7 to t=0" in text
    assert "vanishing gradients (flagged beyond a factor 1000); gradscope diagnose says why" \
        in " ".join(text.split())


def test_both_directions_get_one_flag_rule() -> None:
    """A Bidirectional SimpleRNN whose loss weighs its last three input steps (sample weights
    1 there, 1e-4 elsewhere): read each in the order its direction runs, the forward ∂L/∂h_t
    profile rises 10⁴-fold and the backward one falls 10⁴-fold, so a rule on the profile's
    ends called one vanishing and the other exploding. The rule reads what each recurrence
    carries back: both directions vanish."""
    import keras
    from keras import layers as L

    from gradscope.keras.flow import carried_ratio

    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((30, F)),
                              L.Bidirectional(L.SimpleRNN(4, return_sequences=True),
                                              name="both"),
                              L.TimeDistributed(L.Dense(1))])
    model.compile(loss="mse")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, 30, F)).astype("float32")
    y = rng.standard_normal((B, 30, 1)).astype("float32")
    weights = np.full((B, 30), 1e-4, "float32")
    weights[:, -3:] = 1.0
    flow = gradscope.explain(model, x=x, y=y, sample_weight=weights, flow=True).gradient_flow
    forward, backward = (next(s for s in flow.sequences if s.source == f"both/{d}")
                         for d in ("forward", "backward"))
    assert forward.norms[0] / forward.norms[-1] < 1e-2 < 1e2 < backward.norms[0] / \
        backward.norms[-1]
    verdicts = {f.what: f.kind for f in flow.flags}
    assert verdicts["∂L/∂both/forward/h_t"] == verdicts["∂L/∂both/backward/h_t"] == "vanishing"
    assert carried_ratio(np.ones((1, 3, 2)), np.zeros((1, 3, 2))) == pytest.approx(1.0)
    assert carried_ratio(np.ones((1, 3, 2)), np.ones((1, 3, 2))) == 0.0



def test_an_input_read_backwards_is_not_flagged_by_its_ends(tf) -> None:
    """A go_backwards layer carries the gradient towards its last input step: ∂L/∂x_t is
    large at t = 0 (its last step) and fades towards t = T−1. The model input's series is
    not flagged "exploding" by its ends; the layer's own recurrence is flagged vanishing."""
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(3)
    steps = 20
    x_in = keras.Input((steps, F), name="x")
    rnn = L.SimpleRNN(4, go_backwards=True, name="rnn",
                      recurrent_initializer=keras.initializers.Orthogonal(gain=0.1))
    model = keras.Model(x_in, L.Dense(2)(rnn(x_in)))
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, steps, F)).astype(np.float32)
    y = rng.normal(size=(B, 2)).astype(np.float32)
    report = gradscope.explain(model, x=x, y=y, flow=True)
    flow = report.gradient_flow
    norms = next(np.asarray(s.norms) for s in flow.sequences if s.what == "∂L/∂x_t")
    assert norms[0] / norms[-1] > 1e3  # what the ends of the input's series would flag
    assert [(f.what, f.kind) for f in flow.flags] == [("∂L/∂rnn/h_t", "vanishing")]


def test_a_gradient_rounded_to_zero_on_the_way_back_is_said_so() -> None:
    """A carried ratio of exactly 0 is a gradient that underflowed the layer's dtype on its
    way back (a float32 encoder of 300 steps: its true size is below 1e-45): the flag and
    diagnose's counterfactual line say it rounds to 0, not that it keeps 0.00e+00."""
    from gradscope.keras.flow import recurrence_flag
    from gradscope.report.diagnose_text import _carried

    flag = recurrence_flag("∂L/∂encoder/h_t", 0.0, 300)
    assert flag is not None and flag.kind == "vanishing"
    assert "keeps nothing of the norm it started with (it rounds to 0" in flag.message
    assert "0.00e+00" not in flag.message
    assert _carried(0.0) == "×0 (rounds to 0)" and _carried(2e-5) == "×2.00e-05"


def test_nothing_flagged_is_no_all_clear_for_a_call_not_analysed() -> None:
    """Where the only recurrent call was not analysed, the flow section does not say "no
    vanishing or exploding gradients flagged" as if it had been read: it says how many calls
    were not, beside the input's series it did draw."""
    from rich.console import Console

    from gradscope.report.keras_text import flow_lines
    from gradscope.report.models import KerasFlowSection, KerasFlowSequence, KerasNotAnalysed

    section = KerasFlowSection(
        method="m", flags=[],
        sequences=[KerasFlowSequence(what="∂L/∂x_t", kind="input", source="x",
                                     norms=[1.0, 0.5, 0.25])],
        not_analysed=[KerasNotAnalysed(layer="rnn", reason="why")])
    console = Console(record=True, width=80, color_system=None)
    for part in flow_lines(section, 80):
        console.print(part)
    text = " ".join(console.export_text().split())
    assert "flagged in what was analysed; 1 recurrent call not analysed (below)" in text
    assert "rnn: not analysed: why" in text


def test_a_padded_batch_s_flag_names_the_steps_its_longest_example_ran():
    """On a padded batch the carried ratio is read aligned at each example's last step, so
    its flag says over how many steps, not which step numbers of the padded call."""
    import numpy as np

    from gradscope.keras.flow import recurrence_flag

    ran = np.zeros((3, 40), bool)
    for row, length in enumerate([30, 12, 20]):
        ran[row, :length] = True
    flag = recurrence_flag("∂L/∂lstm/h_t", 1e-7, 40, ran)
    assert flag is not None and flag.kind == "vanishing"
    assert flag.message.startswith("∂L/∂lstm/h_t: carried back through the recurrence over "
                                   "the 30 steps its longest example ran (each example's from "
                                   "its own last step), the gradient keeps 1.00e-07 × the norm "
                                   "it started with")
    whole = recurrence_flag("∂L/∂lstm/h_t", 1e-7, 40, np.ones((3, 40), bool))
    assert whole is not None and "from t=39 to t=0 (the order the layer runs)" in whole.message


def test_an_lstm_s_flag_says_its_ratio_is_of_h_and_c_together(tmp_path):
    """The flag of an LSTM is labelled by h, and its ratio is of h and c together: it says
    so (found tried as a new user would: h alone would read ×2.2e-03 where [h, c] reads
    ×7.9e-03)."""
    import keras
    import numpy as np

    import gradscope

    keras.utils.set_random_seed(2)
    x_in = keras.Input((30, 3))
    lstm = keras.layers.LSTM(4, name="lstm")
    model = keras.Model(x_in, keras.layers.Dense(1)(lstm(x_in)))
    model.compile(loss="mse")
    kernel, recurrent, bias = lstm.get_weights()
    bias[4:8] = -5.0  # the forget gate shut: vanishing
    lstm.set_weights([kernel, recurrent, bias])
    rng = np.random.default_rng(0)
    flow = gradscope.explain(model, x=rng.normal(size=(4, 30, 3)).astype("float32"),
                             y=rng.normal(size=(4, 1)).astype("float32"), flow=True).gradient_flow
    (flag,) = [f for f in flow.flags if f.what == "∂L/∂lstm/h_t"]
    assert "the gradient on h and c together keeps" in flag.message
