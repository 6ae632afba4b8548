"""Exceptions that carry gradscope's exit-code contract.

The CLI decides exit codes in one place (``cli.py``); the library only raises these.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


def one_line(text: str) -> str:
    """Escape control characters (a key named "\n" in a config, say): messages stay one line."""
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode()
                   for ch in text)


def first_line(exc: BaseException) -> str:
    """What an exception of Keras, TensorFlow or the user's code says, in one line: its first
    line, or its class where it says nothing. Keras wraps an error raised inside a layer's
    call ("Exception encountered when calling Lambda.call()."): its message is then the
    wrapped one, and the error the user's code raised first, where Keras raised another in
    handling it (a Lambda's NameError, a custom gradient's own error), is named as the cause."""
    text = _plain(str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = lines[0] if lines else type(exc).__name__
    # A sentence Keras wrapped onto the next lines (found tried as a new user would: Keras'
    # "must override `get_config()` in" ended a reason, its sentence going on two lines more).
    for line in lines[1:8]:
        if said.endswith((".", ":", ";", "!", "?", "=")) or not line[:1].islower():
            break
        said = f"{said} {line}"
    if said.startswith("Exception encountered when calling") and len(lines) > 1:
        said = f"{said.removeprefix('Exception encountered when calling ').rstrip('.')}: {lines[1]}"
    inferred = re.match(r"Could not automatically infer the output shape / dtype of '([^']+)' "
                        r"\(of type (\w+)\)", said)
    after = text.split("Error encountered:", 1)[1].strip().splitlines() if (
        inferred and "Error encountered:" in text) else []
    if inferred and after:
        # Keras' shape inference wraps the layer's own error in three sentences of advice
        # (found tried as a new user would: a reason of six lines): the layer and its error.
        return _unfinished(f"Keras cannot infer the output of '{inferred.group(1)}' "
                           f"({inferred.group(2)}): {after[0].strip()}")
    said = _unfinished(said)
    root = exc
    seen = {id(exc)}
    while (nested := root.__cause__ or root.__context__) is not None and id(nested) not in seen:
        seen.add(id(nested))
        root = nested
    if root is not exc:
        cause = _plain(str(root)).strip().splitlines()
        told = _unfinished(cause[0].strip()) if cause else ""
        if told and told not in said:
            said += f" (caused by {type(root).__name__}: {told})"
    return said


def _unfinished(line: str) -> str:
    """``line`` whose last value goes on over the next lines (a tf.Variable's repr stops at
    "numpy="): its unfinished "name=" left out, and "…" to say it goes on (found tried as a
    new user would: a line that stopped at "numpy=")."""
    return re.sub(r",?\s*\w+=$", " …", line)


def _plain(text: str) -> str:
    """Text without terminal colour codes (Keras bolds the message it wraps)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text).strip()


class GradscopeError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 2

    def __init__(self, message: str, where: str | None = None) -> None:
        message = one_line(message)
        super().__init__(message)
        self.message = message
        self.where = where

    def __str__(self) -> str:
        return self.message


class ConfigError(GradscopeError):
    """The config (YAML or dict) is malformed or names something unknown. Exit 2."""


class DataError(GradscopeError):
    """A supplied array does not fit the model, or holds non-finite values. Exit 2."""


class InternalError(GradscopeError):
    """gradscope disagrees with itself, e.g. a TF gradient shape differs from the algebra.

    Reported loudly; it is a problem found, so the exit code is 1.
    """

    exit_code = 1


# -- how an option is spelt -----------------------------------------------------------------------
# The same refusal reaches a user of the command line and a user of the Python API: each reads
# the option as they wrote it (``--time-steps 0`` there, ``time_steps=0`` here).

_ON_COMMAND_LINE: ContextVar[bool] = ContextVar("gradscope_on_command_line", default=False)

#: Options whose flag is not their Python name.
FLAGS = {"heatmap": "--plot", "max_memory": "--max-memory", "imports": "--import"}


def flag(name: str) -> str:
    """The option ``name`` (the API's keyword) as the user spelt it: ``--time-steps`` on the
    command line, ``time_steps=`` in Python."""
    if _ON_COMMAND_LINE.get():
        return FLAGS.get(name) or "--" + name.replace("_", "-")
    return f"{name}="


def whole_number(value: object) -> bool:
    """Whether ``value`` is a whole number as a user may give one: a Python int, or NumPy's
    (``len(x) // 32 // 10`` is an ``np.int64``: found tried as a new user would, refused as
    "expected a whole number"); never a bool, which Python counts as 1 or 0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def given(name: str, value: object) -> str:
    """The option ``name`` with its value, as the user wrote it: ``--chunks 1`` or
    ``chunks=1``."""
    if _ON_COMMAND_LINE.get():
        return f"{flag(name)} {value}"
    return f"{name}={value!r}"


def imports_given(*sources: str) -> str:
    """Code for a saved model to import, as the user gives it: ``--import my_layers`` on the
    command line, ``imports=['my_layers']`` in Python (:func:`gradscope.load_model`'s)."""
    if _ON_COMMAND_LINE.get():
        return " ".join(f"--import {source}" for source in sources)
    return f"imports={list(sources)!r}"


def load_it(source: str, argument: str, why: str) -> str:
    """The way out in Python where the command line's is a flag: load the saved model with
    :func:`gradscope.load_model`, ``argument`` given (``why``: what it brings), and pass the
    model."""
    return f"load it with gradscope.load_model({source!r}, {argument}) {why}, and pass the model"


def on_the_command_line() -> bool:
    """Whether messages now spell options as flags (within :func:`on_command_line`)."""
    return _ON_COMMAND_LINE.get()


@contextmanager
def on_command_line() -> Iterator[None]:
    """Within this block, messages spell options as flags (the CLI runs its commands here)."""
    token = _ON_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)
