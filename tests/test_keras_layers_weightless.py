"""The weightless layers' explainers, on real saved Keras models.

Each model is built here, saved, and read back with :func:`read_graph`, as the engine reads a
user's file; every layer (and every keras.ops node) gets an explainer whose weights match the
layer's own variables and whose summary and gradient note carry the user's numbers. The numbers
are tied to Keras itself: each layer's output shape is asserted against the built model, and the
dropout scales and the gradients the notes describe are measured with TensorFlow.
"""

from __future__ import annotations

import re
from math import sqrt

import numpy as np
import pytest

from gradscope.keras.graph import LayerNode, ModelGraph, read_graph
from gradscope.keras.layers import LayerFacts, explainer_for
from gradscope.keras.layers.base import variable_key


def _sequence_model(keras):
    from keras import layers

    x = keras.Input((7, 4), name="x")
    masked = layers.GlobalAveragePooling1D(name="gap_masked")(
        layers.Masking(0.0, name="masking")(x))
    noisy = layers.Dropout(0.3, name="drop")(x)
    noisy = layers.SpatialDropout1D(0.2, name="sdrop")(noisy)
    noisy = layers.GaussianNoise(0.1, name="noise")(noisy)
    noisy = layers.GaussianDropout(0.25, name="gdrop")(noisy)
    noisy = layers.AlphaDropout(0.1, name="adrop")(noisy)
    moved = layers.Cropping1D((1, 2), name="crop")(noisy)
    moved = layers.ZeroPadding1D((2, 1), name="pad")(moved)
    moved = layers.UpSampling1D(3, name="up")(moved)
    pooled = layers.MaxPooling1D(2, name="maxp")(moved)
    overlapping = layers.MaxPooling1D(3, strides=1, name="maxp_overlap")(x)
    averaged = layers.AveragePooling1D(2, padding="same", name="avgp")(overlapping)
    vector = layers.GlobalMaxPooling1D(name="gmp")(pooled)
    mean = layers.GlobalAveragePooling1D(name="gap")(averaged)
    shaped = layers.RepeatVector(5, name="rep")(vector)
    shaped = layers.Flatten(name="flat")(shaped)
    shaped = layers.Reshape((10, 2), name="resh")(shaped)
    shaped = layers.Permute((2, 1), name="perm")(shaped)
    shaped = layers.Activation("tanh", name="act")(shaped)
    shaped = layers.Softmax(axis=1, name="soft")(shaped)
    act = layers.ReLU(max_value=6.0, negative_slope=0.1, threshold=0.5, name="relu")(x)
    act = layers.LeakyReLU(negative_slope=0.2, name="leaky")(act)
    act = layers.ELU(alpha=0.7, name="elu")(act)
    act = layers.PReLU(shared_axes=[1], name="prelu")(act)
    kept = layers.GlobalAveragePooling1D(keepdims=True, name="gap_keep")(x)
    channels_first = layers.MaxPooling1D(2, data_format="channels_first", name="maxp_cf")(x)
    return keras.Model(x, [masked, mean, shaped, act, kept, channels_first])


def _merge_model(keras):
    from keras import layers

    x, y, z = keras.Input((7, 4)), keras.Input((7, 3)), keras.Input((7, 4))
    row = keras.Input((1, 4))
    a = layers.Activation("linear", name="a")(x)
    b = layers.Activation("linear", name="b")(y)
    c = layers.Activation("linear", name="c")(z)
    w = layers.Activation("linear", name="w")(row)
    added = layers.Add(name="add")([a, c])
    outputs = [
        layers.Concatenate(name="cat")([a, b]),
        layers.Add(name="add_broadcast")([a, w]),
        layers.Subtract(name="sub")([a, c]),
        layers.Multiply(name="mul")([a, c]),
        layers.Average(name="avg")([a, c, added]),
        layers.Maximum(name="max")([a, c]),
        layers.Minimum(name="min")([a, c]),
        layers.Dot(axes=2, name="dot")([a, c]),
        layers.Dot(axes=(1, 1), normalize=True, name="cos")([a, c]),
    ]
    return keras.Model([x, y, z, row], outputs)


def _ops_model(keras):
    from keras import ops

    x = keras.Input((7, 4))
    ids = keras.Input((7,), dtype="int32")
    shifted = x + 1.0
    flipped = 2.0 - shifted
    product = flipped * x
    halved = product / 2.0
    mask = ops.not_equal(ids, 0)
    outputs = [
        ops.mean(halved, axis=1), ops.sum(x, axis=-1), ops.max(x, axis=1),
        ops.softmax(x, axis=-1), ops.concatenate([x, shifted], axis=-1),
        ops.reshape(x, (-1, 28)), ops.matmul(x, ops.transpose(x, (0, 2, 1))),
        ops.cast(mask, "float32"), ops.where(ops.expand_dims(mask, -1), x, 0.0),
        x[:, 0], ops.tanh(x), keras.activations.relu(x), ops.stack([x, x], axis=1),
        ops.clip(x, -1.0, 1.0),
    ]
    return keras.Model([x, ids], outputs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tf):
    import keras

    folder = tmp_path_factory.mktemp("weightless")
    result = {}
    for name, build in {"sequence": _sequence_model, "merges": _merge_model,
                        "ops": _ops_model}.items():
        model = build(keras)
        path = folder / f"{name}.keras"
        model.save(path)
        result[name] = (model, read_graph(path))
    sequential = keras.Sequential([keras.Input((7, 4)), keras.layers.Dropout(0.4, name="drop"),
                                   keras.layers.Flatten(name="flat")])
    sequential.save(folder / "sequential.keras")
    result["sequential"] = (sequential, read_graph(folder / "sequential.keras"))
    return result


def facts_of(graph: ModelGraph, layer: LayerNode) -> LayerFacts:
    refs = layer.calls[0].refs() if layer.calls else []
    built = tuple(layer.input_shape) if layer.input_shape else ()
    # A Sequential's refs after the first carry no shape: build_config's input_shape has it.
    shapes = tuple(ref.shape if ref.shape is not None else built for ref in refs)
    labels = tuple("input" if graph.layer(ref.layer).is_input else f"{ref.layer} output"
                   for ref in refs)
    return LayerFacts(name=layer.name, class_name=layer.class_name, config=layer.config,
                      input_shapes=shapes, input_labels=labels)


def _operations(model) -> dict:
    operations = getattr(model, "operations", None) or model.layers  # a Sequential: layers
    return {operation.name: operation for operation in operations}


#: The numbers each summary must state, and (after "|") those of the gradient note.
LAYER_NUMBERS = {
    "masking": (["mask_value=0.0", "4 features"], ["== 0.0", "zero gradient"]),
    "gap_masked": (["unmasked steps of the 7"], ["number of unmasked steps"]),
    "drop": (["rate 0.3", "1/(1−0.3) = 1.4286"], ["1.4286"]),
    "sdrop": (["rate 0.2", "4 feature channels", "all 7 steps"], ["1.25"]),
    "noise": (["stddev 0.1", "N(0, 0.1²)"], ["unchanged, in training too"]),
    "gdrop": (["rate 0.25", f"{sqrt(0.25 / 0.75):.5g}"], [f"{sqrt(0.25 / 0.75):.5g}"]),
    "adrop": (["rate 0.1"], ["a = "]),
    "crop": (["(1, 2) on 7 steps", "keeping 4"], ["1 first and 2 last"]),
    "pad": (["(2, 1)", "the 4 steps → 7 steps"], ["2 + 1 padded"]),
    "up": (["size 3", "the 7 steps repeated 3 times", "→ 21 steps"], ["its 3"]),
    "maxp": (["pool_size 2, strides 2", "21 → 10 steps"], ["of its 2", "last 1 step(s)"]),
    "maxp_overlap": (["pool_size 3, strides 1", "7 → 5 steps"], ["stride 1 < pool 3"]),
    "avgp": (["pool_size 2, strides 2, padding 'same'", "5 → 3 steps"],
             ["divided by 2", "'same'"]),
    "gmp": (["the 10 steps", "4 features", "(batch, 4)"], ["(of 10)", "shared evenly"]),
    "gap": (["the mean over the 3 steps"], ["∂L/∂y / 3"]),
    "gap_keep": (["(batch, 7, 4) → (batch, 1, 4)", "over the 7 steps"], ["∂L/∂y / 7"]),
    "maxp_cf": (["4 → 2 steps"], ["of its 2"]),
    "rep": (["n=5", "(batch, 4) → (batch, 5, 4)"], ["its 5 copies"]),
    "flat": (["(batch, 5, 4) → (batch, 20)"], ["(batch, 5, 4)"]),
    "resh": (["(batch, 20) → (batch, 10, 2)"], ["(batch, 20)"]),
    "perm": (["dims (2, 1)", "(batch, 10, 2) → (batch, 2, 10)"], ["(2, 1)"]),
    "act": (["tanh", "(batch, 2, 10)"], ["1−tanh²"]),
    "soft": (["axis 1", "2 values"], ["axis 1"]),
    "relu": (["x > 0.5", "0.1·(x − 0.5)", "max_value 6.0"], ["0.5 < x < 6.0", "0.1"]),
    "leaky": (["negative_slope 0.2"], ["by 0.2"]),
    "elu": (["alpha 0.7"], ["0.7·exp(x)"]),
    "prelu": (["shape (1, 4)", "axis 1"], ["α"]),
    "cat": (["axis -1: 4 + 3 = 7"], ["0–3 to a output (4)", "4–6 to b output (3)"]),
    "add": (["a output (batch, 7, 4)", "c output (batch, 7, 4)"], ["2 inputs"]),
    "add_broadcast": (["w output (batch, 1, 4)"], ["w output is broadcast along axis 1"]),
    "sub": (["a output − c output"], ["c output receives −∂L/∂y"]),
    "mul": (["product"], ["product of the other inputs"]),
    "avg": (["divided by 3"], ["∂L/∂y / 3"]),
    "max": (["maximum"], ["earliest"]),
    "min": (["minimum"], ["earliest"]),
    "dot": (["axis 2", "(4 terms)"], ["Bᵀ"]),
    "cos": (["axis 1", "(7 terms)", "L2 norm"], ["normalize=True"]),
}

#: Output shapes the summaries above rely on, as Keras builds them.
KERAS_SHAPES = {
    "crop": (None, 4, 4), "pad": (None, 7, 4), "up": (None, 21, 4), "maxp": (None, 10, 4),
    "maxp_overlap": (None, 5, 4), "avgp": (None, 3, 4), "gmp": (None, 4), "rep": (None, 5, 4),
    "flat": (None, 20), "resh": (None, 10, 2), "perm": (None, 2, 10), "cat": (None, 7, 7),
    "dot": (None, 7, 7), "cos": (None, 4, 4), "add_broadcast": (None, 7, 4),
    "gap_keep": (None, 1, 4), "maxp_cf": (None, 7, 2),
}

#: keras.ops nodes, by class name (Keras names the nodes itself).
OP_NUMBERS = {
    "Add": (["keras.ops.add", "one of a, b being input (batch, 7, 4)"], ["constant"]),
    "Subtract": (["keras.ops.subtract", "a − b, one of a, b being add output", "a constant"],
                 ["a receives ∂L/∂y, b receives −∂L/∂y", "the constant operand receives none"]),
    "Multiply": (["keras.ops.multiply", "subtract output (batch, 7, 4) · input"],
                 ["subtract output receives ∂L/∂y · input", "summed over the broadcast axes"]),
    "TrueDivide": (["keras.ops.true_divide"], ["b receives −∂L/∂y · a / b²"]),
    "Mean": (["mean over axis 1"], ["∂L/∂y / 7"]),
    "Sum": (["sum over axis -1"], ["each of the 4 summed"]),
    "Max": (["maximum over axis 1"], ["other 6 elements"]),
    "Softmax": (["keras.ops.softmax", "axis -1"], ["diag(y) − y yᵀ"]),
    "Concatenate": (["keras.ops.concatenate", "along axis -1"],
                    ["0–3 to input (4)", "4–7 to add output (4)"]),
    "Reshape": (["reshaped to [-1, 28]"], ["reshaped back"]),
    "Transpose": (["[0, 2, 1]"], ["inverse permutation"]),
    "Matmul": (["keras.ops.matmul"], ["input receives ∂L/∂y · (transpose output)ᵀ"]),
    "NotEqual": (["keras.ops.not_equal", "one of a, b being input (batch, 7)"], ["boolean"]),
    "Cast": (["float32"], ["passes unchanged from a float input (cast to float32)"]),
    "ExpandDims": (["new axis of size 1 at -1"], ["squeezed out"]),
    "Where": (["where(condition, a, b)"], ["the condition receives none"]),
    "GetItem": (["x[…]"], ["the others zero"]),
    "Tanh": (["tanh(x)"], ["1−tanh²"]),
    "ReLU": (["x > 0"], ["zeroed where x < 0"]),
    "Stack": (["new axis 1"], ["its slice along axis 1"]),
    "Clip": (["[-1.0, 1.0]"], ["-1.0 ≤ x ≤ 1.0"]),
}


def _explained(graph: ModelGraph, layer: LayerNode):
    explainer = explainer_for(layer.class_name, layer.module)
    assert explainer is not None, f"no explainer for {layer.class_name} ({layer.module})"
    facts = facts_of(graph, layer)
    return explainer, facts


@pytest.mark.parametrize("model_name", ["sequence", "merges", "ops", "sequential"])
def test_every_layer_is_explained_with_its_own_weights(saved, model_name):
    model, graph = saved[model_name]
    operations = _operations(model)
    for layer in graph.computing_layers:
        explainer, facts = _explained(graph, layer)
        summary, note = explainer.summary(facts), explainer.gradient_note(facts)
        assert summary.strip() and note.strip(), layer.name
        notes = {weight.key: weight.shape for weight in explainer.weights(facts)}
        variables = {variable_key(v.path, layer.name): tuple(v.shape)
                     for v in getattr(operations[layer.name], "weights", [])}
        assert notes == variables, layer.name
        if layer.class_name == "PReLU":
            assert notes == {"alpha": (1, 4)}


@pytest.mark.parametrize("model_name", ["sequence", "merges"])
def test_summaries_and_notes_state_the_users_numbers(saved, model_name):
    model, graph = saved[model_name]
    operations = _operations(model)
    checked = 0
    for layer in graph.computing_layers:
        if layer.name not in LAYER_NUMBERS:
            continue
        explainer, facts = _explained(graph, layer)
        in_summary, in_note = LAYER_NUMBERS[layer.name]
        # Keras numbers unnamed ops per process (add, add_1, …): compare without the number.
        summary, note = (re.sub(r"(?<=[a-z])_\d+\b", "", text)
                         for text in (explainer.summary(facts), explainer.gradient_note(facts)))
        for text in in_summary:
            assert text in summary, (layer.name, text, summary)
        for text in in_note:
            assert text in note, (layer.name, text, note)
        if layer.name in KERAS_SHAPES:
            assert tuple(operations[layer.name].output.shape) == KERAS_SHAPES[layer.name]
        checked += 1
    wanted = {name for name in LAYER_NUMBERS if name in operations}
    assert checked == len(wanted) > 0


def test_keras_ops_nodes_state_their_numbers(saved):
    _, graph = saved["ops"]
    seen = set()
    for layer in graph.computing_layers:
        explainer, facts = _explained(graph, layer)
        if layer.class_name == "ReLU":
            assert layer.module == "keras.src.activations.activations"
        else:
            assert (layer.module or "").startswith("keras.src.ops.")
        in_summary, in_note = OP_NUMBERS[layer.class_name]
        # Keras numbers unnamed ops per process (add, add_1, …): compare without the number.
        summary, note = (re.sub(r"(?<=[a-z])_\d+\b", "", text)
                         for text in (explainer.summary(facts), explainer.gradient_note(facts)))
        for text in in_summary:
            assert text in summary, (layer.class_name, text, summary)
        for text in in_note:
            assert text in note, (layer.class_name, text, note)
        seen.add(layer.class_name)
    assert seen == set(OP_NUMBERS)


def test_an_op_and_a_layer_of_one_class_name_get_their_own_explainers():
    layer, op = explainer_for("Add", "keras.layers"), explainer_for("Add", "keras.src.ops.numpy")
    assert layer is not None and op is not None and layer is not op
    assert explainer_for("Add") is layer


def test_sequential_shapes_come_from_build_config(saved):
    _, graph = saved["sequential"]
    flat = graph.layer("flat")
    explainer, facts = _explained(graph, flat)
    assert facts.input_shape == (None, 7, 4)
    assert "(batch, 7, 4) → (batch, 28)" in explainer.summary(facts)


# -- the numbers measured with TensorFlow ---------------------------------------------------------


def _gradient(tf, layer, x, weights=None, **call):
    x = tf.Variable(x)
    with tf.GradientTape() as tape:
        y = layer(x, **call)
        loss = tf.reduce_sum(y * weights) if weights is not None else tf.reduce_sum(y)
    return y.numpy(), tape.gradient(loss, x).numpy()


def test_dropout_scales_are_those_stated(tf):
    from keras import layers

    from gradscope.keras.layers.dropout import AlphaDropoutExplainer

    ones = np.ones((64, 7, 4), np.float32)
    kept = layers.Dropout(0.3, seed=1)(ones, training=True).numpy()
    assert np.allclose(np.unique(kept), [0.0, 1 / 0.7])
    channels = layers.SpatialDropout1D(0.2, seed=1)(ones, training=True).numpy()
    assert np.all(channels.min(axis=1) == channels.max(axis=1))  # one draw for all 7 steps
    alpha_p, a, b = AlphaDropoutExplainer.affine(0.1)
    out = layers.AlphaDropout(0.1, seed=1)(2 * ones, training=True).numpy()
    assert np.allclose(np.unique(out), sorted([a * alpha_p + b, a * 2 + b]), atol=1e-6)


def test_masking_gives_masked_steps_zero_gradient(tf):
    from keras import layers

    x = np.random.default_rng(0).normal(size=(1, 7, 4)).astype(np.float32)
    x[0, 2] = 0.0
    weights = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
    _, grad = _gradient(tf, layers.Masking(0.0), x, weights)
    assert np.all(grad[0, 2] == 0)
    assert np.allclose(np.delete(grad, 2, axis=1), np.delete(weights, 2, axis=1))


def test_global_average_with_a_mask_averages_the_unmasked_steps(tf):
    from keras import layers

    x = np.ones((1, 7, 4), np.float32)
    mask = np.array([[True, True, False, True, False, True, True]])
    _, grad = _gradient(tf, layers.GlobalAveragePooling1D(), x, mask=mask)
    assert np.allclose(grad[0, mask[0]], 1 / 5) and np.all(grad[0, ~mask[0]] == 0)
    _, plain = _gradient(tf, layers.GlobalAveragePooling1D(), x)
    assert np.allclose(plain, 1 / 7)


def test_copies_sum_and_leftovers_get_nothing(tf):
    from keras import layers

    vector = np.ones((1, 4), np.float32)
    assert np.allclose(_gradient(tf, layers.RepeatVector(5), vector)[1], 5)
    steps = np.ones((1, 7, 4), np.float32)
    assert np.allclose(_gradient(tf, layers.UpSampling1D(3), steps)[1], 3)
    _, crop = _gradient(tf, layers.Cropping1D((1, 2)), steps)
    assert np.all(crop[0, [0, 5, 6]] == 0) and np.all(crop[0, 1:5] == 1)
    ramp = np.arange(21, dtype=np.float32).reshape(1, 21, 1)
    _, pooled = _gradient(tf, layers.MaxPooling1D(2), ramp)
    assert pooled[0, -1, 0] == 0 and pooled.sum() == 10  # 10 windows, step 20 in none


def test_ties_go_where_the_notes_say(tf):
    from keras import layers

    tied = np.array([[[1.0], [3.0], [3.0], [0.0]]], np.float32)
    _, window = _gradient(tf, layers.MaxPooling1D(4), tied)
    assert window.ravel().tolist() == [0, 1, 0, 0]  # the first of the tied steps
    _, whole = _gradient(tf, layers.GlobalMaxPooling1D(), tied)
    assert whole.ravel().tolist() == [0, 0.5, 0.5, 0]  # shared evenly
    a, b = tf.Variable([[1.0, 2.0]]), tf.Variable([[1.0, 1.0]])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(layers.Maximum()([a, b]))
    grad_a, grad_b = tape.gradient(y, [a, b])
    assert grad_a.numpy().tolist() == [[1, 1]] and grad_b.numpy().tolist() == [[0, 0]]
