"""The gate counts' comparison: a gate value is below LOW or above HIGH as NumPy compares it in
float64, though the graph compares it in its own dtype (float32, or float64 for a float64
cell) against bounds of that dtype (``gates._bounds``): checked on every value of the dtype
within 200 of its steps of each bound, and on the float16 values there (a mixed policy's
gates, cast to float32 exactly). The counts themselves are held to a NumPy forward pass in
test_keras_diagnose.py."""

from __future__ import annotations

import numpy as np
import pytest

INTS = {np.float16: np.int16, np.float32: np.int32, np.float64: np.int64}


def _around(value: float, dtype: type) -> np.ndarray:
    """Every value of ``dtype`` within 200 steps of ``value`` rounded to it."""
    centre = np.array([value], dtype).view(INTS[dtype])[0]
    return (centre + np.arange(-200, 201, dtype=INTS[dtype])).view(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("below, above", [(None, None), (0.7, 0.3), (0.3, 0.7)])
def test_a_gate_value_is_below_and_above_as_float64_compares_it(tf, dtype, below, above):
    from gradscope.dynamics import HIGH, LOW
    from gradscope.keras.diagnose.gates import _bounds

    below = LOW if below is None else below  # (0.7, 0.3): float32 rounds 0.7 down, 0.3 up
    above = HIGH if above is None else above
    low, high = _bounds(dtype, below, above)
    assert low.dtype == dtype and high.dtype == dtype
    for kind in {dtype, np.float16}:
        for bound in (below, above):
            values = _around(bound, kind).astype(dtype)
            exact = values.astype(np.float64)
            np.testing.assert_array_equal(values < low, exact < below)
            np.testing.assert_array_equal(values > high, exact > above)
