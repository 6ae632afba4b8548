"""Argument errors are refused before TensorFlow is imported: exit 2, one line naming the
option or file and what was expected, in about a second instead of after the whole run.

Tried as a new user would, on the seed model, on a loaded 2-core machine (whole processes):

| argument error                          | before                       | now    |
|-----------------------------------------|------------------------------|--------|
| explain -o FILE that exists             | 9.1 s, after the run         | 1.4 s  |
| explain -o FOLDER/FILE, no such folder  | 10.9 s, after the run        | 1.3 s  |
| explain --plot FILE.png that exists     | 70 s, after the run          | 1.4 s  |
| check --chunks 1000 (100 steps)         | 28 s, after TF autodiff      | 0.8 s  |
| explain --at 500 --flow                 | 11.7 s, after the TF import  | 0.8 s  |
| explain --at 500 (no --flow)            | exit 0, --at silently ignored| 0.8 s  |
| shapes -o out.json (no --json)          | exit 0, text in a .json file | 0.8 s  |

Whether TensorFlow was imported is asserted from ``sys.modules`` at exit, not from
``python -X importtime``: gradscope points file descriptor 2 at /dev/null while TensorFlow
loads (to hide its start-up log lines), which hides its importtime lines too, so a test on
them would pass whatever happened. The wall-clock bound is only a guard against a full run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TF_GUARD_DRIVER, run_gradscope

SMALL = "input_size: 4\ntime_steps: 3\nbatch_size: 2\nlayers: [{gru: 2}, {dense: 3}]\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """small.yaml (3 steps), data with 5 steps, and files that already exist."""
    folder = tmp_path_factory.mktemp("arguments")
    (folder / "small.yaml").write_text(SMALL)
    (folder / "lstm.yaml").write_text(SMALL.replace("gru", "lstm"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 4))
    y = np.eye(3)[rng.integers(0, 3, size=(2, 5))]
    np.savez(folder / "steps5.npz", x=x, y=y)
    np.save(folder / "x5.npy", x)
    np.save(folder / "y5.npy", y)
    (folder / "exists.txt").write_text("keep me")
    (folder / "exists.png").write_text("keep me")
    return folder


def _run(args: list[str], env: dict[str, str] | None = None,
         python_flags: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], float]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    full_env.update(env or {})
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *python_flags, "-c", TF_GUARD_DRIVER, *args],
                            cwd=REPO,
                            env=full_env, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    return result, time.perf_counter() - start


def _assert_refused_early(result: subprocess.CompletedProcess[str], elapsed: float,
                          fragment: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradscope: error: ") and fragment in lines[0], lines[0]
    assert elapsed < 10, f"{elapsed:.1f} s: this looks like a whole run"


CASES = [
    ("explain -o existing", ["explain", "-o", "{dir}/exists.txt"],
     "-o {dir}/exists.txt: already exists; gradscope does not overwrite files (use --force)"),
    ("explain -o no folder", ["explain", "-o", "{dir}/nowhere/report.txt"],
     "-o {dir}/nowhere/report.txt: the folder {dir}/nowhere does not exist"),
    ("explain -o a folder", ["explain", "-o", "{dir}"], "is a directory"),
    ("check -o existing", ["check", "-o", "{dir}/exists.txt"], "already exists"),
    ("shapes -o FILE.json without --json", ["shapes", "-o", "{dir}/out.json"],
     "-o {dir}/out.json: the name ends in .json but the report would be text; add --json"),
    ("explain --plot existing", ["explain", "--plot", "{dir}/exists.png"],
     "--plot {dir}/exists.png: already exists"),
    ("explain --plot no folder", ["explain", "--plot", "{dir}/nowhere/flow.png"],
     "the folder {dir}/nowhere does not exist"),
    ("explain --plot FILE.txt", ["explain", "--plot", "{dir}/flow.txt"],
     "--plot {dir}/flow.txt: matplotlib cannot write .txt files; expected FILE.png"),
    ("explain --plot and -o the same file",
     ["explain", "--plot", "{dir}/same.png", "-o", "{dir}/same.png"],
     "--plot and -o both name {dir}/same.png"),
    ("check --chunks > steps", ["check", "{dir}/small.yaml", "--chunks", "4"],
     "--chunks 4 is more than time_steps 3; expected at most 3 chunks"),
    ("check --chunks > data steps",
     ["check", "{dir}/small.yaml", "--x", "{dir}/x5.npy", "--y", "{dir}/y5.npy", "--chunks", "6"],
     "--chunks 6 is more than time_steps 5"),
    ("explain --chunks 1", ["explain", "{dir}/small.yaml", "--chunks", "1"],
     "--chunks 1: expected K ≥ 2"),
    ("explain --chunks 1 --json", ["explain", "--chunks", "1", "--json"],
     "--chunks 1: expected K ≥ 2"),
    ("explain --chunks > steps", ["explain", "{dir}/small.yaml", "--chunks", "4"],
     "--chunks 4 is more than time_steps 3; expected at most 3 chunks"),
    ("explain --chunks > data steps",
     ["explain", "{dir}/small.yaml", "--data", "{dir}/steps5.npz", "--chunks", "6"],
     "--chunks 6 is more than time_steps 5"),
    ("explain .keras --chunks 1", ["explain", "{dir}/model.keras", "--chunks", "1"],
     "--chunks 1: expected K ≥ 2"),
    ("explain --at without --flow", ["explain", "{dir}/small.yaml", "--at", "3"],
     "--at 3 is outside the 3 time steps; expected 0 to 2"),
    ("explain --at negative", ["explain", "{dir}/small.yaml", "--at", "-1", "--flow"],
     "--at -1 is outside the 3 time steps"),
    ("explain --at > data steps",
     ["explain", "{dir}/small.yaml", "--data", "{dir}/steps5.npz", "--at", "5"],
     "--at 5 is outside the 5 time steps; expected 0 to 4"),
    ("shapes --force without -o", ["shapes", "--force"],
     "--force overwrites an existing output file; expected it together with -o FILE"),
    ("explain --force without -o", ["explain", "--force"], "with -o FILE or --plot FILE"),
    ("check --equations --json", ["check", "--equations", "--json"],
     "--equations prints text and does not go with --json"),
    ("check --equations without a block GRU", ["check", "{dir}/lstm.yaml", "--equations"],
     "go with block-layout GRU layers, and this spec has none"),
    ("explain YAML --time-steps", ["explain", "{dir}/small.yaml", "--time-steps", "4"],
     "--time-steps is for Keras models; set batch_size and time_steps in the YAML"),
    ("explain .keras --time-steps --data",
     ["explain", "{dir}/model.keras", "--time-steps", "4", "--data", "{dir}/steps5.npz"],
     "--time-steps does not go with --data {dir}/steps5.npz"),
    ("explain .keras --batch-size --x",
     ["explain", "{dir}/model.keras", "--batch-size", "4", "--x", "{dir}/x5.npy", "--y",
      "{dir}/y5.npy"], "--batch-size does not go with --x {dir}/x5.npy"),
    ("explain .keras --data missing", ["explain", "{dir}/model.keras", "--data", "{dir}/no.npz"],
     "{dir}/no.npz: file not found"),
    ("explain --x without --y", ["explain", "--x", "{dir}/x5.npy"],
     "--x and --y go together"),
    ("explain --y missing", ["explain", "--x", "{dir}/x5.npy", "--y", "{dir}/no.npy"],
     "{dir}/no.npy: file not found"),
]


@pytest.mark.parametrize("args,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_argument_error_is_refused_before_tensorflow(folder, args, fragment):
    args = [a.replace("{dir}", str(folder)) for a in args]
    result, elapsed = _run(args)
    _assert_refused_early(result, elapsed, fragment.replace("{dir}", str(folder)))
    if "--json" in args:
        assert list(json.loads(result.stdout)) == ["error"]
    else:
        assert result.stdout == ""
    assert (folder / "exists.txt").read_text() == "keep me"
    assert (folder / "exists.png").read_text() == "keep me"


def test_plot_without_matplotlib_is_refused_before_tensorflow(folder, tmp_path):
    """A real environment without matplotlib: the same packages, minus matplotlib."""
    import numpy

    site_packages = Path(numpy.__file__).resolve().parent.parent
    without = tmp_path / "site-packages"
    without.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.startswith(("matplotlib", "mpl_toolkits", "pylab")):
            (without / entry.name).symlink_to(entry)
    result, elapsed = _run(["explain", str(folder / "small.yaml"), "--plot",
                            str(tmp_path / "flow.png")],
                           env={"PYTHONPATH": f"{REPO}{os.pathsep}{without}"},
                           python_flags=("-S",))
    _assert_refused_early(result, elapsed, "--plot needs matplotlib, which is not installed")
    assert not (tmp_path / "flow.png").exists()


def test_at_implies_flow(folder):
    result = run_gradscope("explain", str(folder / "small.yaml"), "--at", "1", "--json")
    assert result.returncode == 0, result.stderr
    flow = json.loads(result.stdout)["gradient_flow"]
    assert flow is not None and flow["influence_step"] == 1
    assert flow["influence"][2] == 0.0  # x at s = 2 cannot reach h at t = 1


def test_no_arguments_prints_the_help_and_exits_0():
    bare = run_gradscope()
    assert bare.returncode == 0, bare.stderr
    assert bare.stderr == ""
    assert bare.stdout == run_gradscope("--help").stdout
    assert bare.stdout.startswith("Usage: gradscope")


@pytest.mark.parametrize("words,cword", [
    ("gradscope explain sam", 2),
    ("gradscope shapes ", 2),
    ("gradscope check --data ba", 3),
    ("gradscope explain --x ", 3),
    ("gradscope explain --y ", 3),
    ("gradscope explain -o rep", 3),
    ("gradscope explain --plot fl", 3),
])
def test_shell_completion_offers_file_names(words, cword):
    env = {"_GRADSCOPE_COMPLETE": "bash_complete", "COMP_WORDS": words,
           "COMP_CWORD": str(cword)}
    result = run_gradscope(env=env, process=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split(",")[0] == "file", result.stdout


def test_a_missing_config_keeps_its_own_message():
    result = run_gradscope("explain", "nowhere.yaml")
    assert result.returncode == 2
    assert result.stderr.strip() == "gradscope: error: nowhere.yaml: file not found"
