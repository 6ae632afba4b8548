"""The cost of ``explain --per-example`` against one batched tape: the user-sized model
(input 64 → LSTM U (sequences) → LSTM U → Dense 10, softmax cross-entropy from logits),
batch B, T steps, in one process. Each side is traced once (its first run, reported apart:
explain pays it once), then run alternately; medians of the seconds and of the pair ratios.
The method line says which path ran (split from one batched backward pass, or the Jacobian).

    .venv/bin/python bench/per_example_cost.py [--batch 64] [--steps 100] [--units 256]
                                               [--repeats 3] [--json]

Target (issue 37): at most 2× one batched tape at batch 64, 100 steps, LSTM 256.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--units", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from gradscope._tf import import_tensorflow

    tf = import_tensorflow()
    import keras

    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.explain import prepare
    from gradscope.keras.per_example import _shares_and_jacobian

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((args.steps, 64)), keras.layers.LSTM(args.units, return_sequences=True),
        keras.layers.LSTM(args.units), keras.layers.Dense(10)])
    model.compile(loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.steps, 64)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, args.batch)]
    job = prepare(model, x=x, y=y)
    engine = KerasEngine(job.source, job.outputs, job.plan, training=False)
    variables = model.trainable_variables
    feed, targets = [tf.constant(x)], [tf.constant(y)]

    @tf.function(autograph=False)
    def tape(x, y):
        with tf.GradientTape() as recorded:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x), training=False)
        return recorded.gradient(loss, variables)

    def batched() -> None:
        [g.numpy() for g in tape(feed[0], targets[0])]

    kept: dict[object, object] = {}
    method = [""]

    def per_example() -> None:
        _, method[0] = _shares_and_jacobian(engine, variables, feed, targets, None, args.batch,
                                            kept)

    start = time.perf_counter()
    batched()
    tape_trace = time.perf_counter() - start
    start = time.perf_counter()
    per_example()
    ours_trace = time.perf_counter() - start
    ours, theirs = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        batched()
        theirs.append(time.perf_counter() - start)
        start = time.perf_counter()
        per_example()
        ours.append(time.perf_counter() - start)
    row = {"batch": args.batch, "steps": args.steps, "units": args.units,
           "tape_seconds": statistics.median(theirs),
           "per_example_seconds": statistics.median(ours),
           "ratio": statistics.median(o / t for o, t in zip(ours, theirs, strict=True)),
           "tape_first_seconds": tape_trace, "per_example_first_seconds": ours_trace,
           "method": method[0]}
    print(json.dumps(row) if args.json else
          f"batch {args.batch}, {args.steps} steps, LSTM {args.units}: tape "
          f"{row['tape_seconds']:.2f} s, --per-example {row['per_example_seconds']:.2f} s, "
          f"{row['ratio']:.1f}× (first runs, traced: {tape_trace:.1f} s and "
          f"{ours_trace:.1f} s)\nmethod: {method[0]}")


if __name__ == "__main__":
    main()
