"""The likely cause of a non-finite value, in words, with the user's numbers: from the op
that made it (:mod:`~gradscope.keras.nonfinite.births`), the layer call's mask, or the growth of a
recurrent state measured step by step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.keras.nonfinite.births import Birth
from gradscope.report.models import NonFiniteEntry

#: Ops whose overflow is an exponential's.
EXPONENTIALS = {"Exp", "Expm1", "Softplus", "Pow"}
#: Ops that divide.
DIVISIONS = {"RealDiv", "Div", "DivNoNan", "Reciprocal", "Inv", "FloorDiv", "Xdivy"}


def kind_of(value: np.ndarray) -> str:
    """'NaN', 'Inf' or 'NaN and Inf' for the non-finite numbers of ``value``."""
    nan, inf = bool(np.isnan(value).any()), bool(np.isinf(value).any())
    return "NaN and Inf" if nan and inf else "NaN" if nan else "Inf"


def where(step: int | None, examples: list[int]) -> str:
    """'at step 37 (example 2)': the place, as the report gives it."""
    shown = ", ".join(str(e) for e in examples[:8]) + (", …" if len(examples) > 8 else "")
    noun = "example" if len(examples) == 1 else "examples"
    at = "" if step is None else f" at step {step}"
    return f"{at} ({noun} {shown})" if examples else at


def fully_masked(mask: Any, examples: list[int], birth: Birth | None = None,
                 step: int | None = None) -> str | None:
    """Where the call's mask keeps no step of an example that holds the non-finite value:
    'a fully masked example: the mean over 0 steps …' where a division made it (or where no
    operation could be named, what an average over no steps does); else the operation's own
    cause (:func:`op_cause`), the empty mask said beside it. Found tried as a new user
    would: a softmax over scores all masked to −inf was said to be a mean."""
    if mask is None:
        return None
    kept = np.asarray(mask, bool)
    if kept.ndim < 2:
        return None
    empty = [e for e in examples if e < kept.shape[0] and not kept[e].any()]
    if not empty:
        return None
    noun = "example" if len(empty) == 1 else "examples"
    which = (f"{noun} {', '.join(map(str, empty[:8]))}: the mask keeps none of its "
             f"{kept.shape[1]} steps")
    if birth is not None and birth.op_type in DIVISIONS:
        return f"a fully masked example: the mean over 0 steps ({which}, and 0/0 is NaN)"
    if birth is None:
        return (f"a fully masked example ({which}); no single operation could be named: an "
                "average over no steps is 0/0 (a mean, or a softmax whose every score is "
                "masked to −inf)")
    return f"{op_cause(birth, step, examples)}; a fully masked example ({which})"


def op_cause(birth: Birth | None, step: int | None, examples: list[int],
             what: str = "the pre-activation") -> str:
    """The cause read from the op that made the value (``what`` names its first input)."""
    if birth is None:
        return "no single operation could be named (the rerun of the call stayed finite)"
    op = birth.op_type
    bad = ~np.isfinite(birth.output)
    first = birth.inputs[0] if birth.inputs else np.zeros(0)
    at = where(step, examples)
    same = first.shape == birth.output.shape and first.size
    if same and step is not None and bad.ndim >= 3 and step < bad.shape[1] \
            and bad[:, :step].sum() == 0:
        # The numbers quoted are those of the step (and examples) named, not of the whole
        # tensor (found tried as a new user would: "log of a negative number (-0.723) at
        # step 0", -0.723 being at step 9, step 0's lowest -0.630).
        rows = [e for e in examples if e < bad.shape[0]] or list(range(bad.shape[0]))
        here = np.zeros_like(bad)
        here[rows, step] = bad[rows, step]
        if here.any():
            bad = here
    values = first[bad] if same else first.reshape(-1)
    if op in EXPONENTIALS and values.size:
        return f"exp overflow: {what} reached {float(np.max(values)):.4g}{at}"
    if op == "Log" and values.size:
        low = float(np.min(values))
        return (f"log of 0{at}" if low == 0 else f"log of a negative number ({low:.3g}){at}")
    if op in {"Sqrt", "Rsqrt"} and values.size:
        low = float(np.min(values))
        return (f"square root of a negative number ({low:.3g}){at}" if low < 0
                else f"1/sqrt of 0{at}")
    if op in DIVISIONS and len(birth.inputs) >= 2:
        # The denominators where the output is not finite (found tried as a new user would:
        # x/‖x‖ with x all 0 in one place, 0/0 there, was "a division that overflows").
        zero = not np.any(_where_bad(birth.inputs[1], bad))
        return (f"a division by 0{at}" + (" (0/0 is NaN)" if kind_of(birth.output) == "NaN"
                                          else "") if zero else
                f"a division that overflows{at}: numerators up to "
                f"{max(birth.input_magnitudes()):.3g}")
    top = max(birth.input_magnitudes(), default=0.0)
    if kind_of(birth.output) == "Inf":
        return f"{op} overflows float{birth.output.dtype.itemsize * 8}: inputs up to {top:.3g}{at}"
    return f"{op} makes NaN from finite inputs (up to {top:.3g}){at}"


def _where_bad(value: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """``value``'s entries where the output is not finite (``bad``), broadcast to the
    output's shape; all of them where it does not broadcast."""
    try:
        return np.broadcast_to(value, bad.shape)[bad]
    except ValueError:
        return np.asarray(value).reshape(-1)


#: A state is said to grow when its size grows by at least this much a step, on average
#: over the last (at most) 10 steps.
GROWING = 1.05


def _growth(sizes: np.ndarray) -> tuple[float, float] | None:
    """The growth per step of the largest |state| over the last (at most) 10 steps of
    ``sizes`` (one per step), and where it ends; None where it did not grow."""
    span = min(10, len(sizes) - 1)
    if span < 1:
        return None
    before, last = float(sizes[-1 - span]), float(sizes[-1])
    if before <= 0 or last <= before:
        return None
    growth = (last / before) ** (1.0 / span)
    return (growth, last) if growth >= GROWING else None


def _with_what(cell: Any, training: bool) -> str:
    """' with relu and recurrent_dropout 0.25 (…)': what makes a recurrence grow."""
    activation = getattr(getattr(cell, "activation", None), "__name__", None)
    with_what = f" with {activation}" if activation else ""
    rate = float(getattr(cell, "recurrent_dropout", 0) or 0)
    if training and rate:
        with_what += (f" and recurrent_dropout {rate:g} (the units it keeps are scaled by "
                      f"{1 / (1 - rate):.3g} every step)")
    return with_what


def growth_cause(sequence: np.ndarray, example: int, step: int, backwards: bool,
                 cell: Any, training: bool) -> str | None:
    """'the recurrent state grows 1.9× a step with relu, reaching 3e38 at step 61' from a
    state sequence (B, T, ·) in processing order that turns non-finite at ``step`` for
    ``example``; None where it did not grow. Steps are said in input order (``backwards``:
    the layer runs from the last step)."""
    if step < 2:
        return None
    found = _growth(np.max(np.abs(sequence[example, :step].reshape(step, -1)), axis=1))
    if found is None:
        return None
    growth, last = found
    steps = sequence.shape[1]
    shown, previous = ((steps - 1 - step, steps - step) if backwards else (step, step - 1))
    return (f"the recurrent state grows {growth:.2g}× a step{_with_what(cell, training)}, "
            f"reaching {last:.1e} at step {previous}, and overflows "
            f"{_largest(getattr(cell, 'compute_dtype', None) or sequence.dtype)} at step "
            f"{shown} (example {example})")


def _largest(dtype: Any) -> str:
    """'float16 (largest 6.55e+04)': the dtype a value overflows, and its largest number."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype.kind != "f" and dtype.name != "bfloat16":
        return dtype.name
    return f"{dtype.name} (largest {float(ml_dtypes.finfo(dtype).max):.3g})"


def growing(sequence: np.ndarray, backwards: bool, cell: Any, training: bool) -> str | None:
    """'state grows 1.6× a step with relu, reaching 9.4e+24 at step 119 (example 3)' from a
    finite state sequence (B, T, ·) in processing order that ends large, for the example
    that ends largest; None where it did not grow. Steps are said in input order."""
    steps = sequence.shape[1]
    sizes = np.max(np.abs(sequence.reshape(sequence.shape[0], steps, -1)), axis=2)
    example = int(np.argmax(sizes[:, -1]))
    found = _growth(sizes[example])
    if found is None:
        return None
    growth, last = found
    return (f"state grows {growth:.2g}× a step{_with_what(cell, training)}, reaching "
            f"{last:.2g} at step {0 if backwards else steps - 1} (example {example})")


def entry(pass_: str, origin: str, layer: str | None, step: int | None, examples: list[int],
          cause: str, birth: Birth | None = None) -> NonFiniteEntry:
    """The report's entry (``pass`` is a Python keyword: the field is read by its alias)."""
    return NonFiniteEntry.model_validate({
        "pass": pass_, "origin": origin, "layer": layer, "step": step, "examples": examples,
        "operation": None if birth is None else birth.op_type,
        "operation_inputs": [] if birth is None else birth.input_magnitudes(),
        "cause": cause})
