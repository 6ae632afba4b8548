"""gradscope/keras/stepped.py: every recurrent call stepped through the cell the model holds,
masks, other activations and Bidirectional wrappers included.

The truth is computed here and never by gradscope: Keras' own tape on the real model gives
∂L/∂(the layer's output); the layer's own cell is then unrolled in a Python loop, with
Keras' masking written out (a masked step keeps the state and the last output) and a zero
probe on h_t at every step, and one tape gives ∂⟨∂L/∂output, output⟩/∂probe_t: the total
∂L/∂h_t. ∂h_T/∂h_0 is the Jacobian of Keras' own layer called with an initial state, and
‖∂h_t/∂x_s‖ that of Keras' own layer through its input sequence: each Jacobian's rows from
one tape's backward pass over copies of every example (a copy per row: conftest's
``rows_by_copies``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import (
    assert_jacobian_summary,
    copied,
    hold_copied_masks,
    rows_by_copies,
    tuple_state_cell,
)

import gradscope

T, F, B = 7, 3, 5


def _upstream(tf: Any, model: Any, layer: str, x: Any, y: Any) -> Any:
    """∂L/∂(the layer's output) from Keras' own call and compute_loss."""
    import keras

    both = keras.Model(model.inputs, [model.outputs[0], model.get_layer(layer).output])
    with tf.GradientTape() as tape:
        prediction, output = both({"x": x})
        loss = model.compute_loss(x=x, y=y, y_pred=prediction)
    return tape.gradient(loss, output)


def _unrolled(tf: Any, layer: Any, x: Any, mask: Any, upstream: Any,
              training: bool = False, initial: list[Any] | None = None) -> np.ndarray:
    """‖total ∂L/∂h_t‖ per step of a layer (processing order), by hand, from zero states or
    from ``initial`` (a stateful layer's carried states)."""
    cell = layer.cell
    steps = range(x.shape[1])
    order = list(reversed(steps)) if layer.go_backwards else list(steps)
    states = ([tf.constant(s) for s in initial] if initial is not None else
              [tf.zeros((x.shape[0], size), x.dtype) for size in
               (cell.state_size if isinstance(cell.state_size, list | tuple)
                else [cell.state_size])])
    probes = [tf.zeros((x.shape[0], states[0].shape[1]), x.dtype) for _ in order]
    with tf.GradientTape() as tape:
        tape.watch(probes)
        previous = tf.zeros_like(states[0])
        outputs = []
        for k, t in enumerate(order):
            out, new = cell(x[:, t], states, training=training)
            new = list(new) if isinstance(new, list | tuple) else [new]
            if mask is not None:
                keep = tf.reshape(tf.constant(mask[:, t]), (-1, 1))
                new = [tf.where(keep, n, s) for n, s in zip(new, states, strict=True)]
            new[0] = new[0] + probes[k]
            out = new[0] if mask is None else tf.where(
                tf.reshape(tf.constant(mask[:, t]), (-1, 1)), new[0], previous)
            previous, states = out, new
            outputs.append(out)
        sequence = tf.stack(outputs, axis=1)
        returned = sequence if layer.return_sequences else sequence[:, -1]
        objective = tf.reduce_sum(upstream * returned)
    return np.array([float(tf.norm(g)) for g in tape.gradient(objective, probes)])


def _unrolled_jacobian(tf: Any, layer: Any, x: Any, mask: Any,
                       widths: list[int]) -> np.ndarray:
    """∂(final states)/∂(initial states) per example, every state concatenated ([h, c]), of
    a layer's own cell unrolled by hand from zero states, a masked step keeping the states."""
    size = sum(widths)
    x = copied(tf, x, size)
    mask = None if mask is None else np.asarray(copied(tf, mask, size))

    def unrolled(joined: Any) -> Any:
        states = list(tf.split(joined, widths, axis=1))
        for t in range(x.shape[1]):
            _, new = layer.cell(x[:, t], states)
            new = list(new) if isinstance(new, list | tuple) else [new]
            if mask is not None:
                keep = tf.reshape(tf.constant(mask[:, t]), (-1, 1))
                new = [tf.where(keep, n, s) for n, s in zip(new, states, strict=True)]
            states = new
        return tf.concat(states, axis=1)

    return rows_by_copies(tf, tf.zeros((x.shape[0] // size, size), x.dtype), size, unrolled)


def _assert_jacobian(entry: Any, truth: np.ndarray) -> None:
    """A report's Jacobian entry summarises ``truth`` (B, S, S), to float32 rounding."""
    assert_jacobian_summary(entry, truth, rtol=1e-4, smallest_atol=1e-5)


def _flow(report: Any, what: str) -> np.ndarray:
    found = [s for s in report.gradient_flow.sequences if s.what == what]
    assert len(found) == 1, [s.what for s in report.gradient_flow.sequences]
    return np.array(found[0].norms)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    x[0, -3:] = 0.0  # masked at the end
    x[1, :2] = 0.0  # masked at the start
    x[2, 3] = 0.0  # masked in the middle
    return x, np.any(x != 0, axis=-1), rng.normal(size=(B, 2)).astype(np.float32)


@pytest.mark.parametrize("kind", ["masked_gru", "relu", "masked_lstm", "backwards"])
def test_a_call_the_cells_do_not_model_is_stepped_as_keras_runs_it(tf, data, kind):
    import keras
    from keras import layers as L

    x, mask, y = data
    keras.utils.set_random_seed(3)
    x_in = keras.Input((T, F), name="x")
    masked = L.Masking()(x_in)
    layer = {"masked_gru": L.GRU(4, return_sequences=True, name="rnn"),
             "relu": L.SimpleRNN(4, activation="relu", return_sequences=True, name="rnn"),
             "masked_lstm": L.LSTM(3, name="rnn"),
             "backwards": L.GRU(4, go_backwards=True, name="rnn")}[kind]
    h = layer(x_in if kind == "relu" else masked)
    pooled = L.GlobalAveragePooling1D()(h) if len(h.shape) == 3 else h
    model = keras.Model(x_in, L.Dense(2)(pooled))
    model.compile(loss="mse")
    report = gradscope.explain(model, x=x, y=y, flow=True, jacobians=True)
    assert not report.gradient_flow.not_analysed
    assert not report.state_jacobians.not_analysed
    truth = _unrolled(tf, layer, tf.constant(x), None if kind == "relu" else mask,
                      _upstream(tf, model, "rnn", x, y))
    np.testing.assert_allclose(_flow(report, "∂L/∂rnn/h_t"), truth, rtol=1e-4, atol=1e-9)
    # ∂h_T/∂h_0 of Keras' own layer, called with an initial state.
    states = [tf.zeros((B, n)) for n in ([3, 3] if kind == "masked_lstm" else [4])]
    joined = tf.concat(states, axis=1)
    size = int(states[0].shape[1])  # the final h's

    def final(copies: Any) -> Any:
        parts = tf.split(copies, len(states), axis=1)
        out = layer(copied(tf, x, size), initial_state=list(parts),
                    mask=None if kind == "relu" else copied(tf, mask, size))
        # The last output is the final h (a masked step carries it): an LSTM returns h only.
        return out[:, -1] if layer.return_sequences else out

    truth = rows_by_copies(tf, joined, size, final)
    entry = report.state_jacobians.entries[0]
    if kind == "masked_lstm":  # Keras' layer returns h alone: [h, c] is unrolled by hand
        assert entry.target == "rnn/[h_T, c_T]"
        truth = _unrolled_jacobian(tf, layer, tf.constant(x), mask, [3, 3])
    elif kind == "backwards":
        truth = _unrolled_jacobian(tf, layer, tf.reverse(tf.constant(x), [1]),
                                   mask[:, ::-1], [4])
    _assert_jacobian(entry, truth)


def _masked_bidirectional(layer: Any, name: str) -> Any:
    """Masking → Bidirectional(``layer``) named ``name`` → mean over time → Dense 2, compiled
    with mse; and the Bidirectional layer."""
    import keras
    from keras import layers as L

    x_in = keras.Input((T, F), name="x")
    both = L.Bidirectional(layer, name=name)
    model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(both(L.Masking()(x_in)))))
    model.compile(loss="mse")
    return model, both


def test_a_bidirectional_masked_call_is_stepped_in_both_directions(tf, data):
    import keras
    from keras import layers as L

    x, mask, y = data
    keras.utils.set_random_seed(4)
    model, both = _masked_bidirectional(L.GRU(3, return_sequences=True), "both")
    report = gradscope.explain(model, x=x, y=y, flow=True)
    assert not report.gradient_flow.not_analysed
    upstream = _upstream(tf, model, "both", x, y)
    forward = _unrolled(tf, both.forward_layer, tf.constant(x), mask, upstream[..., :3])
    backward = _unrolled(tf, both.backward_layer, tf.constant(x), mask,
                         tf.reverse(upstream[..., 3:], [1]))
    np.testing.assert_allclose(_flow(report, "∂L/∂both/forward/h_t"), forward, rtol=1e-4,
                               atol=1e-9)
    np.testing.assert_allclose(_flow(report, "∂L/∂both/backward/h_t"), backward, rtol=1e-4,
                               atol=1e-9)


def _twin_sequences(layer: Any) -> Any:
    """Keras' own layer, same weights, returning its whole output sequence."""
    twin = type(layer).from_config({**layer.get_config(), "return_sequences": True,
                                    "name": f"{layer.name}_twin"})
    twin.build((None, T, F))
    twin.set_weights(layer.get_weights())
    return twin


@pytest.mark.parametrize("kind", ["masked_gru", "relu_last_step", "backwards"])
def test_the_influence_at_t_is_keras_own_jacobian(tf, data, kind):
    """‖∂h_t/∂x_s‖ (``at``): the Jacobian of Keras' own layer's output at t (a twin that
    returns every step) with respect to its input, per example, median over the batch."""
    import keras
    from keras import layers as L

    x, mask, y = data
    keras.utils.set_random_seed(6)
    x_in = keras.Input((T, F), name="x")
    layer = {"masked_gru": L.GRU(4, return_sequences=True, name="rnn"),
             "relu_last_step": L.SimpleRNN(4, activation="relu", name="rnn"),
             "backwards": L.LSTM(3, go_backwards=True, name="rnn")}[kind]
    masked = kind != "relu_last_step"
    h = layer(L.Masking()(x_in) if masked else x_in)
    pooled = L.GlobalAveragePooling1D()(h) if len(h.shape) == 3 else h
    model = keras.Model(x_in, L.Dense(2)(pooled))
    model.compile(loss="mse")
    at = 4
    report = gradscope.explain(model, x=x, y=y, at=at)
    found = next(i for i in report.gradient_flow.influence if i.source == "rnn")
    assert found.step == at
    twin = _twin_sequences(layer)
    units = int(layer.cell.units)
    jacobian = rows_by_copies(tf, tf.constant(x), units, lambda copies: twin(
        copies, mask=copied(tf, mask, units) if masked else None)[:, at])  # (B, units, T, F)
    truth = np.median(np.sqrt(np.sum(jacobian ** 2, axis=(1, 3))), axis=0)
    np.testing.assert_allclose(found.influence, truth, rtol=1e-4, atol=1e-9)


def test_at_and_plot_on_a_saved_keras_model(tmp_path):
    import keras
    from conftest import run_gradscope
    from keras import layers as L

    keras.utils.set_random_seed(7)
    x_in = keras.Input((T, F), name="x")
    model = keras.Model(x_in, L.Dense(2)(L.GRU(3, name="gru")(x_in)))
    model.compile(loss="mse")
    model.save(tmp_path / "m.keras")
    plot = tmp_path / "flow.png"
    result = run_gradscope("explain", str(tmp_path / "m.keras"), "--at", "2", "--plot",
                           str(plot), "--json")
    assert result.returncode == 0, result.stderr
    import json

    flow = json.loads(result.stdout)["gradient_flow"]
    (found,) = flow["influence"]
    assert found["step"] == 2 and found["influence"][3:] == [0.0] * (T - 3)
    assert found["influence_map"]["steps"][0] == 0 and plot.stat().st_size > 1000
    result = run_gradscope("explain", str(tmp_path / "m.keras"), "--at", "9")
    assert result.returncode == 2 and "--at 9 is outside the 7 time steps" in result.stderr
    # Spelled as the user wrote it (found tried as a new user would: "at=-1: expected …").
    result = run_gradscope("explain", str(tmp_path / "m.keras"), "--at", "-1")
    assert result.returncode == 2 and "--at -1: expected a whole number ≥ 0" in result.stderr
    # Over 20 steps the map's 16 evenly spaced rows miss t = 4: the --at step is added.
    long = keras.Model(x_in := keras.Input((20, F)), L.Dense(2)(L.GRU(3)(x_in)))
    long.compile(loss="mse")
    rng = np.random.default_rng(0)
    report = gradscope.explain(long, x=rng.normal(size=(2, 20, F)).astype("float32"),
                               y=rng.normal(size=(2, 2)).astype("float32"), at=4, heatmap=True)
    (found,) = report.gradient_flow.influence
    assert found.step == 4 and found.influence_map is not None
    assert 4 in found.influence_map.steps and len(found.influence_map.steps) == 17
    row = found.influence_map.steps.index(4)
    assert found.influence_map.values[row] == pytest.approx(found.influence, rel=1e-6)


def _dropout_model(seed: int) -> tuple[Any, Any]:
    """A GRU with dropout and recurrent_dropout under a pooled head, and the GRU."""
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(seed)
    x_in = keras.Input((T, F), name="x")
    layer = L.GRU(4, dropout=0.2, recurrent_dropout=0.3, return_sequences=True, name="rnn")
    model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(layer(x_in))))
    model.compile(loss="mse")
    return model, layer


def test_training_mode_dropout_is_stepped_with_the_masks_the_call_drew(tf, data):
    """``--training`` with dropout and recurrent_dropout in the cell: the masks the observed
    call drew are drawn again from where gradscope seeded the cell's generator, so the
    stepped outputs equal Keras' own (else the call would be refused). The truth: Keras' own
    training-mode call, seeded as gradscope seeds it, for ∂L/∂output; the cell unrolled by
    hand with the masks drawn the same way."""
    import keras

    from gradscope.keras.whole_model import seed_random_draws

    x, _, y = data
    model, layer = _dropout_model(8)
    report = gradscope.explain(model, x=x, y=y, flow=True, training=True, seed=2)
    assert not report.gradient_flow.not_analysed
    both = keras.Model(model.inputs, [model.outputs[0], layer.output])
    seed_random_draws(model, 2)
    with tf.GradientTape() as tape:
        prediction, output = both({"x": x}, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=prediction)
    upstream = tape.gradient(loss, output)
    seed_random_draws(model, 2)
    cell = layer.cell
    cell.get_dropout_mask(tf.constant(x[:, 0]))
    cell.get_recurrent_dropout_mask(tf.zeros((B, 4)))
    try:
        truth = _unrolled(tf, layer, tf.constant(x), None, upstream, training=True)
    finally:
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()
    np.testing.assert_allclose(_flow(report, "∂L/∂rnn/h_t"), truth, rtol=1e-4, atol=1e-9)


def _one_state_cell_base() -> Any:
    """A cell of the user's with one state of ``units`` numbers, a kernel and a recurrent
    kernel; a subclass writes its ``call``."""
    from keras import layers as L

    class OneStateCell(L.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = units
            self.state_size = units

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")
            self.recurrent = self.add_weight(shape=(self.units, self.units), name="recurrent")

    return OneStateCell


def _own_loop_rnn_class() -> Any:
    """A subclass of ``keras.layers.RNN`` whose loop is its own (``inner_loop`` calling
    ``backend.rnn`` itself): gradscope cannot look inside it and steps its cell."""
    import keras
    from keras.src import backend, tree

    class OwnLoopRNN(keras.layers.RNN):
        def inner_loop(self, sequences, initial_state, mask, training=False):
            mask = mask[0] if tree.is_nested(mask) else mask

            def step(inputs, states):
                out, new = self.cell(inputs, states)
                return out, new if tree.is_nested(new) else [new]

            return backend.rnn(step, sequences, list(tree.flatten(initial_state)),
                               go_backwards=self.go_backwards, mask=mask, unroll=False,
                               input_length=sequences.shape[1],
                               zero_output_for_mask=self.zero_output_for_mask,
                               return_all_outputs=self.return_sequences)

    return OwnLoopRNN


@pytest.mark.parametrize("own_loop", [False, True])
def test_a_stateful_layer_starts_from_its_carried_state(tf, data, own_loop):
    """Keras' SimpleRNN, and a subclass of RNN with a loop of its own (whose carried state
    the run does not capture: the layer's own states are read), from a carried state."""
    import keras
    from keras import layers as L

    x, _, y = data
    keras.utils.set_random_seed(9)
    x_in = keras.Input(batch_shape=(B, T, F), name="x")
    layer = (_own_loop_rnn_class()(L.SimpleRNNCell(4, activation="relu"), stateful=True,
                                    return_sequences=True, name="rnn") if own_loop else
             L.SimpleRNN(4, stateful=True, activation="relu", return_sequences=True,
                         name="rnn"))
    model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(layer(x_in))))
    model.compile(loss="mse")
    model.predict(x, verbose=0)  # carries a state into the next batch
    carried = np.asarray(layer.states[0])
    assert np.abs(carried).sum() > 0
    report = gradscope.explain(model, x=x, y=y, flow=True)
    assert not report.gradient_flow.not_analysed
    np.testing.assert_array_equal(np.asarray(layer.states[0]), carried)  # left as it was
    upstream = _upstream(tf, model, "rnn", x, y)  # from the same carried state
    truth = _unrolled(tf, layer, tf.constant(x), None, upstream, initial=[carried])
    np.testing.assert_allclose(_flow(report, "∂L/∂rnn/h_t"), truth, rtol=1e-4, atol=1e-9)


def test_a_cell_of_your_own_with_a_tuple_state_is_stepped_over_masked_steps(tf, data):
    import keras
    from keras import layers as L

    x, mask, y = data
    keras.utils.set_random_seed(10)
    x_in = keras.Input((T, F), name="x")
    layer = L.RNN(tuple_state_cell(3, list), return_sequences=True, name="rnn")
    model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(layer(L.Masking()(x_in)))))
    model.compile(loss="mse")
    report = gradscope.explain(model, x=x, y=y, flow=True, jacobians=True)
    assert not report.gradient_flow.not_analysed and not report.state_jacobians.not_analysed
    truth = _unrolled(tf, layer, tf.constant(x), mask, _upstream(tf, model, "rnn", x, y))
    np.testing.assert_allclose(_flow(report, "∂L/∂rnn/states[0]_t"), truth, rtol=1e-4,
                               atol=1e-9)
    _assert_jacobian(report.state_jacobians.entries[0],
                     _unrolled_jacobian(tf, layer, tf.constant(x), mask, [3, 3]))


def test_a_cell_whose_step_cannot_be_vectorised_gets_its_jacobian_by_backward_passes(
        tf, data, capfd):
    """The Jacobian's tangents are carried forward by ``tf.vectorized_map``, which has no
    rule for some ops (here CumulativeLogsumexp): such a cell is taken one backward pass per
    state unit instead, with the same numbers and no TensorFlow log line."""
    import keras
    from keras import layers as L

    @keras.saving.register_keras_serializable(package="stepped_test")
    class CumulativeCell(_one_state_cell_base()):
        def call(self, inputs: Any, states: Any) -> Any:
            pre = keras.ops.tanh(inputs @ self.kernel + states[0] @ self.recurrent)
            h = tf.math.cumulative_logsumexp(pre, axis=1) / self.units
            return h, [h]

        def get_config(self) -> dict[str, Any]:
            return {**super().get_config(), "units": self.units}

    x, mask, y = data
    keras.utils.set_random_seed(13)
    x_in = keras.Input((T, F), name="x")
    layer = L.RNN(CumulativeCell(3), name="rnn")
    model = keras.Model(x_in, L.Dense(2)(layer(L.Masking()(x_in))))
    model.compile(loss="mse")
    capfd.readouterr()
    report = gradscope.explain(model, x=x, y=y, jacobians=True)
    assert not report.state_jacobians.not_analysed
    _assert_jacobian(report.state_jacobians.entries[0],
                     _unrolled_jacobian(tf, layer, tf.constant(x), mask, [3]))
    assert capfd.readouterr().err == ""


def test_a_stateful_rnn_over_a_cell_of_your_own_starts_from_its_carried_state(tf, data):
    import keras
    from keras import layers as L

    x, _, y = data
    keras.utils.set_random_seed(11)
    x_in = keras.Input(batch_shape=(B, T, F), name="x")
    layer = L.RNN(L.SimpleRNNCell(4, activation="relu"), stateful=True,
                  return_sequences=True, name="rnn")
    model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(layer(x_in))))
    model.compile(loss="mse")
    model.predict(x, verbose=0)
    carried = np.asarray(layer.states[0])
    report = gradscope.explain(model, x=x, y=y, flow=True)
    assert not report.gradient_flow.not_analysed
    upstream = _upstream(tf, model, "rnn", x, y)
    truth = _unrolled(tf, layer, tf.constant(x), None, upstream, initial=[carried])
    np.testing.assert_allclose(_flow(report, "∂L/∂rnn/h_t"), truth, rtol=1e-4, atol=1e-9)
    state = next(s for s in report.initial_state_gradients if s.name == "rnn/h0")
    assert "carried" in state.source


def test_training_mode_influence_uses_the_masks_the_call_drew(tf, data):
    """``--at`` and ``--plot`` with ``--training``: the influence steps the cell with the
    dropout masks of the call, as the flow does (it once drew its own, and with ``--plot``
    failed on a mask cached from another trace). The truth: Keras' own layer, seeded as
    gradscope seeds it, its masks drawn first, then called under a tape."""

    from gradscope.keras.whole_model import seed_random_draws

    x, _, y = data
    model, layer = _dropout_model(12)
    report = gradscope.explain(model, x=x, y=y, at=3, heatmap=True, training=True, seed=4)
    (found,) = report.gradient_flow.influence
    seed_random_draws(model, 4)
    inputs = tf.constant(x)
    drawn = (layer.cell.get_dropout_mask(inputs[:, 0]),
             layer.cell.get_recurrent_dropout_mask(tf.zeros((B, 4))))
    own = np.asarray(layer(inputs, training=True))  # Keras' call takes the masks drawn above
    whole = []

    def call(copies: Any) -> Any:  # the same masks, copied with their examples
        hold_copied_masks(tf, layer.cell, drawn, 4)
        whole.append(layer(copies, training=True))
        return whole[-1][:, 3]

    jacobian = rows_by_copies(tf, inputs, 4, call)
    np.testing.assert_allclose(whole[0][::4], own, rtol=1e-5, atol=1e-6)
    truth = np.median(np.sqrt(np.sum(jacobian ** 2, axis=(1, 3))), axis=0)
    np.testing.assert_allclose(found.influence, truth, rtol=1e-4, atol=1e-9)
    assert found.influence_map is not None and 3 in found.influence_map.steps


def test_a_conv_lstm_call_is_stepped_from_keras_own_zero_states(tf):
    """A ConvLSTM1D (states of feature maps, which the run does not capture) is stepped from
    its own zero states: ‖∂L/∂h_t‖ against its cell unrolled by hand, ∂[h_T, c_T]/∂[h0, c0]
    against Keras' own layer called with an initial state, and ‖∂h_t/∂x_s‖ against the
    tape through a twin that returns every step."""
    import keras
    from keras import layers as L

    steps, width, channels, filters, batch = 4, 5, 2, 2, 3
    rng = np.random.default_rng(2)
    x = rng.normal(size=(batch, steps, width, channels)).astype(np.float32)
    y = rng.normal(size=(batch, 1)).astype(np.float32)
    keras.utils.set_random_seed(8)
    x_in = keras.Input((steps, width, channels), name="x")
    layer = L.ConvLSTM1D(filters, 3, padding="same", name="conv")
    model = keras.Model(x_in, L.Dense(1)(L.Flatten()(layer(x_in))))
    model.compile(loss="mse")
    report = gradscope.explain(model, x=x, y=y, flow=True, jacobians=True, at=2)
    assert not report.gradient_flow.not_analysed and not report.state_jacobians.not_analysed
    # ∂L/∂h_t by hand: the cell unrolled in Python, a zero probe on h after every step.
    upstream = _upstream(tf, model, "conv", x, y)
    zeros = tf.zeros((batch, width, filters))
    probes = [tf.zeros_like(zeros) for _ in range(steps)]
    with tf.GradientTape() as tape:
        tape.watch(probes)
        states = [zeros, zeros]
        for t in range(steps):
            _, (h, c) = layer.cell(tf.constant(x[:, t]), states)
            states = [h + probes[t], c]
        objective = tf.reduce_sum(upstream * states[0])
    truth = [float(tf.norm(g)) for g in tape.gradient(objective, probes)]
    np.testing.assert_allclose(_flow(report, "∂L/∂conv/h_t"), truth, rtol=1e-4, atol=1e-9)
    # ∂[h_T, c_T]/∂[h0, c0]: Keras' own layer, called with its initial state.
    twin = type(layer).from_config({**layer.get_config(), "return_state": True,
                                    "return_sequences": True, "name": "twin"})
    twin.build((None, steps, width, channels))
    twin.set_weights(layer.get_weights())
    size = 2 * width * filters

    def final(copies: Any) -> Any:
        h0, c0 = (tf.reshape(p, (-1, width, filters)) for p in tf.split(copies, 2, axis=1))
        _, h_final, c_final = twin(copied(tf, x, size), initial_state=[h0, c0])
        return tf.concat([tf.reshape(h_final, (-1, size // 2)),
                          tf.reshape(c_final, (-1, size // 2))], axis=1)

    blocks = rows_by_copies(tf, tf.zeros((batch, size)), size, final)
    (entry,) = report.state_jacobians.entries
    assert entry.target == "conv/[h_T, c_T]" and entry.shape == [20, 20]
    frobenius = np.sqrt(np.sum(blocks ** 2, axis=(1, 2)))
    assert entry.frobenius_median == pytest.approx(float(np.median(frobenius)), rel=1e-4)
    # ‖∂h_2/∂x_s‖: the tape through the twin's output sequence.
    jacobian = rows_by_copies(tf, tf.constant(x), width * filters, lambda copies: tf.reshape(
        twin(copies)[0][:, 2], (-1, width * filters)))
    jacobian = jacobian.reshape(batch, width, filters, *jacobian.shape[2:])  # (B, W, F, T, W, C)
    truth = np.median(np.sqrt(np.sum(jacobian ** 2, axis=(1, 2, 4, 5))), axis=0)
    (found,) = report.gradient_flow.influence
    np.testing.assert_allclose(found.influence, truth, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("kind", ["mask_zero_bidirectional", "own_cell_masked",
                                  "relu_stateful", "recurrent_dropout_training"])
def test_each_calls_input_gradient_per_step_is_keras_own(tf, data, kind):
    """‖∂L/∂x_t‖ of every recurrent call's input sequence equals Keras' own tape's gradient
    on that layer's input, in the same call of the whole model."""
    import keras
    from keras import layers as L

    from gradscope.keras.whole_model import seed_random_draws

    x, _, y = data
    keras.utils.set_random_seed(11)
    training = kind == "recurrent_dropout_training"
    if kind == "mask_zero_bidirectional":
        x = np.random.default_rng(4).integers(1, 12, (B, T))
        x[0, -3:] = 0
        x[1, :2] = 0
        x_in = keras.Input((T,), dtype="int32", name="x")
        h = L.Bidirectional(L.LSTM(3, return_sequences=True), name="both")(
            L.Embedding(12, F, mask_zero=True)(x_in))
        calls = ["both", "rnn"]
        h = L.GRU(4, name="rnn")(h)
    else:
        x_in = keras.Input(batch_shape=(B, T, F), name="x")
        layer = {"own_cell_masked": L.RNN(tuple_state_cell(), return_sequences=True),
                 "relu_stateful": L.SimpleRNN(4, stateful=True, activation="relu",
                                              return_sequences=True),
                 "recurrent_dropout_training": L.SimpleRNN(
                     4, activation="relu", dropout=0.2, recurrent_dropout=0.3,
                     return_sequences=True)}[kind]
        layer.name = "rnn"
        h = L.GlobalAveragePooling1D()(layer(L.Masking()(x_in) if kind == "own_cell_masked"
                                             else x_in))
        calls = ["rnn"]
    model = keras.Model(x_in, L.Dense(2)(h))
    model.compile(loss="mse")
    if kind == "relu_stateful":
        model.predict(x, verbose=0)  # carries a state into the next batch
    report = gradscope.explain(model, x=x, y=y, flow=True, training=training, seed=2)
    assert not report.gradient_flow.not_analysed
    # A recurrent layer's recorded input is [sequence, mask] where a mask reached it.
    inputs = [model.get_layer(c).input for c in calls]
    inputs = [i[0] if isinstance(i, list) else i for i in inputs]
    both = keras.Model(model.inputs, [model.outputs[0], *inputs])
    if training:
        seed_random_draws(model, 2)
    feed = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(feed)
        prediction, *read = both({"x": feed}, training=training)
        loss = model.compute_loss(x=x, y=y, y_pred=prediction)
    read = [feed if i is x_in else r for i, r in zip(inputs, read, strict=True)]
    shown = [s.what for s in report.gradient_flow.sequences]
    for call, gradient in zip(calls, tape.gradient(loss, read), strict=True):
        truth = np.sqrt(np.sum(np.square(np.asarray(gradient, np.float64)), axis=(0, 2)))
        # A call that alone reads the model's input is shown once, under the input's name.
        what = f"∂L/∂{call}/x_t" if f"∂L/∂{call}/x_t" in shown else "∂L/∂x_t"
        assert what != "∂L/∂x_t" or kind != "mask_zero_bidirectional"
        np.testing.assert_allclose(_flow(report, what), truth, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("kind", ["own_cell_masked", "relu_stateful", "mask_zero"])
def test_the_influence_of_your_cell_a_carried_state_and_mask_zero_is_keras_own(tf, data,
                                                                              kind):
    """‖∂h_t/∂x_s‖ (``at``) on a cell of the user's with a tuple state behind a mask, a stateful
    relu layer from its carried state, and a layer behind Embedding(mask_zero=True): Keras'
    own RNN over the same cell (the same weights, every step returned, from the same initial
    state and mask), its Jacobian at t with respect to its input sequence."""
    import keras
    from keras import layers as L

    x, mask, y = data
    keras.utils.set_random_seed(13)
    at = 4
    if kind == "mask_zero":
        tokens = np.random.default_rng(5).integers(1, 9, (B, T))
        tokens[0, -2:] = 0
        tokens[1, :3] = 0
        x_in = keras.Input((T,), dtype="int32", name="x")
        embedding = L.Embedding(9, F, mask_zero=True)
        layer = L.GRU(4, return_sequences=True, name="rnn")
        model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(layer(embedding(x_in)))))
        feed, inputs, mask = tokens, embedding(tokens), tokens != 0
    else:
        x_in = keras.Input(batch_shape=(B, T, F), name="x")
        layer = (L.RNN(tuple_state_cell(), return_sequences=True, name="rnn")
                 if kind == "own_cell_masked" else
                 L.SimpleRNN(4, stateful=True, activation="relu", name="rnn"))
        h = layer(L.Masking()(x_in) if kind == "own_cell_masked" else x_in)
        model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(h) if len(h.shape) == 3
                                             else h))
        feed, inputs = x, tf.constant(x)
        mask = mask if kind == "own_cell_masked" else None
    model.compile(loss="mse")
    initial = None
    if kind == "relu_stateful":
        model.predict(x, verbose=0)  # carries a state into the next batch
        initial = [tf.constant(np.asarray(layer.states[0]))]
    report = gradscope.explain(model, x=feed, y=y, at=at)
    found = next(i for i in report.gradient_flow.influence if i.source == "rnn")
    twin = L.RNN(layer.cell, return_sequences=True)  # the same cell, the same weights
    units = int(layer.output.shape[-1])
    jacobian = rows_by_copies(tf, inputs, units, lambda copies: twin(
        copies, initial_state=None if initial is None else [copied(tf, initial[0], units)],
        mask=None if mask is None else copied(tf, mask, units))[:, at])  # (B, units, T, F)
    truth = np.median(np.sqrt(np.sum(jacobian ** 2, axis=(1, 3))), axis=0)
    np.testing.assert_allclose(found.influence, truth, rtol=1e-4, atol=1e-9)


def test_the_influence_of_each_direction_of_a_bidirectional_is_keras_own(tf, data):
    """‖∂h_t/∂x_s‖ of both directions of a masked Bidirectional LSTM: h_t is the direction's
    output after processing t steps (the backward one reads x_T first), s in input order;
    the truth is Keras' own RNN over each direction's cell, every step returned."""
    import keras
    from keras import layers as L

    x, mask, y = data
    keras.utils.set_random_seed(14)
    model, both = _masked_bidirectional(L.LSTM(3, return_sequences=True), "rnn")
    at = 2
    report = gradscope.explain(model, x=x, y=y, at=at)
    inputs = tf.constant(x)
    for name, sub in (("forward", both.forward_layer), ("backward", both.backward_layer)):
        found = next(i for i in report.gradient_flow.influence if i.source == f"rnn/{name}")
        twin = L.RNN(sub.cell, return_sequences=True, go_backwards=sub.go_backwards)
        jacobian = rows_by_copies(tf, inputs, 3, lambda copies, twin=twin: twin(
            copies, mask=copied(tf, mask, 3))[:, at])  # in processing order
        truth = np.median(np.sqrt(np.sum(jacobian ** 2, axis=(1, 3))), axis=0)
        np.testing.assert_allclose(found.influence, truth, rtol=1e-4, atol=1e-9, err_msg=name)


def _masked_model(kind: str) -> tuple[Any, Any]:
    """A masked Bidirectional LSTM returning its sequence, or a masked GRU run backwards
    returning its last step, each called "rnn"; and the recurrent layer."""
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(6)
    if kind == "bidirectional":
        return _masked_bidirectional(L.LSTM(3, return_sequences=True), "rnn")
    x_in = keras.Input((T, F), name="x")
    layer = L.GRU(4, go_backwards=True, name="rnn")
    model = keras.Model(x_in, L.Dense(2)(layer(L.Masking()(x_in))))
    model.compile(loss="mse")
    return model, layer


def _engine_run(model: Any, x: Any, y: Any, **options: Any) -> tuple[Any, Any]:
    """gradscope's engine of ``model`` and its pass on (x, y), every call's outputs watched."""
    from gradscope.keras.data import batch_targets
    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.explain import prepare

    job = prepare(model, x=x, y=y)
    engine = KerasEngine(job.source, job.outputs, job.plan)
    targets = batch_targets(job.plan, job.batch.targets,
                            engine.output_shapes(job.batch.inputs), 0)
    return engine, engine.run(job.batch.inputs, targets, watch_outputs=True, **options)


@pytest.mark.parametrize("kind", ["bidirectional", "backwards_last"])
def test_a_probed_pass_gives_the_squares_of_the_steppings_own_backward(tf, data, kind):
    """Diagnose's main pass: Keras' own backward, probed, and the call stepped forward only
    (:func:`~gradscope.keras.stepped.with_probed`), carried back from each example's last
    step by a backward by stretches; against the stepping's own backward from the gradient
    on the call's outputs, in the tape: ‖∂L/∂s_t‖², its carried part, and what arrives at
    the last step carried back, per example and step, behind a padding mask, both
    directions, a layer run backwards."""
    from gradscope.keras.probed_flow import processing_ran
    from gradscope.keras.stepped import (
        carried_back,
        last_totals,
        step_call,
        step_squares,
        with_probed,
    )

    x, _, y = data
    model, _ = _masked_model(kind)
    engine, result = _engine_run(model, x, y, probe_states=True, carry_back=False)
    call = next(c for c in result.calls if c.layer == "rnn")
    own = step_call(engine, call, result.output_gradients["rnn"], False)
    probed = result.state_totals["rnn"]
    forward = step_call(engine, call, None, False, at_last=last_totals(probed, call.mask))
    assert not isinstance(own, str) and not isinstance(forward, str)
    found = with_probed(forward, probed)
    for index in range(len(own.directions)):
        for mine, theirs in zip(step_squares(found, index), step_squares(own, index),
                                strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-12)
        back = carried_back(own, index)
        assert (back is None) == (kind == "backwards_last")
        if back is not None:
            # At the steps each example ran: past its last, a masked step keeps the state,
            # and the flow reads no step there (the tape's own pass carries v through them,
            # the stretches start at the last step that ran).
            ran = processing_ran(call.mask, T, own.directions[index].backwards)
            np.testing.assert_allclose(carried_back(found, index)[ran], back[ran],
                                       rtol=1e-4, atol=1e-12)


def _unmasked_model(kind: str) -> Any:
    """A Bidirectional LSTM returning its sequence, a GRU run backwards returning its last
    step, or a cell of the user's own whose output is not its state (2·h), each called
    "rnn", without a mask."""
    import keras
    from keras import layers as L

    class Doubled(L.Layer):
        state_size = output_size = 3

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], 3))
            self.recurrent = self.add_weight(shape=(3, 3))

        def call(self, x: Any, states: Any) -> Any:
            h = keras.ops.tanh(x @ self.kernel + states[0] @ self.recurrent)
            return 2.0 * h, [h]

    keras.utils.set_random_seed(8)
    x_in = keras.Input((T, F), name="x")
    if kind == "bidirectional":
        seen = L.GlobalAveragePooling1D()(
            L.Bidirectional(L.LSTM(3, return_sequences=True), name="rnn")(x_in))
    elif kind == "backwards_last":
        seen = L.GRU(4, go_backwards=True, name="rnn")(x_in)
    else:
        seen = L.GlobalAveragePooling1D()(L.RNN(Doubled(), return_sequences=True,
                                                name="rnn")(x_in))
    model = keras.Model(x_in, L.Dense(2)(seen))
    model.compile(loss="mse")
    return model


@pytest.mark.parametrize(("kind", "traced"), [("bidirectional", False), ("bidirectional", True),
                                             ("backwards_last", False), ("own_cell", True)])
def test_a_pass_probed_for_the_squares_alone_gives_the_steppings_own(tf, data, kind, traced,
                                                                     monkeypatch):
    """Diagnose's main pass without a mask probes for the squares alone
    (``probe_states=SQUARES``: an identity whose backward hands out two numbers per example
    and step in place of a probe of the whole state): ‖∂L/∂s_t‖² and its carried part per
    example and step equal the stepping's own backward from the gradient on the call's
    outputs, in the tape; each state's total after the last step equals a probed pass's
    (real gradients of real probes). Eager and traced, both directions, a layer run
    backwards, a cell whose output is not its state (each kind eager or traced, both for
    the Bidirectional)."""
    from gradscope.keras import engine as engine_module
    from gradscope.keras import stepped as stepped_module
    from gradscope.keras.state_probes import SQUARES
    from gradscope.keras.stepped import last_totals, step_call, step_squares, with_probed

    if traced:
        monkeypatch.setattr(engine_module, "TRACE_FROM_STEPS", 1)
    x, _, y = data
    x = np.where(x == 0, 0.5, x).astype(np.float32)  # no step a Masking layer would skip
    model = _unmasked_model(kind)
    engine, result = _engine_run(model, x, y, probe_states=SQUARES, carry_back=False)
    _, whole = _engine_run(model, x, y, probe_states=True, carry_back=False)
    call = next(c for c in result.calls if c.layer == "rnn")
    probed = result.state_totals["rnn"]
    assert all(p.squares is not None for p in probed)  # not the probes' fallback
    for mine, theirs in zip(last_totals(probed, None), last_totals(whole.state_totals["rnn"],
                                                                   None), strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
    own = step_call(engine, call, result.output_gradients["rnn"], False)
    forward = step_call(engine, call, None, False, at_last=last_totals(probed, None))
    assert not isinstance(own, str) and not isinstance(forward, str)
    found = with_probed(forward, probed)
    for index in range(len(own.directions)):
        truth = step_squares(own, index)
        # Every step before the last reached (a check that can fail; the own cell's state
        # after the last step reaches nothing: its output 2·h is not the state).
        assert truth is not None and np.all(truth[0][:, :-1] > 0)
        for mine, theirs in zip(step_squares(found, index), truth, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-12)
    # The stepping's backward by stretches (a long call, as a counterfactual's), which keeps
    # the two squares alone: the same (7 steps in stretches of 2, 2, 2 and 1).
    monkeypatch.setattr(stepped_module, "STRETCH_STEPS", 2)
    stretched = step_call(engine, call, result.output_gradients["rnn"], False, squares=True)
    assert not isinstance(stretched, str) and stretched.squares is not None
    for index in range(len(own.directions)):
        for mine, theirs in zip(step_squares(stretched, index), step_squares(own, index),
                                strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("kind", ["bidirectional", "backwards_last"])
def test_a_long_call_differentiated_by_stretches_gives_keras_own_gradients(tf, data, kind,
                                                                           monkeypatch):
    """A call longer than twice ``STRETCH_STEPS`` is differentiated a stretch at a time (here
    2 steps: 7 steps make stretches of 2, 2, 2 and 1), masked steps among them: ∂L/∂x_t of
    its input equals Keras' own tape's, and the total ∂L/∂h_t the whole tape's (the
    unrolled cell, :func:`_unrolled`)."""
    import keras

    import gradscope.keras.stepped as stepped_module

    x, mask, y = data
    model, layer = _masked_model(kind)
    monkeypatch.setattr(stepped_module, "STRETCH_STEPS", 2)
    engine, result = _engine_run(model, x, y)
    call = next(c for c in result.calls if c.layer == "rnn")
    stepped = stepped_module.step_call(engine, call, result.output_gradients["rnn"], False)
    assert not isinstance(stepped, str), stepped
    # Keras' own tape: ∂L/∂(the layer's input), the mask Masking gives it.
    masked = model.layers[1].output
    both = keras.Model(model.inputs, [model.outputs[0], masked])
    feed = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(feed)
        prediction, read = both({"x": feed})
        loss = model.compute_loss(x=x, y=y, y_pred=prediction)
    truth = np.asarray(tape.gradient(loss, read), np.float64)
    assert stepped.inputs is not None
    np.testing.assert_allclose(stepped.inputs, truth, rtol=1e-4,
                               atol=1e-6 * float(np.max(np.abs(truth))))
    if kind == "backwards_last":
        upstream = _upstream(tf, model, "rnn", x, y)
        totals = np.sqrt(np.sum(np.square(np.asarray(stepped.totals[0][0], np.float64)),
                                axis=(0, 2)))
        np.testing.assert_allclose(totals, _unrolled(tf, layer, x, mask, upstream),
                                   rtol=1e-4)


def test_a_subclass_of_rnn_with_its_own_loop_shows_every_state_of_your_cell(tf, data):
    """A subclass of RNN whose loop is its own, over a two-state cell of the user's, masked:
    stepped through the cell, it shows both states' totals, each equal to what the same
    cell in Keras' own RNN gives (its loop probed), and, as there, no flag."""
    import keras
    from keras import layers as L

    x, _, y = data
    flows = []
    for own_loop in (False, True):
        keras.utils.set_random_seed(10)
        x_in = keras.Input((T, F), name="x")
        kind = _own_loop_rnn_class() if own_loop else L.RNN
        layer = kind(tuple_state_cell(3, list), return_sequences=True, name="rnn")
        model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(
            layer(L.Masking()(x_in)))))
        model.compile(loss="mse")
        report = gradscope.explain(model, x=x, y=y, flow=True)
        flow = report.gradient_flow
        assert not flow.not_analysed and not flow.flags
        # Its initial-state gradient is not read, and the report says why.
        assert bool(report.initial_state_gradients) != own_loop
        assert any("a loop of its own" in w for w in report.warnings) == own_loop
        flows.append({s.what.split(" (")[0]: s.norms for s in flow.sequences
                      if s.kind == "state"})
    probed, stepped = flows
    assert set(stepped) == set(probed) == {"∂L/∂rnn/states[0]_t", "∂L/∂rnn/states[1]_t"}
    for what, norms in probed.items():
        np.testing.assert_allclose(stepped[what], norms, rtol=1e-5, atol=1e-12, err_msg=what)


def test_a_stepped_cell_whose_output_is_not_its_state_reads_the_state_as_the_next_step(
        tf, data):
    """A cell of the user's whose output is not its state (tanh of it): stepped, the total on
    that state is what step t+1 reads, and its label says so, as the probed loop's does; a
    cell whose output is its state has no such qualifier."""
    import keras
    from keras import layers as L

    class Squashed(_one_state_cell_base()):
        def call(self, inputs: Any, states: Any) -> Any:
            h = 0.5 * states[0] + inputs @ self.kernel + states[0] @ self.recurrent * 0.1
            return keras.ops.tanh(h), [h]

    x, _, y = data
    labels = {}
    for name, cell in (("squashed", Squashed(3)), ("own", L.SimpleRNNCell(3))):
        keras.utils.set_random_seed(12)
        x_in = keras.Input((T, F), name="x")
        layer = _own_loop_rnn_class()(cell, return_sequences=True, name="rnn")
        model = keras.Model(x_in, L.Dense(2)(L.GlobalAveragePooling1D()(layer(x_in))))
        model.compile(loss="mse")
        flow = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow
        labels[name] = [s.what for s in flow.sequences if s.kind == "state"]
    assert labels == {"squashed": ["∂L/∂rnn/h_t (as step t+1 reads it)"],
                      "own": ["∂L/∂rnn/h_t"]}
