"""The resource guard's memory estimate beside the measured peak memory (max RSS) of the run.

For the seed model (explain, explain --jacobians --flow, check), for the scale model of
bench/scale.py (GRU 256 → GRU 256 → dense 3, batch 32, input 64) at several lengths, and for
the user-sized Keras model of bench/user_sized.py (LSTM 256 → LSTM 256 → Dense 10, batch 32,
input 64; explain at every length, check at ``--check-steps``, explain --jacobians at
``--jacobian-steps``): the estimate
(gradscope/yaml/memory.py, gradscope/keras/memory.py), the peak RSS of the whole process
(``os.wait4`` on the child), and their ratio (target: within 1.5× either way).

    .venv/bin/python bench/memory_estimate.py [--steps 100 300 1000] [--check-steps 100 300]
                                              [--jacobian-steps 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scale import scale_config  # noqa: E402  (the same scale model)
from user_sized import BUILD  # noqa: E402  (the same user-sized Keras model)

import gradscope  # noqa: E402

TARGET = 1.5


def peak_rss_mib(command: list[str]) -> float:
    """Peak resident memory of one whole child process, in MiB (Linux reports KiB)."""
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode not in (0, 1):  # 1: check found a failure, still a full run
        raise SystemExit(f"{' '.join(command)} exited {child.returncode}")
    return usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--check-steps", type=int, nargs="*", default=[100, 300])
    parser.add_argument("--jacobian-steps", type=int, nargs="*", default=[100])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "gradscope"]
    cases: list[tuple[str, str | None, list[str]]] = [
        ("seed: explain", None, ["explain"]),
        ("seed: explain --jacobians --flow", None, ["explain", "--jacobians", "--flow"]),
        ("seed: check", None, ["check", "--quiet"]),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for steps in args.steps:
            config = scale_config(Path(folder), steps)
            cases.append((f"scale, {steps} steps: explain", str(config), ["explain"]))
        lengths = {"explain": args.steps, "check": args.check_steps,
                   "explain --jacobians": args.jacobian_steps}
        for steps in sorted(set().union(*lengths.values())):
            model = Path(folder) / f"lstm_{steps}.keras"
            subprocess.run([sys.executable, "-c", BUILD, str(steps), "256", str(model)],
                           check=True, stderr=subprocess.DEVNULL)
            for command, among in lengths.items():
                if steps in among:
                    cases.append((f"Keras LSTM, {steps} steps: {command}", str(model),
                                  [*command.split(), "--quiet"]))
        for name, source, command in cases:
            across_time = "--jacobians" in command or "--flow" in command
            terms = gradscope.estimate_memory(source, command[0], across_time=across_time)
            estimated = sum(terms.values()) / (1 << 20)
            measured = peak_rss_mib([*cli, *command, *([source] if source else [])])
            rows.append({"case": name, "estimate_mib": estimated, "peak_rss_mib": measured,
                         "ratio": estimated / measured})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'case':<36}{'estimate':>10}{'peak RSS':>10}{'ratio':>7}")
    for row in rows:
        within = 1 / TARGET <= row["ratio"] <= TARGET
        print(f"{row['case']:<36}{row['estimate_mib']:>7.0f} MiB{row['peak_rss_mib']:>6.0f} MiB"
              f"{row['ratio']:>7.2f}{'' if within else '  outside 1.5×'}")


if __name__ == "__main__":
    main()
