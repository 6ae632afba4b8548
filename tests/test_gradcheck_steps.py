"""gradscope/gradcheck.py's retakes and gradscope/keras/check/precision.py's coarse_loss, on
losses whose truth is known: one that curves within check's float64 step (a chaotic
trajectory's, in miniature: sin(10⁶·⟨w, x⟩)/10⁶) and one computed in float32.

Found tried as a new user would: a tanh SimpleRNN at 3× an orthogonal kernel (chaotic over 60
steps) failed check on correct gradients. Its float64 copy's slope at a step of 1e-4 was
-22, at 1e-8 4.8e4 (the tangent's, as at 1e-9): check took that for float32 code and checked
in float32, and every recurrent weight's probes disagreed at 1e-5 and 1e-7."""

from __future__ import annotations

import numpy as np
import pytest

from gradscope.gradcheck import Probe, directional_error, elements_for, settle_kinks, step_for
from gradscope.keras.check.precision import coarse_loss

FREQUENCY = 1e6
W = np.random.default_rng(0).standard_normal(6)


def _curved(x: np.ndarray) -> float:
    return float(np.sin(FREQUENCY * W @ x) / FREQUENCY + 2.0)


def _settled(gradient: np.ndarray) -> tuple[float, bool]:
    base = np.random.default_rng(1).standard_normal(6) * 1e-3
    direction = np.random.default_rng(2).standard_normal(6)
    probe = Probe("w", "direction 1", direction / np.linalg.norm(direction))
    step = step_for("float64")
    plus = np.array([_curved(base + step * probe.direction)])
    minus = np.array([_curved(base - step * probe.direction)])
    settled = settle_kinks(gradient(base), [probe], plus, minus, _curved, base, 2.0, 1e-5,
                           None)
    assert not settled.kinks
    (group, p, m, taken), = settled.groups
    return taken, directional_error(gradient(base), group, p, m, 2.0, 1e-5, None, taken)[1]


def test_a_loss_that_curves_within_the_step_is_resolved_at_a_smaller_one() -> None:
    """At 1e-5 and 1e-7 the central difference of sin(10⁶·h) is off by 1.7e-3 or more; at
    1e-9 by 1.7e-7: the probe agrees there, and keeps that step."""
    taken, passed = _settled(lambda x: np.cos(FREQUENCY * W @ x) * W)
    assert passed and taken == pytest.approx(1e-9)


def test_a_wrong_gradient_disagrees_at_every_step() -> None:
    taken, passed = _settled(lambda x: 1.01 * np.cos(FREQUENCY * W @ x) * W)
    assert not passed and taken == step_for("float64")


def test_a_loss_curved_within_1e_4_resolves_float64_steps() -> None:
    """Its slopes at 1e-4 and 1e-6 are not the tangent's; at 1e-8 and 1e-9 they are."""
    assert coarse_loss(lambda h: float(np.sin(3e5 * h) / 3e5 + 2.0), 2.0) is None


def test_a_loss_that_curves_at_every_step_is_no_low_precision() -> None:
    """Found tried as a new user would: a cell at 6× an orthogonal kernel over 40 steps, its
    slopes along a direction 1e3, 9e5 and 1e7 at 1e-4, 1e-6 and 1e-8, was checked in float32
    as if it computed in a lower precision. Slopes that large are no float32 rounding (about
    3 times the loss at 1e-8): a ripple at every scale, which rounding does not make."""
    def chaotic(h: float) -> float:
        return 2.0 + sum(np.sin(k * h) / k ** 0.1 for k in (1e4, 1e7, 1e10))

    assert coarse_loss(chaotic, 2.0) is None


def test_a_loss_computed_in_float32_does_not() -> None:
    """The same slope, linear, but each value rounded to float32: its slope at 1e-8 and 1e-9
    is that rounding."""
    found = coarse_loss(lambda h: float(np.float32(2.0 + 0.7 * h)), 2.0)
    assert found is not None and "does not resolve float64 steps" in found


def test_central_differences_that_do_not_settle_are_left_out_not_failed() -> None:
    """A loss with a ripple far finer than any step (10⁻¹²·sin(10¹⁰·⟨w, x⟩), as rounding
    amplified along a chaotic trajectory behaves): its central differences at 1e-7 and 1e-9
    disagree with each other by more than those at 1e-5 and 1e-7 did, so they do not
    converge and witness nothing: the probe is left out, said not resolved, never a failure.
    A wrong gradient on a smooth loss still converges, and fails (above)."""
    a = np.random.default_rng(3).standard_normal(6)

    def rippled(x: np.ndarray) -> float:
        return float(a @ x + 1e-12 * np.sin(1e10 * W @ x) + 2.0)

    base = np.random.default_rng(1).standard_normal(6) * 1e-3
    direction = np.random.default_rng(2).standard_normal(6)
    probe = Probe("w", "direction 1", direction / np.linalg.norm(direction))
    gradient = a + 1e-2 * np.cos(1e10 * W @ base) * W
    step = step_for("float64")
    settled = settle_kinks(gradient, [probe], np.array([rippled(base + step * probe.direction)]),
                           np.array([rippled(base - step * probe.direction)]), rippled, base,
                           2.0, 1e-5, None)
    assert not settled.groups and not settled.kinks
    assert [u[0] for u in settled.unresolved] == ["direction 1"]
    assert settled.left_out_detail(1).startswith("1 of 1 probes not resolved")


def _chaotic(x: np.ndarray) -> float:
    """A loss that curves within 1e-5 (10⁻⁶·sin(10⁶·⟨w, x⟩): its central difference at
    1e-5 is far off, at 1e-7 within 10⁻³ of the slope), with a ripple of 10⁻¹² at a far finer
    scale, as rounding amplified along a chaotic trajectory: no step resolves the slope to
    the float64 tolerance."""
    return float(1e-6 * np.sin(1e6 * W @ x) + 1e-12 * np.sin(1e12 * W[::-1] @ x) + 2.0)


@pytest.mark.parametrize(("off", "left_out"), [(0.0, True), (1e-2, False), (5e-3, False)])
def test_differences_that_come_to_autodiff_on_a_curving_loss_are_left_out(off: float,
                                                                          left_out: bool) -> None:
    """Across such a loss the differences at 1e-5, 1e-7 and 1e-9 come, step by step, to
    within 10⁻³ of the true slope and no closer: the probe is left out, not resolved, never
    a failure. A gradient 1% or 0.5% off (beyond that) still fails."""
    base = np.random.default_rng(1).standard_normal(6) * 1e-3
    direction = np.random.default_rng(2).standard_normal(6)
    probe = Probe("w", "direction 1", direction / np.linalg.norm(direction))
    gradient = np.cos(1e6 * W @ base) * W * (1 + off)
    step = step_for("float64")
    settled = settle_kinks(gradient, [probe], np.array([_chaotic(base + step * probe.direction)]),
                           np.array([_chaotic(base - step * probe.direction)]), _chaotic, base,
                           2.0, 1e-5, None)
    assert not settled.kinks and not settled.unresolved
    assert bool(settled.approaching) == left_out and bool(settled.groups) == (not left_out)
    if left_out:
        assert settled.left_out_detail(1).startswith("1 of 1 probes not resolved: the loss "
                                                     "curves within the step")
        return
    (group, plus, minus, taken), = settled.groups
    assert not directional_error(gradient, group, plus, minus, 2.0, 1e-5, None, taken)[1]


def test_a_small_gradient_3_percent_wrong_fails_where_a_smaller_steps_rounding_would_hide_it(
        ) -> None:
    """Found tried as a new user would: an initial state's gradient of 4.1e-05, 3% wrong (a
    custom gradient's ×1.03 in a layer above), passed check, retaken at 1e-9, where the
    loss's rounding allows 1e-05, more than the gradient itself. A retake is taken only
    where its allowance is narrower than the disagreement: at 1e-7 it is (1e-7 against
    1.2e-6), and the probe fails there. A probe 3% off a gradient of 3.5e-7 (1e-8 off) no
    smaller step can see: taken again at ten times the step, whose rounding is a tenth, it
    disagrees as much, and fails too (found tried as a new user would: such probes, left
    out as not resolved, let a gradient 0.05% wrong pass)."""
    true = np.array([4.0e-5, -3.5e-7, 2.0e-6])

    def linear(x: np.ndarray) -> float:
        return float(1.4362 + true @ x)

    wrong = 1.03 * true
    base = np.zeros(3)
    step = step_for("float64")
    probes = [Probe("h0", f"element ({k},)", np.eye(3)[k], (k,)) for k in (0, 1)]
    plus = np.array([linear(base + step * p.direction) for p in probes])
    minus = np.array([linear(base - step * p.direction) for p in probes])
    # What a retake at 1e-9 gives: it would pass the wrong gradient.
    assert directional_error(wrong, probes[:1], np.array([linear(base + 1e-9 * np.eye(3)[0])]),
                             np.array([linear(base - 1e-9 * np.eye(3)[0])]), 1.4362, 1e-5,
                             None, 1e-9)[1]
    settled = settle_kinks(wrong, probes, plus, minus, linear, base, 1.4362, 1e-5, None)
    assert not settled.kinks and not settled.not_resolved and not settled.left_out_detail(2)
    (group, p, m, taken), = settled.groups
    assert [g.label for g in group] == ["element (0,)", "element (1,)"]
    for k in range(2):
        assert not directional_error(wrong, group[k:k + 1], p[k:k + 1], m[k:k + 1], 1.4362,
                                     1e-5, None, taken)[1]
    # The right gradient still passes both.
    right = settle_kinks(true, probes, plus, minus, linear, base, 1.4362, 1e-5, None)
    (group, p, m, taken), = right.groups
    assert len(group) == 2 and directional_error(true, group, p, m, 1.4362, 1e-5, None,
                                                 taken)[1]


def test_a_small_right_gradient_on_a_loss_curving_at_every_step_taken_is_not_failed() -> None:
    """10⁻⁶·sin(10⁷·⟨w, x⟩)/10⁷ beside a loss of 2: its slope, 10⁻⁶ in size, is off by far
    more at 1e-5 and by 16% at 1e-7; only 1e-9 would resolve it, whose rounding (1.4e-5)
    is larger than the slope. The difference moved between the steps taken (the loss
    curves): nothing tells a wrong gradient from this one, so the probe is left out, said not
    resolved, not failed (and not passed)."""
    w = np.random.default_rng(0).standard_normal(6)
    w /= np.linalg.norm(w)

    def curving(x: np.ndarray) -> float:
        return float(2.0 + 1e-6 * np.sin(1e7 * w @ x) / 1e7)

    base = np.zeros(6)
    probe = Probe("w", "direction 1", w)
    gradient = 1e-6 * np.cos(1e7 * w @ base) * w
    step = step_for("float64")
    settled = settle_kinks(gradient, [probe], np.array([curving(base + step * w)]),
                           np.array([curving(base - step * w)]), curving, base, 2.0, 1e-5,
                           None)
    assert not settled.groups and not settled.kinks and not settled.unresolved
    assert [d[0] for d in settled.drowned] == ["direction 1"] and settled.not_resolved


def test_a_disagreement_that_is_the_losss_rounding_agrees_at_ten_times_the_step() -> None:
    """A loss rounded to 1e-13 (as one whose terms cancel rounds as their sizes do, more than
    64 epsilons of itself): its difference at 1e-5 is 2.5e-5 off a right gradient of 1e-4,
    and no smaller step's rounding can see it. At 1e-4, whose rounding is a tenth, it agrees:
    kept there, passed. A gradient 1% wrong disagrees there too, and fails."""
    gradient = np.array([1.0e-4, -0.7e-4, 0.3e-4])

    def rounded(x: np.ndarray) -> float:
        return float(np.round((1.4362 + gradient @ x) / 1e-13) * 1e-13)

    direction = np.random.default_rng(7).standard_normal(3)
    probe = Probe("w", "direction 1", direction / np.linalg.norm(direction))
    step = step_for("float64")
    plus = np.array([rounded(step * probe.direction)])
    minus = np.array([rounded(-step * probe.direction)])
    assert not directional_error(gradient, [probe], plus, minus, 1.4362, 1e-5, None, step)[1]
    for claimed, passes in ((gradient, True), (1.01 * gradient, False)):
        settled = settle_kinks(claimed, [probe], plus, minus, rounded, np.zeros(3), 1.4362,
                               1e-5, None)
        assert not settled.not_resolved and not settled.kinks
        (group, p, m, taken), = settled.groups
        assert taken == pytest.approx(1e-4 if passes else step)
        assert directional_error(claimed, group, p, m, 1.4362, 1e-5, None, taken)[1] == passes


def test_a_factor_is_shown_in_as_many_digits_as_tell_it_from_1() -> None:
    """Found tried as a new user would: a gradient 0.1% wrong, "the tape's is 1 times the
    differences'"."""
    from gradscope.gradcheck import factor_text

    assert [factor_text(v) for v in (1.5, 1.02, 0.98039, 1.001, 0.9995, 1.0)] == [
        "1.5", "1.02", "0.98", "1.001", "0.9995", "1"]


def test_a_single_element_is_measured_against_an_elements_size_not_a_few_giants() -> None:
    """An input's gradient on a near-chaotic RNN: a few early elements of 1e6, the rest
    4.5e-2, so that ‖g‖/√n is 2.2e5, no element's size. A single element 2% wrong, measured
    against it, passed (found tried as a new user would: an input's gradient 2% wrong read
    ✓, its other probes left out as not resolved); against the median |g| it fails, and the
    right one passes. A random direction keeps ‖g‖/√n, the typical size of its derivative."""
    from gradscope.gradcheck import probe_scales

    true = np.full(100, 4.5e-2)
    true[:5] = 1e6
    wrong = true.copy()
    wrong[50] *= 1.02

    def linear(x: np.ndarray) -> float:
        return float(1.0 + true @ x)

    element_probe = Probe("x", "element (50,) (random)", np.eye(100)[50], (50,))
    step = step_for("float64")
    plus = np.array([linear(step * element_probe.direction)])
    minus = np.array([linear(-step * element_probe.direction)])
    assert not directional_error(wrong, [element_probe], plus, minus, 1.0, 1e-5, None, step)[1]
    assert directional_error(true, [element_probe], plus, minus, 1.0, 1e-5, None, step)[1]
    direction = Probe("x", "direction 1", np.ones(100) / 10.0)
    typical = float(np.linalg.norm(true)) / 10.0
    assert probe_scales(true, [direction], np.array([0.0]))[0] == pytest.approx(typical)
    assert probe_scales(true, [element_probe], np.array([0.0]))[0] == pytest.approx(4.5e-2)


def test_a_layers_own_differences_that_do_not_settle_witness_nothing() -> None:
    """Found tried as a new user would: Keras' own SimpleRNN at 4× an orthogonal kernel,
    "the tape's is -205 times the differences'" (differences that change sign from one step
    to the next), where a custom layer 2% wrong beside it was the fault. Differences that
    settle, to another value than the tape's, still fail."""
    from gradscope.keras.check.own_backward import _not_settled

    gradient = np.array([3.0, -1.0, 2.0])
    probe = Probe("input", "a random direction", np.array([1.0, 0.0, 0.0]))
    assert _not_settled(gradient, probe, [1.9e4, -6.6e4, -1.2e5], 1.0, 1e-5, "float64")
    assert not _not_settled(gradient, probe, [3.06, 3.0600001, 3.0600002], 1.0, 1e-5,
                            "float64")


def test_a_small_losss_rounding_is_measured_apart_from_its_curvature() -> None:
    """A loss of 6e-9 near its minimum (a model's outputs near their targets): over ±2e-8 its
    curvature moves it by about 1e-16, far above its rounding (about 1e-24). A line through
    the five points took that curvature for rounding, so a smaller step was not taken where
    the loss curves within the step, and a right gradient failed. The parabola's residues
    are the rounding's: the floor, 64 epsilons of the loss. A loss whose terms cancel, rounded
    to 1e-18, keeps that rounding."""
    from gradscope.gradcheck import ROUNDING, ROUNDING_STEPS, small_loss_rounding

    def near_minimum(h: float) -> float:
        return 6e-9 + 1e-4 * h + 0.4 * h * h + 3.0 * h ** 3

    measured = small_loss_rounding([near_minimum(h) for h in ROUNDING_STEPS])
    assert measured == pytest.approx(ROUNDING * 6e-9)
    rng = np.random.default_rng(3)
    noisy = [near_minimum(h) + 1e-18 * rng.uniform(-1, 1) for h in ROUNDING_STEPS]
    assert 1e-18 < small_loss_rounding(noisy) < 1e-16


def test_richardsons_extrapolation_resolves_what_no_smaller_step_can_see() -> None:
    """A loss of 1.38 that curves within the step 1e-3 (a softmax LSTM's, in miniature: a
    derivative of 6.26e-6, its central difference 1.15e-10 off, 1.8e-5 of it): at every
    smaller step the rounding is wider than that disagreement, so no retake could tell, and
    a right gradient failed (found tried as a new user would). Extrapolated from 1e-3 and
    5e-4 it agrees; a gradient 0.01% wrong still fails."""
    from gradscope.gradcheck import can_tell, extrapolated_error, retakes_for

    slope, bend = 6.26e-6, 1.15e-4
    direction = np.random.default_rng(5).standard_normal(4)
    probe = Probe("w", "direction 1", direction / np.linalg.norm(direction))
    right = slope * probe.direction

    def loss(h: float) -> float:
        return 1.38 + slope * h + bend * h ** 3

    step = step_for("float64", "smooth")
    plus, minus = np.array([loss(step)]), np.array([loss(-step)])
    half = np.array([loss(step / 2)]), np.array([loss(-step / 2)])
    assert not directional_error(right, [probe], plus, minus, 1.38, 1e-5, None, step)[1]
    assert not any(can_tell(right, [probe], plus, minus, 1.38, 1e-5, None, step, smaller)
                   for smaller in retakes_for("float64", "smooth"))
    for claimed, passes in ((right, True), (1.0001 * right, False)):
        error, passed, detail = extrapolated_error(claimed, [probe], plus, minus, *half, 1.38,
                                                   1e-5, None, step)
        assert passed == passes, (error, detail)
    assert "Richardson" in detail


def test_the_element_probed_of_a_gradient_of_zeros_is_not_called_largest():
    """Every |g| 0 (a weight the loss does not move here): the first element is probed, and
    its label says so, not "largest |g|"."""
    zeros = elements_for("w", np.zeros((2, 3)), [4, 5])
    assert zeros[0].label == "element (0, 0) (the first; every |g| is 0)"
    some = elements_for("w", np.array([[0.0, -2.0, 1.0]]), [0])
    assert some[0].label == "element (0, 1) (largest |g|)"
