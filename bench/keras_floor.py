"""The floor for ``gradscope explain MODEL.keras``: what a user writes by hand to get the
gradients of a saved model. Load it (safe_mode), make a batch, take one GradientTape gradient
of the loss with respect to every trainable weight, print the norms.

    .venv/bin/python bench/keras_floor.py MODEL.keras [--batch-size 32] [--compiled]

``--compiled``: the yardstick of a user-sized model (bench/user_sized.py): the compiled loss
(``model.compute_loss``) and the gradient inside a ``tf.function``.
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
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    model = keras.saving.load_model(args.model, compile=args.compiled, safe_mode=True)
    rng = np.random.default_rng(0)
    shape = (args.batch_size, *model.inputs[0].shape[1:])
    x = rng.standard_normal(shape).astype("float32")
    out_shape = (args.batch_size, *model.outputs[0].shape[1:])
    y = np.eye(out_shape[-1], dtype="float32")[rng.integers(0, out_shape[-1], out_shape[:-1])]
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)

    def gradients_of(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            outputs = model(x, training=False)
            loss = (model.compute_loss(x, y, outputs) if args.compiled
                    else loss_fn(y, outputs))
        return tape.gradient(loss, model.trainable_variables)

    gradients = (tf.function(gradients_of) if args.compiled else gradients_of)(x, y)
    for variable, gradient in zip(model.trainable_variables, gradients, strict=True):
        print(variable.path, float(tf.norm(gradient)))


if __name__ == "__main__":
    main()
