"""Import TensorFlow without letting its start-up log lines reach the terminal.

TF 2.21 prints absl lines (``WARNING: All log messages before absl::InitializeLog()…``,
``I0000 … oneDNN custom operations are on…``) straight to file descriptor 2, at import and again
at the first op, whatever ``TF_CPP_MIN_LOG_LEVEL`` says. So file descriptor 2 is pointed at
/dev/null while TensorFlow runs, and Python's ``sys.stderr`` is re-pointed at a duplicate of the
real stderr, so that gradscope's own progress and error messages still get through.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

_lock = threading.Lock()
_depth = 0  # how many silenced regions are open, on any thread
_saved: tuple[int | None, Any, Any] | None = None  # what the first one replaced


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send native (C/C++) writes to fd 2 to /dev/null; keep Python's ``sys.stderr`` working.

    Re-entrant, across threads too: fd 2 stays silenced while any region is open, and the
    last one to close restores it (found tried as a new user would: XLA's start-up lines of
    a compilation on GradientFlow's worker reached the terminal when the training thread's
    own region, opened first, closed first).
    """
    global _depth, _saved
    with _lock:
        _depth += 1
        if _depth == 1:
            _saved = _silence()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                saved, _saved = _saved, None
                _restore(saved)


def _silence() -> tuple[int | None, Any, Any]:
    """Point fd 2 at /dev/null and ``sys.stderr`` at a duplicate of the real one; what
    :func:`_restore` gives back."""
    saved_stream = sys.stderr
    with contextlib.suppress(AttributeError, ValueError):
        sys.stderr.flush()
    try:
        saved_fd = os.dup(2)
    except OSError:  # no fd 2 at all: nothing to protect
        saved_fd = None
    replacement = None
    if saved_fd is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        if _stream_is_fd2(saved_stream):
            replacement = io.TextIOWrapper(
                os.fdopen(os.dup(saved_fd), "wb", buffering=0),
                encoding=getattr(saved_stream, "encoding", None) or "utf-8",
                errors="backslashreplace",
                write_through=True,
            )
            sys.stderr = replacement
    return saved_fd, saved_stream, replacement


def _restore(saved: tuple[int | None, Any, Any] | None) -> None:
    if saved is None:
        return
    saved_fd, saved_stream, replacement = saved
    if replacement is not None:
        with contextlib.suppress(Exception):
            replacement.flush()
        sys.stderr = saved_stream
        with contextlib.suppress(Exception):
            replacement.close()
    if saved_fd is not None:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)


def _stream_is_fd2(stream: Any) -> bool:
    try:
        return bool(stream.fileno() == 2)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False


_started = False  # gradscope's first op has run (silenced)


def import_tensorflow(start: bool = True) -> ModuleType:
    """Import TF quietly, once; later calls return the module.

    ``start``: gradscope is about to run TensorFlow, so its runtime is started now, by one op
    with stderr silenced (the first op prints its own lines: oneDNN, the CUDA stub). Without
    it (a module of the library imported, as ``from gradscope.keras import GradientFlow``),
    the runtime is left alone: the user may still configure it (``tf.config``'s devices,
    memory growth and threads, which a started runtime refuses), and so does the log level
    of TensorFlow's C++ side: ``TF_CPP_MIN_LOG_LEVEL`` is set (to 3) only where gradscope
    imports TensorFlow for its own run and the user has not set it (the command line sets it
    for its whole process: ``gradscope.cli``)."""
    global _started
    tf = sys.modules.get("tensorflow")
    if tf is None or not hasattr(tf, "function"):
        if start:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        with native_stderr_silenced(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tf = importlib.import_module("tensorflow")
            tf.get_logger().setLevel(logging.ERROR)
            with contextlib.suppress(Exception):
                from absl import logging as absl_logging

                absl_logging.set_verbosity(absl_logging.ERROR)
    if start and not _started:
        with native_stderr_silenced():
            _ = (tf.constant([[1.0]]) @ tf.constant([[1.0]])).numpy()
        _started = True
    return tf


@contextlib.contextmanager
def tensorflow_logger_quieted() -> Iterator[None]:
    """TensorFlow's Python logger at ERROR while gradscope works, then as it was: a notebook
    that imported TensorFlow first keeps its own setting, and hears no retracing warning
    about gradscope's traced functions."""
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def grappler_if(wanted: bool) -> contextlib.AbstractContextManager[None]:
    """Grappler where ``wanted``, else :func:`without_grappler`: it prunes what a second
    gradient through a recurrent loop computes and does not return (the weights' and the
    inputs' parts), 0.7 s of an LSTM 256 at 1000 steps, more than its own cost."""
    return contextlib.nullcontext() if wanted else without_grappler()


@contextlib.contextmanager
def without_grappler() -> Iterator[None]:
    """Functions instantiated and run without TensorFlow's Grappler graph optimiser, on this
    thread only (TensorFlow keeps function call options per thread; a training thread's own
    steps are untouched).

    Grappler costs about 0.3 CPU-s at the first run of a model's pass, for no measurable gain
    on a pass that runs once or every few batches. Its rewrites compute the same functions
    (at most the rounding order differs). The config is part of the key under which
    TensorFlow caches the instantiated function (a call with the default options would
    optimise it anew), so every call of one function should run under this. Where
    TensorFlow's internals differ from what this expects, functions run with the default
    options."""
    try:
        from tensorflow.core.protobuf import config_pb2
        from tensorflow.python.eager import context as eager_context

        current = eager_context.context()
        previous = current.function_call_options
        options = copy.copy(previous)
        config = config_pb2.ConfigProto()
        config.ParseFromString(previous.config_proto_serialized)
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        options.config_proto_serialized = config
    except (ImportError, AttributeError, TypeError, ValueError):
        options = None
    if options is None:
        yield
        return
    current.function_call_options = options
    try:
        yield
    finally:
        current.function_call_options = previous


def batch_free(tf: Any, function: Any) -> Any:
    """``function`` (a ``tf.function``) traced at its first call with the first axis of every
    tensor argument free (the batch's): a later call on another number of examples takes the
    same trace, where ``reduce_retracing`` would trace once more. A diagnosis's changes scan
    the 8 examples the horizon reads (about 0.4 s of a small GRU's Lyapunov scan, of a batch
    of 16), and a fit's diagnoses step an epoch's last, shorter batch."""
    traced: list[bool] = []

    def free(value: Any) -> Any:
        if tf.is_tensor(value) and value.shape.rank:
            return tf.TensorSpec((None, *value.shape[1:]), value.dtype)
        return value

    def run(*args: Any) -> Any:
        if not traced:
            function.get_concrete_function(*tf.nest.map_structure(free, args))
            traced.append(True)
        return function(*args)

    run.__wrapped__ = function  # type: ignore[attr-defined]
    return run


def xla_or_graph(tf: Any, function: Any, **options: Any) -> Any:
    """``function`` compiled by XLA, or traced as a graph where XLA cannot compile it (an op
    it has no kernel for): the first call decides, and every later call takes the same.
    XLA fuses the elementwise ops of a step, which TensorFlow's graph runs one kernel each;
    it pays where those dominate, as in a long loop of small steps. ``options``: for
    ``tf.function``."""
    chosen: list[Any] = []
    compiled = tf.function(function, jit_compile=True, **options)
    traced = tf.function(function, **options)

    def run(*args: Any) -> Any:
        if chosen:
            return chosen[0](*args)
        try:
            with native_stderr_silenced():
                value = compiled(*args)
            chosen.append(compiled)
        except Exception:  # noqa: BLE001  (any op XLA has no kernel for: the graph serves)
            value = traced(*args)
            chosen.append(traced)
        return value

    return run
