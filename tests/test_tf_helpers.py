"""What gradscope/_tf.py does to TensorFlow's functions, held to TensorFlow's own count of
their traces."""

from __future__ import annotations

import numpy as np


def test_a_batch_free_function_is_traced_once_for_every_batch_size(tf):
    """A diagnosis steps a call on the whole batch, then its changes on the 8 examples the
    horizon reads: traced with the batch axis free, the second takes the first's trace (with
    ``reduce_retracing`` alone, TensorFlow traced again for it, about 0.4 s of a small GRU's
    Lyapunov scan). A later call of another shape still computes its own numbers."""
    from gradscope._tf import batch_free

    def summed(x, pair, scale):
        return tf.reduce_sum(x, axis=0) * scale, [pair[0] * 2.0, None if pair[1] is None
                                                  else pair[1] + 1.0]

    function = tf.function(summed, autograph=False, reduce_retracing=True)
    run = batch_free(tf, function)
    for rows in (16, 8, 3):
        total, (doubled, _) = run(tf.ones((rows, 5)), [tf.ones((rows, 2)), None],
                                  tf.constant(3.0))
        np.testing.assert_allclose(total.numpy(), np.full(5, 3.0 * rows))
        assert doubled.shape == (rows, 2)
    assert function.experimental_get_tracing_count() == 1
