"""What a diagnosis of ``GradientFlow(diagnose_every=N)`` costs ``fit`` once its functions are
traced and compiled, measured inside one process: the model and data of
``callback_overhead.py`` (GRU 64 → GRU 32, 50 steps, batch 32), ``GradientFlow(every=50,
log_dir=..., diagnose_every=N)``, but after the first 200 batches diagnoses are taken only in
every other window of ``--window`` batches. The mean step time in the windows with diagnoses
against the windows without, in the same fit, gives the steady cost of diagnosing (as a share
of the steps, and in ms of training time per diagnosis), free of what moves one process
against another (this machine steps some processes at 14 ms instead of 9 throughout, which
``callback_overhead.py`` sees as noise across its pairs). Observations come at the same
batches in both kinds of window.

``--whole``: in the windows without diagnoses the observations are left out too, so that the
two kinds of window hold the whole callback's steady cost, its observations with their
recording and its diagnoses, against training alone (a window of 100 holds two observations
at ``every=50``).

Not the whole overhead: the first 200 batches (the pass traced beside training, the copy
made and witnessed, the first diagnosis traced and compiled) are left out, and so is
everything a fit pays once; ``callback_overhead.py --diagnose-every N`` measures the whole.

    .venv/bin/python bench/diagnosis_steady.py [--diagnose-every 4] [--batches 1000]
                                               [--window 50] [--repeats 3] [--whole]
                                               [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FIT = """
import json, sys, tempfile, time
sys.path.insert(0, {repo!r})
from gradscope._tf import import_tensorflow
tf = import_tensorflow()
import keras
import numpy as np
from gradscope.keras import GradientFlow

every, batches, window = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
whole = sys.argv[4] == "1"


class Alternating(GradientFlow):
    # After the first 200 batches, no diagnosis in every other window.
    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if batch >= 200 and (batch // window) % 2 == 1:
            self._diagnosis_pending = False
            if whole:  # and no observation
                self._pending = False


class Marks(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.marks = []

    def on_train_batch_end(self, batch, logs=None):
        self.marks.append(time.perf_counter())


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((50, 32)), keras.layers.GRU(64, return_sequences=True),
                          keras.layers.GRU(32), keras.layers.Dense(3)])
model.compile(optimizer="adam",
              loss=keras.losses.CategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(batches * 32, 50, 32)).astype("float32")
y = np.eye(3, dtype="float32")[rng.integers(0, 3, size=batches * 32)]
marks = Marks()
with tempfile.TemporaryDirectory() as log_dir:
    flow = Alternating(every=50, log_dir=log_dir, diagnose_every=every)
    start = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[flow, marks])
    taken = [s for s in flow.history.diagnosis_steps if s > 200]
times = np.diff([start, *marks.marks]) * 1000
index = np.arange(len(times))
late = index >= 200
on = late & ((index // window) % 2 == 0)
off = late & ((index // window) % 2 == 1)
print(json.dumps({{"on_ms": float(times[on].mean()), "off_ms": float(times[off].mean()),
                  "on_steps": int(on.sum()), "diagnoses": len(taken)}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--diagnose-every", type=int, default=4, metavar="N")
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole", action="store_true",
                        help="the observations left out of the windows without diagnoses "
                             "too: the whole callback's steady cost")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.batches < 200 + 2 * args.window:
        parser.error(f"--batches must be at least {200 + 2 * args.window}")
    runs = []
    for _ in range(args.repeats):
        result = subprocess.run([sys.executable, "-c", FIT.format(repo=str(REPO)),
                                 str(args.diagnose_every), str(args.batches),
                                 str(args.window), "1" if args.whole else "0"],
                                capture_output=True, text=True, check=True)
        run = json.loads(result.stdout.strip().splitlines()[-1])
        # The extra time of the windows with diagnoses, per diagnosis taken in them.
        extra = (run["on_ms"] - run["off_ms"]) * run["on_steps"]
        run["share"] = run["on_ms"] / run["off_ms"] - 1
        run["ms_per_diagnosis"] = extra / max(run["diagnoses"], 1)
        runs.append(run)
    figures = {"diagnose_every": args.diagnose_every, "batches": args.batches,
               "whole": args.whole,
               "window": args.window, "runs": runs,
               "median_share": statistics.median(r["share"] for r in runs),
               "median_ms_per_diagnosis": statistics.median(r["ms_per_diagnosis"]
                                                            for r in runs)}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"GradientFlow(every=50, diagnose_every={args.diagnose_every}, log_dir), "
          f"{args.batches} batches; after batch 200, diagnoses"
          f"{' and observations' if args.whole else ''} in every other window of "
          f"{args.window}")
    without = "without either" if args.whole else "without"
    for r in runs:
        print(f"  steps {r['on_ms']:.2f} ms with diagnoses, {r['off_ms']:.2f} ms {without}: "
              f"{r['share']:+.1%}, {r['ms_per_diagnosis']:.1f} ms of training per diagnosis"
              f"{' (with its share of the observations)' if args.whole else ''}")
    print(f"median: {figures['median_share']:+.1%} of the steps, "
          f"{figures['median_ms_per_diagnosis']:.1f} ms per diagnosis")


if __name__ == "__main__":
    main()
