"""Scale: `gradscope explain` at 100 and 1000 time steps (units [256, 256], batch 32) against
the floor program at the same sizes: wall time and peak memory (max RSS), medians.

Cost must grow linearly with time_steps (no Python-level unrolling, no retracing per step).

    .venv/bin/python bench/scale.py [--repeats 3] [--steps 100 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INPUT, UNITS, BATCH, CLASSES = 64, (256, 256), 32, 3


def scale_config(folder: Path, steps: int) -> Path:
    """The scale model's YAML config at ``steps`` time steps, written into ``folder``."""
    config = folder / f"scale_{steps}.yaml"
    config.write_text(
        f"input_size: {INPUT}\ntime_steps: {steps}\nbatch_size: {BATCH}\nlayers:\n"
        + "".join(f"  - gru: {u}\n" for u in UNITS) + f"  - dense: {CLASSES}\n")
    return config


def measure(command: list[str]) -> tuple[float, float]:
    """(seconds, peak MiB) of one whole process, from GNU time."""
    result = subprocess.run(["/usr/bin/time", "-f", "%e %M", *command], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            check=True)
    seconds, kib = result.stderr.strip().splitlines()[-1].split()
    return float(seconds), int(kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for steps in args.steps:
            config = scale_config(Path(folder), steps)
            gradscope = [sys.executable, "-m", "gradscope", "explain", str(config)]
            floor = [sys.executable, str(REPO / "bench" / "floor_explain.py"),
                     "--input-size", str(INPUT), "--time-steps", str(steps),
                     "--batch-size", str(BATCH), "--units", ",".join(map(str, UNITS)),
                     "--classes", str(CLASSES)]
            ours, theirs = [], []
            for _ in range(args.repeats):
                theirs.append(measure(floor))
                ours.append(measure(gradscope))
            row = {
                "time_steps": steps,
                "gradscope_s": statistics.median(t for t, _ in ours),
                "floor_s": statistics.median(t for t, _ in theirs),
                "gradscope_peak_mib": statistics.median(m for _, m in ours),
                "floor_peak_mib": statistics.median(m for _, m in theirs),
            }
            row["time_ratio"] = row["gradscope_s"] / row["floor_s"]
            row["memory_ratio"] = row["gradscope_peak_mib"] / row["floor_peak_mib"]
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"units {list(UNITS)}, batch {BATCH}, input {INPUT}; medians of {args.repeats}")
    print(f"{'steps':>6} {'gradscope':>10} {'floor':>8} {'ratio':>6} "
          f"{'peak MiB':>9} {'floor MiB':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['time_steps']:>6} {r['gradscope_s']:>9.2f}s {r['floor_s']:>7.2f}s "
              f"{r['time_ratio']:>6.2f} {r['gradscope_peak_mib']:>9.0f} "
              f"{r['floor_peak_mib']:>10.0f} {r['memory_ratio']:>6.2f}")


if __name__ == "__main__":
    main()
