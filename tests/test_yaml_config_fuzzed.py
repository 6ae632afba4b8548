"""Hypothesis fuzzing of the config loader: any document gives a valid shapes report or a
clean ConfigError (exit 2), never anything else."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradscope.errors import ConfigError
from gradscope.yaml.config import spec_from_yaml
from gradscope.yaml.shapes import shapes

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 300),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["gru", "lstm", "simple_rnn", "dense", "keras", "block",
                                     "mse", "float64", "softmax_cross_entropy"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12)
keys = st.sampled_from(["input_size", "time_steps", "batch_size", "layers", "layout", "loss",
                        "seed", "dtype", "units", "type", "name", "reset_after",
                        "return_sequences", "gru", "lstm", "dense", "input_sise"])
layer = st.dictionaries(keys, values, max_size=4) | st.fixed_dictionaries(
    {"type": st.sampled_from(["gru", "lstm", "simple_rnn", "dense", "rnn"]),
     "units": st.one_of(st.integers(-2, 9), values)},
    optional={"layout": values, "reset_after": values, "return_sequences": values,
              "name": values})
VALID = {"input_size": 3, "time_steps": 2, "batch_size": 2,
         "layers": [{"gru": 2}, {"lstm": 2, "layout": "keras"}, {"dense": 2}]}


def _outcome(text: str) -> None:
    try:
        spec = spec_from_yaml(text, origin="<fuzz>")
    except ConfigError as error:
        assert error.message and "\n" not in error.message
        return
    report = shapes(spec)
    assert report.tensors and all(all(d > 0 for d in t.shape) for t in report.tensors)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=st.dictionaries(keys, values, max_size=8) | values)
def test_random_documents(document):
    _outcome(yaml.safe_dump(document, allow_unicode=True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(removed=st.sets(st.sampled_from(sorted(VALID))), replaced=st.dictionaries(keys, values,
       max_size=3), layers=st.lists(layer, max_size=4) | st.none())
def test_mutations_of_a_valid_config(removed, replaced, layers):
    document = {k: v for k, v in VALID.items() if k not in removed}
    document.update(replaced)
    if layers is not None:
        document["layers"] = layers
    _outcome(yaml.safe_dump(document, allow_unicode=True))


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200))
def test_random_text(text):
    _outcome(text)
