"""The gradients of Keras' regularization penalties, in NumPy: what a witness that recomputes
a layer's gradient (the NumPy reference) must add so that it accounts for the whole loss.

- A weight regularizer adds ``penalty(W)`` to the loss: its gradient joins W's.
- An activity regularizer adds ``penalty(output) / batch`` for each output of each call
  (``Layer.__call__``): its gradient joins the gradient flowing into that output.

Keras' own L1, L2 and L1L2 are written out; any other regularizer has no NumPy form, and the
witness says so instead of comparing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Keras' regularizer classes whose penalty is l1·Σ|x| + l2·Σx² (with their factors).
ELEMENTWISE = {"L1", "L2", "L1L2"}


def unsupported(regularizer: Any) -> str | None:
    """Why a regularizer's gradient has no NumPy form here (None: it has one)."""
    if regularizer is None:
        return None
    name = type(regularizer).__name__
    module = type(regularizer).__module__
    if name in ELEMENTWISE and module.startswith("keras."):
        return None
    return f"the regularizer {name} has no NumPy form in gradscope"


def penalty_gradient(regularizer: Any, value: np.ndarray) -> np.ndarray:
    """∂ penalty(value) / ∂ value for Keras' L1, L2 and L1L2 (sign(0) = 0, as TensorFlow's
    gradient of |x| at 0). Zero for no regularizer."""
    if regularizer is None:
        return np.zeros_like(value)
    reason = unsupported(regularizer)
    if reason is not None:
        raise ValueError(reason)
    config = regularizer.get_config()
    # Keras casts the Python factor with ops.cast, which makes it a float32 tensor first: the
    # penalty uses the factor rounded to float32, in a float64 model too.
    l1 = float(np.float32(config.get("l1", 0.0) or 0.0))
    l2 = float(np.float32(config.get("l2", 0.0) or 0.0))
    return l1 * np.sign(value) + 2.0 * l2 * value


def activity_gradient(regularizer: Any, output: np.ndarray) -> np.ndarray:
    """The activity regularizer's share of ∂L/∂output: Keras divides the penalty by the batch
    size of the output."""
    if regularizer is None or output.ndim == 0:
        return penalty_gradient(regularizer, output)
    return penalty_gradient(regularizer, output) / max(output.shape[0], 1)
