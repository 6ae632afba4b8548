"""The public functions' docstrings: each has Args, and its examples run as written."""

from __future__ import annotations

import doctest
import inspect

import pytest

import gradscope
import gradscope.testing

PUBLIC = [gradscope.load_spec, gradscope.shapes, gradscope.explain, gradscope.check,
          gradscope.estimate_memory, gradscope.infer_spec, gradscope.watch,
          gradscope.load_model, gradscope.diff, gradscope.testing.assert_gradients,
          gradscope.testing.check_layer, gradscope.testing.diagnosis]


@pytest.mark.parametrize("function", PUBLIC, ids=lambda f: f.__name__)
def test_every_public_function_says_its_arguments(function):
    text = inspect.getdoc(function)
    assert "Args:" in text
    assert len(text.splitlines()[0]) <= 100


def test_the_examples_run_as_written():
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    ran = 0
    for function in PUBLIC:
        for test in finder.find(function, globs={"gradscope": gradscope}):
            runner.run(test)
            ran += len([e for e in test.examples if not e.options])
    assert runner.failures == 0
    assert ran >= 8  # shapes, explain, check and estimate_memory run for real
