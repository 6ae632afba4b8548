"""The finite-difference witness: it passes on correct gradients and catches wrong ones."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from gradscope.gradcheck import probes_for
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.check.context import CheckContext
from gradscope.yaml.check.finite_differences import (
    FiniteDifferences,
    finite_difference_witness,
)
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import initial_params, synthetic_batch
from gradscope.yaml.engine import Engine

SPECS = {
    "block": {"layers": [{"gru": 4}, {"gru": 3}, {"dense": 3}]},
    "keras": {"layout": "keras", "layers": [{"gru": 4}, {"type": "gru", "units": 3,
                                                          "reset_after": False}, {"dense": 2}],
              "loss": "mse"},
    "last_step": {"layers": [{"gru": 5, "return_sequences": False}, {"dense": 3}]},
}


def _context(name: str, directions: int = 3) -> CheckContext:
    spec = load_spec({"input_size": 6, "time_steps": 5, "batch_size": 4, **SPECS[name]})
    algebra = model_shapes(spec)
    params = {k: v.astype(np.float64) for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra).astype("float64")
    rng = np.random.default_rng(11)
    for value in batch.initial_states.values():
        value[...] = rng.standard_normal(value.shape)
    engine = Engine(algebra, dtype="float64")
    return CheckContext(algebra, params, batch, engine,
                        engine.run(params, batch, per_step=True),
                        directions=directions)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_correct_gradients_pass_for_every_tensor(name, tf):
    ctx = _context(name)
    results = finite_difference_witness(ctx)
    names = {r.tensor for r in results}
    assert names == {*ctx.params, *ctx.batch.initial_states, "x"}
    for result in results:
        assert result.passed, (result.tensor, result.error, result.detail)
        assert result.error < 5e-6  # well inside the 1e-5 tolerance


@pytest.mark.parametrize("tensor,factor", [("gru_1/w_ru", 1.001), ("gru_2/b_c", 0.99),
                                           ("dense_1/kernel", -1.0), ("gru_1/h0", 1.01)])
def test_a_wrong_autodiff_gradient_is_caught_and_named(tensor, factor, tf):
    ctx = _context("block")
    weights = dict(ctx.autodiff.weight_gradients)
    states = dict(ctx.autodiff.state_gradients)
    target = weights if tensor in weights else states
    target[tensor] = target[tensor] * factor
    ctx.autodiff = dataclasses.replace(ctx.autodiff, weight_gradients=weights,
                                       state_gradients=states)
    failed = [r.tensor for r in finite_difference_witness(ctx) if not r.passed]
    assert failed == [tensor]


def test_a_single_wrong_element_is_caught_by_the_element_probes(tf):
    ctx = _context("block")
    weights = dict(ctx.autodiff.weight_gradients)
    gradient = weights["gru_1/w_c"].copy()
    gradient.flat[np.argmax(np.abs(gradient))] *= 1.05
    weights["gru_1/w_c"] = gradient
    ctx.autodiff = dataclasses.replace(ctx.autodiff, weight_gradients=weights)
    failed = {r.tensor: r for r in finite_difference_witness(ctx) if not r.passed}
    assert list(failed) == ["gru_1/w_c"]
    assert "largest |g|" in failed["gru_1/w_c"].detail


def test_probes_are_unit_directions_and_include_the_largest_element():
    rng = np.random.default_rng(0)
    gradient = rng.standard_normal((7, 5))
    probes = probes_for("w", gradient, 3, rng)
    assert len(probes) == 3 + 1 + 2
    for probe in probes:
        assert probe.direction.shape == gradient.shape
        assert np.linalg.norm(probe.direction) == pytest.approx(1.0)
    largest = np.unravel_index(np.argmax(np.abs(gradient)), gradient.shape)
    assert probes[3].direction[largest] == 1.0


@pytest.mark.parametrize("tensor", ["x", "gru_2/h0"])
def test_a_wrong_element_of_x_or_an_initial_state_is_caught_on_its_one_example(tensor, tf):
    # Element probes of x and of the initial states run only the example they move.
    ctx = _context("block")
    states = dict(ctx.autodiff.state_gradients)
    gradient = (ctx.autodiff.input_gradient if tensor == "x" else states[tensor]).copy()
    gradient.flat[np.argmax(np.abs(gradient))] *= 1.05
    if tensor == "x":
        ctx.autodiff = dataclasses.replace(ctx.autodiff, input_gradient=gradient)
    else:
        states[tensor] = gradient
        ctx.autodiff = dataclasses.replace(ctx.autodiff, state_gradients=states)
    failed = {r.tensor: r for r in finite_difference_witness(ctx) if not r.passed}
    assert list(failed) == [tensor]
    assert "largest |g|" in failed[tensor].detail


def test_the_witness_begun_before_autodiff_gives_what_the_whole_witness_gives(tf):
    ctx = _context("keras")
    early = FiniteDifferences(ctx.shapes, ctx.params, ctx.batch, ctx.engine, ctx.directions)
    early.begin()  # as check does, before the autodiff pass is known
    begun = early.finish(ctx)
    assert [(r.tensor, r.error, r.detail) for r in begun] == [
        (r.tensor, r.error, r.detail) for r in finite_difference_witness(ctx)]
    # Every probe evaluated once, + and −, and nothing else: an early random candidate that
    # turns out to be the largest |g| serves as that probe ("N probes; worst: …").
    assert len(early.losses) == 2 * sum(int(r.detail.split()[0]) for r in begun)


def test_a_loss_that_curves_within_the_step_is_taken_again_at_smaller_ones(tf):
    """Found tried as a new user would: a correct block GRU with weights drawn N(0, 0.5) and
    non-zero initial states read gru_2/b_c 1.5e-5 off at the step 1e-3 (the loss curves
    within it), above the tolerance 1e-5, and check failed it. A tensor that disagrees is
    taken again at 1e-4, 1e-5 and 1e-7: it agrees at 1e-4, and says so; the wrong gradients
    above still fail at every step."""
    from gradscope.yaml.data import Batch

    spec = load_spec({"input_size": 5, "time_steps": 7, "batch_size": 3,
                      "layers": [{"gru": 4}, {"gru": 3}, {"dense": 2}], "seed": 3,
                      "dtype": "float64"})
    algebra = model_shapes(spec)
    rng = np.random.default_rng(42)
    params, inputs = {}, 5
    for layer, units in (("gru_1", 4), ("gru_2", 3)):
        params[f"{layer}/w_ru"] = rng.normal(0, .5, (inputs + units, 2 * units))
        params[f"{layer}/b_ru"] = rng.normal(0, .5, 2 * units)
        params[f"{layer}/w_c"] = rng.normal(0, .5, (inputs + units, units))
        params[f"{layer}/b_c"] = rng.normal(0, .5, units)
        inputs = units
    params["dense_1/kernel"] = rng.normal(0, .5, (3, 2))
    params["dense_1/bias"] = rng.normal(0, .5, 2)
    x = rng.normal(size=(3, 7, 5))
    y = np.eye(2)[rng.integers(0, 2, (3, 7))]
    states = {f"gru_{k}/h0": rng.normal(0, .3, (3, units)) for k, units in ((1, 4), (2, 3))}
    batch = Batch(x=x, y=y, initial_states=states)
    engine = Engine(algebra, dtype="float64")
    ctx = CheckContext(algebra, params, batch, engine, engine.run(params, batch, per_step=True),
                       directions=3)
    results = {r.tensor: r for r in finite_difference_witness(ctx)}
    assert all(r.passed for r in results.values()), [
        (r.tensor, r.error) for r in results.values() if not r.passed]
    assert "(at step 0.0001: at 0.001 the loss curves within the step" in \
        results["gru_2/b_c"].detail


def test_a_float32_config_whose_loss_overflows_fails_explain_and_check(tmp_path):
    """Tried as a new user would: a float32 config whose logits reach 1e37 (its loss is inf
    in float32, 1.6e37 in float64) was explained as "loss = n/a", exit 0, and check passed
    it in float64. explain now says so (exit 1 on the command line), with what a float64
    pass computes, and check fails; the same config at ordinary weights passes."""
    import gradscope

    config = {"input_size": 4, "time_steps": 6, "batch_size": 3,
              "layers": [{"gru": 4}, {"dense": 2}], "seed": 1}
    spec = load_spec(config)
    params = initial_params(model_shapes(spec))
    big = {**params, "dense_1/kernel": params["dense_1/kernel"] * 1e38}
    np.savez(tmp_path / "big.npz", **big)
    report = gradscope.explain(config, weights=tmp_path / "big.npz")
    assert report.loss.value is None and report.not_finite is not None
    assert report.not_finite.startswith("the loss is inf; a float64 pass of the same model "
                                        "computes a loss of ")
    assert "float32 (largest number 3.4e+38) cannot hold this model's numbers" in \
        report.not_finite
    # With --flow: no norms of NaN (their sparklines and their JSON failed), and every
    # number of the document finite (an initial state's per-example norms were NaN).
    flowing = gradscope.explain(config, weights=tmp_path / "big.npz", flow=True)
    assert flowing.gradient_flow is None
    assert flowing.not_finite.endswith("--flow and --jacobians are left out")
    json.dumps(flowing.to_dict(), allow_nan=False)
    checked = gradscope.check(config, weights=tmp_path / "big.npz")
    assert not checked.summary.passed and checked.not_finite is not None
    assert not checked.summary.failed_tensors  # every gradient agrees in float64
    assert gradscope.explain(config).not_finite is None
    assert gradscope.check(config).summary.passed


def test_a_small_loss_near_its_targets_passes_right_gradients_and_fails_a_wrong_one(tf):
    """A model whose outputs are near their targets (mse 6e-9): at the step 1e-3 its loss
    curves within the step, and with 64 epsilons of 1 taken for its rounding no smaller
    step could be taken: every right gradient failed (found tried as a new user would). Its
    rounding is measured: the right ones pass at a smaller step, a recurrent kernel 1% wrong
    fails, alone."""
    from gradscope.yaml.data import Batch

    ctx = _context("keras")
    tf_ = ctx.engine.tf
    predictions, _ = ctx.engine.forward(
        {k: tf_.constant(v) for k, v in ctx.params.items()}, tf_.constant(ctx.batch.x),
        {k: tf_.constant(v) for k, v in ctx.batch.initial_states.items()})
    y = predictions.numpy() + 1e-4 * np.random.default_rng(0).standard_normal(predictions.shape)
    batch = Batch(x=ctx.batch.x, y=y, initial_states=ctx.batch.initial_states)
    run = ctx.engine.run(ctx.params, batch, per_step=True)
    assert run.loss < 1e-7
    for factor in (1.0, 1.01):
        weights = dict(run.weight_gradients)
        weights["gru_1/recurrent_kernel"] = weights["gru_1/recurrent_kernel"] * factor
        ctx = CheckContext(ctx.shapes, ctx.params, batch, ctx.engine,
                           dataclasses.replace(run, weight_gradients=weights), directions=3)
        failed = [r.tensor for r in finite_difference_witness(ctx) if not r.passed]
        assert failed == ([] if factor == 1.0 else ["gru_1/recurrent_kernel"])


def test_a_softmax_near_its_targets_passes_right_gradients_and_fails_a_wrong_one(tf):
    """A softmax model whose targets are its own probabilities within 1e-4 (a loss of 1.4,
    derivatives of 1e-6 to 1e-7): at the step 1e-3 the loss curves within it by more than
    1e-5 of them, and at 1e-5 its rounding is wider than that. Check failed five right
    tensors (found tried as a new user would, on a model of 300 steps). A tenth of the step
    resolves some, Richardson's extrapolation from half of it the others; a kernel 0.1%
    wrong still fails, alone."""
    from gradscope.yaml.data import Batch

    spec = load_spec({"input_size": 4, "time_steps": 40, "batch_size": 6, "layout": "block",
                      "layers": [{"lstm": 8}, {"type": "lstm", "units": 5, "layout": "keras",
                                                "return_sequences": False}, {"dense": 4}],
                      "loss": "softmax_cross_entropy", "dtype": "float64", "seed": 1})
    algebra = model_shapes(spec)
    params = {k: v.astype(np.float64) for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra).astype("float64")
    rng = np.random.default_rng(1)
    for value in batch.initial_states.values():
        value[...] = np.tanh(rng.standard_normal(value.shape))
    engine = Engine(algebra, dtype="float64")
    tf_ = engine.tf
    logits, _ = engine.forward({k: tf_.constant(v) for k, v in params.items()},
                               tf_.constant(batch.x),
                               {k: tf_.constant(v) for k, v in batch.initial_states.items()})
    y = np.clip(tf_.nn.softmax(logits).numpy() + 1e-4 * rng.standard_normal(logits.shape),
                0, None)
    batch = Batch(x=batch.x, y=y / y.sum(-1, keepdims=True),
                  initial_states=batch.initial_states)
    run = engine.run(params, batch, per_step=True)
    for factor in (1.0, 1.001):
        weights = dict(run.weight_gradients)
        weights["lstm_2/kernel"] = weights["lstm_2/kernel"] * factor
        ctx = CheckContext(algebra, params, batch, engine,
                           dataclasses.replace(run, weight_gradients=weights), directions=3)
        results = finite_difference_witness(ctx)
        assert [r.tensor for r in results if not r.passed] == (
            [] if factor == 1.0 else ["lstm_2/kernel"])
        if factor == 1.0:
            assert any("Richardson" in r.detail for r in results)
