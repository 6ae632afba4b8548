"""The GitHub Actions workflow of the README's "In CI" section, run step by step as CI would
run it, in a temporary project holding a saved Keras model and its batch: every gradscope
command in it runs with exit 0, the JUnit file is read back, the base commit's report is made
in a second checkout of the same project, and diff finds no drift between the two. The
workflow's pytest step runs the user's own tests; this project's own such test file is
examples/test_my_gradients.py, which tests/test_testing.py runs with pytest."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO
from junitparser import JUnitXml

from gradscope.cli import main


def _workflow() -> dict:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## In CI"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    return yaml.safe_load(block.group(1))


def _run_lines(workflow: dict) -> list[str]:
    (job,) = workflow["jobs"].values()
    lines = []
    for step in job["steps"]:
        for line in str(step.get("run", "")).splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if command:
                lines.append(command)
    return lines


@pytest.fixture
def project(tf, tmp_path) -> Path:
    """A project with a saved GRU model and the batch it is checked on."""
    import keras

    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((10, 3)), keras.layers.GRU(4, name="gru"),
                              keras.layers.Dense(2, name="head")])
    model.compile(loss="mse")
    folder = tmp_path / "project"
    folder.mkdir()
    model.save(folder / "model.keras")
    rng = np.random.default_rng(0)
    np.savez(folder / "batch.npz", x=rng.standard_normal((6, 10, 3)).astype("float32"),
             y=rng.standard_normal((6, 2)).astype("float32"))
    return folder


def _gradscope(argv: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code or 0


def test_the_readme_workflow_runs_step_by_step(project, monkeypatch, capsys):
    workflow = _workflow()
    # YAML 1.1 (PyYAML) reads the key `on` as True; GitHub reads it as "on".
    assert workflow.get("on", workflow.get(True)) == "pull_request"
    lines = _run_lines(workflow)
    ran = []
    for line in lines:
        words = shlex.split(line)
        if words[:2] == ["pip", "install"] or words[:1] == ["pytest"]:
            continue  # the reader's own environment and tests (see the module docstring)
        if words[:3] == ["git", "worktree", "add"]:
            # The base commit's checkout: here, the same project (so no drift).
            shutil.copytree(project, project.parent / "base")
            continue
        cwd = project
        if words[:2] == ["cd", "../base"]:
            cwd, words = project.parent / "base", words[3:]  # after "&&"
        assert words[0] == "gradscope", line
        code = _gradscope(words[1:], cwd, monkeypatch)
        out, err = capsys.readouterr()
        assert code == 0, f"{line}\n{out[-2000:]}\n{err}"
        ran.append(words[1])
    assert ran == ["check", "explain", "explain", "diff"]
    cases = [case for suite in JUnitXml.fromfile(str(project / "gradients.xml"))
             for case in suite]
    assert cases and all(case.is_passed for case in cases)
    assert (project.parent / "base.json").exists() and (project / "new.json").exists()
