"""The weighted layer explainers against real Keras 3 layers: every variable a layer holds has
one note with its key and shape, and the summary and gradient note speak the user's numbers."""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from typing import Any

import pytest

from gradscope.keras.layers import LayerFacts, explainer_for, known_layers
from gradscope.keras.layers.base import variable_key
from gradscope.keras.layers.conv1d import Geometry

#: A case builds a layer inside a small functional model: (layer, its call's inputs, labels).
Build = Callable[[Any], tuple[Any, list[Any], tuple[str, ...]]]


def model_with(keras: Any, layer: Any, inputs: list[Any], **call: Any) -> None:
    """Call the layer on Keras inputs inside a real functional model."""
    if type(layer).__name__ in ("MultiHeadAttention",):
        out = layer(*inputs[:2], **({"key": inputs[2]} if len(inputs) > 2 else {}), **call)
    elif type(layer).__name__ == "Attention":
        out = layer(inputs, **call)
    else:
        out = layer(inputs[0], **call)
    unique = list({id(t): t for t in inputs}.values())
    keras.Model(unique, out)


def single(make: Callable[[Any], Any], shape: tuple[int | None, ...] = (6, 5),
           dtype: str = "float32") -> Build:
    def build(keras: Any) -> tuple[Any, list[Any], tuple[str, ...]]:
        source = keras.Input(shape, dtype=dtype)
        layer = make(keras)
        model_with(keras, layer, [source])
        return layer, [source], ("input",)
    return build


def pair(make: Callable[[Any], Any], shapes: list[tuple[int, ...]],
         self_attention: bool = False) -> Build:
    def build(keras: Any) -> tuple[Any, list[Any], tuple[str, ...]]:
        if self_attention:
            source = keras.Input(shapes[0])
            inputs, labels = [source, source], ("input", "input")
        else:
            inputs = [keras.Input(shape) for shape in shapes]
            labels = ("query input", "value input", "key input")[: len(inputs)]
        layer = make(keras)
        model_with(keras, layer, inputs)
        return layer, inputs, labels
    return build


CASES: dict[str, tuple[Build, tuple[int, ...]]] = {
    # Bidirectional: GRU and LSTM, every merge mode, a custom backward layer, an RNN cell.
    "bidirectional_gru_concat": (single(lambda k: k.layers.Bidirectional(
        k.layers.GRU(7, return_sequences=True))), (7, 14)),
    "bidirectional_lstm_sum": (single(lambda k: k.layers.Bidirectional(
        k.layers.LSTM(7), merge_mode="sum")), (7,)),
    "bidirectional_lstm_own_backward": (single(lambda k: k.layers.Bidirectional(
        k.layers.LSTM(7, return_sequences=True),
        backward_layer=k.layers.LSTM(4, go_backwards=True, return_sequences=True))),
        (7, 4, 11)),
    "bidirectional_gru_mul_reset_before": (single(lambda k: k.layers.Bidirectional(
        k.layers.GRU(7, reset_after=False), merge_mode="mul"), shape=(None, 5)), (7,)),
    "bidirectional_simple_rnn_ave": (single(lambda k: k.layers.Bidirectional(
        k.layers.SimpleRNN(7, use_bias=False), merge_mode="ave")), (7,)),
    "bidirectional_gru_none": (single(lambda k: k.layers.Bidirectional(
        k.layers.GRU(7, return_sequences=True), merge_mode=None)), (7,)),
    "bidirectional_rnn_gru_cell": (single(lambda k: k.layers.Bidirectional(
        k.layers.RNN(k.layers.GRUCell(7)))), (7, 14)),
    # Embedding.
    "embedding_mask_zero": (single(lambda k: k.layers.Embedding(50, 7, mask_zero=True),
                                   shape=(6,), dtype="int32"), (50, 7)),
    "embedding_plain": (single(lambda k: k.layers.Embedding(50, 7), shape=(None,),
                               dtype="int32"), (50, 7)),
    "embedding_lora": (single(lambda k: k.layers.Embedding(50, 7, lora_rank=2), shape=(6,),
                              dtype="int32"), (50, 7)),
    # Conv1D.
    "conv1d_groups_dilation_causal": (single(lambda k: k.layers.Conv1D(
        8, 3, groups=2, dilation_rate=2, padding="causal"), shape=(9, 6)), (8, 3)),
    "conv1d_stride_same": (single(lambda k: k.layers.Conv1D(
        8, 3, strides=2, padding="same", activation="relu"), shape=(9, 6)), (3,)),
    "conv1d_stride_past_window": (single(lambda k: k.layers.Conv1D(
        8, 2, strides=3, use_bias=False), shape=(10, 6)), (3,)),
    "conv1d_channels_first": (single(lambda k: k.layers.Conv1D(
        4, 3, data_format="channels_first"), shape=(6, 9)), (3,)),
    "conv1d_lora_unknown_steps": (single(lambda k: k.layers.Conv1D(
        8, 3, lora_rank=2), shape=(None, 6)), (3,)),
    # Normalisation on 3-D inputs.
    "layer_normalization": (single(lambda k: k.layers.LayerNormalization()), (5,)),
    "layer_normalization_two_axes": (single(lambda k: k.layers.LayerNormalization(
        axis=[1, 2], center=False)), (30,)),
    "layer_normalization_no_scale": (single(lambda k: k.layers.LayerNormalization(
        scale=False, epsilon=1e-5)), (5,)),
    "batch_normalization": (single(lambda k: k.layers.BatchNormalization()), (5,)),
    "batch_normalization_renorm": (single(lambda k: k.layers.BatchNormalization(
        renorm=True, scale=False, momentum=0.9), shape=(None, 5)), (5,)),
    "batch_normalization_axis1": (single(lambda k: k.layers.BatchNormalization(
        axis=1)), (6,)),
    # Attention.
    "attention_plain": (pair(lambda k: k.layers.Attention(), [(6, 5)], True), (6,)),
    "attention_scale": (pair(lambda k: k.layers.Attention(use_scale=True),
                             [(6, 5), (4, 5)]), (6, 4)),
    "attention_concat_key": (pair(lambda k: k.layers.Attention(
        use_scale=True, score_mode="concat"), [(6, 5), (4, 5), (4, 5)]), (6, 4)),
    # MultiHeadAttention.
    "mha_self": (pair(lambda k: k.layers.MultiHeadAttention(3, 4), [(6, 5)], True), (3, 4)),
    "mha_value_dim_output_shape": (pair(lambda k: k.layers.MultiHeadAttention(
        2, 4, value_dim=3, output_shape=7), [(6, 5), (8, 9)]), (2, 4)),
    "mha_key_gate_no_bias": (pair(lambda k: k.layers.MultiHeadAttention(
        2, 4, use_bias=False, use_gate=True, dropout=0.1), [(6, 5), (8, 9), (8, 3)]), (2, 4)),
    "mha_output_shape_2d": (pair(lambda k: k.layers.MultiHeadAttention(
        2, 4, output_shape=(3, 2)), [(6, 5)], True), (2, 4)),
    # RNN around a cell.
    "rnn_gru_cell": (single(lambda k: k.layers.RNN(k.layers.GRUCell(7))), (7,)),
    "rnn_lstm_cell_sequences": (single(lambda k: k.layers.RNN(
        k.layers.LSTMCell(7), return_sequences=True)), (7,)),
    "rnn_named_simple_cell": (single(lambda k: k.layers.RNN(
        k.layers.SimpleRNNCell(7, name="mycell"))), (7,)),
}


@pytest.fixture(scope="module")
def keras(tf):
    import keras

    return keras


def facts_of(layer: Any, inputs: list[Any], labels: tuple[str, ...],
             config: dict[str, Any] | None = None) -> LayerFacts:
    """What the engine hands an explainer: the saved config, the input shapes, the labels."""
    return LayerFacts(name=layer.name, class_name=type(layer).__name__,
                      config=config if config is not None else layer.get_config(),
                      input_shapes=tuple(tuple(t.shape) for t in inputs),
                      input_labels=labels)


def says(text: str, number: int) -> bool:
    return re.search(rf"(?<![\d.]){number}(?![\d.])", text) is not None


def assert_notes_match_variables(layer: Any, facts: LayerFacts) -> None:
    explainer = explainer_for(facts.class_name)
    assert explainer is not None, f"no explainer for {facts.class_name}"
    notes = explainer.weights(facts)
    by_key = {note.key: note for note in notes}
    assert len(by_key) == len(notes), f"repeated keys: {[n.key for n in notes]}"
    variables = {variable_key(v.path, layer.name): v for v in layer.weights}
    assert len(variables) == len(layer.weights)
    assert set(by_key) == set(variables), (sorted(by_key), sorted(variables))
    for key, variable in variables.items():
        note = by_key[key]
        assert note.shape == tuple(variable.shape), (key, note.shape, variable.shape)
        assert note.formula and note.role and note.meaning
        # A non-trainable variable is said to get no gradient, and only such a one.
        assert ("no gradient" in note.meaning) == (not variable.trainable), (key, note.meaning)


@pytest.mark.parametrize("case", sorted(CASES))
def test_notes_match_the_layers_variables_and_speak_its_numbers(keras, case):
    build, numbers = CASES[case]
    layer, inputs, labels = build(keras)
    facts = facts_of(layer, inputs, labels)
    assert_notes_match_variables(layer, facts)
    explainer = explainer_for(facts.class_name)
    assert explainer is not None
    summary, gradient = explainer.summary(facts), explainer.gradient_note(facts)
    assert isinstance(summary, str) and isinstance(gradient, str)
    for number in numbers:
        assert says(summary, number), (number, summary)
        assert says(gradient, number), (number, gradient)


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if c.startswith("bidirectional")])
def test_bidirectional_states_in_keras_order(keras, case):
    layer, inputs, labels = CASES[case][0](keras)
    explainer = explainer_for("Bidirectional")
    assert explainer is not None
    states = explainer.states(facts_of(layer, inputs, labels))

    def sizes(cell: Any) -> list[int]:
        size = cell.state_size
        return list(size) if isinstance(size, list | tuple) else [size]

    forward = sizes(layer.forward_layer.cell)
    backward = sizes(layer.backward_layer.cell)
    assert [s.units for s in states] == forward + backward
    names = ["h0", "c0"][: len(forward)]
    assert [s.key for s in states] == [f"forward/{n}" for n in names] + [
        f"backward/{n}" for n in names]


def test_bidirectional_lstm_initial_state_takes_forward_then_backward(keras, tf):
    """Keras gives the first half of initial_state to the forward layer: a state fed there
    changes the forward half of the concatenated output only."""
    import numpy as np

    layer = keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True))
    x = np.zeros((1, 4, 2), dtype="float32")
    zeros = [np.zeros((1, 3), dtype="float32") for _ in range(4)]
    base = layer(x, initial_state=zeros).numpy()
    states = explainer_for("Bidirectional").states(  # type: ignore[union-attr]
        LayerFacts(name=layer.name, class_name="Bidirectional", config=layer.get_config(),
                   input_shapes=((None, 4, 2),)))
    for index, state in enumerate(states):
        fed = list(zeros)
        fed[index] = np.ones((1, 3), dtype="float32")
        changed = np.abs(layer(x, initial_state=fed).numpy() - base).max(axis=(0, 1)) > 0
        half = slice(0, 3) if state.key.startswith("forward/") else slice(3, 6)
        other = slice(3, 6) if half == slice(0, 3) else slice(0, 3)
        assert changed[half].any() and not changed[other].any(), state.key


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if c.startswith("conv1d")])
def test_conv1d_output_steps_equal_keras(keras, case):
    layer, inputs, labels = CASES[case][0](keras)
    geometry = Geometry(facts_of(layer, inputs, labels))
    shape = layer.compute_output_shape(tuple(inputs[0].shape))
    steps = shape[-1] if geometry.channels_first else shape[1]
    assert geometry.output_steps() == steps


def test_conv1d_uncovered_steps_get_no_gradient(keras, tf):
    """The count of input steps no window reads equals the zero columns of Keras' gradient."""
    import numpy as np

    for conv, length in [(keras.layers.Conv1D(2, 2, strides=3), 10),
                         (keras.layers.Conv1D(2, 3, strides=2, padding="same"), 9),
                         (keras.layers.Conv1D(2, 3, dilation_rate=2, padding="causal"), 9),
                         (keras.layers.Conv1D(2, 4), 9)]:
        x = tf.constant(np.random.default_rng(0).normal(size=(2, length, 3)), tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(conv(x) ** 2)
        grad = tape.gradient(y, x).numpy()
        zero_steps = int((np.abs(grad).sum(axis=(0, 2)) == 0).sum())
        facts = LayerFacts(name=conv.name, class_name="Conv1D", config=conv.get_config(),
                           input_shapes=((None, length, 3),))
        assert Geometry(facts).uncovered_steps() == zero_steps, conv.get_config()


def test_every_new_layer_is_registered():
    for name in ["Bidirectional", "Embedding", "Conv1D", "LayerNormalization",
                 "BatchNormalization", "Attention", "MultiHeadAttention", "RNN"]:
        assert name in known_layers()


def test_notes_match_after_a_save_and_load(keras, tmp_path):
    """The engine reads configs from the saved archive: the keys still match the variables of
    the reloaded model (the wrapped layers keep their names)."""
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 5),
        keras.layers.Conv1D(6, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.Bidirectional(
            keras.layers.LSTM(4, return_sequences=True),
            backward_layer=keras.layers.LSTM(3, go_backwards=True, return_sequences=True)),
        keras.layers.LayerNormalization(),
        keras.layers.RNN(keras.layers.GRUCell(4)),
    ])
    path = tmp_path / "chain.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        saved = json.loads(archive.read("config.json"))
    configs = {entry["config"]["name"]: entry for entry in saved["config"]["layers"]}
    loaded = keras.saving.load_model(path)
    shape: tuple[int | None, ...] = (None, 6)
    for layer in loaded.layers:
        entry = configs[layer.name]
        facts = LayerFacts(name=layer.name, class_name=entry["class_name"],
                           config=entry["config"], input_shapes=(shape,))
        assert_notes_match_variables(layer, facts)
        shape = tuple(layer.compute_output_shape(shape))


@pytest.mark.parametrize(("build", "says_formula", "extra"), [
    (lambda keras: keras.layers.SimpleRNN(4, activation="relu"),
     "h_t = relu(x_t·W + h_{t−1}·U + b)", None),
    (lambda keras: keras.layers.LSTM(4, activation="relu"),
     "h_t = o∘relu(c_t)", None),
    (lambda keras: keras.layers.GRU(4, activation="relu"),
     "h_t = z∘h_{t−1} + (1−z)∘ĥ", "activation='relu'")])
def test_a_recurrent_layers_formula_names_its_own_activation(keras, build, says_formula,
                                                               extra):
    """Found tried as a new user would: a relu SimpleRNN was written "h_t = tanh(…)", with
    "(activation='relu')" after it. The formula names the layer's activation where it shows
    one; where it shows none (a GRU's ĥ), the option is said after it, as before."""
    layer = build(keras)
    inputs = keras.Input((5, 3))
    layer(inputs)
    summary = explainer_for(type(layer).__name__).summary(facts_of(layer, [inputs],
                                                                   ("input",)))
    assert says_formula in summary and "tanh" not in summary.split(";")[0]
    assert (extra in summary) if extra else ("activation=" not in summary)


def test_a_recurrent_layers_summary_says_the_final_states_it_returns(keras):
    """Found tried as a new user would: an encoder LSTM with return_state=True read "returns
    the last h_T", its final states (its decoder's start) unsaid; use_bias=False unsaid."""
    inputs = keras.Input((5, 3))
    encoder = keras.layers.LSTM(4, return_state=True, use_bias=False)
    encoder(inputs)
    explainer = explainer_for("LSTM")
    facts = facts_of(encoder, [inputs], ("input",))
    summary = explainer.summary(facts)
    assert "returns the last h_T, then its final states h_T and c_T" in summary
    assert "use_bias=False" in summary
    assert "the final states returned (h_T and c_T) bring their own ∂L" in (
        explainer.gradient_note(facts))


def test_a_conv_lstm_summary_says_no_state_size_it_does_not_know(keras):
    """A ConvLSTM cell's state_size is -1: not "a state of -1 numbers"; what it returns and
    its order are said."""
    from gradscope.keras.explain import _plain_summary

    layer = keras.layers.ConvLSTM1D(2, 3, padding="same", go_backwards=True,
                                    return_sequences=True)
    layer(keras.Input((4, 6, 1)))
    said = _plain_summary("ConvLSTM1D", layer)
    assert "-1" not in said
    assert said.endswith("returns its output at every step, reading the steps last to first "
                         "(go_backwards)")


def test_a_conv_lstm_without_initial_state_gradients_says_so(keras):
    """Found tried as a new user would: a ConvLSTM's report had no initial-state gradients
    and no word why."""
    import numpy as np

    import gradscope

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4, 6, 1)),
                              keras.layers.ConvLSTM1D(2, 3, padding="same", name="conv"),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(loss="mse")
    x = np.random.default_rng(0).standard_normal((3, 4, 6, 1)).astype("float32")
    report = gradscope.explain(model, x=x, y=np.ones((3, 1), "float32"))
    assert not report.initial_state_gradients
    (said,) = [w for w in report.warnings if w.startswith("conv: its ∂L/∂(initial state)")]
    assert "ConvLSTMCell" in said and "feature maps" in said
