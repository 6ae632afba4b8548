"""``check --against FILE.py:FUNC``: the user's own backward function as a witness.

Contract: ``FUNC(params, x, y, h0) -> dict`` of gradients of the MEAN loss, keyed by
gradscope names (weights, ``x``, ``gru_k/h0``). Every name is optional, but at least one must
be known: a function that returns nothing gradscope can check, or that raises, breaks the
contract (a ``ConfigError``, exit 2, naming the user's file and line). Each returned array is
checked for its shape, then its values, against TF autodiff on the float64 model; names not
returned are listed as not checked. Time-indexed gradients are compared step by step, so a
wrong carry shows as "right at the last step, wrong before it".
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from gradscope.errors import ConfigError
from gradscope.gradcheck import WitnessResult, relative_error
from gradscope.yaml.check import variants
from gradscope.yaml.check.context import CheckContext
from gradscope.yaml.reference import reference_gradients

WITNESS = "against"


def load_against(target: str) -> Callable[..., Any]:
    """Import FILE.py and return FUNC. This runs the user's file, at the user's request."""
    file, _, name = target.rpartition(":")
    if not file or not name:
        raise ConfigError(f"--against {target!r}: expected FILE.py:FUNC", where="--against")
    path = Path(file)
    if not path.exists():
        raise ConfigError(f"--against: {file}: file not found", where="--against")
    if path.suffix != ".py" or path.is_dir():
        raise ConfigError(f"--against: {file}: expected a Python file (FILE.py)",
                          where="--against")
    spec = importlib.util.spec_from_file_location(f"gradscope_against_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--against: {file}: cannot be imported", where="--against")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:  # the user's file (or one it imports) does not parse
        where = _short(exc.filename) if exc.filename else file
        line = f":{exc.lineno}" if exc.lineno else ""
        raise ConfigError(f"--against: {where}{line}: {type(exc).__name__}: {exc.msg}",
                          where="--against") from None
    except Exception as exc:  # the user's code: any failure is reported, not propagated
        raise ConfigError(
            f"--against: {_user_frame(exc.__traceback__, module.__file__ or file)} (while "
            f"importing it): {_exception_text(exc)}", where="--against") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    function = getattr(module, name, None)
    if function is None:
        names = [n for n in vars(module) if callable(vars(module)[n]) and not n.startswith("_")]
        hint = difflib.get_close_matches(name, names, n=1)
        did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"--against: {file} has no function {name!r}{did_you_mean}",
                          where="--against")
    if not callable(function):
        raise ConfigError(f"--against: {file}:{name} is not a function", where="--against")
    return function


def _exception_text(exc: BaseException) -> str:
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _short(filename: str) -> str:
    """A path relative to the working directory when it lies inside it, as a user typed it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive
        return filename
    return filename if relative.startswith(os.pardir) else relative


def _user_frame(traceback: TracebackType | None, filename: str) -> str:
    """``FILE:LINE in NAME`` for the last traceback frame inside ``filename``: where the
    exception arose in the user's code, even when it was raised deeper (in NumPy, say)."""
    last = None
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == filename:
            last = traceback
        traceback = traceback.tb_next
    if last is None:
        return _short(filename)
    name = last.tb_frame.f_code.co_name
    return f"{_short(filename)}:{last.tb_lineno}" + ("" if name == "<module>" else f" in {name}")


def _call_site(function: Callable[..., Any], traceback: TracebackType | None) -> str:
    """Where the user's function failed: ``FILE:LINE in NAME``.

    The user's file is the file of the first frame below gradscope's call (the function
    itself, or a callable object's ``__call__``). If the call never entered Python code (a
    wrong number of arguments, say), the function's ``def`` line is the place to look.
    """
    entered = traceback.tb_next if traceback is not None else None
    if entered is not None:
        called = entered.tb_frame.f_code
        site = _user_frame(entered, called.co_filename)
        return site if site.endswith(f" in {called.co_name}") else f"{site} (from {called.co_name})"
    code = getattr(function, "__code__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    if code is None:
        return name
    return f"{_short(code.co_filename)}:{code.co_firstlineno} in {name}"


def _label(function: Callable[..., Any]) -> str:
    code = getattr(function, "__code__", None)
    name = getattr(function, "__name__", None) or type(function).__name__
    return f"{_short(code.co_filename)}:{name}" if code is not None else name


def against_witness(ctx: CheckContext, function: Callable[..., Any]) -> list[WitnessResult]:
    """One result per returned name; the names not returned are :func:`not_returned`.

    Raises ``ConfigError`` (exit 2) when the function breaks the contract: it raises, returns
    something other than a dict, or returns no name gradscope knows.
    """
    tolerance = ctx.tolerance(WITNESS)
    expected = ctx.autodiff_gradients()
    params = {name: value.copy() for name, value in ctx.params.items()}
    h0 = {name: value.copy() for name, value in ctx.batch.initial_states.items()}
    try:
        returned = function(params, ctx.batch.x.copy(), ctx.batch.y.copy(), h0)
    except Exception as exc:  # the user's code: reported where it arose, in one line
        raise ConfigError(f"--against: {_call_site(function, exc.__traceback__)}: "
                          f"{_exception_text(exc)}", where="--against") from None
    if not isinstance(returned, dict):
        raise ConfigError(f"--against: {_label(function)} returned {type(returned).__name__}; "
                          "expected a dict of gradients keyed by name, e.g. "
                          f"{{{next(iter(expected))!r}: array}}", where="--against")
    if not any(name in expected for name in returned):
        what = ("an empty dict" if not returned else
                "only unknown names: " + ", ".join(_with_hint(name, expected)
                                                   for name in returned))
        raise ConfigError(f"--against: {_label(function)} returned {what}; expected one or "
                          f"more of: {', '.join(expected)}", where="--against")
    results = []
    for name, value in returned.items():
        if name not in expected:
            results.append(WitnessResult(WITNESS, str(name), None, tolerance, False,
                                         "unknown name" + _hint(name, expected)))
            continue
        results.append(_compare(ctx, str(name), value, expected[name], expected, tolerance))
    return results


def not_returned(ctx: CheckContext, results: list[WitnessResult]) -> list[str]:
    """The gradients the user's function did not return: optional, so not failures, but not
    checked by it either. In the model's order."""
    checked = {result.tensor for result in results}
    return [name for name in ctx.autodiff_gradients() if name not in checked]


def _hint(name: object, expected: dict[str, np.ndarray]) -> str:
    match = difflib.get_close_matches(str(name), list(expected), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _with_hint(name: object, expected: dict[str, np.ndarray]) -> str:
    return repr(name) + _hint(name, expected)


def _compare(ctx: CheckContext, name: str, value: Any, truth: np.ndarray,
             everything: dict[str, np.ndarray], tolerance: float) -> WitnessResult:
    return compare(name, value, truth, everything, tolerance,
                   lambda wrong: _diagnose(ctx, name, wrong, truth, everything, tolerance),
                   time_axis=1 if name == "x" else None)


def compare(name: str, value: Any, truth: np.ndarray, everything: dict[str, np.ndarray],
            tolerance: float, diagnose: Callable[[np.ndarray], str],
            time_axis: int | None = None) -> WitnessResult:
    """The user's ``value`` against ``truth``: shape, finite values, then values, in norm and
    element by element. A wrong array is named by ``diagnose`` (a known mistake's signature)
    and, along ``time_axis``, located in time."""
    try:
        value = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return WitnessResult(WITNESS, name, None, tolerance, False,
                             "not an array of numbers")
    if value.shape != truth.shape:
        others = [n for n, g in everything.items() if n != name and g.shape == value.shape]
        hint = f"; that is the shape of {', '.join(others)}" if others else ""
        return WitnessResult(WITNESS, name, None, tolerance, False,
                             f"shape {value.shape}, expected {truth.shape}{hint}")
    if not np.all(np.isfinite(value)):
        return WitnessResult(WITNESS, name, None, tolerance, False, "has NaN or Inf values")
    error = relative_error(value, truth)
    # Element by element too, so one wrong element in a large tensor cannot hide in the norm.
    scale = np.abs(truth) + 1e-3 * float(np.max(np.abs(truth), initial=0.0))
    elementwise = np.abs(value - truth) <= tolerance * scale + 1e-300
    passed = error <= tolerance and bool(np.all(elementwise))
    if passed:
        return WitnessResult(WITNESS, name, error, tolerance, True)
    detail = diagnose(value)
    if not detail:  # nothing known explains it: show where it is worst
        worst = np.unravel_index(int(np.argmax(np.abs(value - truth) / scale)), truth.shape)
        where = tuple(int(i) for i in worst)
        detail = (f"largest disagreement at element {where}: {value[where]:.6e}, TF says "
                  f"{truth[where]:.6e}")
    first_bad = None
    if time_axis is not None:
        first_bad, time_detail = _locate_in_time(value, truth, tolerance, time_axis)
        detail = "; ".join(part for part in (time_detail, detail) if part)
    return WitnessResult(WITNESS, name, error, tolerance, False, detail, first_bad)


def _locate_in_time(value: np.ndarray, truth: np.ndarray, tolerance: float,
                    axis: int = 1) -> tuple[int | None, str]:
    """The first step, counting back from the end, where a per-step gradient diverges."""
    steps = truth.shape[axis]
    errors = [relative_error(np.take(value, t, axis), np.take(truth, t, axis))
              for t in range(steps)]
    bad = [t for t in range(steps) if errors[t] > tolerance]
    if not bad:
        return None, ""
    first = max(bad)
    last = steps - 1
    if first == last - 1 and bad == list(range(last)) and steps > 1:
        # Before the last step the gradient at t adds what arrives from above at t to what
        # is carried from t+1; at the last step only the first. Either may be the one left
        # out (found tried as a new user would: seed 004's second attempt, which keeps the
        # carry and drops what arrives from above, was said to drop the carry).
        return first, (f"matches at t=T−1={last}, wrong from t=T−2={last - 1} backwards: "
                       "before the last step the gradient at t is what arrives from above "
                       "at t plus what is carried from t+1, and one of them is not added "
                       "(or not right)")
    if first == last and len(bad) == steps:
        return first, ("wrong at every step, including the last: the error is inside one "
                       "step, not in the carry")
    return first, f"first wrong at t={first} (counting back from t={last})"


def _diagnose(ctx: CheckContext, name: str, value: np.ndarray, truth: np.ndarray,
              everything: dict[str, np.ndarray], tolerance: float) -> str:
    """Name the known mistake ``value`` carries: a wrong BPTT (computed with the NumPy
    reference, see :mod:`gradscope.yaml.check.variants`), a scaling, a swap."""
    tiny = float(np.finfo(np.float32).tiny)
    largest = float(np.max(np.abs(truth))) if truth.size else 0.0
    if not np.any(value) and 0 < largest < tiny:
        # Found tried as a new user would: a backward that returned float32 had an initial
        # state's gradient of 2e-83 flushed to 0, and was said to leave out a carry.
        return (f"is 0 where the gradient's largest element is {largest:.1e}, below "
                f"float32's smallest normal number ({tiny:.1e}): a float32 computation "
                "flushes it to 0")
    match = variants.identify(name, value, truth, _signatures(ctx, everything),
                              max(tolerance, 1e-6))
    if match is not None:
        return variants.describe(name, match)
    for other, gradient in everything.items():
        if other != name and gradient.shape == value.shape and \
                relative_error(value, gradient) <= max(tolerance, 1e-6):
            return f"equals the gradient of {other}: swapped?"
    return ""


def _signatures(ctx: CheckContext, everything: dict[str, np.ndarray]) -> list[variants.Signature]:
    """The whole model's known wrong gradients, computed once per check (on first need)."""
    if "against_signatures" in ctx.memo:
        return ctx.memo["against_signatures"]
    spec = ctx.shapes.spec
    batch, steps = ctx.batch.x.shape[:2]
    positions = batch * steps if spec.sequence_output else batch
    # The mean loss divides by the positions (softmax cross-entropy) or by every element (mse).
    count = positions * (spec.output_size if spec.loss == "mse" else 1)
    signatures = variants.scalings(everything, [
        (float(count), "sum_loss", "the gradient of the sum loss, not the mean loss"),
        (1 / positions, "mean_over_positions", "averaged over the positions instead of summed"),
        (float(batch), "sum_over_batch", "summed over the batch instead of averaged"),
        (1 / batch, "mean_over_batch", "divided by the batch size once more"),
    ])
    signatures += variants.gate_swaps(ctx.shapes.weights, everything)
    signatures += variants.model_variants(ctx.shapes, ctx.params, ctx.batch)
    recurrent = {cell.name for cell in ctx.shapes.cells}
    signatures += variants.forward_gate_swaps(
        [info for info in ctx.shapes.weights if info.layer in recurrent], ctx.params,
        lambda params: reference_gradients(ctx.shapes, params, ctx.batch).gradients)
    ctx.memo["against_signatures"] = signatures
    return signatures
