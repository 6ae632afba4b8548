"""--weights and `gradscope spec`: a user's trained weights, from a TF1 name-based checkpoint
(written with tf.compat.v1 variables under the seed's scopes), an .npz by gradscope names or
Keras paths, and a TF2 object-based checkpoint; each against an independent program."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, run_gradscope, run_without_tensorflow
from rich.cells import cell_len

import gradscope
from gradscope.errors import ConfigError
from gradscope.yaml.config import load_spec, spec_from_yaml

SEED_SCOPES = ("GRU_Layer1", "GRU_Layer2")
AGAINST = str(REPO / "tests" / "against" / "user_gru_bptt.py")


def seed_variables(rng: np.random.Generator, sizes=(200, 64, 32, 3)) -> dict[str, np.ndarray]:
    """The seed model's TF1 variables: GRUCell under GRU_Layer1/rnn, GRU_Layer2/rnn, and the
    seed's output_layer/fc_weights, fc_bias."""
    features, u1, u2, labels = sizes
    values = {}
    for scope, f, u in ((SEED_SCOPES[0], features, u1), (SEED_SCOPES[1], u1, u2)):
        cell = f"{scope}/rnn/gru_cell"
        values[f"{cell}/gates/kernel"] = rng.uniform(-0.3, 0.3, (f + u, 2 * u))
        values[f"{cell}/gates/bias"] = 1.0 + rng.uniform(-0.2, 0.2, 2 * u)
        values[f"{cell}/candidate/kernel"] = rng.uniform(-0.3, 0.3, (f + u, u))
        values[f"{cell}/candidate/bias"] = rng.uniform(-0.2, 0.2, u)
    values["output_layer/fc_weights"] = rng.uniform(-0.5, 0.5, (u2, labels))
    values["output_layer/fc_bias"] = rng.uniform(-0.2, 0.2, labels)
    return {name: value.astype(np.float32) for name, value in values.items()}


def write_tf1_checkpoint(tf, prefix, values: dict[str, np.ndarray]) -> str:
    """A TF1 name-based checkpoint from tf.compat.v1 variables (no Keras 2), with the optimizer
    state a trained model's checkpoint carries (global_step, an Adam slot)."""
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(value, name=name) for name, value in values.items()]
        variables.append(tf.compat.v1.train.get_or_create_global_step())
        first = next(iter(values))
        variables.append(tf.compat.v1.Variable(np.zeros_like(values[first]),
                                               name=f"{first}/Adam"))
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return saver.save(session, str(prefix))


def tf1_program(tf, values: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray):
    """The seed model written again, independently: TF1 GRUCell's math (rnn_cell_impl.py) in
    tf.scan, the variables by their TF1 names. Returns the loss and d loss / d variable."""
    variables = {name: tf.Variable(value) for name, value in values.items()}

    def gru_layer(scope, inputs):
        cell = f"{scope}/rnn/gru_cell"
        gate_kernel, gate_bias = variables[f"{cell}/gates/kernel"], variables[f"{cell}/gates/bias"]
        kernel, bias = variables[f"{cell}/candidate/kernel"], variables[f"{cell}/candidate/bias"]
        units = int(bias.shape[0])

        def step(state, inputs_t):
            value = tf.sigmoid(tf.matmul(tf.concat([inputs_t, state], 1), gate_kernel)
                               + gate_bias)
            r, u = tf.split(value=value, num_or_size_splits=2, axis=1)
            c = tf.tanh(tf.matmul(tf.concat([inputs_t, r * state], 1), kernel) + bias)
            return u * state + (1 - u) * c

        initial = tf.zeros([tf.shape(inputs)[1], units])
        return tf.scan(step, inputs, initializer=initial)

    with tf.GradientTape() as tape:
        hidden = gru_layer(SEED_SCOPES[1], gru_layer(SEED_SCOPES[0], tf.transpose(x, [1, 0, 2])))
        output2 = tf.reshape(tf.transpose(hidden, [1, 0, 2]), [-1, hidden.shape[-1]])
        logits = output2 @ variables["output_layer/fc_weights"] + variables["output_layer/fc_bias"]
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
            labels=tf.reshape(y, [-1, y.shape[-1]]), logits=logits))
    gradients = tape.gradient(loss, variables)
    return float(loss), {name: g.numpy() for name, g in gradients.items()}


def one_hot_batch(rng, batch, steps, features, labels):
    x = rng.standard_normal((batch, steps, features)).astype(np.float32)
    y = np.eye(labels, dtype=np.float32)[rng.integers(0, labels, (batch, steps))]
    return x, y


@pytest.fixture(scope="module")
def seed_files(tf, tmp_path_factory):
    """The seed model's checkpoint, a misshapen twin, and a small batch."""
    folder = tmp_path_factory.mktemp("seed_weights")
    rng = np.random.default_rng(7)
    values = seed_variables(rng)
    prefix = write_tf1_checkpoint(tf, folder / "good" / "model.ckpt", values)
    bad = dict(values)
    bad["GRU_Layer1/rnn/gru_cell/gates/kernel"] = np.zeros((265, 128), np.float32)
    bad_prefix = write_tf1_checkpoint(tf, folder / "bad" / "model.ckpt", bad)
    x, y = one_hot_batch(rng, 3, 8, 200, 3)
    data = folder / "batch.npz"
    np.savez(data, x=x, y=y)
    return {"values": values, "prefix": prefix, "bad": bad_prefix, "x": x, "y": y,
            "data": str(data), "folder": folder}


def test_spec_reads_the_seed_checkpoint_back(seed_files):
    result = run_gradscope("spec", seed_files["prefix"])
    assert result.returncode == 0, result.stderr
    spec = spec_from_yaml(result.stdout)  # gradscope loads what it printed
    assert spec.input_size == 200
    assert [(layer.type, layer.units) for layer in spec.layers] == [
        ("gru", 64), ("gru", 32), ("dense", 3)]
    assert spec.layout == "block"
    # The explanations on stderr wrap at the terminal's width (80 without one).
    lines = result.stderr.splitlines()
    assert lines and max(cell_len(line) for line in lines) <= 80
    said = " ".join(result.stderr.split())
    assert ("(264, 128) and (264, 64) under GRU_Layer1/rnn/gru_cell: a GRU with 64 units on "
            "200 inputs") in said
    comments = " ".join(line.split("# ", 1)[1] for line in result.stdout.splitlines()
                        if "# " in line)
    assert "time_steps: 100" in result.stdout and "--data sets it from x" in comments
    # The YAML too, its reasons on comment lines of their own (found tried as a new user
    # would: lines of 91–155 columns).
    assert max(cell_len(line) for line in result.stdout.splitlines()) <= 80
    assert "\n                               # 200 inputs (TF1 GRUCell, block layout)\n" \
        in result.stdout
    assert "global_step (optimizer or training state)" in said
    (seed_files["folder"] / "seed.yaml").write_text(result.stdout)


def test_explain_weights_reproduces_an_independent_tf1_program(tf, seed_files):
    config = seed_files["folder"] / "seed.yaml"
    if not config.exists():
        config.write_text(gradscope.infer_spec(seed_files["prefix"]).yaml)
    result = run_gradscope("explain", str(config), "--weights", seed_files["prefix"],
                           "--data", seed_files["data"], "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    loss, expected = tf1_program(tf, seed_files["values"], seed_files["x"], seed_files["y"])
    assert report["loss"]["value"] == pytest.approx(loss, rel=1e-5)
    variable_of = {item["name"]: item["variables"] for item in report["weights"]["mapping"]}
    assert variable_of["gru_1/w_ru"] == ["GRU_Layer1/rnn/gru_cell/gates/kernel"]
    assert variable_of["dense_1/kernel"] == ["output_layer/fc_weights"]
    assert report["weights"]["format"] == "TF1 name-based checkpoint"
    for entry in report["gradients"]:
        (variable,) = variable_of[entry["name"]]
        # Each gradient is shown under the checkpoint's own variable name.
        assert (entry["alias"], entry["alias_source"]) == (variable, "checkpoint")
        g = expected[variable]
        assert entry["shape"] == list(g.shape)
        for key, value in (("l2", np.linalg.norm(g)), ("max_abs", np.abs(g).max()),
                           ("mean_abs", np.abs(g).mean())):
            assert entry["stats"][key] == pytest.approx(float(value), rel=1e-5), (entry["name"],
                                                                                  key)


def test_every_gradient_element_matches_the_independent_program(tf, seed_files):
    """Element by element (the report carries statistics): the mapped weights in the engine
    that explain runs."""
    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.data import load_batch
    from gradscope.yaml.engine import Engine
    from gradscope.yaml.weights import load_weights

    spec = gradscope.infer_spec(seed_files["prefix"])
    spec, batch = load_batch(spec_from_yaml(spec.yaml), data=seed_files["data"])
    loaded = load_weights(spec, seed_files["prefix"])
    result = Engine(model_shapes(spec)).run(loaded.params, batch)
    _, expected = tf1_program(tf, seed_files["values"], seed_files["x"], seed_files["y"])
    for item in loaded.entry.mapping:
        g = expected[item.variables[0]]
        np.testing.assert_allclose(result.weight_gradients[item.name], g, rtol=1e-5,
                                   atol=1e-6 * np.abs(g).max(), err_msg=item.name)


def test_a_misshapen_checkpoint_variable_exits_2_with_the_formula(seed_files):
    result = run_gradscope("explain", "--weights", seed_files["bad"])
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gradscope: error: --weights {seed_files['bad']}: GRU_Layer1/rnn/gru_cell/gates/kernel "
        "is (265, 128) but (input 200 + units 64) gives 264 rows (gru_1/w_ru (264, 128))")


# -- .npz files: no TensorFlow before the run ---------------------------------------------------

SMALL = {"input_size": 5, "time_steps": 6, "batch_size": 4,
         "layers": [{"gru": 4}, {"gru": 3}, {"dense": 3}], "dtype": "float64"}


@pytest.fixture(scope="module")
def small_npz(tmp_path_factory):
    folder = tmp_path_factory.mktemp("npz_weights")
    values = seed_variables(np.random.default_rng(3), sizes=(5, 4, 3, 3))
    tf1 = folder / "tf1_names.npz"
    np.savez(tf1, **{f"{name}:0": value for name, value in values.items()})
    gradscope_names = {"gru_1/w_ru": "GRU_Layer1/rnn/gru_cell/gates/kernel",
                       "gru_1/b_ru": "GRU_Layer1/rnn/gru_cell/gates/bias",
                       "gru_1/w_c": "GRU_Layer1/rnn/gru_cell/candidate/kernel",
                       "gru_1/b_c": "GRU_Layer1/rnn/gru_cell/candidate/bias",
                       "gru_2/w_ru": "GRU_Layer2/rnn/gru_cell/gates/kernel",
                       "gru_2/b_ru": "GRU_Layer2/rnn/gru_cell/gates/bias",
                       "gru_2/w_c": "GRU_Layer2/rnn/gru_cell/candidate/kernel",
                       "gru_2/b_c": "GRU_Layer2/rnn/gru_cell/candidate/bias",
                       "dense_1/kernel": "output_layer/fc_weights",
                       "dense_1/bias": "output_layer/fc_bias"}
    by_gradscope = {ours: values[theirs] for ours, theirs in gradscope_names.items()}
    ours = folder / "gradscope_names.npz"
    np.savez(ours, **by_gradscope)
    misshapen = dict(by_gradscope)
    misshapen["gru_2/w_c"] = np.zeros((8, 3), np.float32)
    del misshapen["dense_1/bias"]
    bad = folder / "misshapen.npz"
    np.savez(bad, **misshapen)
    config = folder / "small.yaml"
    config.write_text(json.dumps(SMALL))  # JSON is YAML
    return {"tf1": str(tf1), "ours": str(ours), "bad": str(bad), "config": str(config),
            "params": by_gradscope}


def test_spec_of_an_npz_needs_no_tensorflow(small_npz):
    result = run_without_tensorflow("spec", small_npz["tf1"])
    assert result.returncode == 0, result.stderr
    spec = spec_from_yaml(result.stdout)
    assert (spec.input_size, [layer.units for layer in spec.layers]) == (5, [4, 3, 3])
    result = run_without_tensorflow("spec", small_npz["ours"], "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["layers"] == [{"gru": 4}, {"gru": 3},
                                                             {"dense": 3}]


def test_spec_says_a_non_finite_weight_as_explain_does_and_hangs_its_lines(small_npz,
                                                                           tmp_path):
    """Tried as a new user would: spec on an .npz holding inf said "internal error: the
    inferred spec does not take …" (explain --weights, a plain data error); and its reasons,
    wrapped at 80 columns, left words alone at the first column."""
    values = dict(np.load(small_npz["ours"]))
    values["gru_1/b_c"] = values["gru_1/b_c"].copy()
    values["gru_1/b_c"][0] = np.inf
    np.savez(tmp_path / "inf.npz", **values)
    result = run_without_tensorflow("spec", str(tmp_path / "inf.npz"))
    assert result.returncode == 2
    assert "internal error" not in result.stderr
    assert "gru_1/b_c has a non-finite value (inf) at index (0,)" in result.stderr
    shown = run_gradscope("spec", small_npz["ours"], env={"COLUMNS": "60"})
    assert shown.returncode == 0, shown.stderr
    lines = shown.stderr.splitlines()
    assert lines[0].startswith("gradscope spec: ") and len(lines) > 4
    assert all(line.startswith("  ") and line == line.rstrip() for line in lines[1:]), lines


@pytest.mark.parametrize("command", ["explain", "check"])
def test_a_misfitting_npz_is_refused_before_tensorflow_one_line_per_variable(small_npz, command):
    result = run_without_tensorflow(command, small_npz["config"], "--weights", small_npz["bad"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].endswith("misshapen.npz: 2 problems, one per line:")
    assert lines[1].strip() == ("gru_2/w_c is (8, 3) but (gru_1 units 4 + units 3) gives 7 rows "
                                "(gru_2/w_c (7, 3))")
    assert lines[2].strip().startswith("dense_1/bias: missing: dense_1/bias (3,) = units 3")


def test_npz_names_of_every_kind_give_the_same_gradients(tf, small_npz):
    """gradscope names, TF1 names with :0, and the dict API all map to the same weights."""
    from gradscope.yaml.explain import explain

    spec = load_spec(SMALL)
    expected = explain(spec, params={k: v.astype(np.float64)
                                     for k, v in small_npz["params"].items()})
    for weights in (small_npz["ours"], small_npz["tf1"], small_npz["params"]):
        report = gradscope.explain(spec, weights=weights)
        assert report.loss == expected.loss
        assert [g.stats for g in report.gradients] == [g.stats for g in expected.gradients]
    assert report.weights is not None and report.weights.format == "arrays"


def test_check_weights_passes_and_a_gate_order_mutant_fails(small_npz):
    args = ("check", small_npz["config"], "--weights", small_npz["tf1"], "--against")
    passed = run_gradscope(*args, f"{AGAINST}:correct", "--json")
    assert passed.returncode == 0, passed.stderr
    report = json.loads(passed.stdout)
    assert report["summary"]["passed"]
    assert report["weights"]["mapping"][0]["variables"] == [
        "GRU_Layer1/rnn/gru_cell/gates/kernel"]
    failed = run_gradscope(*args, f"{AGAINST}:swap_ru")
    assert failed.returncode == 1
    assert "FAILED" in failed.stdout


# -- Keras weights: paths in an .npz, and a TF2 object-based checkpoint -------------------------


@pytest.fixture(scope="module")
def keras_model(tf):
    import keras

    keras.utils.set_random_seed(5)
    # Named explicitly: Keras numbers unnamed layers across the process (gru_3 after other
    # tests' GRUs), and the weight paths below are these names.
    model = keras.Sequential([
        keras.Input((6, 5)),
        keras.layers.GRU(4, reset_after=False, return_sequences=True, name="gru"),
        keras.layers.LSTM(3, return_sequences=True, name="lstm"),
        keras.layers.Dense(3, name="dense"),
    ], name="sequential")
    for weight in model.weights:  # biases away from zero, so that their order matters
        weight.assign(weight.numpy() + np.random.default_rng(len(weight.path)).uniform(
            -0.3, 0.3, weight.shape))
    rng = np.random.default_rng(11)
    x, y = one_hot_batch(rng, 4, 6, 5, 3)
    with tf.GradientTape() as tape:
        logits = model(x)
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
    gradients = tape.gradient(loss, model.trainable_weights)
    return {"model": model, "x": x, "y": y, "loss": float(loss),
            "gradients": {w.path: g.numpy() for w, g in zip(model.trainable_weights, gradients,
                                                            strict=True)}}


def _layer_norms(named: dict[str, np.ndarray], prefixes: dict[str, str]) -> dict[str, float]:
    """‖all gradients of a layer‖: the same in every layout (the layouts only rearrange)."""
    return {layer: float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2)
                                      for name, g in named.items() if name.startswith(prefix))))
            for layer, prefix in prefixes.items()}


@pytest.mark.parametrize("layout", ["block", "keras"])
def test_keras_paths_npz_matches_keras_in_either_layout(tf, keras_model, tmp_path, layout):
    """Keras' own forward and tape are the independent program. In the block layout the gates
    are rearranged ([z | r | h] → [r | u], [i | f | c | o] → [i | j | f | o]): a wrong order
    changes the loss."""
    path = tmp_path / "keras_paths.npz"
    np.savez(path, **{w.path: w.numpy() for w in keras_model["model"].weights})
    layers = ([{"gru": 4}, {"lstm": 3}, {"dense": 3}] if layout == "block" else
              [{"type": "gru", "units": 4, "reset_after": False}, {"lstm": 3}, {"dense": 3}])
    spec = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 4, "layout": layout,
                      "layers": layers})
    report = gradscope.explain(spec, data={"x": keras_model["x"], "y": keras_model["y"]},
                               weights=str(path))
    assert report.loss.value == pytest.approx(keras_model["loss"], rel=1e-5)
    ours = {g.name: g.stats.l2 for g in report.gradients}
    norms = {layer: float(np.sqrt(sum(v ** 2 for k, v in ours.items() if k.startswith(layer))))
             for layer in ("gru_1", "lstm_1", "dense_1")}
    theirs = _layer_norms(keras_model["gradients"], {"gru_1": "sequential/gru/",
                                                     "lstm_1": "sequential/lstm/",
                                                     "dense_1": "sequential/dense/"})
    for layer in norms:
        assert norms[layer] == pytest.approx(theirs[layer], rel=1e-5), layer
    mapping = {m.name: m for m in report.weights.mapping}
    if layout == "keras":
        assert mapping["gru_1/kernel"].variables == ["sequential/gru/gru_cell/kernel"]
        assert mapping["gru_1/kernel"].conversion == ""
        expected = keras_model["gradients"]["sequential/gru/gru_cell/kernel"]
        assert ours["gru_1/kernel"] == pytest.approx(float(np.linalg.norm(expected)), rel=1e-5)
    else:
        assert mapping["gru_1/w_ru"].variables == ["sequential/gru/gru_cell/kernel",
                                                   "sequential/gru/gru_cell/recurrent_kernel"]
        assert "[r | z]" in mapping["gru_1/w_ru"].conversion


def test_tf2_object_checkpoint_of_a_keras_model(tf, keras_model, tmp_path):
    prefix = tf.train.Checkpoint(model=keras_model["model"]).save(str(tmp_path / "ckpt"))
    inferred = gradscope.infer_spec(prefix)
    assert inferred.format == "TF2 object-based checkpoint"
    assert inferred.config["layers"] == [{"gru": 4, "reset_after": False}, {"lstm": 3},
                                         {"dense": 3}]
    assert inferred.config["layout"] == "keras"
    spec = spec_from_yaml(inferred.yaml)
    report = gradscope.explain(spec, data={"x": keras_model["x"], "y": keras_model["y"]},
                               weights=prefix)
    assert report.loss.value == pytest.approx(keras_model["loss"], rel=1e-5)
    assert any(i.reason.startswith("optimizer") or "save_counter" in i.variable
               for i in report.weights.ignored)


def test_tf2_checkpoint_of_plain_variables_and_a_reset_after_gru_refused_in_block(tf, tmp_path):
    """tf.Variables in tf.Modules; a Keras GRU with reset_after=True has no block-layout
    twin, so a block spec is refused with the reason."""
    rng = np.random.default_rng(2)
    module = tf.Module()
    module.gru = tf.Module()
    module.gru.kernel = tf.Variable(rng.standard_normal((5, 12)).astype(np.float32))
    module.gru.recurrent_kernel = tf.Variable(rng.standard_normal((4, 12)).astype(np.float32))
    module.gru.bias = tf.Variable(rng.standard_normal((2, 12)).astype(np.float32))
    module.dense = tf.Module()
    module.dense.kernel = tf.Variable(rng.standard_normal((4, 2)).astype(np.float32))
    module.dense.bias = tf.Variable(np.zeros(2, np.float32))
    prefix = tf.train.Checkpoint(net=module).save(str(tmp_path / "vars"))
    inferred = gradscope.infer_spec(prefix)
    assert inferred.config["layers"] == [{"gru": 4, "reset_after": True}, {"dense": 2}]
    spec = load_spec({"input_size": 5, "time_steps": 3, "batch_size": 2,
                      "layers": [{"gru": 4}, {"dense": 2}]})
    with pytest.raises(ConfigError, match="reset_after=True computes r∘"):
        gradscope.explain(spec, weights=prefix)


def test_the_mapping_fits_every_width_without_cutting_a_name(tf, keras_model, tmp_path):
    from conftest import render_text

    prefix = tf.train.Checkpoint(model=keras_model["model"]).save(str(tmp_path / "ckpt"))
    spec = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 4,
                      "layers": [{"gru": 4}, {"lstm": 3}, {"dense": 3}]})
    report = gradscope.explain(spec, weights=prefix)
    names = {name for item in report.weights.mapping for name in item.variables}
    assert "model/_functional/_operations/1/cell/recurrent_kernel" in names
    for width in (60, 80, 120):
        text = render_text(report, width)
        assert max(len(line) for line in text.splitlines()) <= width
        words = set(text.split())
        assert names <= words, (width, names - words)
        assert ("Weights read from ckpt-1 (TF2 object-based checkpoint; layers matched by kind "
                "and the order of their names)") in " ".join(text.split())


def _gru_block(scope: str, features: int, units: int) -> dict[str, np.ndarray]:
    return {f"{scope}/gates/kernel": np.zeros((features + units, 2 * units)),
            f"{scope}/gates/bias": np.ones(2 * units),
            f"{scope}/candidate/kernel": np.zeros((features + units, units)),
            f"{scope}/candidate/bias": np.zeros(units)}


def test_refusals_name_the_variable_and_need_no_tensorflow(small_npz, tmp_path):
    config = small_npz["config"]
    dense = {"dense/kernel": np.zeros((3, 3)), "dense/bias": np.zeros(3)}
    files = {
        "pickled": {"gru_1/w_ru": np.array([{"a": 1}], dtype=object)},
        "unknown": {**_gru_block("rnn/cell_0/gru_cell", 5, 4),
                    **_gru_block("rnn/cell_1/gru_cell", 4, 3), **dense,
                    "rnn/cell_0/gru_cell/w_f_diag": np.zeros(4)},
        "extra": {**_gru_block("rnn/cell_0/gru_cell", 5, 4),
                  **_gru_block("rnn/cell_1/gru_cell", 4, 3), **dense,
                  "dense_1/kernel": np.zeros((3, 3)), "dense_1/bias": np.zeros(3)},
        "untold": {**_gru_block("encoder/gru_cell", 5, 4),
                   **_gru_block("decoder/gru_cell", 4, 3), **dense},
    }
    expected = {
        "pickled": "array 'gru_1/w_ru' holds pickled Python objects",
        "unknown": "rnn/cell_0/gru_cell/w_f_diag (4,): not a weight name gradscope knows",
        "extra": "dense_1/kernel (3, 3), dense_1/bias (3,): extra: the spec has 1 dense layer",
        "untold": "the names decoder/gru_cell and encoder/gru_cell do not say which gru layer "
                  "comes first",
    }
    for name, arrays in files.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        result = run_without_tensorflow("explain", config, "--weights", str(path))
        assert result.returncode == 2, (name, result.stderr)
        assert expected[name] in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr
    missing = run_without_tensorflow("check", config, "--weights", str(tmp_path / "nope.ckpt"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("gradscope: error: --weights ")
    assert "file not found (nor nope.ckpt.index)" in missing.stderr
    # `spec` orders such scopes by their shapes when only one order chains, and names the
    # layers after them, so that --weights then matches by name; two orders are refused.
    untold = run_without_tensorflow("spec", str(tmp_path / "untold.npz"))
    assert untold.returncode == 0, untold.stderr
    inferred = spec_from_yaml(untold.stdout)
    assert [(layer.name, layer.units) for layer in inferred.layers] == [
        ("encoder", 4), ("decoder", 3), ("dense", 3)]
    path = tmp_path / "two_orders.npz"
    np.savez(path, **_gru_block("encoder/gru_cell", 4, 4), **_gru_block("decoder/gru_cell", 4, 4),
             **{"dense/kernel": np.zeros((4, 3)), "dense/bias": np.zeros(3)})
    two = run_without_tensorflow("spec", str(path))
    assert two.returncode == 2
    assert ("the names of the recurrent scopes (decoder/gru_cell, encoder/gru_cell) do not say "
            "their order, and 2 orders of their shapes chain; refusing to pick one") in two.stderr


def test_tf1_multi_rnn_cell_names_into_the_keras_layout(tf, keras_model, tmp_path):
    """Keras → block → Keras: Keras' weights rearranged into TF1 MultiRNNCell names
    (GRUCell, LSTMCell with forget_bias 1.0), then read back by a keras-layout spec; Keras'
    own loss is the independent truth for both directions of the rearrangement."""
    from gradscope.yaml.weights import load_weights

    keras_paths = tmp_path / "keras_paths.npz"
    np.savez(keras_paths, **{w.path: w.numpy() for w in keras_model["model"].weights})
    block = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 4,
                       "layers": [{"gru": 4}, {"lstm": 3}, {"dense": 3}]})
    params = load_weights(block, str(keras_paths)).params
    tf1_names = {"gru_1/w_ru": "rnn/multi_rnn_cell/cell_0/gru_cell/gates/kernel",
                 "gru_1/b_ru": "rnn/multi_rnn_cell/cell_0/gru_cell/gates/bias",
                 "gru_1/w_c": "rnn/multi_rnn_cell/cell_0/gru_cell/candidate/kernel",
                 "gru_1/b_c": "rnn/multi_rnn_cell/cell_0/gru_cell/candidate/bias",
                 "lstm_1/kernel": "rnn/multi_rnn_cell/cell_1/lstm_cell/kernel",
                 "lstm_1/bias": "rnn/multi_rnn_cell/cell_1/lstm_cell/bias",
                 "dense_1/kernel": "dense/kernel", "dense_1/bias": "dense/bias"}
    tf1 = tmp_path / "tf1.npz"
    np.savez(tf1, **{f"{theirs}:0": params[ours] for ours, theirs in tf1_names.items()})
    inferred = gradscope.infer_spec(str(tf1))
    assert inferred.config["layers"] == [{"gru": 4}, {"lstm": 3}, {"dense": 3}]
    assert inferred.config["layout"] == "block"
    keras_layout = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 4,
                              "layout": "keras",
                              "layers": [{"type": "gru", "units": 4, "reset_after": False},
                                         {"lstm": 3}, {"dense": 3}]})
    report = gradscope.explain(keras_layout, data={"x": keras_model["x"], "y": keras_model["y"]},
                               weights=str(tf1))
    assert report.loss.value == pytest.approx(keras_model["loss"], rel=1e-5)
    mapping = {m.name: m for m in report.weights.mapping}
    assert mapping["lstm_1/bias"].variables == ["rnn/multi_rnn_cell/cell_1/lstm_cell/bias"]
    assert "f + 1" in mapping["lstm_1/bias"].conversion
    back = load_weights(keras_layout, str(tf1)).params
    ours = {"sequential/gru/gru_cell/": "gru_1/", "sequential/lstm/lstm_cell/": "lstm_1/",
            "sequential/dense/": "dense_1/"}
    for weight in keras_model["model"].weights:
        name = next(weight.path.replace(k, v) for k, v in ours.items()
                    if weight.path.startswith(k))
        np.testing.assert_allclose(back[name], weight.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)


def test_every_misshapen_missing_and_extra_variable_is_listed_at_once(tmp_path):
    """The seed model (200 → GRU 64 → GRU 32 → dense 3) and a file holding only a misshapen
    gru_1/w_ru: that variable, the rest of gru_1, gru_2 and dense_1 are all named, in one
    error, before TensorFlow is imported."""
    path = tmp_path / "bad.npz"
    np.savez(path, **{"gru_1/w_ru": np.zeros((5, 5), np.float32)})
    result = run_without_tensorflow("explain", "--weights", str(path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line.strip() for line in result.stderr.strip().splitlines()]
    assert lines[0] == f"gradscope: error: --weights {path}: 6 problems, one per line:"
    assert lines[1] == ("gru_1/w_ru is (5, 5) but (input 200 + units 64) gives 264 rows and "
                        "2·units 64 gives 128 columns (gru_1/w_ru (264, 128))")
    for short, shape in (("b_ru", "(128,)"), ("w_c", "(264, 64)"), ("b_c", "(64,)")):
        assert any(line.startswith(f"gru_1/{short}: missing: gru_1/{short} {shape} = ")
                   for line in lines), (short, lines)
    gru_2 = next(line for line in lines if line.startswith("gru_2: missing:"))
    assert gru_2.endswith("expected gru_2/w_ru (96, 64), gru_2/b_ru (64,), gru_2/w_c (96, 32), "
                          "gru_2/b_c (32,)")
    dense = next(line for line in lines if line.startswith("dense_1: missing:"))
    assert dense.endswith("expected dense_1/kernel (32, 3), dense_1/bias (3,)")


def test_unknown_extra_misshapen_and_non_float_variables_in_one_error(small_npz, tmp_path):
    arrays = dict(small_npz["params"])
    arrays["gru_2/w_c"] = np.zeros((8, 3), np.float32)
    arrays["gru_1/w_f_diag"] = np.zeros(4, np.float32)
    arrays["dense_2/kernel"], arrays["dense_2/bias"] = np.zeros((3, 3)), np.zeros(3)
    arrays["gru_1/b_c"] = np.zeros(4, np.int64)
    arrays["dense_1/bias"] = np.array([0.0, np.nan, 0.0], np.float32)
    path = tmp_path / "many.npz"
    np.savez(path, **arrays)
    result = run_without_tensorflow("check", small_npz["config"], "--weights", str(path))
    assert result.returncode == 2, result.stderr
    lines = [line.strip() for line in result.stderr.strip().splitlines()]
    assert lines[0].endswith("many.npz: 5 problems, one per line:")
    expected = [
        "gru_1/b_c has dtype int64; expected float weights",
        "gru_1/w_f_diag (4,): not a weight name gradscope knows",
        "gru_2/w_c is (8, 3) but (gru_1 units 4 + units 3) gives 7 rows (gru_2/w_c (7, 3))",
        "dense_2/kernel (3, 3), dense_2/bias (3,): extra: the spec has 1 dense layer, the file "
        "2 (dense_1, dense_2)",
        "dense_1/bias has a non-finite value (nan) at index (1,)",
    ]
    for fragment in expected:
        assert sum(fragment in line for line in lines[1:]) == 1, (fragment, lines)
    with pytest.raises(ConfigError) as caught:
        gradscope.explain(load_spec(SMALL), weights=str(path))
    assert caught.value.exit_code == 2 and len(caught.value.lines) == 5
