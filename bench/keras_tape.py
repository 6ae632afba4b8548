"""The yardstick of a user-sized Keras model: what a user writes by hand for its gradients.
Load the saved model (safe_mode), make a batch, take one GradientTape gradient of the
compiled loss (``model.compute_loss``) inside a ``tf.function``, print the norms.

    .venv/bin/python bench/keras_tape.py MODEL.keras [--batch-size 32]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402  (after TensorFlow, as a user's script would)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    model = keras.saving.load_model(args.model, safe_mode=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, *model.inputs[0].shape[1:])).astype("float32")
    out_shape = (args.batch_size, *model.outputs[0].shape[1:])
    y = np.eye(out_shape[-1], dtype="float32")[rng.integers(0, out_shape[-1], out_shape[:-1])]

    @tf.function
    def gradients(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=False))
        return tape.gradient(loss, model.trainable_variables)

    for variable, gradient in zip(model.trainable_variables, gradients(x, y), strict=True):
        print(variable.path, float(tf.norm(gradient)))


if __name__ == "__main__":
    main()
