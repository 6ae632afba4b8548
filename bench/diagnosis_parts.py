"""What one diagnosis of ``GradientFlow(diagnose_every=N)`` costs, part by part, on the model
of ``callback_overhead.py`` (input 32 → GRU 64 (sequences) → GRU 32 → Dense 3, 50 steps,
8 examples, as ``GradientFlow`` reads them by default): the CPU time (user + system, this
process) of Keras' own call of the copy (the captured pass), the steppings, the Lyapunov scans
and the gates, per diagnosis, medians over rounds of diagnoses on the copy given the model's
weights as fit gives them (``take_weights``), after a first diagnosis that traces (and
compiles) them. As graphs, and under XLA (as a fit that will diagnose at least
``COMPILED_DIAGNOSES`` times reads them: the whole diagnosis in one function,
one_function.py), with the CPU time of the first diagnosis of each.

Alone, with the machine's cores to itself: in ``fit`` each diagnosis after the first runs
while training waits (see ``callback_overhead.py --diagnose-every N`` for the whole cost).

    .venv/bin/python bench/diagnosis_parts.py [--rounds 5] [--diagnoses 20] [--examples 8]
                                              [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PARTS = {
    "captured pass": ("gradscope.keras.diagnose.captured", "captured_pass"),
    "steppings": ("gradscope.keras.stepped", "step_call"),
    "Lyapunov scans": ("gradscope.keras.diagnose.trajectory", "lyapunov_logs"),
    "gates": ("gradscope.keras.diagnose.gates", "read_gates"),
    "one function": ("gradscope.keras.diagnose.one_function", "read_in_one_function"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--diagnoses", type=int, default=20, help="per round")
    parser.add_argument("--examples", type=int, default=8,
                        help="the examples a diagnosis reads (GradientFlow's "
                             "diagnose_examples; default 8, as it)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from gradscope._tf import import_tensorflow

    import_tensorflow()
    import importlib

    import keras
    import numpy as np

    from gradscope.keras.diagnosis_twin import make_twin

    spent: dict[str, float] = collections.defaultdict(float)
    for name, (module, function) in PARTS.items():
        owner = importlib.import_module(module)
        original = getattr(owner, function)

        def timed(*a, _original=original, _name=name, **k):  # type: ignore[no-untyped-def]
            start = time.process_time()
            try:
                return _original(*a, **k)
            finally:
                spent[_name] += time.process_time() - start

        setattr(owner, function, timed)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((50, 32)),
                              keras.layers.GRU(64, return_sequences=True),
                              keras.layers.GRU(32), keras.layers.Dense(3)])
    model.compile(optimizer="adam",
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.examples, 50, 32)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, size=args.examples)]
    twin = make_twin(model, None, {"x": x})
    if twin is None:
        raise SystemExit("the model could not be copied")
    rows = {}
    for compiled in (False, True):
        start = time.process_time()
        twin.take_weights(model)  # as fit gives the copy its weights
        twin.read(None, {"x": x}, {"y": y}, None, 1, False, compiled)
        first = time.process_time() - start
        totals: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(args.rounds):
            spent.clear()
            began = time.process_time()
            for _ in range(args.diagnoses):
                twin.take_weights(model)
                twin.read(None, {"x": x}, {"y": y}, None, 1, False, compiled)
            totals["whole"].append((time.process_time() - began) / args.diagnoses)
            for name in PARTS:
                totals[name].append(spent[name] / args.diagnoses)
        rows["XLA" if compiled else "graph"] = {
            "first_diagnosis_s": first,
            **{f"{name}_ms": 1000 * statistics.median(values)
               for name, values in totals.items()}}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    names = ["whole", *PARTS]
    print(f"{'scans':6} {'first':>8} " + " ".join(f"{name:>15}" for name in names))
    for kind, row in rows.items():
        print(f"{kind:6} {row['first_diagnosis_s']:>6.2f} s "
              + " ".join(f"{row[name + '_ms']:>12.1f} ms" for name in names))


if __name__ == "__main__":
    main()
