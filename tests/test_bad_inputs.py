"""The bad-input corpus (tests/bad_inputs/cases.yaml): every case exits 2 with its message
in one line, no traceback, and --json gives exactly one error object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gradscope.cli import main

FOLDER = Path(__file__).parent / "bad_inputs"
CASES = yaml.safe_load((FOLDER / "cases.yaml").read_text())


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[" ".join(c["args"][:2]).replace("{dir}/", "")
                                             for c in CASES])
def test_bad_input_exits_2_with_its_message(case, capsys, tf):
    args = [a.replace("{dir}", str(FOLDER)) for a in case["args"]]
    code, out, err = _run(args, capsys)
    assert code == 2, (out, err)
    assert case["fragment"] in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert out == ""
    code, out, err = _run([*args, "--json"], capsys)
    assert code == 2
    document = json.loads(out)
    assert list(document) == ["error"] and case["fragment"] in document["error"]["message"]
    assert set(document["error"]) == {"message", "where"}
