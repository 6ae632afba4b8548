"""The user's own Keras model.

``archive`` and ``graph`` read a saved ``.keras`` file without TensorFlow: the model's
``config.json`` from the zip, as a graph of layer calls. Everything that can be refused from the
structure alone is refused there, before TensorFlow is imported. ``GradientFlow``
(``callback.py``) is the callback that watches the gradient flow during training.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``gradscope.keras.GradientFlow`` imports TensorFlow and Keras only when it is asked for:
    the CLI reads ``.keras`` files through this package without them."""
    if name == "GradientFlow":
        from gradscope.keras.callback import GradientFlow

        return GradientFlow
    raise AttributeError(f"module 'gradscope.keras' has no attribute {name!r}")


__all__ = ["GradientFlow"]
