"""Exceptions that carry gradscope's exit-code contract.

The CLI decides exit codes in one place (``cli.py``); the library only raises these.
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """Escape control characters (a key named "\n" in a config, say): messages stay one line."""
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode()
                   for ch in text)


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
