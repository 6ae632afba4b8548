"""gradscope/keras/state_probes.py: the total ∂L/∂s_t of every state, read from the pass's own
backward through zero probes in Keras' own loop.

Its witnesses, each computed apart from the probes: the stepped scan of the cell the model
holds (gradscope/keras/stepped.py, fed the tape's ∂L/∂(the call's outputs)), gradscope's
NumPy BPTT where its cells model the call, and, for what neither steps (a ConvLSTM), the cell
unrolled by hand under a tape. The probes must change no value of Keras' own call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import tuple_state_cell

T, F, B = 6, 3, 4


def _pass(model: Any, x: np.ndarray, y: np.ndarray, training: bool = False,
          probe_states: bool = True) -> tuple[Any, Any]:
    """gradscope's engine on the model, and its pass with the loops probed."""
    from gradscope.keras.data import batch_targets
    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.explain import prepare

    job = prepare(model, x=x, y=y, training=training, seed=1)
    engine = KerasEngine(job.source, job.outputs, job.plan, training=training, seed=1)
    targets = batch_targets(job.plan, job.batch.targets,
                            engine.output_shapes(job.batch.inputs), 1)
    return engine, engine.run(job.batch.inputs, targets, watch_outputs=True,
                              watch_inputs=True, probe_states=probe_states)


def _data(masked: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    if masked:
        x[0, -2:] = 0.0  # masked at the end
        x[1, :2] = 0.0  # at the start
        x[2, 3] = 0.0  # in the middle
    return x, rng.normal(size=(B, 2)).astype(np.float32)


def _cell(units: int = 3) -> Any:
    return tuple_state_cell(units)


def _model(kind: str) -> Any:
    """A small model around one recurrent call (or two: a shared layer, an encoder wired into
    a decoder) of the kind named."""
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(3)
    x_in = keras.Input((T, F), name="x")
    masked = L.Masking()(x_in)
    if kind == "shared_wired":
        encoder = L.LSTM(3, return_sequences=True, return_state=True, name="encoder")
        sequence, h, c = encoder(masked)
        decoder = L.LSTM(3, return_sequences=True, name="decoder")
        shared = L.GRU(2, name="shared")
        out = L.Concatenate()([shared(decoder(sequence, initial_state=[h, c])), shared(x_in)])
        return keras.Model(x_in, L.Dense(2)(out))
    layer = {
        "masked_lstm_state": L.LSTM(3, return_sequences=True, return_state=True, name="rnn"),
        "backwards_zero_output": L.GRU(4, go_backwards=True, zero_output_for_mask=True,
                                       return_sequences=True, name="rnn"),
        "bidirectional": L.Bidirectional(L.LSTM(2, return_sequences=True), name="rnn"),
        "tuple_cell": L.RNN(_cell(), return_sequences=True, name="rnn"),
        "relu_last": L.SimpleRNN(4, activation="relu", name="rnn"),
        "unrolled": L.GRU(3, unroll=True, return_sequences=True, name="rnn"),
        "dropout": L.GRU(4, dropout=0.2, recurrent_dropout=0.3, return_sequences=True,
                         name="rnn"),
    }[kind]
    out = layer(x_in if kind in ("relu_last", "dropout") else masked)
    out = out[0] if isinstance(out, list | tuple) else out
    pooled = L.GlobalAveragePooling1D()(out) if len(out.shape) == 3 else out
    return keras.Model(x_in, L.Dense(2)(pooled))


@pytest.mark.parametrize("kind", ["masked_lstm_state", "backwards_zero_output",
                                  "bidirectional", "tuple_cell", "relu_last", "unrolled",
                                  "dropout", "shared_wired"])
def test_the_probes_equal_the_stepped_cell_on_every_state(tf, kind, monkeypatch):
    """Every state of every direction, c included, and what arrives from above at each step:
    the probes against the stepped scan fed the tape's ∂L/∂(the call's outputs); and against
    its backward pass by stretches of 2 steps (a long call's: the gradient carried from each
    stretch into the one before, masked steps among them), from the same pass."""
    import gradscope.keras.stepped as stepped_module
    from gradscope.keras.engine import call_label
    from gradscope.keras.stepped import step_call

    training = kind == "dropout"
    model = _model(kind)
    model.compile(loss="mse")
    x, y = _data(masked=True)
    engine, result = _pass(model, x, y, training=training)
    recurrent = [c for c in result.calls if c.states]
    assert len(recurrent) == (4 if kind == "shared_wired" else 1)
    for stretched in (False, True):
        if stretched:
            monkeypatch.setattr(stepped_module, "STRETCH_STEPS", 2)
        for call in recurrent:
            label = call_label(call.layer, call.index)
            probed = result.state_totals[label]
            stepped = step_call(engine, call, result.output_gradients[label], training)
            assert not isinstance(stepped, str), stepped
            assert stepped.totals is not None and stepped.direct is not None
            assert len(probed) == len(stepped.totals)
            for loop, totals, direct in zip(probed, stepped.totals, stepped.direct,
                                            strict=True):
                assert len(loop.totals) == len(totals) and loop.output_state == 0
                for k, (mine, theirs) in enumerate(zip(loop.totals, totals, strict=True)):
                    scale = float(np.max(np.abs(theirs)))
                    assert scale > 0
                    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-6 * scale,
                                               err_msg=f"{label} state {k} ({stretched=})")
                np.testing.assert_allclose(loop.direct, direct, rtol=1e-4,
                                           atol=1e-6 * float(np.max(np.abs(direct))))


@pytest.mark.parametrize("backwards", [False, True])
@pytest.mark.parametrize("stretched", [False, True])
def test_what_arrives_at_the_last_step_carried_back_against_a_hand_unrolled_tape(
        tf, backwards, stretched, monkeypatch):
    """An LSTM that returns its sequence gets a gradient from above at every step; what the
    loss puts on [h, c] at each example's last step that ran is carried back alone: ‖v_t‖²
    per example and step from the probes and from the stepped cell (``stretched``: by
    stretches of 2 steps), against the cell unrolled by hand with Keras' masking (a masked
    step keeps its states), a zero probe on h and c after every step, and one gradient of
    the states at the last step that ran seeded with the totals there (examples padded
    after, before and in the middle; ``backwards``: the layer runs the other way)."""
    import keras
    from keras import layers as L

    import gradscope.keras.stepped as stepped_module
    from gradscope.keras.stepped import carried_back, step_call, step_squares

    if stretched:
        monkeypatch.setattr(stepped_module, "STRETCH_STEPS", 2)
    keras.utils.set_random_seed(7)
    x_in = keras.Input((T, F), name="x")
    rnn = L.LSTM(3, return_sequences=True, go_backwards=backwards, name="rnn")
    pooled = L.GlobalAveragePooling1D()(rnn(L.Masking()(x_in)))
    model = keras.Model(x_in, L.Dense(2)(pooled))
    model.compile(loss="mse")
    x, y = _data(masked=True)
    engine, result = _pass(model, x, y)
    (call,) = [c for c in result.calls if c.states]
    (loop,) = result.state_totals["rnn"]
    stepped = step_call(engine, call, result.output_gradients["rnn"], False)
    assert not isinstance(stepped, str), stepped

    ran = np.any(x != 0, axis=2)[:, ::-1] if backwards else np.any(x != 0, axis=2)
    last = [int(np.nonzero(r)[0][-1]) for r in ran]  # processing order
    inputs = tf.constant(x[:, ::-1] if backwards else x)
    probes = [[tf.zeros((B, 3)), tf.zeros((B, 3))] for _ in range(T)]
    with tf.GradientTape() as tape:
        tape.watch(probes)
        states, seen = [tf.zeros((B, 3)), tf.zeros((B, 3))], []
        for t in range(T):
            _, new = rnn.cell(inputs[:, t], states)
            keep = tf.constant(ran[:, t])[:, None]
            states = [tf.where(keep, n, s) + p for n, s, p in zip(new, states, probes[t],
                                                                 strict=True)]
            seen.append(states)
        objective = tf.add_n([tf.reduce_sum(loop.totals[k][b, last[b]] * seen[last[b]][k][b])
                              for b in range(B) for k in range(2)])
    back = tape.gradient(objective, probes)
    truth = np.array([[sum(float(tf.reduce_sum(g[b] ** 2)) for g in step) for step in back]
                      for b in range(B)])
    # (Run backwards, Keras' mask on the output sequence is in input order while the
    # sequence is in processing order: one example gets no gradient at its last step, and
    # nothing is carried back from there.)
    assert sum(truth[b, last[b]] > 0 for b in range(B)) >= B - int(backwards)
    # Up to each example's last step that ran (after it, nothing is read).
    upto = np.arange(T)[None, :] <= np.array(last)[:, None]
    # Where an example gets no gradient at its last step that ran, the ratio is read on the
    # others, and says so.
    from gradscope.keras.probed_flow import resting_on

    reached = sum(bool(truth[b, last[b]] > 0) for b in range(B))
    assert resting_on(loop.carried_back, ran) == (None if reached == B else (reached, B))
    if backwards and not stretched:
        import gradscope

        flow = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow
        (read,) = [q for q in flow.sequences if q.carried is not None]
        assert read.carried_examples == [reached, B]
    # diagnose's stepping keeps the squared norms alone (by stretches): the same numbers.
    kept = step_call(engine, call, result.output_gradients["rnn"], False, squares=True)
    assert not isinstance(kept, str), kept
    assert (kept.squares is not None) == stretched
    for mine, theirs in zip(step_squares(kept, 0), step_squares(stepped, 0), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-14)
    for found in (loop.carried_back, carried_back(stepped, 0), carried_back(kept, 0)):
        assert found is not None
        np.testing.assert_allclose(np.where(upto, found, 0), truth, rtol=1e-4, atol=1e-12)


def test_the_probes_equal_the_numpy_bptt_and_change_no_number(tf):
    """Where gradscope's NumPy cells model the calls (a GRU chain, an LSTM that returns its
    states), their float64 BPTT gives the same totals of h; and the pass with probes gives the
    loss and every gradient of the pass without them."""
    import keras
    from keras import layers as L

    from gradscope.keras.flow import recurrent_calls, total_state_gradients

    keras.utils.set_random_seed(5)
    x_in = keras.Input((T, F), name="x")
    first = L.GRU(4, return_sequences=True, name="first")(x_in)
    _, h, c = L.LSTM(3, go_backwards=True, return_state=True, name="second")(first)
    model = keras.Model(x_in, L.Dense(2)(L.Concatenate()([h, c])))
    model.compile(loss="mse")
    x, y = _data()
    engine, result = _pass(model, x, y)
    usable, skipped = recurrent_calls(None, engine, result)
    assert not skipped and [r.label for r in usable] == ["first", "second"]
    for recurrent in usable:
        parts = total_state_gradients(recurrent, result)
        assert not isinstance(parts, str)
        (loop,) = result.state_totals[recurrent.label]
        (total, direct), = parts
        np.testing.assert_allclose(loop.totals[0], total, rtol=1e-4,
                                   atol=1e-6 * float(np.max(np.abs(total))))
        np.testing.assert_allclose(loop.direct, direct, rtol=1e-4, atol=1e-9)
    _, plain = _pass(model, x, y, probe_states=False)
    assert plain.state_totals == {} and result.loss == pytest.approx(plain.loss, rel=1e-7)
    for path, gradient in plain.gradients.items():
        np.testing.assert_allclose(result.gradients[path], gradient, rtol=1e-6, atol=1e-9)
    for label, gradients in plain.state_gradients.items():
        for mine, theirs in zip(result.state_gradients[label], gradients, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-9)


def test_a_conv_lstm_is_read_from_the_pass(tf):
    """A ConvLSTM1D runs Keras' own loop too: its ‖∂L/∂h_t‖ against its cell unrolled by hand
    with a zero probe on h and c after every step."""
    import keras
    from keras import layers as L

    import gradscope

    keras.utils.set_random_seed(6)
    x_in = keras.Input((T, 5, 2), name="x")
    conv = L.ConvLSTM1D(2, 3, padding="same", return_sequences=True, name="conv")
    model = keras.Model(x_in, L.Dense(2)(L.Flatten()(conv(x_in))))
    model.compile(loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, T, 5, 2)).astype(np.float32)
    y = rng.normal(size=(B, 2)).astype(np.float32)
    report = gradscope.explain(model, x=x, y=y, flow=True)
    (found,) = [s for s in report.gradient_flow.sequences
                if s.source == "conv" and s.kind == "state"]
    assert found.what == "∂L/∂conv/h_t" and not report.gradient_flow.not_analysed

    head = keras.Model(conv.output, model.outputs[0])
    inputs = tf.constant(x)
    zeros = tf.zeros((B, 5, 2))
    probes = [[tf.zeros_like(zeros), tf.zeros_like(zeros)] for _ in range(T)]
    with tf.GradientTape() as tape:
        tape.watch(probes)
        states, outputs = [zeros, zeros], []
        for t in range(T):
            _, (h, c) = conv.cell(inputs[:, t], states)
            states = [h + probes[t][0], c + probes[t][1]]
            outputs.append(states[0])
        loss = model.compute_loss(x=x, y=y, y_pred=head(tf.stack(outputs, axis=1)))
    truth = [float(tf.norm(g[0])) for g in tape.gradient(loss, probes)]
    np.testing.assert_allclose(found.norms, truth, rtol=1e-4, atol=1e-9)


def test_a_loop_traced_with_a_free_time_axis_is_probed(tf):
    """Traced with the time axis free (as a retrace may give it), the probes take their
    shape from the sequence at run time, and give what the eager loop gives."""
    import keras
    from keras import layers as L

    from gradscope.keras.state_probes import filled, probe_targets, state_totals, states_probed

    keras.utils.set_random_seed(7)
    layer = L.LSTM(3, return_sequences=True)
    x, _ = _data(masked=True)
    mask = tf.constant(np.any(x != 0, axis=-1))
    weights = tf.constant(np.random.default_rng(2).normal(size=(B, T, 3)).astype(np.float32))

    def totals(x: Any) -> tuple[list[Any], list[Any]]:
        found: list[Any] = []
        with tf.GradientTape() as tape:
            with states_probed([layer], found, tape.watch):
                out = layer(x, mask=mask)
            loss = tf.reduce_sum(weights * out)
        targets = probe_targets(found)
        return found, filled(tf, targets, tape.gradient(loss, targets))

    eager_found, eager = totals(tf.constant(x))
    traced_found: list[Any] = []

    @tf.function(input_signature=[tf.TensorSpec((None, None, F), tf.float32)])
    def traced(x: Any) -> Any:
        found, gradients = totals(x)
        traced_found[:] = found
        return gradients

    gradients = traced(tf.constant(x))
    for mine, theirs in zip(state_totals(traced_found, gradients),
                            state_totals(eager_found, eager), strict=True):
        for a, b in zip(mine.totals, theirs.totals, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_loop_the_probes_cannot_run_is_keras_own_and_stepped(tf, monkeypatch):
    """Where the probed loop fails (here made to), Keras' own loop runs unprobed, the call's
    numbers are unchanged, and the flow steps the cell the model holds instead, which the
    method says."""
    import gradscope
    from gradscope.keras import state_probes

    model = _model("masked_lstm_state")
    model.compile(loss="mse")
    x, y = _data(masked=True)
    probed = gradscope.explain(model, x=x, y=y, flow=True)

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("not this loop")

    monkeypatch.setattr(state_probes, "probed_loop", fails)
    stepped = gradscope.explain(model, x=x, y=y, flow=True)
    assert "from the pass's own backward" in probed.gradient_flow.method
    assert stepped.gradient_flow.method.startswith("the total ∂L/∂h_t of each recurrent "
                                                   "call: the cell the model holds, stepped")
    assert stepped.loss.value == probed.loss.value
    for mine, theirs in zip(stepped.gradient_flow.sequences, probed.gradient_flow.sequences,
                            strict=True):
        assert mine.what == theirs.what
        np.testing.assert_allclose(mine.norms, theirs.norms, rtol=1e-4, atol=1e-9)
