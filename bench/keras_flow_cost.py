"""What ``--flow --jacobians`` costs on a Keras model: ``gradscope explain MODEL.keras --flow
--jacobians`` against plain ``gradscope explain MODEL.keras``, whole processes, alternating,
medians and the median of the pair ratios (``--flags=--flow``: another set of options).

The models, each saved once into a temporary folder:
- ``seed``: the seed model written in Keras (input 200 → GRU 64 → GRU 32 → Dense 3, 100 steps,
  batch 34);
- ``masked``: the same behind a Masking layer, with the last 20 steps of half the batch
  masked;
- ``lstm``: the user-sized LSTM 256 × 2 (input 64, 1000 steps, batch 32, Dense 10).

    .venv/bin/python bench/keras_flow_cost.py [--models seed masked lstm] [--repeats 5]
        [--flags="--flow --jacobians"] [--json]

Target (issue 35): at most 1.3× plain explain.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np
from explain_latency import compare

BUILD = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras, numpy as np
kind, path = sys.argv[1], sys.argv[2]
keras.utils.set_random_seed(0)
L = keras.layers
if kind == "lstm":
    steps, features, batch = 1000, 64, 32
    layers = [keras.Input((steps, features)), L.LSTM(256, return_sequences=True), L.LSTM(256),
              L.Dense(10)]
else:
    steps, features, batch = 100, 200, 34
    layers = [keras.Input((steps, features)), *([L.Masking()] if kind == "masked" else []),
              L.GRU(64, return_sequences=True, name="gru_1"),
              L.GRU(32, return_sequences=True, name="gru_2"), L.Dense(3, name="dense_1")]
model = keras.Sequential(layers)
model.compile(loss="mse")
model.save(path)
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, steps, features)).astype("float32")
if kind == "masked":
    x[: batch // 2, -20:] = 0.0
y = rng.standard_normal((batch, *model.output_shape[1:]))
np.savez(path.replace(".keras", ".npz"), x=x, y=y.astype("float32"))
"""


def saved(folder: str, kind: str) -> tuple[str, str]:
    """The model ``kind`` saved into ``folder`` by :data:`BUILD`: its path and its batch's."""
    path = os.path.join(folder, f"{kind}.keras")
    subprocess.run([sys.executable, "-c", BUILD, kind, path], check=True,
                   stderr=subprocess.DEVNULL)
    return path, path.replace(".keras", ".npz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["seed", "masked", "lstm"],
                        choices=["seed", "masked", "lstm"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flags", default="--flow --jacobians",
                        help="the options timed against plain explain (default: %(default)s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3")
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.models:
            path, data = saved(folder, kind)
            plain = [sys.executable, "-m", "gradscope", "explain", path, "--data", data]
            rows[kind] = compare([*plain, *shlex.split(args.flags)], plain, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'model':8} {args.flags:>20} {'plain explain':>15} {'ratio':>7}")
    for kind, figures in rows.items():
        print(f"{kind:8} {figures['gradscope_median_s']:>18.2f} s "
              f"{figures['floor_median_s']:>13.2f} s "
              f"{np.round(figures['median_pair_ratio'], 3):>7}")


if __name__ == "__main__":
    main()
