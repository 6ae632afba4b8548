"""A zoo of ordinary Keras models, built in the tests (no checked-in binaries).

Each entry builds a model, may compile it, and says how the test computes the loss
independently of gradscope (``truth``: Keras loss objects applied to the model's own outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

T, F, B = 5, 3, 4  # steps, features, batch


@dataclass
class Entry:
    name: str
    build: Callable[[], Any]
    #: Per output: a Keras loss (object) and its weight, as the test computes the loss itself.
    truth: Callable[[Any], list[tuple[Any, float]]]
    #: What targets look like: "one_hot", "classes", "binary" or "real", per output.
    targets: list[str] = field(default_factory=lambda: ["one_hot"])
    #: Token-id inputs: input name → vocabulary.
    vocab: dict[str, int] = field(default_factory=dict)
    pad: int = 0  # padded steps at the end (value 0)
    options: dict[str, Any] = field(default_factory=dict)  # passed to prepare()


def _ce_logits(k: Any) -> list[tuple[Any, float]]:
    return [(k.losses.CategoricalCrossentropy(from_logits=True), 1.0)]


def _ce(k: Any) -> list[tuple[Any, float]]:
    return [(k.losses.CategoricalCrossentropy(), 1.0)]


def _mse(k: Any) -> list[tuple[Any, float]]:
    return [(k.losses.MeanSquaredError(), 1.0)]


def zoo() -> list[Entry]:
    import keras
    from keras import layers as L

    def seq(*stack: Any, shape: tuple[int, ...] = (T, F), dtype: str = "float32") -> Any:
        return keras.Sequential([keras.Input(shape, dtype=dtype), *stack])

    def functional(inputs: Any, outputs: Any) -> Any:
        return keras.Model(inputs, outputs)

    entries = [
        Entry("gru_dense", lambda: seq(L.GRU(4, return_sequences=True), L.Dense(3)), _ce_logits),
        Entry("lstm_time_distributed",
              lambda: seq(L.LSTM(4, return_sequences=True), L.TimeDistributed(L.Dense(3))),
              _ce_logits),
        Entry("simple_rnn_relu_regression",
              lambda: seq(L.SimpleRNN(4, activation="relu"), L.Dense(1)), _mse, ["real"]),
        Entry("gru_reset_before_softmax",
              lambda: seq(L.GRU(4, reset_after=False), L.Dense(3, activation="softmax")), _ce),
        Entry("gru_no_bias_sigmoid",
              lambda: seq(L.GRU(4, use_bias=False), L.Dense(2, activation="sigmoid")),
              lambda k: [(k.losses.BinaryCrossentropy(), 1.0)], ["binary"]),
        Entry("lstm_no_forget_bias",
              lambda: seq(L.LSTM(4, unit_forget_bias=False, return_sequences=True),
                          L.Dense(3)), _ce_logits),
        Entry("gru_dropouts",
              lambda: seq(L.GRU(4, dropout=0.2, recurrent_dropout=0.1, return_sequences=True),
                          L.Dropout(0.3), L.Dense(3)), _ce_logits),
        Entry("bidirectional_gru_concat",
              lambda: seq(L.Bidirectional(L.GRU(4, return_sequences=True)), L.Dense(3)),
              _ce_logits),
        Entry("bidirectional_lstm_sum",
              lambda: seq(L.Bidirectional(L.LSTM(3), merge_mode="sum"), L.Dense(3)),
              _ce_logits),
        Entry("embedding_gru_sparse_compiled", _compiled(
            lambda: seq(L.Embedding(30, 4), L.GRU(4), L.Dense(5), shape=(T,), dtype="int32"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
              lambda k: [(k.losses.SparseCategoricalCrossentropy(from_logits=True), 1.0)],
              ["classes"], vocab={"input": 30}),
        Entry("embedding_mask_zero_lstm",
              lambda: seq(L.Embedding(20, 4, mask_zero=True), L.LSTM(3, return_sequences=True),
                          L.Dense(3), shape=(T,), dtype="int32"),
              _ce_logits, vocab={"input": 20}, pad=2),
        Entry("masking_padded_gru",
              lambda: seq(L.Masking(0.0), L.GRU(4, return_sequences=True), L.Dense(3)),
              _ce_logits, pad=2),
        Entry("conv1d_gru",
              lambda: seq(L.Conv1D(4, 2, padding="causal"), L.GRU(3), L.Dense(3)), _ce_logits),
        Entry("layer_normalization",
              lambda: seq(L.GRU(4, return_sequences=True), L.LayerNormalization(), L.Dense(3)),
              _ce_logits),
        Entry("batch_normalization",
              lambda: seq(L.GRU(4, return_sequences=True), L.BatchNormalization(), L.Dense(3)),
              _ce_logits),
        Entry("attention", _attention, _ce_logits),
        Entry("multi_head_attention", _mha, _ce_logits),
        Entry("noise_and_spatial_dropout",
              lambda: seq(L.GaussianNoise(0.1), L.SpatialDropout1D(0.2), L.GRU(4),
                          L.Dense(3)), _ce_logits),
        Entry("flatten_reshape",
              lambda: seq(L.GRU(4, return_sequences=True), L.Flatten(), L.Dense(6),
                          L.Reshape((2, 3))), _mse, ["real"]),  # no activation rule: mse
        Entry("repeat_vector_seq2seq",
              lambda: seq(L.GRU(4), L.RepeatVector(T), L.GRU(3, return_sequences=True),
                          L.TimeDistributed(L.Dense(3))), _ce_logits),
        Entry("pooling",
              lambda: seq(L.GRU(4, return_sequences=True), L.MaxPooling1D(2),
                          L.AveragePooling1D(1), L.GlobalMaxPooling1D(), L.Dense(3)),
              _ce_logits),
        Entry("global_average_pooling",
              lambda: seq(L.LSTM(4, return_sequences=True), L.GlobalAveragePooling1D(),
                          L.Dense(3, activation="softmax")), _ce),
        Entry("parallel_concatenate", _parallel("concatenate"), _ce_logits),
        Entry("parallel_add", _parallel("add"), _ce_logits),
        Entry("parallel_multiply_average", _parallel("multiply_average"), _ce_logits),
        Entry("two_inputs", _two_inputs, _ce_logits),
        Entry("two_heads_compiled_weighted", _two_heads,
              lambda k: [(k.losses.CategoricalCrossentropy(from_logits=True), 1.0),
                         (k.losses.MeanSquaredError(), 0.5)], ["one_hot", "real"]),
        Entry("two_heads_inferred", _two_heads_plain,
              lambda k: [(k.losses.CategoricalCrossentropy(from_logits=True), 1.0),
                         (k.losses.CategoricalCrossentropy(from_logits=True), 1.0)],
              ["one_hot", "one_hot"]),
        Entry("return_state_two_outputs", _return_state,
              lambda k: [(k.losses.CategoricalCrossentropy(from_logits=True), 1.0),
                         (k.losses.MeanSquaredError(), 1.0)], ["one_hot", "real"]),
        Entry("encoder_decoder_gru", _encoder_decoder, _ce_logits),
        Entry("encoder_decoder_lstm_two_inputs", _encoder_decoder_lstm, _ce_logits),
        Entry("shared_gru", _shared, _ce_logits),
        Entry("dense_relu_stack",
              lambda: seq(L.GRU(4), L.Dense(5, activation="relu"), L.Dense(3, activation="tanh"),
                          L.Activation("softmax")), _ce),
        Entry("simple_rnn_subtract", _subtract, _mse, ["real"]),
    ]
    return entries


def _compiled(build: Callable[[], Any], **compile_args: Any) -> Callable[[], Any]:
    def built() -> Any:
        model = build()
        model.compile(optimizer="sgd", **compile_args)
        return model
    return built


def _attention() -> Any:
    import keras
    from keras import layers as L

    x = keras.Input((T, F))
    query = L.GRU(4, return_sequences=True, name="query_gru")(x)
    value = L.GRU(4, return_sequences=True, name="value_gru")(x)
    attended = L.Attention(use_scale=True)([query, value])
    return keras.Model(x, L.Dense(3)(attended))


def _mha() -> Any:
    import keras
    from keras import layers as L

    x = keras.Input((T, F))
    h = L.GRU(4, return_sequences=True)(x)
    attended = L.MultiHeadAttention(num_heads=2, key_dim=3)(h, h)
    return keras.Model(x, L.Dense(3)(L.GlobalAveragePooling1D()(attended)))


def _parallel(kind: str) -> Callable[[], Any]:
    def build() -> Any:
        import keras
        from keras import layers as L

        x = keras.Input((T, F))
        a = L.GRU(4, name="branch_a")(x)
        b = L.LSTM(4 if kind != "concatenate" else 3, name="branch_b")(x)
        if kind == "concatenate":
            merged = L.Concatenate()([a, b])
        elif kind == "add":
            merged = L.Add()([a, b])
        else:
            merged = L.Average()([L.Multiply()([a, b]), a])
        return keras.Model(x, L.Dense(3)(merged))
    return build


def _two_inputs() -> Any:
    import keras
    from keras import layers as L

    left, right = keras.Input((T, F), name="left"), keras.Input((T + 1, 2), name="right")
    merged = L.Concatenate()([L.GRU(4)(left), L.SimpleRNN(3)(right)])
    return keras.Model([left, right], L.Dense(3)(merged))


def _two_heads() -> Any:
    import keras
    from keras import layers as L

    x = keras.Input((T, F))
    h = L.GRU(4, return_sequences=True)(x)
    model = keras.Model(x, [L.Dense(3, name="classes")(h), L.Dense(2, name="values")(h)])
    model.compile(optimizer="sgd",
                  loss=[keras.losses.CategoricalCrossentropy(from_logits=True), "mse"],
                  loss_weights=[1.0, 0.5])
    return model


def _two_heads_plain() -> Any:
    import keras
    from keras import layers as L

    x = keras.Input((T, F))
    h = L.GRU(4, return_sequences=True)(x)
    return keras.Model(x, [L.Dense(3, name="head_a")(h), L.Dense(2, name="head_b")(h)])


def _return_state() -> Any:
    import keras
    from keras import layers as L

    x = keras.Input((T, F))
    last, state = L.GRU(4, return_state=True)(x)
    return keras.Model(x, [L.Dense(2, name="out")(last), state])


def _encoder_decoder() -> Any:
    import keras
    from keras import layers as L

    x = keras.Input((T, F))
    sequence, state = L.GRU(4, return_sequences=True, return_state=True, name="encoder")(x)
    decoded = L.GRU(4, return_sequences=True, name="decoder")(sequence, initial_state=state)
    return keras.Model(x, L.Dense(3, name="out")(decoded))


def _encoder_decoder_lstm() -> Any:
    import keras
    from keras import layers as L

    source, target = keras.Input((T, F), name="source"), keras.Input((T - 1, 2), name="target")
    _, h, c = L.LSTM(4, return_state=True, name="encoder")(source)
    decoded = L.LSTM(4, return_sequences=True, name="decoder")(target, initial_state=[h, c])
    return keras.Model([source, target], L.Dense(3, name="out")(decoded))


def _shared() -> Any:
    import keras
    from keras import layers as L

    a, b = keras.Input((T, F), name="a"), keras.Input((T, F), name="b")
    shared = L.GRU(4, name="shared")
    return keras.Model([a, b], L.Dense(3)(L.Add()([shared(a), shared(b)])))


def _subtract() -> Any:
    import keras
    from keras import layers as L

    x = keras.Input((T, F))
    forward = L.SimpleRNN(3)(x)
    backward = L.SimpleRNN(3, go_backwards=True)(x)
    return keras.Model(x, L.Dense(1)(L.Subtract()([forward, backward])))
