"""What ``gradscope diagnose`` costs on the user-sized LSTM 256 × 2 at 1000 steps (batch 32,
64 features; the model of ``keras_flow_cost.py``) against Keras' own tape of the same model
(``keras_floor.py --compiled``: load, the compiled loss and every weight's gradient in a
tf.function): whole processes, alternating, wall time, CPU time (user + system: less moved by
other work on a shared machine) and peak RSS of each, medians and the median of the pair
ratios.

    .venv/bin/python bench/diagnose_cost.py [--repeats 3] [--models lstm seed] [--json]

Targets (issue 36): at most 4× the tape's time and 1.5× its memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from keras_flow_cost import saved

HERE = os.path.dirname(os.path.abspath(__file__))


def measured(command: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MiB) of one whole process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(command)}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def compare(command: list[str], floor: list[str], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"diagnose": [], "tape": []}
    cpu: dict[str, list[float]] = {"diagnose": [], "tape": []}
    memory: dict[str, list[float]] = {"diagnose": [], "tape": []}
    for _ in range(repeats):
        for name, run in (("tape", floor), ("diagnose", command)):
            seconds, used, peak = measured(run)
            times[name].append(seconds)
            cpu[name].append(used)
            memory[name].append(peak)
    pairs = [d / t for d, t in zip(times["diagnose"], times["tape"], strict=True)]
    cpu_pairs = [d / t for d, t in zip(cpu["diagnose"], cpu["tape"], strict=True)]
    return {
        "diagnose_median_s": statistics.median(times["diagnose"]),
        "tape_median_s": statistics.median(times["tape"]),
        "median_pair_ratio": statistics.median(pairs),
        "diagnose_cpu_s": statistics.median(cpu["diagnose"]),
        "tape_cpu_s": statistics.median(cpu["tape"]),
        "cpu_pair_ratio": statistics.median(cpu_pairs),
        "diagnose_peak_mib": statistics.median(memory["diagnose"]),
        "tape_peak_mib": statistics.median(memory["tape"]),
        "memory_ratio": statistics.median(memory["diagnose"]) / statistics.median(
            memory["tape"]),
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["lstm"], choices=["seed", "lstm"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.models:
            path, data = saved(folder, kind)
            batch = "32" if kind == "lstm" else "34"
            command = [sys.executable, "-m", "gradscope", "diagnose", path, "--data", data,
                       "--json", "--timings"]
            floor = [sys.executable, os.path.join(HERE, "keras_floor.py"), path,
                     "--batch-size", batch, "--compiled"]
            rows[kind] = compare(command, floor, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'model':6} {'diagnose':>10} {'tape':>8} {'ratio':>6} {'cpu':>9} {'tape':>8} "
          f"{'ratio':>6} {'peak':>9} {'tape':>9} {'ratio':>6}")
    for kind, f in rows.items():
        print(f"{kind:6} {f['diagnose_median_s']:>8.1f} s {f['tape_median_s']:>6.1f} s "
              f"{f['median_pair_ratio']:>6.2f} {f['diagnose_cpu_s']:>7.1f} s "
              f"{f['tape_cpu_s']:>6.1f} s {f['cpu_pair_ratio']:>6.2f} "
              f"{f['diagnose_peak_mib']:>5.0f} MiB {f['tape_peak_mib']:>5.0f} MiB "
              f"{f['memory_ratio']:>6.2f}")


if __name__ == "__main__":
    main()
