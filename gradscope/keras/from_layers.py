"""A Keras model built from a list of Keras layers (class, config, weights) and a loss, held to
predictions made without Keras: how ``gradscope diagnose CONFIG`` gets Keras' own cells for a
YAML spec's model (the list is :func:`gradscope.yaml.keras_layers.keras_layers`'s).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.errors import InternalError
from gradscope.keras.live import LOADED_FROM


def built(name: str, steps: int, features: int, layers: list[Any],
          loss: tuple[str, dict[str, Any]], label: str, x: np.ndarray, expected: np.ndarray,
          dtype: str) -> Any:
    """``keras.Sequential`` of ``layers`` (each with ``class_name``, ``config`` and
    ``weights``) on inputs (steps, features), compiled with ``loss`` (a class name in
    ``keras.losses`` and its arguments) and known by ``label`` in reports. Its predictions for
    ``x`` must equal ``expected`` (a float64 computation of the same model) to the cross-check
    tolerance of ``dtype``; else :class:`InternalError`: the model would not be the one
    described."""
    from gradscope._tf import import_tensorflow

    import_tensorflow()  # quietly, before Keras imports it
    import keras

    from gradscope.gradcheck import tolerance

    # The model object's own dtype policy, and the loss's, are the global one as they are
    # made: the spec's dtype, so that a float64 spec computes (and its loss adds up) in float64.
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        model = keras.Sequential([keras.Input((steps, features), dtype=dtype, name="x")],
                                 name=name)
        for layer in layers:
            made = getattr(keras.layers, layer.class_name)(**layer.config)
            model.add(made)
            made.set_weights(layer.weights)
        loss_class, arguments = loss
        model.compile(loss=getattr(keras.losses, loss_class)(**arguments, dtype=dtype))
    finally:
        keras.config.set_dtype_policy(previous)
    predicted = np.asarray(model(x.astype(dtype), training=False), np.float64)
    rtol, atol = tolerance("cross_check", dtype)
    if predicted.shape != expected.shape or not np.allclose(predicted, expected, rtol=rtol,
                                                            atol=atol):
        worst = (float(np.max(np.abs(predicted - expected)))
                 if predicted.shape == expected.shape else float("nan"))
        raise InternalError(f"{label}: Keras' layers with the spec's weights do not predict "
                            f"what the spec's own NumPy pass does (largest difference "
                            f"{worst:.3g}, shapes {predicted.shape} and {expected.shape})")
    setattr(model, LOADED_FROM, label)
    return model
