"""``gradscope explain`` against the hand-written floor program, whole process each time.

The two run alternately (floor, gradscope, floor, …) after one untimed warm-up of each, so
that drift in the machine's load hits both. Prints the medians and the median ratio.

    .venv/bin/python bench/explain_latency.py [--repeats 7] [--json]
    .venv/bin/python bench/explain_latency.py --gradscope-args "shapes" --floor-args ""
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True)
    return time.perf_counter() - start


def compare(gradscope: list[str], floor: list[str], repeats: int) -> dict[str, float]:
    wall(floor), wall(gradscope)  # warm-up, untimed
    floor_times, gradscope_times = [], []
    for _ in range(repeats):
        floor_times.append(wall(floor))
        gradscope_times.append(wall(gradscope))
    ratios = [g / f for g, f in zip(gradscope_times, floor_times, strict=True)]
    return {
        "gradscope_median_s": statistics.median(gradscope_times),
        "gradscope_min_s": min(gradscope_times),
        "floor_median_s": statistics.median(floor_times),
        "floor_min_s": min(floor_times),
        "ratio_of_medians": statistics.median(gradscope_times) / statistics.median(floor_times),
        "median_pair_ratio": statistics.median(ratios),
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gradscope-args", default="explain",
                        help="arguments after `python -m gradscope` (default: explain)")
    parser.add_argument("--floor-args", default="", help="extra arguments for the floor")
    parser.add_argument("--baseline-gradscope-args", metavar="ARGS",
                        help="compare with this gradscope command instead of the floor, "
                             "e.g. 'explain' as the baseline of 'explain --jacobians --flow'")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")
    gradscope = [sys.executable, "-m", "gradscope", *shlex.split(args.gradscope_args)]
    floor = [sys.executable, str(REPO / "bench" / "floor_explain.py"),
             *shlex.split(args.floor_args)]
    baseline_name = "floor_explain.py"
    if args.baseline_gradscope_args:
        floor = [sys.executable, "-m", "gradscope", *shlex.split(args.baseline_gradscope_args)]
        baseline_name = "gradscope " + args.baseline_gradscope_args
    figures = compare(gradscope, floor, args.repeats)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    width = max(28, len(args.gradscope_args) + 12)
    print(f"{'program':<{width}}{'median':>10}{'min':>10}")
    print(f"{'gradscope ' + args.gradscope_args:<{width}}{figures['gradscope_median_s']:>9.2f}s"
          f"{figures['gradscope_min_s']:>9.2f}s")
    print(f"{baseline_name:<{width}}{figures['floor_median_s']:>9.2f}s"
          f"{figures['floor_min_s']:>9.2f}s")
    print(f"ratio of medians {figures['ratio_of_medians']:.3f}, median of pair ratios "
          f"{figures['median_pair_ratio']:.3f} ({args.repeats} runs each)")


if __name__ == "__main__":
    main()
