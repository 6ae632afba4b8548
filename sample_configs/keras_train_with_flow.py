"""Train a small recurrent model with gradscope's GradientFlow callback, to try `gradscope
watch` (and TensorBoard) on its log folder.

    .venv/bin/python sample_configs/keras_train_with_flow.py runs/memory
    .venv/bin/gradscope watch runs/memory
    .venv/bin/tensorboard --logdir runs        # optional: scalars and the heatmap images

The task needs memory: the label of each sequence of 40 steps is the sign of its first step's
first feature, and the rest is noise. A SimpleRNN (tanh) reads the sequence, an LSTM reads
the SimpleRNN's outputs, and a Dense head gives 2 logits. 3 epochs of 32 batches; the callback
takes one extra pass every 8 batches. The trained model is saved as LOG_DIR/model.keras.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# gradscope first: it imports TensorFlow without its start-up log lines.
from gradscope.keras import GradientFlow  # noqa: E402, I001
import keras  # noqa: E402
import numpy as np  # noqa: E402


def main(log_dir: str) -> None:
    keras.utils.set_random_seed(0)
    generator = np.random.default_rng(0)
    x = generator.normal(size=(1024, 40, 4)).astype("float32")
    y = (x[:, 0, 0] > 0).astype("int32")
    model = keras.Sequential([
        keras.Input((40, 4)),
        keras.layers.SimpleRNN(16, return_sequences=True, name="rnn"),
        keras.layers.LSTM(8, name="lstm"),
        keras.layers.Dense(2, name="logits"),
    ], name="memory")
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    flow = GradientFlow(every=8, log_dir=log_dir)
    model.fit(x, y, batch_size=32, epochs=3, verbose=2, callbacks=[flow])
    flow.report()
    model.save(os.path.join(log_dir, "model.keras"))  # the trained model, beside its log


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
