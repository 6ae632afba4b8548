"""The user's own Keras model, exactly: for every model of the zoo, gradscope's loss and every
weight gradient equal what Keras' own GradientTape gives on the same batch, computed here
independently (the model loaded again, called as a user calls it, the loss written out)."""

from __future__ import annotations

import numpy as np
import pytest
from keras_zoo import B, Entry, zoo

from gradscope.keras.explain import explain, prepare
from gradscope.keras.graph import read_graph
from gradscope.keras.loss import output_names

ZOO = {entry.name: entry for entry in zoo()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tf):
    import keras

    keras.utils.set_random_seed(1)
    folder = tmp_path_factory.mktemp("zoo")
    paths = {}
    for name, entry in ZOO.items():
        paths[name] = folder / f"{name}.keras"
        entry.build().save(paths[name])
    return folder, paths


def _batch(entry: Entry, model, path, folder):
    """Inputs and targets for the model, written to an .npz named after its inputs/outputs."""
    rng = np.random.default_rng(7)
    inputs = {}
    for tensor in model.inputs:
        name = tensor._keras_history[0].name
        shape = (B, *tensor.shape[1:])
        if name in entry.vocab or (entry.vocab and len(model.inputs) == 1):
            vocab = entry.vocab.get(name, next(iter(entry.vocab.values())))
            value = rng.integers(1, vocab, size=shape).astype("int32")
        else:
            value = rng.standard_normal(shape).astype("float32")
        if entry.pad:
            value[:, -entry.pad:] = 0
        inputs[name] = value
    predictions = model([*inputs.values()] if len(inputs) > 1 else next(iter(inputs.values())),
                        training=False)
    predictions = predictions if isinstance(predictions, list | tuple) else [predictions]
    targets = {}
    names = output_names(read_graph(path))
    for name, kind, prediction in zip(names, entry.targets, predictions, strict=True):
        shape = tuple(prediction.shape)
        if kind == "one_hot":
            targets[name] = np.eye(shape[-1], dtype="float32")[
                rng.integers(0, shape[-1], size=shape[:-1])]
        elif kind == "classes":
            targets[name] = rng.integers(0, shape[-1], size=shape[:-1]).astype("int32")
        elif kind == "binary":
            targets[name] = rng.integers(0, 2, size=shape).astype("float32")
        else:
            targets[name] = rng.standard_normal(shape).astype("float32")
    data = folder / f"{path.stem}.npz"
    np.savez(data, **inputs, **targets)
    return inputs, targets, data


def _keras_truth(entry: Entry, path, inputs, targets, tf):
    """Keras' own tape on a freshly loaded copy, the loss computed from the outputs here."""
    import keras

    model = keras.saving.load_model(path, compile=False, safe_mode=True)
    feed = [*inputs.values()]
    with tf.GradientTape() as tape:
        predictions = model(feed if len(feed) > 1 else feed[0], training=False)
        predictions = predictions if isinstance(predictions, list | tuple) else [predictions]
        loss = sum(weight * loss_object(target, prediction)
                   for (loss_object, weight), target, prediction
                   in zip(entry.truth(keras), targets.values(), predictions, strict=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    return float(loss), {v.path: tf.convert_to_tensor(g).numpy()
                         for v, g in zip(model.trainable_variables, gradients, strict=True)}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_gradients_equal_keras_own_tape(saved, name, tf):
    import keras

    from gradscope.keras.engine import KerasEngine

    folder, paths = saved
    entry, path = ZOO[name], paths[name]
    model = keras.saving.load_model(path, compile=False, safe_mode=True)
    inputs, targets, data = _batch(entry, model, path, folder)
    truth_loss, truth = _keras_truth(entry, path, inputs, targets, tf)

    job = prepare(str(path), data=str(data))
    engine = KerasEngine(str(path), job.outputs, job.plan)
    result = engine.run(job.batch.inputs, job.batch.targets)
    assert result.loss == pytest.approx(truth_loss, rel=1e-5)
    assert set(result.gradients) == set(truth)
    for variable_path, gradient in truth.items():
        ours = result.gradients[variable_path]
        assert ours is not None, variable_path
        np.testing.assert_allclose(ours, gradient, rtol=1e-5, atol=1e-7, err_msg=variable_path)

    report = explain(job)  # the algebra's shapes and the cell witnesses hold, or it raises
    assert report.loss.value == pytest.approx(truth_loss, rel=1e-5)
    assert {g.path for g in report.gradients if g.trainable} == set(truth)
    for entry_ in report.gradients:
        if entry_.trainable:
            assert entry_.stats is not None
            assert entry_.stats.l2 == pytest.approx(float(np.linalg.norm(truth[entry_.path])),
                                                    rel=1e-4, abs=1e-12)
    assert all(w.passed in (True, None) for w in report.witnesses)
    assert not report.warnings, report.warnings


@pytest.mark.parametrize("name", sorted(ZOO))
def test_check_passes(saved, name, tf):
    import keras

    from gradscope.keras.check import check

    folder, paths = saved
    entry, path = ZOO[name], paths[name]
    model = keras.saving.load_model(path, compile=False, safe_mode=True)
    _, _, data = _batch(entry, model, path, folder)
    report = check(prepare(str(path), data=str(data)))
    failures = [(t.name, [(w.witness, w.error, w.detail) for w in t.witnesses if not w.passed])
                for t in report.tensors if not t.passed]
    assert report.summary.passed, failures
    # Every weight, named as explain names it, with Keras' own path beside.
    checked = {t.path for t in report.tensors}
    assert {v.path for v in model.trainable_variables} <= checked


def test_a_weight_perturbed_after_the_tape_fails_check_and_is_named(saved, tf):
    """A check that cannot fail is a defect: move one element of one weight of the float64
    copy after the tape, and the finite differences must see a different model."""
    from gradscope.keras.check import check

    folder, paths = saved
    path = paths["encoder_decoder_gru"]
    target = "decoder/gru_cell/recurrent_kernel"

    def mutate(model):
        variable = next(v for v in model.trainable_variables if v.path == target)
        value = variable.numpy()
        value[0, 0] += 0.05
        variable.assign(value)

    report = check(prepare(str(path), batch_size=3), after_autodiff=mutate)
    assert not report.summary.passed
    assert "decoder/recurrent_kernel" in report.summary.failed_tensors  # explain's name
    assert {t.name: t.path for t in report.tensors}["decoder/recurrent_kernel"] == target
    untouched = check(prepare(str(path), batch_size=3))
    assert untouched.summary.passed


def test_check_cli_exits_0_and_names_every_tensor(saved):
    import json

    from conftest import run_gradscope

    _, paths = saved
    result = run_gradscope("check", str(paths["encoder_decoder_gru"]), "--batch-size", "2",
                           "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads(result.stdout)
    names = {t["name"] for t in document["tensors"]}
    assert {"encoder/h0", "decoder/h0", "decoder/kernel"} <= names
    paths = {t["name"]: t["path"] for t in document["tensors"]}
    assert paths["decoder/kernel"] == "decoder/gru_cell/kernel" and paths["decoder/h0"] is None
    assert document["summary"]["witnesses"] == ["finite_differences", "numpy_reference"]


def test_a_regression_model_gets_mse_and_a_real_loss(saved):
    import json

    from conftest import run_gradscope

    _, paths = saved
    result = run_gradscope("explain", str(paths["simple_rnn_relu_regression"]), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    loss = json.loads(result.stdout)["loss"]
    assert loss["source"] == "inferred" and loss["outputs"][0]["loss"] == "mean_squared_error"
    assert loss["outputs"][0]["rule"] == "linear output of one unit → mean squared error"
    assert loss["value"] > 0


@pytest.mark.parametrize("name", ["encoder_decoder_gru", "bidirectional_lstm_sum",
                                  "multi_head_attention", "embedding_mask_zero_lstm"])
def test_shapes_reads_the_file_without_tensorflow(saved, name):
    import json

    import keras
    from conftest import run_without_tensorflow

    from gradscope.report.models import json_schema

    _, paths = saved
    result = run_without_tensorflow("shapes", str(paths[name]), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads(result.stdout)
    import jsonschema

    jsonschema.validate(document, json_schema("shapes-keras"))
    model = keras.saving.load_model(paths[name], compile=False, safe_mode=True)
    derived = {(w["layer"], tuple(w["shape"])) for w in document["weights"]}
    for layer in model.layers:
        for variable in layer.weights:
            assert (layer.name, tuple(variable.shape)) in derived, variable.path
    assert document["underived"] == []


def test_explain_and_check_json_follow_their_schemas(saved):
    import json

    import jsonschema
    from conftest import run_gradscope

    from gradscope.report.models import json_schema

    _, paths = saved
    path = str(paths["two_inputs"])
    explained = run_gradscope("explain", path, "--json")
    assert explained.returncode == 0, explained.stderr[-2000:]
    jsonschema.validate(json.loads(explained.stdout), json_schema("explain-keras"))
    checked = run_gradscope("check", path, "--json", "--directions", "1")
    assert checked.returncode == 0, checked.stderr[-2000:]
    jsonschema.validate(json.loads(checked.stdout), json_schema("check-keras"))


def test_training_mode_is_seeded_and_differs_from_inference(saved):
    from gradscope.keras.explain import explain as explain_job

    _, paths = saved
    path = str(paths["gru_dropouts"])
    first = explain_job(prepare(path, batch_size=4, training=True))
    again = explain_job(prepare(path, batch_size=4, training=True))
    inference = explain_job(prepare(path, batch_size=4))
    assert first.model.mode == "training" and inference.model.mode == "inference"
    assert first.loss.value == again.loss.value
    assert [g.stats for g in first.gradients] == [g.stats for g in again.gradients]
    assert first.loss.value != inference.loss.value


def test_an_embeddings_rows_are_counted_as_indexed_and_as_not_0_against_the_tape(tf):
    """Behind Embedding(mask_zero), the padding token 0 is indexed and gets zeros: found
    tried as a new user would, "50 of 50 rows received a gradient" where the tape's row 0 is
    all 0."""
    import keras
    from conftest import render_text

    import gradscope

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,), dtype="int32"),
                              keras.layers.Embedding(12, 3, mask_zero=True, name="embed"),
                              keras.layers.LSTM(4), keras.layers.Dense(1)])
    model.compile(loss="mse")
    x = np.array([[3, 5, 7, 0, 0, 0], [1, 2, 4, 6, 0, 0]], "int32")
    y = np.ones((2, 1), "float32")
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x))
    slices = tape.gradient(loss, model.get_layer("embed").embeddings)
    dense = np.asarray(tf.convert_to_tensor(slices))
    indexed = int(np.unique(np.asarray(slices.indices)).size)
    nonzero = int(np.count_nonzero(np.any(dense != 0, axis=1)))
    assert (indexed, nonzero) == (8, 7)
    report = gradscope.explain(model, x=x, y=y)
    (entry,) = [g for g in report.gradients if g.sparse is not None]
    assert (entry.sparse.rows_with_gradient, entry.sparse.rows, entry.sparse.rows_nonzero) == (
        indexed, 12, nonzero)
    assert ("IndexedSlices: 8 of 12 rows indexed by the batch's token ids, 7 of them a "
            "gradient other than 0") in " ".join(render_text(report, 200).split())
