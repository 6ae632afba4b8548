"""The scalars GradientFlow writes to TensorBoard's event files: each one the bytes
TensorBoard's own ``scalar_pb`` writes for its tag and value."""

from __future__ import annotations

import math

import numpy as np
import pytest


# TensorBoard's scalar_pb warns as it rounds 1e300 to float32's infinity.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_each_scalar_is_the_bytes_tensorboard_own_scalar_pb_writes(tf):
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.scalar.summary_v2 import scalar_pb

    from gradscope.keras.summaries import add_scalar

    values = [0.0, -0.0, -1.5, 1 / 3, 1e-45, 1e-50, 3.4e38, 1e300, -1e300, math.inf,
              -math.inf, math.nan, True, 7, np.float64(0.1), np.float32(2.5), np.int64(-3)]
    ours = summary_pb2.Summary()
    for index, value in enumerate(values):
        add_scalar(ours, f"diagnose/layer_{index}/lyapunov_1", value)
    for index, value in enumerate(values):
        theirs = scalar_pb(f"diagnose/layer_{index}/lyapunov_1", value).value[0]
        assert ours.value[index].SerializeToString() == theirs.SerializeToString(), value
