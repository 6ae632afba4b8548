"""What ``--chunks K`` costs on a Keras model: ``gradscope explain MODEL.keras --chunks K``
against plain ``gradscope explain MODEL.keras``, whole processes, alternating, medians and the
median of the pair ratios. The models are those of ``keras_flow_cost.py`` (``seed``: the seed
model in Keras, 100 steps; ``lstm``: the user-sized LSTM 256 × 2 at 1000 steps).

    .venv/bin/python bench/keras_chunks_cost.py [--models seed lstm] [--chunks 2] [--repeats 5]

No target: the cut run is one more forward pass of every recurrent layer through its own cell
in tf.scan, and (K − 1) + 1 backward passes of it, beside explain's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from explain_latency import compare
from keras_flow_cost import BUILD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["seed", "lstm"],
                        choices=["seed", "masked", "lstm"])
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.models:
            path = os.path.join(folder, f"{kind}.keras")
            subprocess.run([sys.executable, "-c", BUILD, kind, path], check=True,
                           stderr=subprocess.DEVNULL)
            plain = [sys.executable, "-m", "gradscope", "explain", path, "--data",
                     path.replace(".keras", ".npz")]
            rows[kind] = compare([*plain, "--chunks", str(args.chunks)], plain, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'model':8} {f'--chunks {args.chunks}':>14} {'plain explain':>15} {'ratio':>7}")
    for kind, figures in rows.items():
        print(f"{kind:8} {figures['gradscope_median_s']:>12.2f} s "
              f"{figures['floor_median_s']:>13.2f} s "
              f"{np.round(figures['median_pair_ratio'], 3):>7}")


if __name__ == "__main__":
    main()
