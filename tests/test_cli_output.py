"""The CLI as a user meets it: golden text at a fixed width, clean streams, one JSON document,
byte-identical repeats, and no TensorFlow log lines."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest
from conftest import REPO, render_text, run_gradscope
from jsonschema import Draft202012Validator
from rich.cells import cell_len

from gradscope.report.tables import WITNESS_TITLES
from gradscope.yaml.check.block_kernel import CORRECTED_EQUATIONS

GOLDEN = REPO / "tests" / "golden"
REGENERATE = bool(os.environ.get("GRADSCOPE_REGEN_GOLDEN"))
PLAIN = {"COLUMNS": "120", "NO_COLOR": "1"}
ANSI = re.compile(r"\x1b\[")
TF_NOISE = re.compile(r"absl|oneDNN|cuda|I0000|W0000|E0000|tensorflow/|TF_ENABLE|WARNING")


#: The check columns whose digits are rounding noise of the CPU the test runs on: the NumPy
#: reference agrees with autodiff to ~1e-16, and TF's float32 GRUBlockCellGrad kernel (like the
#: errata's evidence, computed with it) takes other code paths on other CPUs. The same golden
#: texts gave e.g. 8.2e-16 / 2.1e-07 on one CI machine and 8.4e-16 / 2.0e-07 on an AMD EPYC.
#: Their digits are masked on both sides; every word, width and the other columns' numbers
#: still count, and the witnesses' values are held to independent truth by their own tests.
ROUNDING_COLUMNS = (WITNESS_TITLES["numpy_reference"], WITNESS_TITLES["gru_block_kernel"])
CELL = re.compile(r"[✓✗] \S+|(?<= )–(?= |$)")
SCIENTIFIC = re.compile(r"\d\.\d+e[+-]\d\d")


def _rounding_masked(text: str) -> str:
    """``text`` with the digits of the cells in ROUNDING_COLUMNS, and of the errata's evidence,
    replaced by '#' (same widths)."""
    out, columns, errata = [], None, False
    for line in text.splitlines(keepends=True):
        errata = errata or line.startswith("Errata in the public")
        if errata:
            line = SCIENTIFIC.sub(lambda m: "#" * len(m.group()), line)
        elif WITNESS_TITLES["finite_differences"] in line:  # a table header
            found = sorted((line.find(t), t) for t in WITNESS_TITLES.values() if t in line)
            columns = [title for _, title in found]
        elif not line.strip():
            columns = None
        elif columns is not None:
            cells = list(CELL.finditer(line))
            if len(cells) == len(columns):
                for cell, title in reversed(list(zip(cells, columns, strict=True))):
                    if title in ROUNDING_COLUMNS:
                        masked = re.sub(r"[0-9]", "#", cell.group())
                        line = line[:cell.start()] + masked + line[cell.end():]
        out.append(line)
    return "".join(out)


def _compare_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGENERATE or not path.exists():
        path.write_text(text, encoding="utf-8")
        if not REGENERATE:
            pytest.fail(f"golden file {name} was missing and has been written; check it in")
    golden = path.read_text(encoding="utf-8")
    if name.startswith("check"):
        text, golden = _rounding_masked(text), _rounding_masked(golden)
    assert text == golden, (
        f"output differs from {path}; if the change is intended, rerun with "
        "GRADSCOPE_REGEN_GOLDEN=1"
    )


def test_explain_seed_golden_and_no_tf_log_lines():
    # The user's environment asks TF for every log line; none may reach either stream.
    result = run_gradscope("explain", env={**PLAIN, "TF_CPP_MIN_LOG_LEVEL": "0"},
                           process=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert not TF_NOISE.search(result.stdout)
    assert not ANSI.search(result.stdout)
    for shape in ["(264, 128)", "(128,)", "(264, 64)", "(64,)", "(96, 64)", "(96, 32)",
                  "(32,)", "(32, 3)", "(3,)", "(34, 64)", "(34, 32)"]:
        assert shape in result.stdout
    assert "Passed 10 grad_ys for 2 ys" in result.stdout
    _compare_golden("explain_seed.txt", result.stdout)


@pytest.mark.parametrize("config", ["keras_gru", "last_step", "mixed_regression"])
def test_explain_sample_configs_golden(config):
    result = run_gradscope("explain", f"sample_configs/{config}.yaml", env=PLAIN)
    assert result.returncode == 0, result.stderr
    _compare_golden(f"explain_{config}.txt", result.stdout)


def test_shapes_golden():
    result = run_gradscope("shapes", env=PLAIN)
    assert result.returncode == 0, result.stderr
    _compare_golden("shapes_seed.txt", result.stdout)


#: The seed model's golden texts: their CLI arguments. Each is kept at 120 columns (NAME.txt)
#: and at 80 (NAME_80.txt).
SEED_GOLDENS = {
    "explain_seed": ["explain"],
    "explain_flow_seed": ["explain", "--flow"],
    "explain_chunks_seed": ["explain", "--chunks", "2"],
    "check_seed": ["check"],
    "check_equations_seed": ["check", "--equations"],
}


@pytest.mark.parametrize("name", SEED_GOLDENS)
def test_seed_golden_at_80_columns(name):
    result = run_gradscope(*SEED_GOLDENS[name], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert max(cell_len(line) for line in result.stdout.splitlines()) <= 80
    _compare_golden(f"{name}_80.txt", result.stdout)


def _seed_report(seed_reports, name: str):
    """The in-process report behind a golden text, and the equations check --equations adds."""
    explain = seed_reports["explain"]
    numbers = ("chunks", "chunk_lengths", "weights", "products", "threshold", "matters",
               "verdict")
    plain = explain.model_copy(update={
        "carry": explain.carry.model_copy(update=dict.fromkeys(numbers))})
    return {
        "explain_seed": (plain.model_copy(update={"gradient_flow": None,
                                                  "state_jacobians": None}), None),
        "explain_flow_seed": (plain.model_copy(update={"state_jacobians": None}), None),
        "explain_chunks_seed": (explain.model_copy(update={"gradient_flow": None,
                                                           "state_jacobians": None}), None),
        "check_seed": (seed_reports["check"], None),
        "check_equations_seed": (seed_reports["check"], CORRECTED_EQUATIONS),
    }[name]


#: A Keras model whose weight names are long (bidirectional/forward_lstm/recurrent_kernel):
#: at 80 columns each name takes a line of its own, with its text under it at full width.
BIDIRECTIONAL_KERAS = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((12, 5)),
    keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True)),
    keras.layers.GRU(6),
    keras.layers.Dense(3, activation="softmax"),
])
model.compile(loss="categorical_crossentropy")
model.save(sys.argv[1])
"""

#: The NumPy reference's distance from Keras' float32 output: rounding noise of the CPU.
WITNESS_DISTANCE = re.compile(r"(?<=output to )\d\.\de[-+]\d\d")


@pytest.fixture(scope="module")
def bidirectional_keras(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keras_80") / "bidirectional.keras"
    subprocess.run([sys.executable, "-c", BIDIRECTIONAL_KERAS, str(path)], check=True,
                   capture_output=True, timeout=120)
    return str(path)


@pytest.mark.parametrize("name,args", [
    ("explain_keras_bidirectional_80", ["explain", "--batch-size", "4", "--flow"]),
    ("shapes_keras_bidirectional_80", ["shapes"]),
])
def test_keras_golden_at_80_columns(bidirectional_keras, name, args):
    result = run_gradscope(args[0], bidirectional_keras, *args[1:],
                           env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert max(cell_len(line) for line in result.stdout.splitlines()) <= 80
    assert "\u00a0" not in result.stdout  # what is glued while wrapping shows plain spaces
    text = WITNESS_DISTANCE.sub(lambda m: "#" * len(m.group()), result.stdout)
    _compare_golden(f"{name}.txt", text)


@pytest.mark.parametrize("name", SEED_GOLDENS)
def test_seed_golden_at_120_columns_and_the_same_report_at_80(seed_reports, name):
    # One TensorFlow run per command renders both widths; at 80 columns it must print what the
    # CLI printed, so the 120-column text is the CLI's too.
    report, equations = _seed_report(seed_reports, name)
    _compare_golden(f"{name}.txt", render_text(report, 120, equations))
    at_80 = GOLDEN / f"{name}_80.txt"
    if at_80.exists():
        _compare_golden(at_80.name, render_text(report, 80, equations))


def test_explain_json_is_one_valid_document_and_byte_identical_on_repeat():
    first = run_gradscope("explain", "--json", process=True)  # a fresh process, then this one
    second = run_gradscope("explain", "--json")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout
    document = json.loads(first.stdout)  # raises if there is anything but one document
    schema = json.loads(run_gradscope("schema", "explain").stdout)
    Draft202012Validator(schema).validate(document)
    assert document["schema_version"] == "1"
    assert {"schema_version", "model", "loss", "gradients", "initial_state_gradients"} <= set(
        document)
    for entry in document["gradients"]:
        assert {"name", "alias", "shape", "formula", "meaning", "stats"} <= set(entry)
    assert "timings" not in document or document["timings"] is None


def _run_in_pty(args: list[str], env: dict[str, str]) -> str:
    """Run the CLI with stdout on a pseudo-terminal, as in an interactive shell (COLUMNS
    only where ``env`` gives it)."""
    main_fd, child_fd = pty.openpty()
    full_env = {**os.environ, **env}
    if "COLUMNS" not in env:
        full_env.pop("COLUMNS", None)
    process = subprocess.Popen([sys.executable, "-m", "gradscope", *args], cwd=REPO,
                               stdout=child_fd, stderr=child_fd, env=full_env)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait(timeout=60)
    os.close(main_fd)
    return b"".join(chunks).decode("utf-8", "replace")


def test_terminal_gets_colour_but_not_with_no_color():
    env = {"TERM": "xterm-256color"}
    coloured = _run_in_pty(["shapes"], {**env, "NO_COLOR": ""})
    assert ANSI.search(coloured), "a terminal should get styled output"
    plain = _run_in_pty(["shapes"], {**env, "NO_COLOR": "1"})
    assert "gru_1/w_ru" in plain
    assert not ANSI.search(plain)


def test_an_error_on_a_terminal_is_wrapped_at_its_width_between_words_and_one_line_in_a_log():
    args = ["explain", "--flwo", "x"]
    logged = run_gradscope(*args)
    assert logged.returncode == 2
    (line,) = logged.stderr.splitlines()  # a log keeps it on one line, for grep
    assert len(line) > 100 and "'--flow'" in line
    shown = _run_in_pty(args, {"NO_COLOR": "1", "COLUMNS": "80"}).replace("\r", "")
    lines = [ANSI.sub("", x) for x in shown.splitlines() if x.strip()]
    assert len(lines) > 1 and all(len(x) <= 80 for x in lines), lines
    assert all(x.startswith("  ") for x in lines[1:])  # continued, indented
    assert " ".join(x.strip() for x in lines) == line  # no word cut, none lost


def test_wrapped_breaks_between_words_only():
    from gradscope.report.layout import wrapped

    text = ("gradscope: error: a.npz: 2 problems, one per line:\n  has 1.2345678901e-07 "
            + "word " * 20 + "/a/path/" + "x" * 90 + ".npz end")
    out = wrapped(text, 40).splitlines()
    assert out[:2] == ["gradscope: error: a.npz: 2 problems, one", "  per line:"]
    assert "    /a/path/" + "x" * 90 + ".npz" in out  # longer than the line, never cut
    assert all(len(x) <= 40 for x in out if "/a/path/" not in x)
    assert out[2].startswith("  has 1.2345678901e-07") and out[3].startswith("    word")
    assert " ".join(x.strip() for x in out[2:]) == text.splitlines()[1].strip()


def test_output_file_is_written_and_never_overwritten(tmp_path):
    target = tmp_path / "report.json"
    first = run_gradscope("shapes", "--json", "-o", str(target))
    assert first.returncode == 0, first.stderr
    assert json.loads(target.read_text())["command"] == "shapes"
    target.write_text("keep me")
    second = run_gradscope("shapes", "--json", "-o", str(target))
    assert second.returncode == 2
    assert "already exists" in second.stderr
    assert target.read_text() == "keep me"
    forced = run_gradscope("shapes", "--json", "-o", str(target), "--force")
    assert forced.returncode == 0 and "gru_1/w_ru" in target.read_text()
    text = tmp_path / "report.txt"
    assert run_gradscope("shapes", "-o", str(text)).returncode == 0
    assert "gru_1/w_ru" in text.read_text() and not text.read_text().startswith("{")


def test_check_json_is_byte_identical_on_repeat(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("input_size: 5\ntime_steps: 6\nbatch_size: 4\n"
                      "layers: [{gru: 4}, {lstm: 3, layout: keras}, {dense: 3}]\n")
    first = run_gradscope("check", str(config), "--json", "--chunks", "2", process=True)
    second = run_gradscope("check", str(config), "--json", "--chunks", "2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr
    assert first.stdout == second.stdout
    assert first.stderr == "" and second.stderr == ""


def test_silenced_regions_on_two_threads_keep_native_stderr_silenced_until_the_last_closes(
        capfd):
    """GradientFlow's worker compiles under XLA in a silenced region that the training
    thread's own, opened first, may outlast: found tried as a new user would, XLA's start-up
    lines reached the terminal when the first region closed. A native write to fd 2 while any
    region is open goes nowhere; after the last one closes, it is seen again."""
    import os
    import threading

    from gradscope._tf import native_stderr_silenced

    opened, first_closed = threading.Event(), threading.Event()

    def worker() -> None:
        with native_stderr_silenced():
            opened.set()
            first_closed.wait(10)
            os.write(2, b"a native line of the worker\n")

    with native_stderr_silenced():
        thread = threading.Thread(target=worker)
        thread.start()
        opened.wait(10)
    first_closed.set()
    thread.join(10)
    os.write(2, b"a native line after both\n")
    err = capfd.readouterr().err
    assert "a native line of the worker" not in err
    assert "a native line after both" in err


def test_what_a_command_is_doing_stays_on_one_line_of_a_narrow_terminal():
    import io

    from rich.console import Console
    from rich.status import Status

    from gradscope.cli import _one_line

    console = Console(file=io.StringIO(), width=40, force_terminal=True)
    status = Status("gradscope check", console=console)
    _one_line(status)("finite differences, and the NumPy reference where it models a layer")
    lines = console.render_lines(status.renderable, console.options, pad=False)
    assert len(lines) == 1
    shown = "".join(segment.text for segment in lines[0])
    assert len(shown) <= 40 and shown.rstrip().endswith("…") and "finite differences" in shown
