"""Build and save a small encoder–decoder Keras model to try `gradscope explain` on.

    .venv/bin/python sample_configs/keras_encoder_decoder.py /tmp/encdec.keras
    .venv/bin/gradscope explain /tmp/encdec.keras

The encoder reads 12 steps of 8 features; its final state starts the decoder, which reads the
encoder's sequence; a Dense head gives 5 logits per step. Compiled with a softmax
cross-entropy on logits, which gradscope uses as the model's loss.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    source = keras.Input((12, 8), name="source")
    sequence, state = keras.layers.GRU(16, return_sequences=True, return_state=True,
                                       name="encoder")(source)
    decoded = keras.layers.GRU(16, return_sequences=True, name="decoder")(
        sequence, initial_state=state)
    logits = keras.layers.Dense(5, name="logits")(decoded)
    model = keras.Model(source, logits, name="encoder_decoder")
    model.compile(optimizer="adam",
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    return model


if __name__ == "__main__":
    build().save(sys.argv[1] if len(sys.argv) > 1 else "encoder_decoder.keras")
