"""User-sized Keras models: ``gradscope explain`` and ``gradscope check`` on a saved model
against the tape a user writes by hand (``bench/keras_floor.py --compiled``: load the model, one
``GradientTape`` gradient of ``compute_loss`` in a ``tf.function``). Whole processes, each
command alternating with the tape; wall time and peak memory (max RSS, from GNU time);
medians, and the median of the pair ratios.

The model: input 64 → LSTM U (sequences) → LSTM U → Dense 10, softmax cross-entropy
(from logits), batch B, T steps; saved once per size into a temporary folder.

    .venv/bin/python bench/user_sized.py [--steps 100 1000] [--units 256] [--batch 32]
                                         [--commands explain check] [--repeats 5]
                                         [--max-memory SIZE] [--json]

Targets (issue 22): explain ≤ 1.15× the tape's time and ≤ 1.3× its peak memory; check ≤ 3×
its time and ≤ 2× its peak memory.
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
INPUT, CLASSES = 64, 10

BUILD = f"""
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras
steps, units, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((steps, {INPUT})),
    keras.layers.LSTM(units, return_sequences=True),
    keras.layers.LSTM(units),
    keras.layers.Dense({CLASSES}),
])
model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
model.save(path)
"""


def measure(command: list[str]) -> tuple[float, float]:
    """(seconds, peak MiB) of one whole process, from GNU time."""
    result = subprocess.run(["/usr/bin/time", "-f", "%e %M", *command], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode not in (0, 1):  # check exits 1 when a witness disagrees: say so
        raise SystemExit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr}")
    seconds, kib = result.stderr.strip().splitlines()[-1].split()
    return float(seconds), int(kib) / 1024


def row(model: Path, command: str, batch: int, repeats: int,
        max_memory: str | None = None) -> dict[str, float]:
    ours_command = [sys.executable, "-m", "gradscope", command, str(model),
                    "--batch-size", str(batch), "--quiet",
                    *(["--max-memory", max_memory] if max_memory else [])]
    tape_command = [sys.executable, str(REPO / "bench" / "keras_floor.py"), str(model),
                    "--batch-size", str(batch), "--compiled"]
    measure(tape_command), measure(ours_command)  # warm-up (file cache), untimed
    ours, tape = [], []
    for _ in range(repeats):
        tape.append(measure(tape_command))
        ours.append(measure(ours_command))
    time_ratios = [o[0] / t[0] for o, t in zip(ours, tape, strict=True)]
    memory_ratios = [o[1] / t[1] for o, t in zip(ours, tape, strict=True)]
    return {
        "seconds": statistics.median(o[0] for o in ours),
        "tape_seconds": statistics.median(t[0] for t in tape),
        "time_ratio": statistics.median(time_ratios),
        "peak_mib": statistics.median(o[1] for o in ours),
        "tape_peak_mib": statistics.median(t[1] for t in tape),
        "memory_ratio": statistics.median(memory_ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--units", type=int, nargs="+", default=[256])
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--commands", nargs="+", default=["explain", "check"],
                        choices=["explain", "check"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-memory", metavar="SIZE",
                        help="passed to gradscope (its guard refuses big rows by default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    if not args.json:
        print(f"{'command':<8}{'steps':>6}{'units':>6}{'batch':>6}{'time':>9}{'tape':>8}"
              f"{'ratio':>7}{'peak':>10}{'tape':>10}{'ratio':>7}")
    with tempfile.TemporaryDirectory() as folder:
        for units in args.units:
            for steps in args.steps:
                model = Path(folder) / f"lstm_{units}_{steps}.keras"
                subprocess.run([sys.executable, "-c", BUILD, str(steps), str(units),
                                str(model)], check=True, stderr=subprocess.DEVNULL)
                for batch in args.batch:
                    for command in args.commands:
                        figures = {"command": command, "steps": steps, "units": units,
                                   "batch": batch, "repeats": args.repeats,
                                   **row(model, command, batch, args.repeats,
                                         args.max_memory)}
                        rows.append(figures)
                        if not args.json:
                            print(f"{command:<8}{steps:>6}{units:>6}{batch:>6}"
                                  f"{figures['seconds']:>8.2f}s{figures['tape_seconds']:>7.2f}s"
                                  f"{figures['time_ratio']:>6.2f}×"
                                  f"{figures['peak_mib']:>6.0f} MiB"
                                  f"{figures['tape_peak_mib']:>6.0f} MiB"
                                  f"{figures['memory_ratio']:>6.2f}×", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
