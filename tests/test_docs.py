"""Every `gradscope` command shown in README.md and docs/*.md runs, with the exit code it shows.

A command is a `$ ` line of a ```text block (with its `\\` continuations), or a line of a
```sh block, whose program is `gradscope`, `.venv/bin/gradscope` or `python -m gradscope`
(after `NAME=value` settings, which become environment variables, and `time`). Pipes and
redirections are cut off: the gradscope part runs. The exit code expected is the one the doc
shows: 2 when the output shown under the command has a `gradscope: error:` line (whose text
must then be the error printed), 1 when it has a `FAILED` verdict, else 0 (a `# exit N`
comment on a sh line says otherwise); a `PASSED`/`FAILED` verdict shown must be the one
printed.

Each command runs in this process (`gradscope.cli.main`), from the repository root. Files the
docs name that are not in the clone are made once, in a temporary folder (WORKSPACE below),
and the command's arguments point there; `-o`, `--plot` and `--junit` files go to a temporary
folder too.
Nothing is written into the clone. Shell lines that are not gradscope commands are listed
below, by hand, so that a reviewer sees each one.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, SAMPLES

from gradscope.cli import main

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Shell lines shown in the docs that are not gradscope commands and are not run here.
SKIPPED = {
    "make demo": "creates .venv: the environment these tests run in",
    "make test": "runs this very suite",
    "pip install -e .": "installs into an environment of the reader's own",
    "pip install -e '.[plot]'": "installs into an environment of the reader's own",
    "pip install -e '.[all]'": "installs into an environment of the reader's own",
    "cat seed_model.yaml": "shows the file `gradscope spec` wrote (WORKSPACE makes it)",
    ".venv/bin/python bench/callback_overhead.py --repeats 20": "a bench: minutes of fits",
    ".venv/bin/python bench/per_example_cost.py --batch 64 --steps 100 --units 256":
        "a bench: minutes of one process",
    ".venv/bin/python bench/diagnose_cost.py --repeats 3": "a bench: minutes of whole "
    "processes",
    ".venv/bin/python bench/user_sized.py --steps 100 1000 --commands explain --repeats 5":
        "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 100 300 1000 3000 --commands explain "
    "--repeats 3": "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 1000 --units 64 512 --commands explain "
    "--repeats 3": "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 1000 --batch 256 --commands explain "
    "--repeats 3 --max-memory 20G": "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 100 300 1000 --commands check --repeats 3":
        "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 100 300 --commands check --repeats 3":
        "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 1000 --units 64 512 --commands check "
    "--repeats 3": "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 3000 --commands check --repeats 2 "
    "--max-memory 20G": "a bench: minutes of whole processes",
    ".venv/bin/python bench/user_sized.py --steps 1000 --batch 256 --commands check "
    "--repeats 2 --max-memory 20G": "a bench: minutes of whole processes",
}

#: Shell lines that make the files later commands read: the workspace runs each of these
#: sample scripts itself, in this process, with its argument in the temporary folder.
ENCODER_DECODER = ".venv/bin/python sample_configs/keras_encoder_decoder.py /tmp/encdec.keras"
MADE_BY_THE_WORKSPACE = {
    ENCODER_DECODER: "/tmp/encdec.keras",
    ".venv/bin/python sample_configs/keras_train_with_flow.py runs/memory": "runs/memory",
}

#: docs/check.md's course-layout tanh RNN (the doc shows this config).
COURSE_RNN = ("input_size: 4\ntime_steps: 6\nbatch_size: 3\nlayers:\n"
              "  - {type: simple_rnn, units: 5, layout: keras}\n  - dense: 3\n")

#: Arguments that are files the doc names but the clone does not hold: what stands for each.
WORKSPACE = {
    "model.keras": "README: any saved Keras 3 model; here the sample encoder–decoder",
    "/tmp/encdec.keras": "docs/keras.md: written by sample_configs/keras_encoder_decoder.py",
    "runs/memory": "docs/training.md: written by sample_configs/keras_train_with_flow.py",
    "/tmp/seed200.yaml": "docs/explain.md: sample_configs/seed.yaml with time_steps: 200",
    "course_rnn.yaml": "docs/check.md: the config shown there (COURSE_RNN)",
    "course_adapter.py": "docs/check.md: the clone's tests/against/course_adapter.py",
    "seed_model/model.ckpt": "docs/weights.md: a TF1 checkpoint of the seed model's names",
    "bad_model/model.ckpt": "docs/weights.md: its twin whose first kernel has a row too many",
    "seed_model.yaml": "docs/weights.md: what `gradscope spec seed_model/model.ckpt` writes",
    "base.json": "docs/ci.md: the seed model's explain report",
    "new.json": "docs/ci.md: the explain report of the seed model with `- gru: 16`",
    "runs/memory/model.keras": "docs/weights.md: saved by sample_configs/keras_train_with_flow.py",
    "memory.yaml": "docs/weights.md: what `gradscope spec runs/memory/model.keras` writes",
    "fading.keras": "docs/ci.md: a SimpleRNN 4 over 12 steps, its recurrent kernel "
                    "orthogonal × 0.1 (its gradients vanish)",
}

FENCE = re.compile(r"^```(\S*)\s*$")
SETTING = re.compile(r"^[A-Z_][A-Z0-9_]*=")
STOPS = {"|", ">", ">>", "<", "&&", "||", ";", "&"}


@dataclass(frozen=True)
class Shown:
    """One shell line shown in a doc, with the output shown under it."""

    doc: str
    line: int
    text: str  # the line as shown, continuations joined, without `$ ` and comments
    output: tuple[str, ...]
    comment: str

    @property
    def words(self) -> list[str]:
        lexer = shlex.shlex(self.text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        cut = next((i for i, w in enumerate(words) if w in STOPS), len(words))
        return words[:cut]

    @property
    def env(self) -> dict[str, str]:
        settings = {}
        for word in self.words:
            if not SETTING.match(word):
                break
            name, _, value = word.partition("=")
            settings[name] = value
        return settings

    @property
    def program(self) -> list[str]:
        words = [w for w in self.words if not SETTING.match(w)]
        return words[1:] if words[:1] == ["time"] else words

    @property
    def argv(self) -> list[str] | None:
        """The gradscope arguments, or None when the line runs another program."""
        words = self.program
        if words[:1] in (["gradscope"], [".venv/bin/gradscope"]):
            return words[1:]
        if len(words) >= 3 and words[0].endswith("python") and words[1:3] == ["-m", "gradscope"]:
            return words[3:]
        return None

    @property
    def expected_code(self) -> int:
        stated = re.search(r"\bexits? (\d)\b", self.comment)
        if stated:
            return int(stated.group(1))
        if any(line.startswith("gradscope: error:") for line in self.output):
            return 2
        if any(line.startswith("FAILED") for line in self.output):
            return 1
        return 0

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line} {self.text}"


def _split_comment(line: str) -> tuple[str, str]:
    match = re.search(r"(^|\s)#", line)
    if not match:
        return line.rstrip(), ""
    return line[:match.start()].rstrip(), line[match.end():].strip()


def _join_continuations(lines: list[str], start: int) -> tuple[str, int]:
    """The line at ``start`` with its ``\\`` continuations, and the index after them."""
    text, i = lines[start].rstrip(), start + 1
    while text.endswith("\\") and i < len(lines):
        text = text[:-1].rstrip() + " " + lines[i].strip()
        i += 1
    return text, i


def shown_lines() -> list[Shown]:
    found: list[Shown] = []
    for path in DOCS:
        doc = str(path.relative_to(REPO))
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            language, end = fence.group(1), i + 1
            while not lines[end].startswith("```"):
                end += 1
            block = lines[i + 1:end]
            if language in ("text", "console"):
                j = 0
                while j < len(block):
                    if not block[j].startswith("$ "):
                        j += 1
                        continue
                    text, after = _join_continuations(block, j)
                    output_end = next((k for k in range(after, len(block))
                                       if block[k].startswith("$ ")), len(block))
                    command, comment = _split_comment(text[2:])
                    found.append(Shown(doc, i + 2 + j, command, tuple(block[after:output_end]),
                                       comment))
                    j = output_end
            elif language in ("sh", "bash", "shell"):
                j = 0
                while j < len(block):
                    text, after = _join_continuations(block, j)
                    command, comment = _split_comment(text)
                    if command.strip():
                        found.append(Shown(doc, i + 2 + j, command.strip(), (), comment))
                    j = after
            i = end + 1
    return found


SHOWN = shown_lines()
COMMANDS = [s for s in SHOWN if s.argv is not None]


def test_every_shell_line_is_a_gradscope_command_or_listed_here():
    others = {s.text for s in SHOWN if s.argv is None}
    assert others == set(SKIPPED) | set(MADE_BY_THE_WORKSPACE)


def test_the_course_config_is_the_one_docs_check_shows():
    assert f"```yaml\n{COURSE_RNN}```" in (REPO / "docs" / "check.md").read_text()


def _run_sample_script(line: str, target: Path) -> None:
    """A MADE_BY_THE_WORKSPACE line, run here: its script, with ``target`` as its argument."""
    script = REPO / shlex.split(line)[1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), str(target)])
        # The scripts set TF_CPP_MIN_LOG_LEVEL: give it back as it was afterwards.
        patch.setenv("TF_CPP_MIN_LOG_LEVEL", os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3"))
        runpy.run_path(str(script), run_name="__main__")
    assert target.exists(), line


@pytest.fixture(scope="module")
def workspace(tf, tmp_path_factory) -> dict[str, Path]:
    """{name the docs use: the file made for it} for every WORKSPACE name."""
    from test_yaml_weights import seed_variables, write_tf1_checkpoint

    import gradscope

    folder = tmp_path_factory.mktemp("docs_workspace")
    # Each file keeps the name the docs give it (messages name a file by its name).
    files = {name: folder / name.lstrip("/") for name in WORKSPACE}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    files["course_adapter.py"] = REPO / "tests" / "against" / "course_adapter.py"
    for line, name in MADE_BY_THE_WORKSPACE.items():
        _run_sample_script(line, files[name])
    _run_sample_script(ENCODER_DECODER, files["model.keras"])

    seed = (SAMPLES / "seed.yaml").read_text()
    assert seed.count("time_steps: 100") == 1
    files["/tmp/seed200.yaml"].write_text(seed.replace("time_steps: 100", "time_steps: 200"))
    files["course_rnn.yaml"].write_text(COURSE_RNN)

    values = seed_variables(np.random.default_rng(7))
    prefix = write_tf1_checkpoint(tf, folder / "seed_model" / "model.ckpt", values)
    files["seed_model/model.ckpt"] = Path(prefix)
    bad = {**values, "GRU_Layer1/rnn/gru_cell/gates/kernel": np.zeros((265, 128), np.float32)}
    files["bad_model/model.ckpt"] = Path(
        write_tf1_checkpoint(tf, folder / "bad_model" / "model.ckpt", bad))
    files["seed_model.yaml"].write_text(gradscope.infer_spec(prefix).yaml)
    files["runs/memory/model.keras"] = files["runs/memory"] / "model.keras"
    files["memory.yaml"].write_text(gradscope.infer_spec(files["runs/memory/model.keras"]).yaml)
    files["base.json"].write_text(gradscope.explain(None).to_json())
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((12, 3), name="x")
    fading = keras.layers.SimpleRNN(
        4, name="rnn", recurrent_initializer=keras.initializers.Orthogonal(gain=0.1))(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(fading))
    model.compile(loss="mse")
    model.save(files["fading.keras"])
    narrowed = seed.replace("  - gru: 32\n", "  - gru: 16\n")
    assert narrowed != seed
    files["new.json"].write_text(
        gradscope.explain(gradscope.load_spec(yaml.safe_load(narrowed))).to_json())
    assert set(files) == set(WORKSPACE)
    return files


def _arguments(argv: list[str], files: dict[str, Path], outputs: Path) -> list[str]:
    result, previous = [], ""
    for word in argv:
        name, colon, function = word.partition(":")
        if previous in ("-o", "--output", "--plot", "--junit"):
            word = str(outputs / Path(word).name)
        elif word in files:
            word = str(files[word])
        elif colon and name in files:
            word = f"{files[name]}:{function}"
        result.append(word)
        previous = word
    return result


def _verdict(lines) -> str:
    """The PASSED/FAILED verdict and what follows it, with the line breaks of the width gone."""
    lines = list(lines)
    start = next((i for i, line in enumerate(lines)
                  if line.startswith(("PASSED", "FAILED"))), None)
    return "" if start is None else " ".join(" ".join(lines[start:]).split())


@pytest.mark.parametrize("shown", COMMANDS, ids=[s.id for s in COMMANDS])
def test_the_command_runs_with_the_exit_code_shown(shown, workspace, monkeypatch, capsys,
                                                   tmp_path):
    monkeypatch.chdir(REPO)
    for name, value in shown.env.items():
        monkeypatch.setenv(name, value)
    argv = _arguments(shown.argv, workspace, tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out, err = capsys.readouterr()
    code = stop.value.code or 0
    assert code == shown.expected_code, f"{shown.id}\nstdout:\n{out[-3000:]}\nstderr:\n{err}"

    for name, path in workspace.items():
        err = err.replace(str(path), name)
    errors = [line for line in shown.output if line.startswith("gradscope: error:")]
    if errors:
        assert err.strip() == errors[0]
    for line in shown.output:  # what --fail-on says failed, on stderr
        if re.match(r"gradscope \w+: --fail-on ", line):
            assert line in err.splitlines(), err
    if _verdict(shown.output):
        assert _verdict(out.splitlines()) == _verdict(shown.output)


def test_nothing_was_written_into_the_clone():
    for name in [*WORKSPACE, "encoder_decoder.keras", "runs"]:
        if not name.startswith("/") and name != "course_adapter.py":
            assert not (REPO / name).exists(), name


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_relative_link_and_anchor_resolves(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        path = (doc.parent / name).resolve() if name else doc
        assert path.exists(), f"{doc.name}: {target}"
        if anchor:
            assert anchor in _anchors(path), f"{doc.name}: {target}"
