"""``check --junit FILE``: real checks written as JUnit XML, read back with junitparser (a
reader CI tools use), one test case per tensor. A wrong backward (``--against`` mutants of the
user's own GRU BPTT) must become failures that name the tensor and carry the diagnosis; a
correct one, a file of passing cases."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_gradscope
from junitparser import Failure, JUnitXml, Skipped

AGAINST = "tests/against/user_gru_bptt.py"


def _cases(path: Path) -> dict[str, object]:
    xml = JUnitXml.fromfile(str(path))
    return {case.name: case for suite in xml for case in suite}


def test_a_passing_check_is_a_file_of_passing_cases(tmp_path):
    junit = tmp_path / "gradients.xml"
    done = run_gradscope("check", "--against", f"{AGAINST}:correct", "--junit", str(junit),
                         "-q")
    assert done.returncode == 0, done.stderr
    xml = JUnitXml.fromfile(str(junit))
    suite = next(iter(xml))
    cases = _cases(junit)
    assert suite.tests == len(cases) > 10
    assert suite.failures == 0 and suite.errors == 0
    assert all(case.is_passed for case in cases.values())
    assert cases["gru_1/w_ru"].classname == "gradscope.check.gru_1"
    assert cases["x"].classname == "gradscope.check.inputs"
    assert cases["gru_2/h0"].classname == "gradscope.check.gru_2"


def test_a_wrong_backward_fails_the_tensors_it_gets_wrong_with_the_diagnosis(tmp_path):
    """The dense kernel off by 5% in one element: only that tensor fails, and its failure
    says which witness, the error and the element."""
    junit = tmp_path / "gradients.xml"
    done = run_gradscope("check", "--against", f"{AGAINST}:one_element_off", "--junit",
                         str(junit), "-q")
    assert done.returncode == 1
    cases = _cases(junit)
    failed = {name for name, case in cases.items() if not case.is_passed}
    assert failed == {"dense_1/kernel"}
    (failure,) = [r for r in cases["dense_1/kernel"].result if isinstance(r, Failure)]
    assert failure.message.startswith("dense_1/kernel · --against: relative error")
    assert "element (0, 0)" in failure.text
    assert next(iter(JUnitXml.fromfile(str(junit)))).failures == 1


def test_a_keras_check_names_layers_and_lists_what_a_witness_skipped(tmp_path, tf):
    """A Keras model with a relu GRU: the NumPy reference cannot stand in for it, which is a
    skipped case with the reason."""
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4, activation="relu",
                                                                    name="gru"),
                              keras.layers.Dense(2, name="out")])
    model.compile(loss="mse")
    path = tmp_path / "relu.keras"
    model.save(path)
    junit = tmp_path / "gradients.xml"
    done = run_gradscope("check", str(path), "--junit", str(junit), "-q")
    assert done.returncode == 0, done.stderr
    cases = _cases(junit)
    assert cases["gru/gru_cell/kernel"].classname == "gradscope.check.gru"
    skipped = [case for case in cases.values()
               if any(isinstance(r, Skipped) for r in case.result)]
    assert skipped and "relu" in skipped[0].result[0].message


def test_an_existing_file_is_never_overwritten(tmp_path):
    junit = tmp_path / "gradients.xml"
    junit.write_text("mine")
    done = run_gradscope("check", "--junit", str(junit), "-q")
    assert done.returncode == 2
    assert "--junit" in done.stderr and "already exists" in done.stderr
    assert junit.read_text() == "mine"
    same = run_gradscope("check", "--junit", str(tmp_path / "a.xml"), "-o",
                         str(tmp_path / "a.xml"), "-q")
    assert same.returncode == 2 and "two different files" in same.stderr


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
