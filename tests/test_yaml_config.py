"""The config contract: defaults, short and long forms, and one clear line for every mistake."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, SAMPLES

from gradscope.errors import ConfigError
from gradscope.yaml.config import load_spec

BASE = {"input_size": 4, "time_steps": 3, "batch_size": 2}


def test_embedded_default_is_the_seed_model_and_matches_the_sample():
    spec = load_spec()
    assert spec == load_spec(str(SAMPLES / "seed.yaml"))
    assert (spec.input_size, spec.batch_size, spec.time_steps) == (200, 34, 100)
    assert [(layer.name, layer.type, layer.units) for layer in spec.layers] == [
        ("gru_1", "gru", 64), ("gru_2", "gru", 32), ("dense_1", "dense", 3)]
    assert (spec.layout, spec.loss, spec.seed, spec.dtype) == (
        "block", "softmax_cross_entropy", 0, "float32")


def test_short_and_long_forms_and_default_names():
    short = load_spec({**BASE, "layers": [{"gru": 8}, {"gru": 4}, {"dense": 2}]})
    long = load_spec({**BASE, "layers": [{"type": "gru", "units": 8}, {"type": "gru", "units": 4},
                                         {"type": "dense", "units": 2}]})
    assert short == long
    named = load_spec({**BASE, "layers": [{"gru": 8, "name": "enc"}, {"gru": 4}, {"dense": 1}]})
    assert [layer.name for layer in named.layers] == ["enc", "gru_2", "dense_1"]
    mixed = load_spec({**BASE, "layout": "keras", "layers": [{"gru": 3, "layout": "block"},
                                                             {"gru": 3}]})
    assert [(layer.layout, layer.reset_after) for layer in mixed.layers] == [
        ("block", None), ("keras", True)]


def test_every_sample_config_loads():
    samples = sorted(SAMPLES.glob("*.yaml"))
    assert len(samples) >= 4
    for path in samples:
        load_spec(str(path))


@pytest.mark.parametrize("config,fragment,where", [
    ({**BASE, "input_sise": 4, "layers": [{"gru": 2}]}, "did you mean 'input_size'", "input_sise"),
    ({**BASE, "layers": [{"gru": 2, "unit": 3}]}, "did you mean 'units'", "layers[0].unit"),
    ({**BASE, "batch_size": "2", "layers": [{"gru": 2}]}, "found '2'", "batch_size"),
    ({**BASE, "batch_size": True, "layers": [{"gru": 2}]}, "found true", "batch_size"),
    ({**BASE, "time_steps": 1.5, "layers": [{"gru": 2}]}, "found 1.5", "time_steps"),
    ({**BASE, "time_steps": 0, "layers": [{"gru": 2}]},
     "expected a positive integer of at most 2147483647, found 0", "time_steps"),
    # Found tried as a new user would: a 20-digit size was an internal error (exit 1).
    ({**BASE, "layers": [{"gru": 10**20}]}, "at most 2147483647, found 100000000000000000000",
     "layers[0].units"),
    ({**BASE, "layers": [{"gru": -3}]}, "found -3", "layers[0].units"),
    ({**BASE, "layers": []}, "found an empty list", "layers"),
    ({**BASE, "layers": "gru"}, "expected a list of layers", "layers"),
    ({**BASE, "layers": ["gru"]}, "expected a mapping such as {gru: 64}", "layers[0]"),
    ({**BASE, "layers": [{"dense": 2}, {"gru": 2}]}, "found a dense layer first", "layers[0]"),
    ({**BASE, "layers": [{"gru": 2}, {"dense": 2}, {"gru": 2}]}, "comes before this recurrent",
     "layers[2]"),
    ({**BASE, "layers": [{"gur": 2}]}, "did you mean 'gru'", "layers[0]"),
    # The case alone (found tried as a new user would: no hint for the likeliest slip).
    ({**BASE, "layers": [{"type": "GRU", "units": 2}]}, "'GRU' (did you mean 'gru'?)",
     "layers[0].type"),
    ({**BASE, "layers": [{"LSTM": 2}]}, "'LSTM' (did you mean 'lstm'?)", "layers[0]"),
    ({**BASE, "layers": [{"type": "conv", "units": 2}]}, "unknown layer type 'conv'",
     "layers[0].type"),
    ({**BASE, "loss": "mes", "layers": [{"gru": 2}]}, "did you mean 'mse'", "loss"),
    ({**BASE, "dtype": "float16", "layers": [{"gru": 2}]}, "expected one of float32, float64",
     "dtype"),
    ({**BASE, "layout": "kears", "layers": [{"gru": 2}]}, "did you mean 'keras'", "layout"),
    ({**BASE, "layers": [{"gru": 2, "name": "a"}, {"gru": 2, "name": "a"}]}, "used twice",
     "layers"),
    ({**BASE, "layers": [{"gru": 2, "name": "1x"}]}, "starting with a letter", "layers[0].name"),
    ({**BASE, "layers": [{"gru": 2, "reset_after": False}]}, "only a keras-layout GRU",
     "layers[0].reset_after"),
    ({**BASE, "layers": [{"gru": 2, "return_sequences": False}, {"gru": 2}]},
     "expected false only on the last recurrent layer", "layers[0].return_sequences"),
    ({**BASE, "layers": [{"gru": 2}, {"dense": 2, "layout": "keras"}]}, "a dense layer has no",
     "layers[1].layout"),
    ({"time_steps": 3, "batch_size": 2, "layers": [{"gru": 2}]}, "missing required key",
     "input_size"),
    ([1, 2], "found a list of 2 items", "<dict>"),
])
def test_bad_configs_give_one_line_naming_the_key(config, fragment, where):
    with pytest.raises(ConfigError) as caught:
        load_spec(config) if isinstance(config, dict) else _load_yaml_text(str(config))
    message = caught.value.message
    assert fragment in message, message
    assert "\n" not in message
    if isinstance(config, dict):
        assert caught.value.where == where


def _load_yaml_text(text):
    from gradscope.yaml.config import spec_from_yaml

    return spec_from_yaml(text, origin="<dict>")


@pytest.mark.parametrize("text,fragment", [
    ("", "the config is empty"),
    ("input_size: [1, 2", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping of keys at the top level, found a list"),
    ("!!python/object/apply:os.system ['touch /tmp/gradscope-pwned']\n", "not valid YAML"),
])
def test_yaml_problems_are_config_errors(text, fragment, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_spec(str(path))


@pytest.mark.parametrize(("name", "fragment"), [
    ("train.py", "is Python source, which gradscope does not run as a model; save the model "
                 "with model.save"),
    ("Train.IPYNB", "is a notebook"),
    ("model.h5", "is an HDF5 file; expected a YAML config or a whole Keras model saved as "
                 ".keras"),
    ("batch.npz", "is an array file; expected a YAML config or a .keras model, and the batch "
                  "in --data"),
])
def test_files_that_are_no_config_are_named_for_what_they_are(name, fragment, tmp_path):
    """Found tried as a new user would: `diagnose train.py` said "expected a mapping of keys
    at the top level, found 'import keras …'" (the file read as YAML). A file whose content
    would read as YAML is named by its suffix all the same."""
    path = tmp_path / name
    path.write_text("input_size: 4\n")
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_spec(str(path))
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "saved_model.pb").write_bytes(b"")
    with pytest.raises(ConfigError, match="is a TensorFlow SavedModel, which gradscope does "
                                          "not read"):
        load_spec(str(saved))


def test_file_problems_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_spec(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="is a directory"):
        load_spec(str(tmp_path))
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_spec(str(binary))
    assert REPO.exists()
