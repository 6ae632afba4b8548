"""The floor: a minimal hand-written TF2 program for the seed model, nothing else.

Block-layout (TF1 GRUCell) GRUs with tf.function + tf.scan, a dense layer at every step,
mean softmax cross-entropy, one forward/backward pass for all weights and initial states.
``gradscope explain`` is timed against this (bench/explain_latency.py).
"""

import argparse
import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--input-size", type=int, default=200)
parser.add_argument("--time-steps", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=34)
parser.add_argument("--units", default="64,32")
parser.add_argument("--classes", type=int, default=3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
units = [int(u) for u in args.units.split(",")]
rng = np.random.default_rng(args.seed)


def glorot(shape):
    limit = np.sqrt(6.0 / sum(shape))
    return tf.constant(rng.uniform(-limit, limit, shape), tf.float32)


weights, fan_in = [], args.input_size
for u in units:
    weights += [glorot((fan_in + u, 2 * u)), tf.ones([2 * u]), glorot((fan_in + u, u)),
                tf.zeros([u])]
    fan_in = u
weights += [glorot((fan_in, args.classes)), tf.zeros([args.classes])]
h0s = [tf.zeros([args.batch_size, u]) for u in units]
x = tf.constant(rng.standard_normal((args.batch_size, args.time_steps, args.input_size)),
                tf.float32)
labels = tf.one_hot(rng.integers(0, args.classes, (args.batch_size, args.time_steps)),
                    args.classes)


def gru(sequence, h0, w_ru, b_ru, w_c, b_c):
    def step(h, x_t):
        r, u = tf.split(tf.sigmoid(tf.concat([x_t, h], 1) @ w_ru + b_ru), 2, axis=1)
        c = tf.tanh(tf.concat([x_t, r * h], 1) @ w_c + b_c)
        return u * h + (1 - u) * c

    return tf.scan(step, sequence, initializer=h0)


@tf.function
def loss_and_gradients(weights, h0s):
    with tf.GradientTape() as tape:
        tape.watch([weights, h0s])
        sequence = tf.transpose(x, [1, 0, 2])
        for k, h0 in enumerate(h0s):
            sequence = gru(sequence, h0, *weights[4 * k: 4 * k + 4])
        logits = tf.einsum("tbu,uc->btc", sequence, weights[-2]) + weights[-1]
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels, logits))
    return loss, tape.gradient(loss, [weights, h0s])


loss, (weight_gradients, state_gradients) = loss_and_gradients(weights, h0s)
arrays = [g.numpy() for g in weight_gradients + state_gradients]
print(f"loss {loss.numpy():.6f}, {len(arrays)} gradients")
