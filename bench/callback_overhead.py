"""``model.fit`` for 200 batches with ``gradscope.keras.GradientFlow(every=50, log_dir=...)``
against the same ``fit`` without it, side by side in one run: each repeat is a fresh process
(so each pays its own tracing), the two kinds alternate so that load drifts hit both, and the
medians of the ``fit`` times are compared, and each run's ratio to the plain run beside it
(with a bootstrap interval of their median). Goal: at most 1.10×.

The time compared runs from the call of ``fit`` to the end of its last ``on_train_end`` (a
callback placed after GradientFlow, whose own ``on_train_end`` waits for everything it does
beside training). What ``fit`` does after that is TensorFlow's teardown of its data iterator:
it waits for the next wake-up of tf.data's autotune thread (as measured here): 0–5 s,
depending on where fit ends between two wake-ups (a plain fit of 200 batches with a 1 s pause
added ends 4 s later than with a 1.5 s pause). A fit that ends later, as one with a callback
does, is more likely to wait long. That teardown is reported beside, and so is the ratio of
the whole wall times: both belong in any figure quoted. So is the ratio of the fits' CPU
time (user and system, every thread, from the call of ``fit`` to its return): the machine's
other load moves it less than the wall time.

Where the time goes: every fit's step times are kept too (from one batch's end to the next,
and from the last to the end of ``on_train_end``), and the medians across repeats, step by
step, are compared: the first step (fit's set-up; Keras traces its own train step), the
steps while the pass is traced beside training, the observed steps, the steps after them
(while the worker records), the other steps and the end (the wait for the last recording).
A step's median is steadier than a whole fit's time, so the sum of the step medians gives a
second estimate of the ratio, with the split.

The model: input 32 → GRU 64 (sequences) → GRU 32 → Dense 3, 50 steps, batch 32, softmax
cross-entropy, Adam; synthetic data from a fixed seed, unshuffled. ``--model lstm256``: the
user-sized model instead (input 64 → LSTM 256 → LSTM 256 → Dense 10, 100 steps);
``--model masked``: the GRU model behind a Masking layer, the last 10 steps of every other
sequence zeros (masked); ``--model mixed``: the GRU model under ``mixed_float16`` (Adam in
Keras' LossScaleOptimizer), whose observations take the mixed-precision section too.

``--paired``: both fits of a repeat in one process, in turns first, after a short plain fit
that takes TensorFlow's first set-up. The repeats are even, each order as often, and the
ratio balanced by order is the geometric mean of the medians of the pair ratios with the
callback's fit second and first: a fit's place in its process weighs as much for the
callback as against it (four plain fits of 1000 batches in a row, in two processes on a
quiet machine: 14.9, 14.2, 15.4, 14.3 s and 15.0, 13.3, 16.6, 14.6 s; no order is
faster every time, and a pair moves by up to a tenth).

``--diagnose-every N``: the callback diagnoses every recurrent call every N batches too
(``GradientFlow(diagnose_every=N)``); goals: at most 1.10× at N = 16, 1.2× at N = 4. The
split then has the diagnosed steps apart.

``--per-example``: each observation takes explain's per-example section too
(``GradientFlow(per_example=True)``: each example's gradient norms and the noise scale); no
goal is set.

    .venv/bin/python bench/callback_overhead.py [--repeats 5] [--batches 200] [--every 50]
                                                [--paired]
                                                [--model gru|lstm256|masked|mixed] [--json]
                                                [--diagnose-every N] [--per-example]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent

FIT = """
import json, os, resource, sys, tempfile, time
sys.path.insert(0, {repo!r})
from gradscope._tf import import_tensorflow
tf = import_tensorflow()
import keras
import numpy as np

kinds, batches, every = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
kind, diagnose_every = sys.argv[4], int(sys.argv[5]) or None
per_example = sys.argv[6] == "1"
if kind == "mixed":  # compile wraps Adam in a LossScaleOptimizer under mixed_float16
    keras.config.set_dtype_policy("mixed_float16")


def fit(with_callback, batches):
    keras.utils.set_random_seed(0)
    if kind == "lstm256":  # the user-sized model of bench/user_sized.py, 100 steps
        steps, features, classes = 100, 64, 10
        layers = [keras.layers.LSTM(256, return_sequences=True), keras.layers.LSTM(256)]
    else:
        steps, features, classes = 50, 32, 3
        layers = [keras.layers.GRU(64, return_sequences=True), keras.layers.GRU(32)]
        if kind == "masked":
            layers = [keras.layers.Masking(), *layers]
    model = keras.Sequential([keras.Input((steps, features)), *layers,
                              keras.layers.Dense(classes)])
    model.compile(optimizer="adam",
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * 32, steps, features)).astype("float32")
    if kind == "masked":
        x[::2, -10:] = 0.0
    y = np.eye(classes, dtype="float32")[rng.integers(0, classes, size=batches * 32)]
    ended, marks = [], []

    class Ended(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.append(time.perf_counter())

        def on_train_end(self, logs=None):
            ended.append(time.perf_counter())

    callbacks = []
    with tempfile.TemporaryDirectory() as log_dir:
        if with_callback:
            from gradscope.keras import GradientFlow

            callbacks = [GradientFlow(every=every, log_dir=log_dir,
                                      diagnose_every=diagnose_every,
                                      per_example=per_example)]
        used = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                  callbacks=[*callbacks, Ended()])
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (used.ru_utime + used.ru_stime)
    observations = len(callbacks[0].history.observations) if callbacks else 0
    diagnoses = len(callbacks[0].history.diagnosis_steps) if callbacks else 0
    times = [start, *marks, ended[0]]
    steps_ms = [1000 * (b - a) for a, b in zip(times, times[1:])]
    return {{"kind": "callback" if with_callback else "plain", "fit_s": ended[0] - start,
             "wall_s": wall, "cpu_s": cpu, "teardown_s": wall - (ended[0] - start),
             "observations": observations, "diagnoses": diagnoses, "steps_ms": steps_ms}}


if len(kinds) > 1:  # --paired: TensorFlow's first fit in a process pays its own set-up
    fit(False, 20)
print(json.dumps([fit(k == "callback", batches) for k in kinds]))
"""


def run(kinds: list[str], batches: int, every: int, model: str, diagnose_every: int = 0,
        per_example: bool = False) -> list[dict[str, Any]]:
    """The fits of ``kinds`` ("plain", "callback"), in that order, in one fresh process."""
    code = FIT.format(repo=str(REPO))
    result = subprocess.run([sys.executable, "-c", code, ",".join(kinds), str(batches),
                             str(every), model, str(diagnose_every),
                             "1" if per_example else "0"],
                            capture_output=True, text=True, check=True)
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def balanced(pairs: list[float]) -> dict[str, float]:
    """The pair ratios of ``--paired`` runs by order (even repeats: the callback's fit second
    in its process, odd: first): each order's median, and the geometric mean of the two."""
    second, first = statistics.median(pairs[0::2]), statistics.median(pairs[1::2])
    return {"median_pair_ratio_callback_second": second,
            "median_pair_ratio_callback_first": first,
            "order_balanced_ratio": float(np.sqrt(second * first))}


def median_interval(values: list[float], resamples: int = 4000) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of ``values`` (a fixed seed: the same
    runs give the same interval)."""
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(values, size=(resamples, len(values))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def step_split(plain: list[list[float]], watched: list[list[float]], every: int,
               diagnose_every: int = 0) -> dict[str, float]:
    """The callback's extra time, in ms, where it was spent: for every step, the median of its
    times with the callback minus the median of its plain times (the last entry is the end,
    from the last batch to the end of on_train_end)."""
    count = min(len(r) for r in plain + watched)
    extra = [statistics.median(r[i] for r in watched) - statistics.median(r[i] for r in plain)
             for i in range(count)]
    batches = count - 1
    observed = {i for i in range(every - 1, batches, every)}
    after = {i + k for i in observed for k in range(1, 6) if i + k < batches}
    warm = set(range(1, min(every - 1, batches))) - observed
    diagnosed = ({i for i in range(diagnose_every - 1, batches, diagnose_every)}
                 if diagnose_every else set())
    observed -= diagnosed
    after -= diagnosed
    warm -= diagnosed
    regions = {
        "diagnosed steps (and observed ones among them)": diagnosed,
        "first step (fit's set-up, Keras traces its train step)": {0},
        f"steps 2–{every - 1} (the pass traced beside training)": warm,
        "observed steps": observed,
        "the 5 steps after each observed one (recording)": after - warm,
        "the other steps": set(range(1, batches)) - warm - observed - after - diagnosed,
        "end (on_train_end: the last recording)": {batches},
    }
    split = {name: sum(extra[i] for i in sorted(indexes)) for name, indexes in regions.items()}
    plain_total = sum(statistics.median(r[i] for r in plain) for i in range(count))
    split["ratio of the sums of step medians"] = (plain_total + sum(extra)) / plain_total
    return split


#: Batches per window of :func:`by_window`.
WINDOW = 100


def by_window(plain: list[list[float]], watched: list[list[float]]
              ) -> list[tuple[float, float]]:
    """Per window of :data:`WINDOW` batches, the callback's extra time in ms (the sum over its
    steps of the median step time with the callback less the plain median) and that extra
    over the window's plain time: where the first diagnoses trace and compile beside
    training, and what the rest costs once they are traced."""
    count = min(len(r) for r in plain + watched) - 1  # the last entry is the end
    found = []
    for first in range(0, count, WINDOW):
        steps = range(first, min(first + WINDOW, count))
        base = sum(statistics.median(r[i] for r in plain) for i in steps)
        extra = sum(statistics.median(r[i] for r in watched) for i in steps) - base
        found.append((extra, extra / base if base else 0.0))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--model", choices=["gru", "lstm256", "masked", "mixed"], default="gru",
                        help="gru: the model above; lstm256: input 64 → LSTM 256 → LSTM 256 → "
                             "Dense 10 over 100 steps (bench/user_sized.py's model); masked: "
                             "the GRU model behind a Masking layer, half the sequences "
                             "masked over their last 10 steps; mixed: the GRU model under "
                             "mixed_float16 (each observation takes the mixed-precision "
                             "section too: two more passes)")
    parser.add_argument("--diagnose-every", type=int, default=0, metavar="N",
                        help="GradientFlow(diagnose_every=N) too (0: none)")
    parser.add_argument("--per-example", action="store_true",
                        help="GradientFlow(per_example=True): each observation takes explain's "
                             "per-example section too")
    parser.add_argument("--paired", action="store_true",
                        help="both fits of a repeat in one process (after a short plain fit "
                             "that takes TensorFlow's first set-up), in turns first")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3")
    if args.paired and args.repeats % 2:
        # With an odd count one order has one pair more, and the median of the pair ratios
        # leans its way wherever a fit's place in its process moves its time.
        parser.error("--paired needs an even --repeats: each order as often")
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "callback": []}
    for repeat in range(args.repeats):
        # --paired: both fits in one process, in turns first (each process's speed differs
        # from the next one's by up to a quarter on this machine).
        orders = ([["plain", "callback"] if repeat % 2 == 0 else ["callback", "plain"]]
                  if args.paired else [["plain"], ["callback"]])
        for order in orders:
            for done in run(order, args.batches, args.every, args.model,
                            args.diagnose_every, args.per_example):
                runs[done["kind"]].append(done)

    def series(kind: str, key: str) -> list[Any]:
        return [r[key] for r in runs[kind]]

    plain, watched = series("plain", "fit_s"), series("callback", "fit_s")
    pairs = [w / p for w, p in zip(watched, plain, strict=True)]
    figures = {
        "batches": args.batches, "every": args.every, "repeats": args.repeats,
        "paired": args.paired,
        "observations": int(runs["callback"][-1]["observations"]),
        "diagnose_every": args.diagnose_every or None,
        "per_example": args.per_example,
        "diagnoses": int(runs["callback"][-1]["diagnoses"]),
        "plain_fit_median_s": statistics.median(plain),
        "callback_fit_median_s": statistics.median(watched),
        "ratio_of_medians": statistics.median(watched) / statistics.median(plain),
        "median_pair_ratio": statistics.median(pairs),
        "median_pair_ratio_95": median_interval(pairs),
        # --paired: the two orders' medians, and their geometric mean, in which a fit's
        # place in its process weighs as much for the callback as against it.
        **(balanced(pairs) if args.paired else {}),
        "wall_ratio_of_medians": (statistics.median(series("callback", "wall_s"))
                                  / statistics.median(series("plain", "wall_s"))),
        "cpu_ratio_of_medians": (statistics.median(series("callback", "cpu_s"))
                                 / statistics.median(series("plain", "cpu_s"))),
        "plain_teardown_s": series("plain", "teardown_s"),
        "callback_teardown_s": series("callback", "teardown_s"),
        "plain_fit_s": plain, "callback_fit_s": watched,
        "extra_ms_by_step": step_split(series("plain", "steps_ms"),
                                       series("callback", "steps_ms"), args.every,
                                       args.diagnose_every),
        "extra_ms_by_window": by_window(series("plain", "steps_ms"),
                                        series("callback", "steps_ms")),
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"fit, {args.batches} batches                      "
          f"{figures['plain_fit_median_s']:.2f} s median")
    diagnosing = (f", diagnose_every={args.diagnose_every}" if args.diagnose_every else "")
    diagnosing += ", per_example=True" if args.per_example else ""
    print(f"fit with GradientFlow(every={args.every}{diagnosing}, log_dir)  "
          f"{figures['callback_fit_median_s']:.2f} s median "
          f"({figures['observations']} extra passes, {figures['diagnoses']} diagnoses)")
    low, high = figures["median_pair_ratio_95"]
    print(f"ratio of medians {figures['ratio_of_medians']:.3f}, median of pair ratios "
          f"{figures['median_pair_ratio']:.3f} (95% bootstrap interval {low:.3f}–{high:.3f}; "
          f"{args.repeats} runs each, alternating"
          f"{'; each pair in one process' if args.paired else ''})")
    if args.paired:
        print(f"by order: the callback's fit second in its process "
              f"{figures['median_pair_ratio_callback_second']:.3f}, first "
              f"{figures['median_pair_ratio_callback_first']:.3f}; balanced (their geometric "
              f"mean) {figures['order_balanced_ratio']:.3f}")
    teardown = {kind: ", ".join(f"{s:.1f}" for s in series(kind, "teardown_s"))
                for kind in runs}
    print(f"CPU time (every thread, the whole fit with its teardown): "
          f"{figures['cpu_ratio_of_medians']:.3f}× by medians (the machine's other load moves "
          "it less than the wall time)")
    print(f"then TensorFlow's data-iterator teardown: {teardown['plain']} s plain, "
          f"{teardown['callback']} s with the callback; whole wall times "
          f"{figures['wall_ratio_of_medians']:.3f}× by medians")
    split = dict(figures["extra_ms_by_step"])
    ratio = split.pop("ratio of the sums of step medians")
    print(f"step by step (medians across runs): the sum of the step medians {ratio:.3f}×; "
          "the extra time by where it was spent:")
    for name, ms in split.items():
        print(f"  {ms:8.0f} ms  {name}")
    windows = figures["extra_ms_by_window"]
    print(f"the extra time per {WINDOW} batches (step medians; the first window holds the "
          "first step, fit's set-up): "
          + ", ".join(f"{extra:.0f} ms ({share:+.0%})" for extra, share in windows))
    if len(windows) > 3:
        # Once the first diagnosis has traced (and compiled) its functions beside training.
        steady = statistics.median(share for _, share in windows[2:])
        print(f"after the first {2 * WINDOW} batches (set-up, tracing): the median window "
              f"{steady:+.1%}")


if __name__ == "__main__":
    main()
