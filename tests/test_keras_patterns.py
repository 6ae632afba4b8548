"""Common Keras patterns that once crashed: a loss compiled as a function, dict outputs keyed
otherwise than their layers, wrappers around layers gradscope does not derive, attention called
by keyword. Each is read from a saved file as a user would, and its numbers are Keras' own
tape's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_keras_numbers, keras_tape_norms, run_gradscope

import gradscope

RTOL = 1e-5


def _build(name: str) -> Any:
    import keras
    from keras import layers

    keras.utils.set_random_seed(21)
    if name == "loss_function":
        model = keras.Sequential([keras.Input((6, 3)), layers.GRU(4),
                                  layers.Dense(1, activation="sigmoid")])
        model.compile(loss=keras.losses.binary_crossentropy)
    elif name == "dict_outputs":
        x = keras.Input((6, 3), name="x")
        h = layers.GRU(4, name="gru")(x)
        model = keras.Model(x, {"zeta": layers.Dense(2, name="d1")(h),
                                "alpha": layers.Dense(3, name="d2")(h)})
        model.compile(loss={"zeta": "mse", "alpha": "mae"}, loss_weights={"zeta": 2.0,
                                                                          "alpha": 1.0})
    elif name == "time_distributed_conv":
        model = keras.Sequential([keras.Input((4, 6, 6, 1)),
                                  layers.TimeDistributed(layers.Conv2D(2, 3)),
                                  layers.TimeDistributed(layers.Flatten()), layers.GRU(3),
                                  layers.Dense(2)])
        model.compile(loss="mse")
    elif name == "stacked_cells":
        model = keras.Sequential([keras.Input((6, 3)),
                                  layers.RNN(layers.StackedRNNCells([layers.GRUCell(4),
                                                                     layers.LSTMCell(3)])),
                                  layers.Dense(2)])
        model.compile(loss="mse")
    elif name == "attention_by_keyword":
        x = keras.Input((6, 4), name="x")
        attended = layers.MultiHeadAttention(2, 3, name="mha")(query=x, value=x)
        model = keras.Model(x, layers.Dense(2)(layers.GRU(4)(attended)))
        model.compile(loss="mse")
    else:
        raise KeyError(name)
    return model


PATTERNS = ["loss_function", "dict_outputs", "time_distributed_conv", "stacked_cells",
            "attention_by_keyword"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any, tf: Any) -> dict[str, tuple[Path, Any]]:
    folder = tmp_path_factory.mktemp("patterns")
    models = {}
    for name in PATTERNS:
        model = _build(name)
        path = folder / f"{name}.keras"
        model.save(path)
        models[name] = (path, model)
    return models


def _batch(model: Any, name: str) -> tuple[Any, Any]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, *model.inputs[0].shape[1:])).astype("float32")
    if name == "dict_outputs":
        return x, {"zeta": rng.standard_normal((3, 2)).astype("float32"),
                   "alpha": rng.standard_normal((3, 3)).astype("float32")}
    shape = (3, *model.outputs[0].shape[1:])
    y = rng.integers(0, 2, shape) if name == "loss_function" else rng.standard_normal(shape)
    return x, y.astype("float32")


@pytest.mark.parametrize("name", PATTERNS)
def test_the_pattern_gives_keras_own_numbers(saved, name, tf):
    _, model = saved[name]
    x, y = _batch(model, name)
    report = gradscope.explain(model, x=x, y=y)
    assert_keras_numbers(report, *keras_tape_norms(model, x, y))


@pytest.mark.parametrize("name", PATTERNS)
def test_the_saved_pattern_explains_checks_and_shapes_from_the_command_line(saved, name):
    path, _ = saved[name]
    for command in ("explain", "check", "shapes"):
        result = run_gradscope(command, str(path), "--json", "-q")
        assert result.returncode == 0, (command, result.stderr)
        assert "internal error" not in result.stderr
        json.loads(result.stdout)


def test_dict_outputs_are_named_by_their_keys_or_their_layers(saved, tf, tmp_path):
    _, model = saved["dict_outputs"]
    x, y = _batch(model, "dict_outputs")
    by_key = gradscope.explain(model, x=x, y=y)
    by_layer = gradscope.explain(model, x=x, y={"d1": y["zeta"], "d2": y["alpha"]})
    assert [o.name for o in by_key.model.outputs] == ["alpha", "zeta"]
    assert by_key.loss.value == by_layer.loss.value
    data = tmp_path / "batch.npz"
    np.savez(data, x=x, d1=y["zeta"], alpha=y["alpha"])
    from_file = gradscope.explain(saved["dict_outputs"][0], data=str(data))
    assert from_file.loss.value == pytest.approx(by_key.loss.value, rel=RTOL)
    weights = {o.output: o.weight for o in by_key.loss.outputs}
    assert weights == {"zeta": 2.0, "alpha": 1.0}


def test_a_loss_function_is_named_by_its_function(saved):
    report = gradscope.shapes(saved["loss_function"][0])
    assert "binary_crossentropy" in report.loss


def test_an_underived_wrapper_is_listed_with_every_weight_and_no_derivation(saved):
    path, model = saved["time_distributed_conv"]
    report = gradscope.explain(path)
    names = [g.name for g in report.gradients]
    assert len(names) == len(set(names)) == len(model.trainable_variables)
    wrapper = report.gradients[0]
    assert "no derivation for this layer type" in wrapper.meaning
    assert wrapper.stats is not None


def test_a_stack_of_cells_derives_each_cells_weights_from_the_cell_below(saved):
    """RNN(StackedRNNCells([GRUCell(4), LSTMCell(3)])) on 3 features: each cell's weights
    derived as the layer that computes what it computes, the LSTMCell reading the GRUCell's
    h (4), in the shapes Keras holds (explain checks every derived shape against them);
    found tried as a new user would: a TF1 MultiRNNCell written as a stack had none."""
    path, model = saved["stacked_cells"]
    report = gradscope.explain(path)
    derived = {g.name: (g.shape, g.formula) for g in report.gradients
               if g.name.startswith("rnn/")}
    assert derived == {
        "rnn/cells[0]/kernel": ([3, 12], "input 3 × 3·units 4"),
        "rnn/cells[0]/recurrent_kernel": ([4, 12], "units 4 × 3·units 4"),
        "rnn/cells[0]/bias": ([2, 12], "2 × 3·units 4"),
        "rnn/cells[1]/kernel": ([4, 12], "cells[0] h 4 × 4·units 3"),
        "rnn/cells[1]/recurrent_kernel": ([3, 12], "units 3 × 4·units 3"),
        "rnn/cells[1]/bias": ([12], "4·units 3")}
    assert [tuple(v.shape) for v in model.layers[0].weights] == [
        (3, 12), (4, 12), (2, 12), (4, 12), (3, 12), (12,)]
    # In a Bidirectional, a stack's weights keep Keras' scopes: listed as before, not derived
    # (derived, their names were not the algebra's: an internal error).
    import keras

    both = keras.Sequential([keras.Input((6, 3)), keras.layers.Bidirectional(keras.layers.RNN(
        [keras.layers.GRUCell(4), keras.layers.LSTMCell(3)])), keras.layers.Dense(2)])
    both.compile(loss="mse")
    x, y = _batch(both, "stacked_cells")
    listed = gradscope.explain(both, x=x, y=y).gradients
    assert len(listed) == len(both.trainable_variables)
    assert all("no derivation for this layer type" in g.meaning for g in listed
               if g.name.startswith("bidirectional/"))


@pytest.mark.parametrize("name", ["time_distributed_conv", "stacked_cells"])
def test_shapes_lists_every_weight_of_an_underived_layer(saved, name):
    """From the file without TensorFlow, and from the model object: every weight, with the
    shape Keras holds, in Keras' order."""
    from conftest import run_without_tensorflow

    path, model = saved[name]
    truth = [tuple(v.shape) for v in model.weights]
    for source in (path, model):
        report = gradscope.shapes(source)
        assert sorted(tuple(w.shape) for w in report.weights) == sorted(truth)
        assert report.weight_count == sum(int(np.prod(s)) for s in truth)
    underived = model.layers[0]
    stored = [w for w in gradscope.shapes(path).weights if w.layer == underived.name]
    assert [tuple(w.shape) for w in stored] == [tuple(v.shape) for v in underived.weights]
    result = run_without_tensorflow("shapes", str(path), "--json")
    assert result.returncode == 0, result.stderr


def _save_with_custom_cell(folder: Path, kind: str) -> Path:
    """A registered custom class nested where a layer walk does not look: a cell inside RNN,
    a cell inside StackedRNNCells, a regularizer."""
    import keras
    from keras import layers

    @keras.saving.register_keras_serializable(package="gradscope_tests")
    class HalfCell(layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = units
            self.state_size = units

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], self.units))

        def call(self, x: Any, states: Any) -> Any:
            h = keras.ops.tanh(x @ self.kernel + 0.5 * states[0])
            return h, [h]

        def get_config(self) -> dict[str, Any]:
            return {**super().get_config(), "units": self.units}

    @keras.saving.register_keras_serializable(package="gradscope_tests")
    class Tiny(keras.regularizers.Regularizer):
        def __call__(self, x: Any) -> Any:
            return 1e-3 * keras.ops.sum(x ** 2)

        def get_config(self) -> dict[str, Any]:
            return {}

    if kind == "cell":
        recurrent = layers.RNN(HalfCell(3), name="rnn")
    elif kind == "stacked":
        recurrent = layers.RNN(layers.StackedRNNCells([layers.GRUCell(3), HalfCell(3)]),
                               name="rnn")
    else:
        recurrent = layers.GRU(3, kernel_regularizer=Tiny(), name="rnn")
    model = keras.Sequential([keras.Input((4, 2)), recurrent, layers.Dense(1)])
    model.compile(loss="mse")
    path = folder / f"nested_{kind}.keras"
    model.save(path)
    return path


@pytest.mark.parametrize(("kind", "where"), [("cell", "as its cell"),
                                             ("stacked", "as its cell/cells/1"),
                                             ("regularizer", "as its kernel_regularizer")])
def test_a_nested_custom_class_is_named_before_tensorflow(kind, where, tmp_path, tf):
    from conftest import run_without_tensorflow

    path = _save_with_custom_cell(tmp_path, kind)
    for command in ("shapes", "explain", "check"):
        result = run_without_tensorflow(command, str(path))
        assert result.returncode == 2, (command, result.stderr)
        assert "layer 'rnn' holds a custom class 'gradscope_tests>" in result.stderr
        assert where in result.stderr and "--loss" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_the_loss_hint_is_given_only_when_the_saved_loss_is_what_fails(tmp_path, tf):
    """A compiled model whose loss is the user's own registered function: its file loads
    only without the loss, so --loss is the way out and is said. A file whose weights are
    damaged does not load at all: no loss would help, and none is suggested."""
    import zipfile

    import keras

    @keras.saving.register_keras_serializable(package="gradscope_tests")
    def my_loss(y_true: Any, y_pred: Any) -> Any:
        return keras.ops.mean(keras.ops.abs(y_true - y_pred))

    model = keras.Sequential([keras.Input((4, 2)), keras.layers.GRU(3), keras.layers.Dense(1)])
    model.compile(loss=my_loss)
    path = tmp_path / "own_loss.keras"
    model.save(path)
    result = run_gradscope("explain", str(path), "-q", process=True)  # its loss unregistered
    assert result.returncode == 2, result.stderr
    assert ("its saved loss cannot be rebuilt: add --import MODULE (the module that "
            "registers it), or pass --loss NAME") in result.stderr
    assert run_gradscope("explain", str(path), "--loss", "mae", "-q").returncode == 0
    damaged = tmp_path / "damaged.keras"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(damaged, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            target.writestr(item, b"not hdf5" if item.filename.endswith(".h5") else data)
    result = run_gradscope("explain", str(damaged), "-q", process=True)  # as above
    assert result.returncode == 2 and "--loss" not in result.stderr, result.stderr


def _mixed_bidirectional() -> Any:
    import keras
    from keras import layers

    return keras.Sequential([keras.Input((5, 3)),
                             layers.Bidirectional(layers.LSTM(4), backward_layer=layers.GRU(
                                 4, go_backwards=True)),
                             layers.Dense(2)])


def _stateful_stacked_cells() -> Any:
    import keras
    from keras import layers

    return keras.Sequential([keras.Input((5, 3), batch_size=2),
                             layers.RNN(layers.StackedRNNCells([layers.GRUCell(3),
                                                                layers.LSTMCell(2)]),
                                        stateful=True),
                             layers.Dense(2)])


def _mask_out_of_a_sub_model() -> Any:
    import keras
    from keras import layers

    tokens = keras.Input((5,), dtype="int32")
    embedded = keras.Model(tokens, layers.Embedding(8, 3, mask_zero=True)(tokens))
    outer = keras.Input((5,), dtype="int32")
    return keras.Model(outer, layers.Dense(2)(layers.GRU(4)(embedded(outer))))


@pytest.mark.parametrize("build", [_mixed_bidirectional, _stateful_stacked_cells,
                                   _mask_out_of_a_sub_model])
def test_models_the_generator_found_give_keras_numbers(build, tf):
    """Found by tests/test_keras_generated.py: directions with different numbers of states
    (LSTM forward, GRU backward) crashed; a stateful RNN(StackedRNNCells) kept its nested
    states moved between the two passes; a mask made inside a sub-model did not reach the
    GRU after it, because the injected initial state kept Keras from taking the mask the
    sequence carries. The witness refused the last two (internal error); now all are exact."""
    import keras

    keras.utils.set_random_seed(61)
    model = build()
    model.compile(loss="mse")
    rng = np.random.default_rng(9)
    if build is _mask_out_of_a_sub_model:
        x = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]], "int32")
    else:
        x = rng.standard_normal((2, 5, 3)).astype("float32")
        model(x)  # a stateful layer then carries a state that is not zero
    y = rng.standard_normal((2, 2)).astype("float32")
    report = gradscope.explain(model, x=x, y=y)
    assert_keras_numbers(report, *keras_tape_norms(model, x, y))


def test_a_loss_that_keras_makes_nan_is_shown_as_such_with_a_warning(tf):
    """Found by the generator: an average over a sequence whose every step is masked is NaN
    in Keras' own call; gradscope shows the same (no value, its NaN counts) and says why it
    may be, instead of failing or inventing a number."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(62)
    x = keras.Input((3, 2))
    pooled = layers.GlobalAveragePooling1D()(layers.Masking(0.0)(x))
    model = keras.Model(x, layers.Dense(1)(pooled))
    model.compile(loss="mse")
    batch = np.zeros((2, 3, 2), "float32")
    batch[0, 0] = 1.0  # the second example has every step masked
    targets = np.ones((2, 1), "float32")
    loss, _ = keras_tape_norms(model, batch, targets)
    assert not np.isfinite(loss)
    report = gradscope.explain(model, x=batch, y=targets)
    assert report.loss.value is None
    assert any(w.startswith("the loss is not finite (nan)") for w in report.warnings)
    assert any(g.stats is not None and g.stats.nonfinite for g in report.gradients)
    found = report.nonfinite  # where the NaN is born: the mean over example 1's 0 steps
    assert found is not None and found.examples == [1]
    assert found.layer is not None and found.layer.startswith("global_average_pooling1d")
    assert found.cause.startswith("a fully masked example: the mean over 0 steps")
    checked = gradscope.check(model, x=batch, y=targets)  # a problem found, not refused
    assert not checked.summary.passed and checked.nonfinite == found


def test_two_outputs_of_one_shared_sub_model_take_their_own_targets(tf):
    """Found by the long fuzz run: a sub-model called twice whose two calls are both outputs.
    Keras names both outputs after the sub-model; gradscope named both 'sub_0', so one target
    stood in for the other and the loss was wrong. Each call is now named, and its target is
    its own."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(5)
    inner = keras.Input((6,))
    sub = keras.Model(inner, layers.Dense(2, name="d")(inner), name="sub")
    a, b = keras.Input((6,), name="a"), keras.Input((6,), name="b")
    model = keras.Model([a, b], [sub(a), sub(b)])
    model.compile(loss=["mse", "mse"])
    rng = np.random.default_rng(5)
    x = [rng.standard_normal((4, 6)).astype("float32") for _ in range(2)]
    y = [rng.standard_normal((4, 2)).astype("float32") for _ in range(2)]
    report = gradscope.explain(model, x=x, y=y)
    assert_keras_numbers(report, *keras_tape_norms(model, x, y))
    names = [term.name for term in report.loss.terms]
    assert len(set(names)) == 2, names
