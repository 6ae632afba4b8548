"""NumPy work in a process that runs TensorFlow.

TensorFlow's thread pools keep spinning after each op; NumPy's BLAS, with a thread per core,
then fights them for the same cores. Measured here on 2 cores: a 100-step GRU forward in the
NumPy reference takes 0.03 s alone, 0.7 s after TensorFlow has run an op, and 0.03 s again with
one BLAS thread. The reference's matrices are small: one thread loses nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def blas_beside_tensorflow() -> Iterator[None]:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield
