"""gradscope check end to end: the seed model passes, random models raise no false alarm,
and the report is what the schema says."""

from __future__ import annotations

import json

from conftest import run_gradscope
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from gradscope.report.models import json_schema
from gradscope.yaml.check import check
from gradscope.yaml.config import load_spec

recurrent = st.fixed_dictionaries(
    {"type": st.sampled_from(["gru", "lstm", "simple_rnn"]), "units": st.integers(1, 8),
     "layout": st.sampled_from(["block", "keras"])},
    optional={"reset_after": st.booleans()},
)


@st.composite
def float32_models(draw):
    layers = [
        {k: v for k, v in layer.items()
         if k != "reset_after" or (layer["layout"] == "keras" and layer["type"] == "gru")}
        for layer in draw(st.lists(recurrent, min_size=1, max_size=3))
    ]
    if draw(st.booleans()):
        layers[-1]["return_sequences"] = False
    heads = draw(st.lists(st.integers(1, 4), max_size=2))
    return load_spec({
        "input_size": draw(st.integers(1, 6)), "time_steps": draw(st.integers(1, 6)),
        "batch_size": draw(st.integers(1, 4)), "layers": layers + [{"dense": h} for h in heads],
        "loss": draw(st.sampled_from(["softmax_cross_entropy", "mse"])),
        "seed": draw(st.integers(0, 2**16)), "dtype": "float32",
    })


@settings(max_examples=9, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(spec=float32_models())
def test_no_false_alarms_on_random_float32_models(spec, tf):
    report = check(spec, chunks=min(2, spec.time_steps))
    failures = [(t.name, w.witness, w.error, w.detail)
                for t in report.tensors for w in t.witnesses if not w.passed]
    assert report.summary.passed, failures
    assert "tbptt_carry" in report.summary.witnesses


def test_seed_model_passes_every_witness_and_exits_0():
    result = run_gradscope("check", "--json", "--chunks", "3")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    document = json.loads(result.stdout)
    Draft202012Validator(json_schema("check")).validate(document)
    summary = document["summary"]
    assert summary["passed"] is True
    assert summary["witnesses"] == ["finite_differences", "numpy_reference",
                                    "gru_block_kernel", "tbptt_carry"]
    names = [t["name"] for t in document["tensors"]]
    assert names[:13] == ["gru_1/w_ru", "gru_1/b_ru", "gru_1/w_c", "gru_1/b_c", "gru_2/w_ru",
                          "gru_2/b_ru", "gru_2/w_c", "gru_2/b_c", "dense_1/kernel",
                          "dense_1/bias", "gru_1/h0", "gru_2/h0", "x"]
    boundaries = document["carry"]["boundaries"]
    assert [b["step"] for b in boundaries] == [34, 67]
    assert [g["shape"] for g in boundaries[0]["grad_ys"]] == [[34, 64], [34, 32]]
    assert all(e["confirmed"] for e in document["errata"])


def _block_context():
    import numpy as np

    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.check.context import CheckContext
    from gradscope.yaml.data import initial_params, synthetic_batch
    from gradscope.yaml.engine import Engine

    spec = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 4,
                      "layers": [{"gru": 4}, {"type": "gru", "units": 3, "layout": "keras"},
                                 {"gru": 3}, {"dense": 2}]})
    algebra = model_shapes(spec)
    params = {k: v.astype(np.float64) for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra).astype("float64")
    engine = Engine(algebra, dtype="float64")
    return CheckContext(algebra, params, batch, engine, engine.run(params, batch, per_step=True))


def test_kernel_witness_skips_keras_layers_and_catches_a_wrong_gradient(tf):
    import dataclasses

    from gradscope.yaml.check.block_kernel import errata_evidence, kernel_witness

    ctx = _block_context()
    results = kernel_witness(ctx)
    assert {r.tensor.split("/")[0] for r in results} == {"gru_1", "gru_3"}  # gru_2 is keras
    assert all(r.passed for r in results), [(r.tensor, r.error) for r in results if not r.passed]
    assert all(e.confirmed for e in errata_evidence(ctx))
    weights = dict(ctx.autodiff.weight_gradients)
    weights["gru_3/w_c"] = weights["gru_3/w_c"] * 1.05
    ctx.autodiff = dataclasses.replace(ctx.autodiff, weight_gradients=weights)
    assert [r.tensor for r in kernel_witness(ctx) if not r.passed] == ["gru_3/w_c"]


def test_kernel_witness_locates_a_missing_carry_in_time(tf):
    """Feed the kernel only the gradient from above (no carry from t+1): the per-step
    comparison still agrees step by step, but the weight sums and h0 disagree with autodiff."""
    import dataclasses

    from gradscope.yaml.check.block_kernel import kernel_witness

    ctx = _block_context()
    gradients = dict(ctx.autodiff.sequence_gradients)
    gradients["gru_1/h"] = gradients["gru_1/h"] * 0.5
    ctx.autodiff = dataclasses.replace(ctx.autodiff, sequence_gradients=gradients)
    failed = {r.tensor for r in kernel_witness(ctx) if not r.passed}
    assert {"gru_1/w_ru", "gru_1/w_c", "gru_1/h0"} <= failed


def test_a_model_near_its_targets_holds_the_numpy_reference_to_its_grown_rounding(tf):
    """Predictions within 1e-8 of their targets (an mse of 1e-16): the residual cancels, and
    float64's rounding grows by as much, so TF's gradients and the NumPy reference's differ
    by 1e-8 relative, both right (found tried as a new user would: 7 tensors failed at
    2.4e-9 > 1e-9, exit 1; the same code in long double moves by as much). A tensor that
    disagrees is held to ten times what one rounding of every input moves the reference:
    the model passes, and says which tensors were held so; a gradient 1e-5 wrong fails."""
    import dataclasses

    import numpy as np
    from conftest import render_text

    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.check.context import CheckContext
    from gradscope.yaml.check.numpy_reference import reference_gradients, reference_witness
    from gradscope.yaml.data import Batch, initial_params, synthetic_batch
    from gradscope.yaml.engine import Engine

    spec = load_spec({"input_size": 6, "time_steps": 20, "batch_size": 5, "layout": "keras",
                      "layers": [{"gru": 8}, {"type": "gru", "units": 6, "reset_after": False},
                                 {"dense": 2}], "loss": "mse", "dtype": "float64"})
    algebra = model_shapes(spec)
    params = {k: v.astype(np.float64) for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra).astype("float64")
    engine = Engine(algebra, dtype="float64")
    tf_ = engine.tf
    predictions, _ = engine.forward(
        {k: tf_.constant(v) for k, v in params.items()}, tf_.constant(batch.x),
        {k: tf_.constant(v) for k, v in batch.initial_states.items()})
    y = predictions.numpy() + 1e-8 * np.random.default_rng(0).standard_normal(
        predictions.shape)
    batch = Batch(x=batch.x, y=y, initial_states=batch.initial_states)
    report = check(spec, data=batch, params=params)
    assert report.summary.passed, report.summary.failed_tensors
    held = [t.name for t in report.tensors for w in t.witnesses
            if w.witness == "numpy_reference" and w.tolerance > 1e-9]
    assert held
    text = " ".join(render_text(report, 80).split())
    assert f"NumPy ref. held {held[0]}" in text
    assert "whose residual cancels" in text

    run = engine.run(params, batch, per_step=True)
    weights = dict(run.weight_gradients)
    weights["gru_2/bias"] = weights["gru_2/bias"] * (1 + 1e-5)
    ctx = CheckContext(algebra, params, batch, engine,
                       dataclasses.replace(run, weight_gradients=weights))
    results = reference_witness(ctx, reference_gradients(algebra, params, batch))
    assert [r.tensor for r in results if not r.passed] == ["gru_2/bias"]
