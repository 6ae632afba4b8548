"""``gradscope explain MODEL.keras`` against the hand-written floor (bench/keras_floor.py:
load the model, one GradientTape gradient), whole processes, alternating, medians.

The model is the seed model written in Keras (input 200 → GRU 64 → GRU 32 → Dense 3, 100 steps),
saved once into a temporary folder; batch 34.

    .venv/bin/python bench/keras_explain.py [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from explain_latency import compare

REPO = Path(__file__).resolve().parent.parent

BUILD = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((100, 200)),
    keras.layers.GRU(64, return_sequences=True, name="gru_1"),
    keras.layers.GRU(32, return_sequences=True, name="gru_2"),
    keras.layers.Dense(3, name="dense_1"),
])
model.save(sys.argv[1])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "seed.keras")
        subprocess.run([sys.executable, "-c", BUILD, path], check=True,
                       stderr=subprocess.DEVNULL)
        gradscope = [sys.executable, "-m", "gradscope", "explain", path, "--batch-size", "34"]
        floor = [sys.executable, str(REPO / "bench" / "keras_floor.py"), path,
                 "--batch-size", "34"]
        figures = compare(gradscope, floor, args.repeats)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"gradscope explain seed.keras  {figures['gradscope_median_s']:.2f} s median "
          f"({figures['gradscope_min_s']:.2f} s best)")
    print(f"keras_floor.py seed.keras     {figures['floor_median_s']:.2f} s median "
          f"({figures['floor_min_s']:.2f} s best)")
    print(f"ratio of medians {figures['ratio_of_medians']:.3f}, median of pair ratios "
          f"{figures['median_pair_ratio']:.3f} ({args.repeats} runs each)")


if __name__ == "__main__":
    main()
