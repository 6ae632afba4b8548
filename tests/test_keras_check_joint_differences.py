"""The joint directions of check's finite differences, on a loss written in NumPy whose
gradient is known exactly: tensors whose gradients differ by orders of magnitude, a wrong
gradient in any one of them caught, and the right ones passed (a check that cannot fail is a
defect; one that fails on the truth is one too)."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from gradscope.gradcheck import rounding_noise
from gradscope.keras.check.joint_differences import Part, joint_check

RTOL, DELTA = 1e-5, 1e-5


def _problem(sizes: list[int], scales: list[float], seed: int):
    """L = Σ_t s_t·Σ sin(w_t·θ_t): each tensor's gradient is s_t·w_t·cos(w_t·θ_t)."""
    rng = np.random.default_rng(seed)
    values = {f"t{k}": rng.standard_normal(n) for k, n in enumerate(sizes)}
    weights = {name: rng.uniform(0.5, 2.0, value.shape) for name, value in values.items()}
    scale = {f"t{k}": s for k, s in enumerate(scales)}

    def loss(at: dict[str, np.ndarray]) -> float:
        return float(sum(scale[n] * np.sum(np.sin(weights[n] * at.get(n, values[n])))
                         for n in values))

    gradients = {n: scale[n] * weights[n] * np.cos(weights[n] * values[n]) for n in values}
    return values, gradients, loss


problems = st.tuples(
    st.lists(st.integers(1, 400), min_size=1, max_size=8),
    st.integers(0, 2**31),
).flatmap(lambda found: st.tuples(
    st.just(found[0]),
    st.lists(st.floats(-4, 1), min_size=len(found[0]), max_size=len(found[0])),
    st.just(found[1])))


@settings(max_examples=60, deadline=None)
@given(problems)
# Found by hypothesis: 740 terms of up to 10 summing to 1.1 round as their sizes do, 2.1e-5
# off at 1e-5; at 1e-4, 2.8e-7.
@example(([16, 24, 240, 165, 294], [-4.0, 0.0, 1.0, 0.0, 0.25], 64))
def test_the_true_gradients_pass(problem) -> None:
    sizes, exponents, seed = problem
    values, gradients, loss = _problem(sizes, [10.0 ** e for e in exponents], seed)
    parts = [Part(n, gradients[n], values[n]) for n in values]
    result = joint_check(parts, 3, np.random.default_rng(seed), loss(values), RTOL, None, DELTA,
                         loss)
    assert result.passed, result.detail


@settings(max_examples=60, deadline=None)
@given(problems, st.data())
def test_a_wrong_gradient_in_any_one_tensor_is_caught(problem, data) -> None:
    """One tensor's gradient off by 0.1% (100 times the tolerance), whatever its size next to
    the others': caught, wherever that error stands clear of the loss's rounding (where its own
    probe would see it)."""
    sizes, exponents, seed = problem
    values, gradients, loss = _problem(sizes, [10.0 ** e for e in exponents], seed)
    wrong = data.draw(st.sampled_from(sorted(values)))
    assume(1e-3 * Part(wrong, gradients[wrong], values[wrong]).typical()
           >= 10 * rounding_noise(loss(values), DELTA))
    parts = [Part(n, gradients[n] * (1.001 if n == wrong else 1.0), values[n]) for n in values]
    result = joint_check(parts, 3, np.random.default_rng(seed), loss(values), RTOL, None, DELTA,
                         loss)
    assert not result.passed, result.detail


def test_a_part_held_fixed_does_not_move() -> None:
    values, gradients, loss = _problem([50], [1.0], 0)
    keep = (np.arange(50) % 2).astype(np.float64)
    moved = []

    def watching(at: dict[str, np.ndarray]) -> float:
        moved.append(at["t0"] - values["t0"])
        return loss(at)

    joint_check([Part("t0", gradients["t0"], values["t0"], keep)], 2,
                np.random.default_rng(0), loss(values), RTOL, None, DELTA, watching)
    assert moved and all(np.all(delta[keep == 0] == 0) for delta in moved)
