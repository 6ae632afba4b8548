"""The first operation that turns finite numbers into NaN or Inf, while one piece of work
(a layer call, a cell step, a loss) runs eagerly.

``tf.debugging.enable_check_numerics`` raises at the first op whose output is not finite,
and says only its type. This registers an op callback of the same kind (the hook
check_numerics itself is built on) that records, for the first op whose float inputs are
all finite and whose float output is not, its type, its inputs and that output, and lets the
run go on: the magnitudes and positions then come with the op. The callback is removed
afterwards, whatever happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Birth:
    """The op that first made a non-finite value, with its float inputs and that output."""

    op_type: str
    inputs: list[np.ndarray]
    output: np.ndarray

    def input_magnitudes(self) -> list[float]:
        """max |x| of each float input (0 for an empty one)."""
        return [float(np.max(np.abs(x))) if x.size else 0.0 for x in self.inputs]


def finite(value: Any) -> bool:
    """Whether every number of a float array (or tensor) is finite; other dtypes are."""
    array = np.asarray(value)
    return array.dtype.kind != "f" or bool(np.all(np.isfinite(array)))


@contextlib.contextmanager
def watched_births() -> Iterator[list[Birth]]:
    """Within the block, every eager op is looked at; the list it yields gets the first
    :class:`Birth` (at most one)."""
    from tensorflow.python.framework import op_callbacks

    found: list[Birth] = []

    def callback(op_type: Any, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None,
                 graph: Any = None) -> None:
        if found or graph is not None or not outputs:
            return None  # a traced op has no values yet
        floats = [np.asarray(x) for x in inputs or () if _float_tensor(x)]
        if not all(finite(x) for x in floats):
            return None
        for output in outputs:
            if _float_tensor(output) and not finite(output):
                name = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
                found.append(Birth(name, floats, np.asarray(output)))
                break
        return None

    op_callbacks.add_op_callback(callback)
    try:
        yield found
    finally:
        op_callbacks.remove_op_callback(callback)


def first_birth(run: Callable[[], Any]) -> tuple[Any, Birth | None]:
    """``run()`` eagerly with its ops looked at: what it returned (None where it raised)
    and the first op that made a non-finite value."""
    from gradscope._tf import native_stderr_silenced

    result = None
    # The user's code may raise on a NaN: the op that made it is known by then.
    with native_stderr_silenced(), watched_births() as found, \
            contextlib.suppress(Exception):
        result = run()
    return result, (found[0] if found else None)


def _float_tensor(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return bool(getattr(dtype, "is_floating", False)) and hasattr(value, "numpy")
