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


def fully_masked(mask: Any, examples: list[int]) -> str | None:
    """'a fully masked example: …' where the call's mask keeps no step of an example that
    holds the non-finite value."""
    if mask is None:
        return None
    kept = np.asarray(mask, bool)
    if kept.ndim < 2:
        return None
    empty = [e for e in examples if e < kept.shape[0] and not kept[e].any()]
    if not empty:
        return None
    noun = "example" if len(empty) == 1 else "examples"
    return (f"a fully masked example: the mean over 0 steps ({noun} "
            f"{', '.join(map(str, empty[:8]))}: the mask keeps none of its {kept.shape[1]} "
            "steps, and 0/0 is NaN)")


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
        zero = not np.any(birth.inputs[1])
        return (f"a division by 0{at}" + (" (0/0 is NaN)" if kind_of(birth.output) == "NaN"
                                          else "") if zero else
                f"a division that overflows{at}: numerators up to "
                f"{max(birth.input_magnitudes()):.3g}")
    top = max(birth.input_magnitudes(), default=0.0)
    if kind_of(birth.output) == "Inf":
        return f"{op} overflows float{birth.output.dtype.itemsize * 8}: inputs up to {top:.3g}{at}"
    return f"{op} makes NaN from finite inputs (up to {top:.3g}){at}"


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
            f"reaching {last:.1e} at step {previous}, and overflows at step {shown} (example "
            f"{example})")


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
