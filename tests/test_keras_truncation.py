"""gradscope/keras/truncation.py and check's carry witness: truncated BPTT on a Keras model.

The truth is written here by hand: each layer's own cell unrolled in a Python loop, with
Keras' masking written out, ``tf.stop_gradient`` on the states where each chunk begins, and
Keras' own ``compute_loss``; the carry's product is ``tape.gradient(ys=a chunk's final
states, xs=its initial states, output_gradients=the next chunk's ∂L/∂(initial states))``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import gradscope

T, F, B = 9, 3, 4


@pytest.fixture
def keras_tf(tf: Any) -> tuple[Any, Any]:
    import keras

    return keras, tf


def _model(keras: Any, backwards: bool = False, masked: bool = False) -> Any:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((T, F), name="x")
    h = keras.layers.Masking()(inputs) if masked else inputs
    h = keras.layers.GRU(5, return_sequences=True, go_backwards=backwards, name="gru")(h)
    h = keras.layers.LSTM(4, return_sequences=True, name="lstm")(h)
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(h))
    model.compile(loss="mse")
    return model


def _batch(masked: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    if masked:
        x[0, -3:] = 0.0
        x[1, 4] = 0.0  # masked at a chunk's first step
    return x, rng.normal(size=(B, T, 2)).astype(np.float32)


def _starts(chunks: int) -> list[int]:
    lengths = [len(p) for p in np.array_split(np.arange(T), chunks)]
    return list(np.cumsum(lengths)[:-1])


def _by_hand(tf: Any, model: Any, x: np.ndarray, y: np.ndarray, chunks: int,
             cut: bool = True) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """The loss, its weight gradients (cut at the chunk starts, or not) and, uncut, the
    states entering and leaving every chunk, unrolled by hand under one persistent tape."""
    gru, lstm, dense = (model.get_layer(n) for n in ("gru", "lstm", "dense"))
    mask = np.any(x != 0, axis=-1)
    starts = set(_starts(chunks))
    entering: dict[str, Any] = {}
    leaving: dict[str, Any] = {}
    tape = tf.GradientTape(persistent=True)
    with tape:
        def run(layer: Any, sequence: Any, states: list[Any], name: str) -> list[Any]:
            order = list(range(T))[::-1] if layer.go_backwards else list(range(T))
            outputs: list[Any] = [None] * T
            previous = tf.zeros_like(states[0])
            for k, t in enumerate(order):
                boundary = (T - t) if layer.go_backwards else t
                if k and (t + 1 if layer.go_backwards else t) in starts and boundary:
                    leaving[f"{name}@{k}"] = states
                    states = [tf.stop_gradient(s) for s in states] if cut else \
                        [tf.identity(s) for s in states]
                    # The last output a masked step gives: a path across the boundary too.
                    previous = tf.stop_gradient(previous) if cut else previous
                    tape.watch(states)
                    entering[f"{name}@{k}"] = states
                out, new = layer.cell(sequence[k], states)
                new = list(new) if isinstance(new, list | tuple) else [new]
                keep = tf.reshape(tf.constant(mask[:, t]), (-1, 1))
                states = [tf.where(keep, n, s) for n, s in zip(new, states, strict=True)]
                previous = tf.where(keep, out, previous)
                outputs[k] = previous
            return outputs

        xs = tf.constant(x)
        gru_order = list(range(T))[::-1] if gru.go_backwards else list(range(T))
        first = run(gru, [xs[:, t] for t in gru_order], [tf.zeros((B, 5))], "gru")
        # Keras returns a go_backwards layer's sequence in processing order.
        second = run(lstm, first, [tf.zeros((B, 4)), tf.zeros((B, 4))], "lstm")
        prediction = dense(tf.stack(second, axis=1))
        if not np.all(mask):  # the mask reaches the loss, as Keras hands it over
            from keras.src.backend.common.masking import set_keras_mask

            set_keras_mask(prediction, tf.constant(mask))
        loss = model.compute_loss(x=xs, y=tf.constant(y), y_pred=prediction)
    return loss, tape, entering, leaving


@pytest.mark.parametrize("backwards, masked", [(False, False), (True, True)])
def test_truncated_gradients_equal_a_program_with_stop_gradient(keras_tf: Any, backwards: bool,
                                                                masked: bool) -> None:
    """Per weight, the truncated gradient equals the hand-written program's; with the carry,
    the chunks give Keras' own full gradient; go_backwards and masks included."""
    keras, tf = keras_tf
    model = _model(keras, backwards, masked)
    x, y = _batch(masked)
    report = gradscope.explain(model, x=x, y=y, chunks=3)
    loss, tape, _, _ = _by_hand(tf, model, x, y, 3)
    hand = dict(zip([v.path for v in model.trainable_variables],
                    tape.gradient(loss, model.trainable_variables), strict=True))
    names = {entry.path: entry.name for entry in report.gradients}
    truncated = {w.name: w.l2_truncated for w in report.carry.weights}
    for path, gradient in hand.items():
        assert truncated[names[path]] == pytest.approx(float(tf.norm(gradient)), rel=1e-4)
    full = {e.name: e.stats.l2 for e in report.gradients if e.stats is not None}
    assert all(w.l2_full == pytest.approx(full[w.name], rel=1e-6) for w in report.carry.weights)
    assert report.carry.carried_error < 1e-4
    assert report.carry.matters
    assert [call.layer for call in report.carry.calls] == ["gru", "lstm"]
    assert report.carry.calls[0].chunk_lengths == [3, 3, 3]
    # A go_backwards call's lengths are in time order: the text says it runs the last first.
    from conftest import render_text

    text = " ".join(render_text(report, 200).split())
    assert ("gru 3 + 3 + 3 in time order, run from the last" in text) == backwards


def test_a_padded_batch_is_cut_as_keras_own_layers_called_chunk_by_chunk(
        keras_tf: Any) -> None:
    """Found tried as a new user would: behind a padding mask, a sequence that ends before a
    boundary crossed it by the last output Keras' masked loop carries (gru/bias truncated
    3.5e-3 against 8.0e-2), and the carried chunks still added up. The truth here is Keras'
    own layers called chunk by chunk, each from its state held (tf.stop_gradient)."""
    keras, tf = keras_tf
    keras.utils.set_random_seed(5)
    tokens = np.random.default_rng(1).integers(1, 30, size=(8, 12)).astype("int32")
    for row, length in enumerate([12, 5, 7, 4, 12, 9, 6, 10]):
        tokens[row, length:] = 0
    y = np.arange(8) % 2
    model = keras.Sequential([keras.Input((12,), dtype="int32"),
                              keras.layers.Embedding(30, 5, mask_zero=True),
                              keras.layers.GRU(8, return_sequences=True, name="gru"),
                              keras.layers.GRU(6, name="gru_1"),
                              keras.layers.Dense(2)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = gradscope.explain(model, x=tokens, y=y, chunks=3)
    embedding, first, second, dense = model.layers
    cuts = [(0, 4), (4, 8), (8, 12)]

    def chunk_by_chunk(layer: Any, sequence: Any, mask: Any, units: int) -> tuple[Any, Any]:
        state, outputs = tf.zeros((8, units)), []
        for a, b in cuts:
            out = keras.layers.RNN(layer.cell, return_sequences=True, return_state=True)(
                sequence[:, a:b], mask=mask[:, a:b], initial_state=[tf.stop_gradient(state)])
            outputs.append(out[0])
            state = out[1]
        return tf.concat(outputs, 1), state

    with tf.GradientTape() as tape:
        mask = tf.not_equal(tokens, 0)
        sequence, _ = chunk_by_chunk(first, embedding(tokens), mask, 8)
        _, last = chunk_by_chunk(second, sequence, mask, 6)
        loss = model.compute_loss(x=tokens, y=y, y_pred=dense(last))
    hand = tape.gradient(loss, model.trainable_variables)
    names = {entry.path: entry.name for entry in report.gradients}
    truncated = {w.name: w.l2_truncated for w in report.carry.weights}
    for variable, gradient in zip(model.trainable_variables, hand, strict=True):
        assert truncated[names[variable.path]] == pytest.approx(
            float(tf.norm(tf.convert_to_tensor(gradient))), rel=1e-4), variable.path
    assert report.carry.carried_error < 1e-4


def test_the_carry_through_each_chunk_is_the_seed_product(keras_tf: Any) -> None:
    """Each chunk's product: tape.gradient(ys=its final states, xs=its initial states,
    output_gradients=∂L/∂(the next chunk's initial states)), all states of both layers."""
    keras, tf = keras_tf
    model = _model(keras)
    x, y = _batch()
    report = gradscope.explain(model, x=x, y=y, chunks=3)
    loss, tape, entering, leaving = _by_hand(tf, model, x, y, 3, cut=False)
    keys = sorted(entering, key=lambda key: int(key.split("@")[1]))
    starts = _starts(3)
    grad_ys = {key: tape.gradient(loss, entering[key]) for key in keys}
    found = {(p.layer, p.chunk, p.x): p for p in report.carry.products}

    def x_of(name: str, chunk: int) -> str:
        return f"{name}/h0" if chunk == 0 else f"{name}/h[t={starts[chunk - 1] - 1}]"

    for chunk, start in enumerate(starts):
        later = [key for key in keys if key.endswith(f"@{start}")]
        ys = [s for key in later for s in leaving[key]]
        output_gradients = [g for key in later for g in grad_ys[key]]
        for key in later:
            name = key.split("@")[0]
            assert found[(name, chunk, x_of(name, chunk))].l2_grad_y == \
                pytest.approx(float(tf.norm(grad_ys[key][0])), rel=1e-4)
        if chunk == 0:
            continue
        for key in (key for key in keys if key.endswith(f"@{starts[chunk - 1]}")):
            name = key.split("@")[0]
            product = tape.gradient(ys, entering[key][0], output_gradients=output_gradients)
            assert found[(name, chunk, x_of(name, chunk))].l2_product == \
                pytest.approx(float(tf.norm(product)), rel=1e-4)


def test_check_holds_the_chunks_carried_against_the_tape(keras_tf: Any) -> None:
    """check --chunks passes on a correct model and names its boundaries; a copy changed
    after the tape (the cut run no longer sees the model the tape saw) fails it."""
    keras, _ = keras_tf
    model = _model(keras, masked=True)
    x, y = _batch(masked=True)
    report = gradscope.check(model, x=x, y=y, chunks=3, examples=None)
    rows = {t.name: t for t in report.tensors}
    carried = [e for t in report.tensors for e in t.witnesses if e.witness == "tbptt_carry"]
    assert len(carried) == len(model.trainable_variables)
    assert all(e.passed and e.error < 1e-9 for e in carried)
    assert [b.step for b in report.carry.boundaries] == [3, 6]
    assert report.summary.passed and "tbptt_carry" in report.summary.witnesses

    def scaled(copy: Any) -> None:
        kernel = copy.get_layer("gru").cell.recurrent_kernel
        kernel.assign(kernel * 1.01)

    # Found tried as a new user would: a Bidirectional layer's long state names cut the
    # boundaries' table at 80 columns ("bound" / "ary", "(8," without its close); where
    # they do not fit whole, each y stands over its grad_y, whole.
    from rich.console import Console

    from gradscope.report.tables import carry_check_section

    def longer(named: Any) -> Any:
        return named.model_copy(update={"name": named.name.replace(
            "gru/", "a_rather_long_bidirectional_encoder/forward/")})

    carry = report.carry.model_copy(update={"boundaries": [b.model_copy(update={
        "ys": [longer(y) for y in b.ys], "grad_ys": [longer(g) for g in b.grad_ys]})
        for b in report.carry.boundaries]})
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(carry_check_section(carry, 80))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    for boundary in carry.boundaries:
        for named in [*boundary.ys, *boundary.grad_ys]:
            assert any(f"{named.name} ({', '.join(map(str, named.shape))})" in line
                       for line in lines), named.name

    mutated = gradscope.check(model, x=x, y=y, chunks=3, examples=None,
                              after_autodiff=scaled)
    failed = {t.name for t in mutated.tensors
              if any(e.witness == "tbptt_carry" and not e.passed for e in t.witnesses)}
    assert "gru/recurrent_kernel" in failed and rows


def _cli(args: list[str], capsys: Any) -> tuple[int, str, str]:
    from gradscope.cli import main

    with pytest.raises(SystemExit) as stop:
        main(args)
    captured = capsys.readouterr()
    return stop.value.code, captured.out, captured.err


def test_chunks_on_a_saved_model_from_the_command_line(keras_tf: Any, tmp_path: Any,
                                                       capsys: Any, monkeypatch: Any) -> None:
    """--chunks on a .keras file: the carry in the JSON and at 80 columns; K = 1 or K beyond
    the steps exits 2 with the reason."""
    import json

    keras, _ = keras_tf
    path = str(tmp_path / "m.keras")
    _model(keras).save(path)
    x, y = _batch()
    data = str(tmp_path / "d.npz")
    np.savez(data, x=x, dense=y)
    code, out, _ = _cli(["explain", path, "--data", data, "--chunks", "2", "--json"], capsys)
    assert code == 0
    carry = json.loads(out)["carry"]
    assert carry["chunks"] == 2 and carry["calls"][0]["chunk_lengths"] == [5, 4]
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = _cli(["explain", path, "--data", data, "--chunks", "2"], capsys)
    assert code == 0 and "Truncated BPTT in 2 chunks" in out
    from rich.cells import cell_len

    assert max(cell_len(line) for line in out.splitlines()) <= 80
    for chunks, says in (("1", "--chunks 1: expected K ≥ 2"), ("10", "more than the 9")):
        code, _, err = _cli(["explain", path, "--data", data, "--chunks", chunks], capsys)
        assert code == 2 and says in err, err


def _tuple_cell(keras: Any, tf: Any) -> Any:
    class TupleCell(keras.layers.Layer):
        """A cell of the user's with a tuple state: h and a slow average of it."""

        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units, self.state_size, self.output_size = units, (units, units), units

        def build(self, shape: Any) -> None:
            self.k = self.add_weight(shape=(shape[-1], self.units))
            self.r = self.add_weight(shape=(self.units, self.units))

        def call(self, x: Any, states: Any) -> Any:
            h, m = states
            h = tf.tanh(x @ self.k + h @ self.r)
            m = 0.9 * m + 0.1 * h
            return h + m, (h, m)

    return TupleCell(4)


@pytest.mark.parametrize("kind", ["tuple_cell", "encoder_decoder", "same_steps", "conv_lstm",
                                  "dropout"])
def test_every_kind_of_recurrent_call_is_cut(keras_tf: Any, kind: str) -> None:
    """A cell of the user's with a tuple state, a decoder started from the encoder's state
    (each cut on its own time axis), a ConvLSTM1D, training-mode dropout with relu: every
    call is cut, and the chunks, carried, give Keras' own full gradient."""
    keras, tf = keras_tf
    layers = keras.layers
    keras.utils.set_random_seed(2)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    y = rng.normal(size=(B, T, 2)).astype(np.float32)
    inputs = keras.Input((T, F))
    options: dict[str, Any] = {}
    if kind == "tuple_cell":
        h = layers.RNN(_tuple_cell(keras, tf), return_sequences=True, name="rnn")(inputs)
        expected = ["rnn"]
    elif kind == "same_steps":
        # Encoder and decoder on one time axis: a chain of chunks runs through the decoder's
        # boundaries, then on into the encoder's (found tried as a new user would: the
        # project's own sample_configs/keras_encoder_decoder.py "did not settle").
        later = keras.Input((T, F))
        _, state = layers.GRU(4, return_state=True, name="encoder")(inputs)
        h = layers.GRU(4, return_sequences=True, name="decoder")(later, initial_state=state)
        inputs, x = [inputs, later], [x, x[:, ::-1]]
        expected = ["encoder", "decoder"]
    elif kind == "encoder_decoder":
        later = keras.Input((5, F))
        _, state = layers.GRU(4, return_state=True, name="encoder")(inputs)
        h = layers.GRU(4, return_sequences=True, name="decoder")(later, initial_state=state)
        inputs, x, y = [inputs, later], [x, x[:, :5]], y[:, :5]
        expected = ["encoder", "decoder"]
    elif kind == "conv_lstm":
        x = rng.normal(size=(B, T, 6, 2)).astype(np.float32)
        inputs = keras.Input((T, 6, 2))
        h = layers.ConvLSTM1D(3, 3, padding="same", return_sequences=True, name="conv")(inputs)
        h = layers.Reshape((T, 18))(h)
        expected = ["conv"]
    else:
        h = layers.SimpleRNN(4, activation="relu", dropout=0.2, recurrent_dropout=0.3,
                             return_sequences=True, name="rnn")(inputs)
        options["training"] = True
        expected = ["rnn"]
    model = keras.Model(inputs, layers.Dense(2)(h))
    model.compile(loss="mse")
    report = gradscope.explain(model, x=x, y=y, chunks=3, **options)
    assert [call.layer for call in report.carry.calls] == expected
    assert report.carry.carried_error < 1e-4
    if kind == "encoder_decoder":
        assert [call.chunk_lengths for call in report.carry.calls] == [[3, 3, 3], [2, 2, 1]]


def test_chunks_on_a_saved_stateful_model_start_each_pass_from_its_carried_state(
        keras_tf: Any, tmp_path: Any) -> None:
    """A stateful LSTM saved to a file, its state carried from a batch before: every pass
    (the full one, then the cut ones) starts from that state. The pass moved it before, and
    the cut runs then disagreed with Keras' full gradient; the file reads as the object."""
    import gradscope

    keras, _ = keras_tf
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((8, 2), batch_size=4),
                              keras.layers.LSTM(5, stateful=True, return_sequences=True),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 8, 2)).astype(np.float32)
    y = rng.normal(size=(4, 8, 1)).astype(np.float32)
    model.predict(x, verbose=0)  # a batch before: the state the next one starts from
    path = str(tmp_path / "stateful.keras")
    model.save(path)
    from_file = gradscope.explain(path, x=x, y=y, chunks=2)
    from_object = gradscope.explain(keras.saving.load_model(path), x=x, y=y, chunks=2)
    mine, theirs = from_file.to_dict()["carry"], from_object.to_dict()["carry"]
    assert mine["verdict"] == theirs["verdict"] and mine["weights"]
    for a, b in zip(mine["weights"], theirs["weights"], strict=True):
        assert a["name"] == b["name"]
        for key in ("l2_full", "l2_truncated"):
            assert a[key] == pytest.approx(b[key], rel=1e-5)


def test_a_chain_from_one_loop_into_another_is_carried_to_its_end_in_float32(
        keras_tf: Any) -> None:
    """Found tried as a new user would: Embedding(mask_zero) → Bidirectional LSTM → LSTM run
    backwards, 45 steps, float32. The carries were taken as settled when they moved by less
    than the carry's tolerance (3.6e-5), and a carry that was 0 and no longer was counted by
    its absolute size (2.2e-6): the chunks then gave a weight 8.8e-4 (2 chunks) and 3.6e-4
    (3 chunks) away from Keras' own gradient, and explain refused a correct model. Carried
    until nothing moves beyond rounding, they give Keras' own."""
    keras, _ = keras_tf
    keras.utils.set_random_seed(4)
    rng = np.random.default_rng(5)
    x = rng.integers(1, 40, size=(8, 45))
    for i, length in enumerate(rng.integers(5, 46, size=8)):
        x[i, length:] = 0
    y = rng.integers(0, 2, size=(8, 1)).astype("float32")
    model = keras.Sequential([
        keras.Input((None,), dtype="int32"), keras.layers.Embedding(40, 6, mask_zero=True),
        keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True)),
        keras.layers.LSTM(4, go_backwards=True), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(loss="binary_crossentropy")
    for chunks in (2, 3):
        report = gradscope.explain(model, x=x.astype("int32"), y=y, chunks=chunks)
        assert report.carry is not None and report.carry.chunks == chunks


def test_a_call_shorter_than_the_chunks_is_refused_in_gradscopes_words(keras_tf: Any) -> None:
    """Found tried as a new user would: an encoder of 12 steps whose final states start a
    decoder of 3, under 4 chunks. The decoder's loop refuses it, and Keras wrapped that in
    "Exception encountered when calling LSTM.call()" with its escapes; the refusal is now
    gradscope's own, naming the call."""
    keras, _ = keras_tf
    keras.utils.set_random_seed(11)
    encoder_in = keras.Input((12, 5), name="enc")
    _, h, c = keras.layers.LSTM(6, return_state=True, name="encoder")(encoder_in)
    decoder_in = keras.Input((3, 4), name="dec")
    decoded = keras.layers.LSTM(6, return_sequences=True, name="decoder")(
        decoder_in, initial_state=[h, c])
    model = keras.Model([encoder_in, decoder_in], keras.layers.Dense(4, name="out")(decoded))
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x = {"enc": rng.normal(size=(2, 12, 5)).astype("float32"),
         "dec": rng.normal(size=(2, 3, 4)).astype("float32")}
    y = rng.normal(size=(2, 3, 4)).astype("float32")
    from gradscope.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        gradscope.explain(model, x=x, y=y, chunks=4)
    assert str(refused.value).startswith(
        "--chunks 4 is more than the steps decoder runs: 3; expected at most 3 chunks")
    assert "LSTM.call()" not in str(refused.value)
