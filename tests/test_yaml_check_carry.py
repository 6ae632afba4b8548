"""The truncated-BPTT carry witness: chunked backward passes with carried grad_ys equal full
BPTT, and the same chunks without the carry do not."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from gradscope.chunks import chunk_lengths
from gradscope.errors import ConfigError
from gradscope.gradcheck import tolerance
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.check import carry
from gradscope.yaml.check.carry import (
    CarryResult,
    carry_witness,
    compare_with_full_bptt,
    truncated_gradients,
)
from gradscope.yaml.check.context import CheckContext
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import initial_params, synthetic_batch
from gradscope.yaml.engine import Engine

TIME_STEPS = 7
# No carry (1), unequal chunks (3: 3, 2, 2), a boundary at every step (7); 2 and 5 are
# chunked in test_carried_gradient_depends_on_the_step_only.
CHUNKS = (1, 3, 7)

SPECS = {
    # Sequence output, softmax CE, block under keras (reset_after default).
    "block-keras-ce": {
        "layers": [{"gru": 5, "layout": "block"}, {"gru": 4, "layout": "keras"}, {"dense": 3}],
        "loss": "softmax_cross_entropy",
    },
    # Last step only, mse, keras (reset_after false) under block.
    "keras-block-last-mse": {
        "layers": [{"gru": 6, "layout": "keras", "reset_after": False},
                   {"gru": 4, "layout": "block", "return_sequences": False}, {"dense": 2}],
        "loss": "mse",
    },
    # Sequence output, mse, two block GRUs and two dense layers.
    "block-block-mse": {
        "layout": "block",
        "layers": [{"gru": 4}, {"gru": 5}, {"dense": 6}, {"dense": 2}],
        "loss": "mse",
    },
    # Last step only, softmax CE, three keras GRUs.
    "keras3-last-ce": {
        "layout": "keras",
        "layers": [{"gru": 3}, {"gru": 5}, {"gru": 4, "return_sequences": False}, {"dense": 3}],
        "loss": "softmax_cross_entropy",
    },
}


@cache
def context(key: str) -> CheckContext:
    spec = load_spec({"input_size": 3, "time_steps": TIME_STEPS, "batch_size": 2,
                      "dtype": "float64", "seed": 7, **SPECS[key]})
    shapes = model_shapes(spec)
    params = initial_params(shapes)
    batch = synthetic_batch(shapes)
    # Non-zero initial states: the carry must also start from the user's h0.
    rng = np.random.default_rng(3)
    states = {name: 0.5 * rng.standard_normal(value.shape)
              for name, value in batch.initial_states.items()}
    batch = type(batch)(x=batch.x, y=batch.y, initial_states=states, source=batch.source)
    engine = Engine(shapes, dtype="float64")
    autodiff = engine.run(params, batch, per_step=True)
    return CheckContext(shapes, params, batch, engine, autodiff)


def boundary_steps(chunks: int) -> list[int]:
    return [int(part[0]) for part in np.array_split(np.arange(TIME_STEPS), chunks)[1:]]


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("key", list(SPECS))
def test_carried_chunks_equal_full_bptt(key, chunks):
    ctx = context(key)
    result = carry_witness(ctx, chunks)

    assert isinstance(result, CarryResult)
    assert result.chunk_lengths == chunk_lengths(TIME_STEPS, chunks)
    assert sum(result.chunk_lengths) == TIME_STEPS
    failed = [(r.tensor, r.error, r.detail) for r in result.results if not r.passed]
    assert not failed
    expected_names = [*ctx.params, *ctx.batch.initial_states]
    assert [r.tensor for r in result.results] == expected_names
    for r in result.results:
        assert r.witness == "tbptt_carry"
        assert r.tolerance == tolerance("tbptt_carry").rtol
        assert r.error is not None and r.error <= 1e-12

    assert len(result.boundaries) == chunks - 1
    assert [b.step for b in result.boundaries] == boundary_steps(chunks)
    for boundary in result.boundaries:
        t = boundary.step - 1
        expected_ys = [(f"{cell.name}/h[t={t}]", (2, cell.units)) for cell in ctx.shapes.cells]
        assert boundary.ys == expected_ys
        assert boundary.grad_ys == [(f"∂L/∂{name}", shape) for name, shape in expected_ys]
        assert len(boundary.grad_ys_norm) == len(boundary.ys)
        assert all(np.isfinite(n) and n > 0 for n in boundary.grad_ys_norm)


def test_unequal_chunks_follow_array_split():
    assert chunk_lengths(7, 2) == [4, 3]
    assert chunk_lengths(7, 3) == [3, 2, 2]
    assert chunk_lengths(7, 5) == [2, 2, 1, 1, 1]
    assert chunk_lengths(7, 7) == [1] * 7
    assert chunk_lengths(100, 3) == [34, 33, 33]


def test_carried_gradient_depends_on_the_step_only():
    """∂L/∂h[t] carried across a boundary is the same however the rest is chunked."""
    ctx = context("block-keras-ce")
    by_step: dict[int, list[dict[str, np.ndarray]]] = {}
    for chunks in (2, 3, 5):
        lengths = chunk_lengths(TIME_STEPS, chunks)
        gradients = truncated_gradients(ctx, lengths)
        for step, carried in zip(boundary_steps(chunks), gradients.carried, strict=True):
            by_step.setdefault(step, []).append(carried)
    shared = {step: seen for step, seen in by_step.items() if len(seen) > 1}
    assert set(shared) == {4, 5}
    for seen in shared.values():
        for name, value in seen[0].items():
            np.testing.assert_allclose(seen[1][name], value, rtol=1e-12, atol=1e-15)


# Between them: both layouts, both losses, sequence and last-step output.
@pytest.mark.parametrize("key", ["block-keras-ce", "keras-block-last-mse"])
def test_without_the_carry_the_witness_fails(key):
    """Mutant: zero grad_ys into every chunk (plain truncated BPTT). The recurrent weights and
    every h0 must fail; the dense layers, which the carry does not reach, still pass."""
    ctx = context(key)
    lengths = chunk_lengths(TIME_STEPS, 3)
    results = compare_with_full_bptt(ctx, truncated_gradients(ctx, lengths, carry=False))
    dense = {layer.name for layer in ctx.shapes.dense}
    for r in results:
        layer = r.tensor.split("/")[0]
        if layer in dense:
            assert r.passed, (r.tensor, r.error)
        else:
            assert not r.passed, (r.tensor, r.error)
            assert r.error is not None and r.error > 1e-3, r.tensor
    # And with the carry, the very same comparison passes.
    assert all(r.passed for r in compare_with_full_bptt(ctx, truncated_gradients(ctx, lengths)))


def test_chunk_step_is_traced_once(monkeypatch):
    """One trace for chunks of lengths 2, 2, 1, 1, 1: the time axis is left open."""
    made = []

    class Recording(carry._ChunkFunctions):
        def __init__(self, ctx):
            super().__init__(ctx)
            made.append(self)

    monkeypatch.setattr(carry, "_ChunkFunctions", Recording)
    carry_witness(context("block-keras-ce"), 5)
    (functions,) = made
    assert functions.backward.experimental_get_tracing_count() == 1
    assert functions.forward.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("chunks", [TIME_STEPS + 1, 100, 0])
def test_bad_chunk_counts_are_config_errors(chunks):
    with pytest.raises(ConfigError) as caught:
        carry_witness(context("block-keras-ce"), chunks)
    message = str(caught.value)
    assert "\n" not in message
    assert f"--chunks {chunks}" in message
    if chunks > 0:
        assert f"time_steps {TIME_STEPS}" in message
    assert caught.value.exit_code == 2
