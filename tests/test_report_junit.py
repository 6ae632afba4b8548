"""``check --junit FILE``: real checks written as JUnit XML, read back with junitparser (a
reader CI tools use), one test case per tensor. A wrong backward (``--against`` mutants of the
user's own GRU BPTT) must become failures that name the tensor and carry the diagnosis; a
correct one, a file of passing cases."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_cli, run_gradscope
from junitparser import Failure, JUnitXml, Skipped

AGAINST = "tests/against/user_gru_bptt.py"
#: The seed's layers (block GRU 64 → block GRU 32 → dense), small: the diagnosis of a wrong
#: backward reruns the NumPy reference for each known mistake (on the seed 100 s of the suite).
SMALL = ("input_size: 5\ntime_steps: 6\nbatch_size: 4\n"
         "layers: [{gru: 4}, {gru: 3}, {dense: 3}]\n")


def _small(tmp_path: Path) -> str:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return str(path)


def _cases(path: Path) -> dict[str, object]:
    xml = JUnitXml.fromfile(str(path))
    return {case.name: case for suite in xml for case in suite}


def test_a_passing_check_is_a_file_of_passing_cases(tmp_path):
    junit = tmp_path / "gradients.xml"
    done = run_gradscope("check", _small(tmp_path), "--against", f"{AGAINST}:correct",
                         "--junit", str(junit), "-q")
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
    done = run_gradscope("check", _small(tmp_path), "--against",
                         f"{AGAINST}:one_element_off", "--junit", str(junit), "-q")
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
    assert cases["gru/kernel"].classname == "gradscope.check.gru"
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


def test_a_check_that_cannot_run_still_writes_the_file_with_why(tmp_path, tf):
    """A data error (exit 2): the JUnit file holds one error case with the message, so that a
    CI job reading it reports why rather than a missing file."""
    import keras
    from junitparser import Error

    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4, name="gru"),
                              keras.layers.Dense(2, name="out")])
    model.compile(loss="mse")
    path = tmp_path / "gru.keras"
    model.save(path)
    import numpy as np

    np.savez(tmp_path / "bad.npz", x=np.ones((2, 5, 3), "float32"))  # no targets
    junit = tmp_path / "gradients.xml"
    done = run_gradscope("check", str(path), "--data", str(tmp_path / "bad.npz"), "--junit",
                         str(junit), "-q")
    assert done.returncode == 2, done.stderr
    (case,) = _cases(junit).values()
    (error,) = case.result
    assert isinstance(error, Error) and "no targets for the output" in error.message


def test_a_model_checked_in_float32_says_so_in_its_properties(tmp_path, tf):
    """A saved model whose registered layer makes a float32 sub-layer in its code: check runs
    in float32 (exit 0), and the JUnit properties name the dtype and why."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "blocks.py").write_text(textwrap.dedent('''
        import keras


        @keras.saving.register_keras_serializable("blocks")
        class Block(keras.layers.Layer):
            def __init__(self, units, **kwargs):
                super().__init__(**kwargs)
                self.units = units
                self.project = keras.layers.Dense(units, dtype="float32")  # not in config

            def call(self, x):
                return self.project(x)

            def get_config(self):
                return {**super().get_config(), "units": self.units}
    '''))
    build = textwrap.dedent('''
        import keras, blocks
        keras.utils.set_random_seed(7)
        inputs = keras.Input((5, 3))
        h = keras.layers.GRU(4, name="gru")(blocks.Block(3, name="block")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
        model.compile(loss="mse")
        model.save("blocks.keras")
    ''')
    done = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    junit = tmp_path / "gradients.xml"
    done = run_cli("check", "blocks.keras", "--import", "blocks", "--junit", str(junit), "-q",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    properties = {p.name: p.value for suite in JUnitXml.fromfile(str(junit))
                  for p in suite.properties()}
    assert properties["dtype"] == "float32" and properties["rtol.finite_differences"] == "0.002"
    assert "block/dense" in properties["dtype.reason"]
