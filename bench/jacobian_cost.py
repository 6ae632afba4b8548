"""What ∂h_T/∂h_0 of one recurrent layer costs per time step, three ways side by side, and the
floor below which no exact float64 Jacobian goes.

One layer of the user-sized model (LSTM 256 on 64 features, batch 32; gradscope's TF cell in
float64, as ``explain --jacobians`` runs it), over ``--steps`` steps:
- ``floor``: the one product every Jacobian column needs at every step, the recurrent
  kernel (u × 4u) times the h part of S = 2u columns for all B examples, and nothing else;
- ``by_hand``: gradscope's route, the S tangents carried forward in blocks
  (gradscope/keras/state_tangents.py) through the cell's step linearised by hand
  (``Cell.tf_step_tangent``);
- ``carried``: the route before it, the same blocks through forward-mode autodiff of the step
  (``tf.autodiff.ForwardAccumulator``), as a cell of the user's still takes;
- ``backward``: the route before it, ``batch_jacobian`` with one backward pass per unit.
Each runs once untimed (its trace), then alternately ``--repeats`` times; wall and CPU
seconds per step (medians), and both extrapolated to 1000 steps and two layers.

    .venv/bin/python bench/jacobian_cost.py [--steps 20] [--repeats 3] [--units 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from gradscope._tf import import_tensorflow  # noqa: E402
from gradscope.cells.lstm_keras import LSTMKeras  # noqa: E402
from gradscope.keras import state_tangents  # noqa: E402


def routes(tf, cell, params, x, initial):  # noqa: ANN001, ANN201  (a bench)
    """Each route as a function of no arguments that returns its result as NumPy."""
    units, width = cell.units, 2 * cell.units
    inputs = tuple(cell.tf_inputs(tf, params, tf.transpose(x, [1, 0, 2])))
    weights = cell.tf_step_weights(tf, params)
    states = list(tf.split(initial, 2, axis=1))

    def advance(weights, states, inputs_t):  # noqa: ANN001, ANN202
        return list(cell.tf_step(tf, weights, tuple(states), inputs_t))

    def tangent(weights, states, inputs_t, tangents):  # noqa: ANN001, ANN202
        after, moved = cell.tf_step_tangent(tf, weights, tuple(states), inputs_t,
                                            tuple(tangents))
        return list(after), list(moved)

    carried = state_tangents.jacobian_function(tf, advance)
    by_hand = state_tangents.jacobian_function(tf, advance, tangent=tangent)

    @tf.function(autograph=False)
    def floor(inputs, columns):  # noqa: ANN001, ANN202
        kernel = params["recurrent_kernel"]

        def body(tangents, inputs_t):  # noqa: ANN001, ANN202
            flat = tf.reshape(tangents[:, :, :units], [-1, units])
            product = tf.reshape(flat @ kernel, [width, -1, 4 * units])
            return tangents + 1e-3 * product[:, :, :width]

        return tf.foldl(body, inputs, initializer=columns)

    @tf.function(autograph=False)
    def backward(params, x, initial):  # noqa: ANN001, ANN202
        with tf.GradientTape() as tape:
            tape.watch(initial)
            _, finals = cell.tf_sequence(tf, params, tf.transpose(x, [1, 0, 2]),
                                         tuple(tf.split(initial, 2, axis=1)))
            final = tf.concat(list(finals), axis=1)
        return tape.batch_jacobian(final, initial, experimental_use_pfor=False)

    columns = tf.zeros((width, int(x.shape[0]), width), x.dtype)
    return {
        "floor": lambda: floor(inputs, columns).numpy(),
        "by_hand": lambda: state_tangents.state_jacobian(tf, by_hand, weights, inputs,
                                                         states)[0],
        "carried": lambda: state_tangents.state_jacobian(tf, carried, weights, inputs,
                                                         states)[0],
        "backward": lambda: backward(params, x, initial).numpy(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--units", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    tf = import_tensorflow()
    cell = LSTMKeras(name="lstm", units=args.units, input_size=64, input_label="input")
    rng = np.random.default_rng(0)
    params = {k: tf.constant(v) for k, v in cell.init_params(rng).items()}
    x = tf.constant(rng.standard_normal((args.batch, args.steps, 64)))
    initial = tf.constant(0.1 * rng.standard_normal((args.batch, 2 * args.units)))
    found = routes(tf, cell, params, x, initial)
    truth = found["backward"]()
    for name in ("by_hand", "carried"):  # the same Jacobian, and each route traced
        np.testing.assert_allclose(found[name](), truth, rtol=1e-9, atol=1e-12)
    found["floor"]()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in found}
    for _ in range(args.repeats):
        for name, run in found.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"LSTM {args.units}, batch {args.batch}, {args.steps} steps, float64; per step "
          f"(medians of {args.repeats}), and for 1000 steps × 2 layers")
    print(f"{'route':10}{'wall ms':>10}{'CPU ms':>10}{'wall s':>10}{'CPU s':>10}")
    for name, pairs in times.items():
        wall = statistics.median(w for w, _ in pairs) / args.steps
        cpu = statistics.median(c for _, c in pairs) / args.steps
        print(f"{name:10}{1e3 * wall:>10.1f}{1e3 * cpu:>10.1f}{2000 * wall:>10.0f}"
              f"{2000 * cpu:>10.0f}")
    flops = 2 * args.batch * (2 * args.units) * args.units * 4 * args.units
    print(f"the floor's product: {flops / 1e9:.1f} GFLOP per step")


if __name__ == "__main__":
    main()
