"""gradscope/keras/nonfinite/causes.py: the causes in words, from numbers made here (no
TensorFlow): a state sequence that doubles each step, ops with known inputs."""

from __future__ import annotations

import numpy as np

from gradscope.keras.nonfinite.births import Birth
from gradscope.keras.nonfinite.causes import fully_masked, growth_cause, op_cause
from gradscope.keras.nonfinite.reruns import positions


class _Relu:
    __name__ = "relu"


class _Cell:
    activation = _Relu()
    recurrent_dropout = 0.25


def test_the_growth_is_measured_over_the_steps_before_the_overflow():
    sequence = np.ones((2, 12, 3))
    sequence[1] = 2.0 ** np.arange(12)[:, None]  # example 1 doubles each step
    sequence[1, 9:] = np.inf
    cause = growth_cause(sequence, 1, 9, False, _Cell(), training=False)
    assert cause == ("the recurrent state grows 2× a step with relu, reaching 2.6e+02 at "
                     "step 8, and overflows float64 (largest 1.8e+308) at step 9 (example 1)")
    trained = growth_cause(sequence, 1, 9, False, _Cell(), training=True)
    assert trained is not None and "recurrent_dropout 0.25 (the units it keeps are scaled " \
                                   "by 1.33 every step)" in trained
    backwards = growth_cause(sequence, 1, 9, True, _Cell(), training=False)
    assert backwards is not None and backwards.endswith(
        "at step 3, and overflows float64 (largest 1.8e+308) at step 2 (example 1)")
    # The dtype that overflows, named with its largest number (found tried as a new user
    # would: a mixed_float16 state past 65504 was said to overflow, float16 not named).
    half = growth_cause(sequence.astype("float16"), 1, 9, False, _Cell(), training=False)
    assert half is not None and "overflows float16 (largest 6.55e+04) at step 9" in half
    assert growth_cause(np.ones((1, 12, 3)), 0, 9, False, _Cell(), False) is None  # flat


def test_ops_say_their_cause_with_the_numbers():
    exp = Birth("Exp", [np.array([[1.0, 812.0]])], np.array([[np.e, np.inf]]))
    assert op_cause(exp, 37, [2]) == "exp overflow: the pre-activation reached 812 at step " \
                                     "37 (example 2)"
    log = Birth("Log", [np.array([0.5, 0.0])], np.array([-0.69, -np.inf]))
    assert op_cause(log, None, [1]) == "log of 0 (example 1)"
    divide = Birth("RealDiv", [np.zeros(2), np.zeros(2)], np.array([np.nan, np.nan]))
    assert op_cause(divide, None, [0, 1]) == "a division by 0 (examples 0, 1) (0/0 is NaN)"
    # x/‖x‖ where one example's x is all 0: 0/0 there, the other divisors not 0 (found tried
    # as a new user would: said "a division that overflows … numerators up to 0.452").
    x = np.array([[0.452, 0.3], [0.0, 0.0]])
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        normalised = Birth("RealDiv", [x, norms], x / norms)
    assert op_cause(normalised, 4, [1]) == "a division by 0 at step 4 (example 1) (0/0 is NaN)"
    large = Birth("RealDiv", [np.array([3e38, 1.0]), np.array([1e-3, 2.0])],
                  np.array([np.inf, 0.5]))
    assert op_cause(large, None, [0]) == ("a division that overflows (example 0): numerators "
                                          "up to 3e+38")
    assert op_cause(None, None, []).startswith("no single operation could be named")
    # The number quoted is the named step's (found tried as a new user would: step 0 named,
    # the lowest over every step quoted).
    features = np.full((2, 3, 2), 0.5)
    features[0, 0, 1], features[1, 0, 0], features[1, 2, 1] = -0.630, -0.2, -0.723
    with np.errstate(invalid="ignore"):
        logs = Birth("Log", [features], np.log(features))
    assert op_cause(logs, 0, [0, 1]) == ("log of a negative number (-0.63) at step 0 "
                                         "(examples 0, 1)")


def test_a_fully_masked_example_and_positions():
    mask = np.ones((3, 4), bool)
    mask[2] = False
    mean = Birth("RealDiv", [np.zeros((3, 2)), np.zeros((3, 1))], np.full((3, 2), np.nan))
    assert fully_masked(mask, [2], mean) == ("a fully masked example: the mean over 0 steps "
                                             "(example 2: the mask keeps none of its 4 steps, "
                                             "and 0/0 is NaN)")
    # No operation named (a softmax over scores all masked to −inf, found tried as a new
    # user would: it was said to be a mean), or another one: said as what it is.
    assert fully_masked(mask, [2]) == (
        "a fully masked example (example 2: the mask keeps none of its 4 steps); no single "
        "operation could be named: an average over no steps is 0/0 (a mean, or a softmax "
        "whose every score is masked to −inf)")
    log = Birth("Log", [np.array([0.0])], np.array([-np.inf]))
    assert fully_masked(mask, [2], log) == ("log of 0 (example 2); a fully masked example "
                                            "(example 2: the mask keeps none of its 4 steps)")
    assert fully_masked(mask, [0]) is None and fully_masked(None, [2]) is None
    value = np.zeros((3, 5, 2))
    value[1, 4, 0] = value[2, 3, 1] = np.nan
    assert positions(value) == (3, [2])
    assert positions(value[:, :, 0]) == (None, [1])
    assert positions(np.array([0.0, np.inf, np.nan])) == (None, [1, 2])
