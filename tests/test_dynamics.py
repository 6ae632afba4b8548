"""gradscope/dynamics.py: the neutral arithmetic of diagnose, on numbers written here."""

from __future__ import annotations

import numpy as np
import pytest

from gradscope import dynamics


def test_exponents_average_over_the_steps_each_example_ran() -> None:
    logs = np.zeros((2, 4, 2))
    logs[0, :, 0], logs[0, :, 1] = -1.0, -3.0
    logs[1, :2, 0], logs[1, :2, 1] = -2.0, -0.5  # example 1 ran two steps
    ran = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    spectrum, change = dynamics.lyapunov_exponents(logs, ran)
    np.testing.assert_allclose(spectrum, [-1.5, -1.75])  # largest first
    assert change == pytest.approx(0.0)


def test_horizon_timescales_and_words() -> None:
    ratios = np.array([[1.0, 0.1, 1e-2, 1e-4], [1.0, 0.2, 2e-3, np.nan]])
    medians = dynamics.median_ratios(ratios)
    np.testing.assert_allclose(medians, [1.0, 0.15, 6e-3, 1e-4])
    assert dynamics.measured_horizon(medians) == 3
    assert dynamics.predicted_horizon(-np.log(10)) == pytest.approx(3.0)
    assert dynamics.predicted_horizon(0.1) is None
    assert dynamics.agreement(3, 3.0) == "within 1.00×"
    taus = dynamics.timescales(np.array([np.exp(-1), 1.0, 0.0]))
    np.testing.assert_allclose(taus, [1.0, np.inf, 0.0])
    assert dynamics.quantile(taus, 1.0) is None
    evidence = dynamics.Evidence(name="lstm", steps=50, largest=-2.0, measured=3, window=16,
                                 predicted=3.45, share_above_1=0.0, keep_gate="forget",
                                 keep_below=0.91, keep_above=0.0, median_tau=0.4)
    assert dynamics.mechanism(evidence) == "vanishing"
    assert dynamics.verdict(evidence).startswith(
        "lstm: vanishing: 91.0% of forget-gate values below 0.1, median τ 0.4 steps, so "
        "gradients fade by 10³ within about 3 steps (measured 3, predicted 3.5)")


def test_a_horizon_measured_over_every_lag_is_not_overruled_by_the_predicted_one() -> None:
    """λ₁ = −0.268 predicts 25.8 steps; measured over every lag of 30 steps (window 29) the
    influence stays above 10⁻³: it holds. The prediction stands in only where the budget cut
    the window short of the sequence, and beyond it."""
    evidence = dynamics.Evidence(name="lstm", steps=30, largest=-0.268, measured=None,
                                 window=29, predicted=25.8, share_above_1=0.0)
    assert dynamics.fades_within(evidence) is None
    assert dynamics.mechanism(evidence) == "holds"
    assert "measured more than 29, predicted 26" in dynamics.verdict(evidence)
    # A long horizon whole, as the horizon line below the verdict writes it (found tried as a
    # new user would: "predicted 7.4e+02" above "predicted 739").
    far = dynamics.Evidence(name="gru", steps=100, largest=-0.00934, measured=None,
                            window=99, predicted=739.4, share_above_1=0.0)
    assert "(measured more than 99, predicted 739)" in dynamics.verdict(far)
    cut = dynamics.Evidence(name="lstm", steps=300, largest=-0.05, measured=None, window=64,
                            predicted=138.0, share_above_1=0.0)
    assert dynamics.fades_within(cut) == 138.0 and dynamics.mechanism(cut) == "vanishing"
    below = dynamics.Evidence(name="lstm", steps=300, largest=-0.2, measured=None, window=64,
                              predicted=34.5, share_above_1=0.0)
    assert dynamics.fades_within(below) is None and dynamics.mechanism(below) == "holds"
    # Found tried as a new user would: a padded batch whose steps measured have 18 lags, all
    # of them measured, in a call of 20 steps: the prediction (19.4) did overrule them.
    every = dynamics.Evidence(name="lstm", steps=20, largest=-0.356, measured=None,
                              window=18, predicted=19.4, share_above_1=0.0, longest=18)
    assert dynamics.fades_within(every) is None and dynamics.mechanism(every) == "holds"
    budget = dynamics.Evidence(name="lstm", steps=20, largest=-0.356, measured=None,
                               window=16, predicted=19.4, share_above_1=0.0, longest=19)
    assert dynamics.fades_within(budget) == 19.4


def test_one_fading_on_either_side_of_the_factor_is_said_so() -> None:
    """A 30-step layer at λ₁ = −0.204: ∂L/∂s carried back keeps ×7.8e-4 (explain flags it),
    an input's influence 29 steps back ×1.5e-3 (the horizon holds); λ₁ alone leaves
    e^(−0.204·29) = ×2.69e-3, within APART of the carried ratio: one fading, two reads."""
    evidence = dynamics.Evidence(name="bi/forward", steps=30, largest=-0.204, measured=None,
                                 window=29, predicted=33.9, share_above_1=0.0, carried=7.8e-4,
                                 reach=1.5e-3, reach_lag=29)
    assert dynamics.flow_kind(7.8e-4) == "vanishing" and dynamics.mechanism(evidence) == "holds"
    kept = np.exp(-0.204 * 29)
    assert dynamics.verdict(evidence).endswith(
        "neither vanishing within the 30 steps nor exploding; explain --flow flags it "
        "vanishing: ∂L/∂s carried back from t=29 to t=0 keeps ×0.00078 "
        f"({np.log(7.8e-4) / 29:+.3g} per step), while an input's influence 29 steps back is "
        f"still ×0.0015 of its own step's: one fading at about λ₁'s rate (λ₁ = -0.204 per "
        f"step leaves ×{kept:.3g} over those 29 steps), read two ways that fall on either "
        "side of 10³")
    assert dynamics.flow_kind(1 / dynamics.FLOW_FACTOR) is None
    assert dynamics.flow_kind(1.01 * dynamics.FLOW_FACTOR) == "exploding"
    agreeing = dynamics.Evidence(name="lstm", steps=30, largest=-0.209, measured=None,
                                 window=29, predicted=33.1, share_above_1=0.0,
                                 carried=1.96e-3, reach=3.98e-3, reach_lag=29)
    assert dynamics.flow_note(agreeing) is None


def test_a_smallest_singular_value_below_the_arithmetics_resolution_is_a_bound():
    """σ_min far below max(rows, columns)·eps·σ_max is rounding: given as that floor, marked;
    one the arithmetic resolves is given as it is."""
    from gradscope.dynamics import singular_summary

    rng = np.random.default_rng(0)
    q1, _ = np.linalg.qr(rng.standard_normal((3, 3, 3)))
    q2, _ = np.linalg.qr(rng.standard_normal((3, 3, 3)))
    eps = float(np.finfo(np.float64).eps)
    for low, below in ((1e-3, False), (1e-22, True)):
        blocks = q1 @ (np.array([2.0, 1.0, low])[:, None] * q2)
        found = singular_summary(blocks, eps)
        assert found["smallest_singular_below"] is below
        assert found["largest_singular_median"] == pytest.approx(2.0)
        assert found["smallest_singular_median"] == pytest.approx(3 * eps * 2.0 if below
                                                                  else low, rel=1e-6)
        assert found["frobenius_median"] == pytest.approx(np.sqrt(5 + low**2))


def test_a_padded_batch_is_read_over_the_steps_its_longest_example_ran() -> None:
    """The same evidence on a batch padded to 200 steps whose longest example ran 30: the
    verdict counts 30 steps, and the carried ratio spans them, said without step numbers
    (a batch padded after its sequences is read aligned at each example's last step)."""
    evidence = dynamics.Evidence(name="bi/forward", steps=200, largest=-0.204, measured=None,
                                 window=29, predicted=33.9, share_above_1=0.0, carried=7.8e-4,
                                 reach=1.5e-3, reach_lag=29, ran=30)
    kept = np.exp(-0.204 * 29)
    assert dynamics.mechanism(evidence) == "holds"
    assert dynamics.verdict(evidence).endswith(
        "neither vanishing within the 30 steps the longest example ran (200 with padding) "
        "nor exploding; explain --flow flags it vanishing: ∂L/∂s carried back over the 30 "
        f"steps the longest example ran keeps ×0.00078 ({np.log(7.8e-4) / 29:+.3g} per "
        "step), while an input's influence 29 steps back is still ×0.0015 of its own step's: "
        f"one fading at about λ₁'s rate (λ₁ = -0.204 per step leaves ×{kept:.3g} over those "
        "29 steps), read two ways that fall on either side of 10³")


def test_a_vanishing_layer_whose_steps_stretch_says_how_both_hold() -> None:
    """Found tried as a new user would: a tanh SimpleRNN at spectral radius 1.3 read
    "vanishing" beside "‖J_t‖₂ > 1 on 100% of steps", with no word on how both hold. Where
    at least half the steps stretch, the verdict says it; below half, nothing is added."""
    def said(share: float) -> str:
        return dynamics.verdict(dynamics.Evidence(
            name="srnn", steps=100, largest=-0.135, measured=56, window=99, predicted=51.2,
            share_above_1=share))

    assert said(1.0).endswith(
        "of the 100 steps, though ‖J_t‖₂ > 1 on 100% of steps: what one step stretches, "
        "the steps after it shrink more")
    assert said(0.49).endswith("of the 100 steps")


def test_a_change_run_on_some_examples_is_compared_on_them_in_words() -> None:
    """Found tried as a new user would: "λ₁ = -0.243 per step … λ₁ would be -0.0734 per
    step, against -0.244 now", the second on the change's 8 examples, read as two values of
    one number. The verdict names the examples' count where the change ran on some."""
    whole = dynamics.remedy_by_rate("forget-gate bias +1", -0.0734, -0.244, 36,
                                    first_column=True, measured=31)
    some = dynamics.remedy_by_rate("forget-gate bias +1", -0.0734, -0.244, 36,
                                   first_column=True, measured=31, examples=8)
    assert "λ₁ of the first tangent column would be -0.0734 per step, against -0.244 now " \
        "(measured)" in whole
    assert "against -0.244 now on the same 8 examples (measured)" in some
    # And the horizon it predicts is said to be that λ₁'s (found tried as a new user would:
    # "(measured 38, predicted 30)", then "not 34 steps", read as two predictions of one).
    assert "within about 94 steps, not 28 steps as -0.244 gives (predicted;" in some
    plain = dynamics.remedy_by_rate("forget-gate bias +1", -0.0734, -0.244, 36, measured=31)
    assert "within about 94 steps, not 28 steps (predicted;" in plain


@pytest.mark.parametrize(("horizon", "before", "named"), [
    (3, 2, False),  # 1.5 times, but one step: found tried as a new user would (a GRU's)
    (4, 2, True), (5, 4, False), (6, 4, True), (15.5, 10, True), (14, 10, False)])
def test_a_change_is_a_remedy_only_where_it_lengthens_the_horizon_enough(horizon, before,
                                                                         named):
    """A measured horizon names its change for a vanishing layer at 1.5 times the layer's
    and 2 steps more (a horizon beyond its window counts half a step past it)."""
    assert dynamics.lengthens(horizon, before) is named


@pytest.mark.parametrize(("largest", "later", "said"), [
    (-0.003, 0.0131, "read alone, the second half would be exploding (λ₁ above 0.01)"),
    (0.02, 0.004, "read alone, the second half would not be exploding (λ₁ at most 0.01)"),
    (-0.3, -0.2, None), (0.03, 0.05, None), (0.01, 0.0100001, "read alone, the second half "
                                            "would be exploding (λ₁ above 0.01)")])
def test_a_second_half_read_otherwise_than_the_verdict_is_said(largest, later, said) -> None:
    """Found tried as a new user would: λ₁'s unsettled second half read +0.0131 beside a
    verdict "holds, … nor exploding", read from all the steps."""
    assert dynamics.read_apart(largest, later) == said
