"""Known wrong gradients, computed exactly, so that a wrong result can be named: each classic
BPTT bug leaves an exact signature (dropping the carry from t+1 gives, to the last bit, the
gradient of a BPTT without ``+ d_h_next``). All in NumPy, with the cells' own NumPy steps
(they take the tanh derivative as an argument); the user's array is matched against:

- BPTT variants (:data:`VARIANTS`): a carry dropped or doubled, h_t for h_{t−1}, a wrong tanh
  derivative, the weights' gradient of one step only;
- transforms of the right gradient: a gate's column block swapped with another (gate order),
  scaling by the batch, the time steps or the loss's positions (sum versus mean);
- a forward pass that reads two gates in each other's place (:func:`forward_gate_swaps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.cells.base import Cell, TensorInfo
from gradscope.cells.lstm import lstm_step_backward
from gradscope.cells.numpy_bptt import (
    Backward,
    Cache,
    Params,
    Sketch,
    StepCache,
    TanhPrime,
    tanh_derivative,
)
from gradscope.gradcheck import relative_error
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.data import Batch
from gradscope.yaml.reference import reference_gradients


@dataclass(frozen=True)
class Variant:
    """One known way to get BPTT wrong. The defaults are the right BPTT."""

    key: str
    #: Completes "your gru_1/w_ru equals …".
    text: str
    #: The factor on the gradient carried back from t+1: 0 = not added, 2 = added twice.
    carry: float = 1.0
    #: The same for the LSTM's cell-state carry.
    c_carry: float = 1.0
    #: Every step backward reads h_t where it should read h_{t−1}.
    h_for_h_prev: bool = False
    tanh_prime: TanhPrime | None = None
    #: The weights' gradient keeps this step's contribution only (0, or −1 for the last).
    only_step: int | None = None
    lstm_only: bool = False


def _one_minus_a(a: np.ndarray) -> np.ndarray:
    return 1.0 - a


def _one(a: np.ndarray) -> np.ndarray:
    return np.ones_like(a)


VARIANTS: tuple[Variant, ...] = (
    Variant("no_carry", "the gradient with no carry from t+1", carry=0.0),
    Variant("carry_twice", "the gradient with the carry from t+1 added twice", carry=2.0),
    Variant("no_c_carry", "the gradient with no carry of the cell state c from t+1",
            c_carry=0.0, lstm_only=True),
    Variant("h_for_h_prev", "the gradient with h_t in place of h_{t−1} (the cache's a_next "
            "for a_prev)", h_for_h_prev=True),
    Variant("tanh_one_minus_a", "the gradient with the tanh derivative 1 − a instead of "
            "1 − a²", tanh_prime=_one_minus_a),
    Variant("no_tanh_derivative", "the gradient without the tanh derivative 1 − a²",
            tanh_prime=_one),
    Variant("last_step_only", "the gradient of the last step only (the weights' sum over "
            "time is missing)", only_step=-1),
    Variant("first_step_only", "the gradient of step t=0 only (= where += belongs in the "
            "loop over time)", only_step=0),
)


@dataclass(frozen=True)
class Signature:
    """A known wrong gradient of some tensors, keyed like the truth it is compared with."""

    key: str
    text: str
    gradients: dict[str, np.ndarray]


# -- BPTT variants -----------------------------------------------------------------------------


def _h_prev(cache: StepCache) -> np.ndarray:
    if "h_prev" in cache:
        return cache["h_prev"]
    return cache["xh"][:, cache["x"].shape[1]:]


def _with_h_for_h_prev(cache: StepCache, h: np.ndarray) -> StepCache:
    """The step's cache with h_t wherever h_{t−1} was kept (and in what is made of it)."""
    out = dict(cache)
    x = cache["x"]
    if "h_prev" in cache:
        out["h_prev"] = h
    if "xh" in cache and cache["xh"].shape[1] == x.shape[1] + h.shape[1]:
        out["xh"] = np.concatenate([x, h], axis=1)
    if "xrh" in cache:
        out["xrh"] = np.concatenate([x, cache["r"] * h], axis=1)
    if "rh" in cache:
        out["rh"] = cache["r"] * h
    return out


def _keep(variant: Variant, t: int, steps: int) -> bool:
    return variant.only_step is None or t == variant.only_step % steps


def variant_backward(cell: Cell, variant: Variant) -> Backward:
    """The BPTT of ``cell`` with ``variant``'s mistake, with the reference's signature. One
    loop over time for every cell; a step differs only in what it carries back (an LSTM also
    carries ∂L/∂c). It always gives ∂L/∂x_t and whole weight gradients (``inputs`` and
    ``sketch`` are taken for the signature only)."""
    tanh = variant.tanh_prime or tanh_derivative
    lstm = cell.kind == "lstm"
    step_back = _lstm_step(cell.layout, variant, tanh) if lstm else _step(cell, variant, tanh)

    def backward(params: Params, cache: Cache, d_h_seq: np.ndarray,
                 d_h_final: np.ndarray | None = None, *, d_c_final: np.ndarray | None = None,
                 totals: list[np.ndarray] | None = None, inputs: bool = True,
                 sketch: Sketch | None = None) -> tuple[np.ndarray | None, Any, Params]:
        steps = len(cache)
        d_h_seq = np.swapaxes(d_h_seq, 0, 1)
        d_x = np.zeros((steps, *cache[0]["x"].shape))
        d_params = {name: np.zeros_like(value) for name, value in params.items()}
        d_h_next = np.zeros_like(d_h_seq[0]) if d_h_final is None else d_h_final
        d_c_next = np.zeros_like(d_h_seq[0]) if d_c_final is None else d_c_final
        for t in reversed(range(steps)):
            d_h = d_h_seq[t] + variant.carry * d_h_next
            d_x[t], d_h_next, d_c_next, d_step = step_back(params, cache[t], d_h, d_c_next)
            if _keep(variant, t, steps):
                for name, value in d_step.items():
                    d_params[name] += value
        return np.swapaxes(d_x, 0, 1), (d_h_next, d_c_next) if lstm else d_h_next, d_params

    return backward


#: One step back: (params, the step's cache, ∂L/∂h_t, ∂L/∂c_t carried) → ∂L/∂x_t, ∂L/∂h_{t−1},
#: ∂L/∂c_{t−1} (an LSTM's; else what came in), the step's weight gradients.
StepBack = Callable[[Params, dict[str, np.ndarray], np.ndarray, np.ndarray],
                    tuple[np.ndarray | None, np.ndarray, np.ndarray, Params]]


def _step(cell: Cell, variant: Variant, tanh: TanhPrime) -> StepBack:
    step, step_backward = cell.numpy_steps()

    def back(params: Params, step_cache: dict[str, np.ndarray], d_h: np.ndarray,
             d_c: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, Params]:
        if variant.h_for_h_prev:
            h_t, _ = step(params, step_cache["x"], _h_prev(step_cache))
            step_cache = _with_h_for_h_prev(step_cache, h_t)
        d_x, d_h_prev, d_step = step_backward(params, step_cache, d_h, tanh_prime=tanh)
        return d_x, d_h_prev, d_c, d_step

    return back


def _lstm_step(layout: str, variant: Variant, tanh: TanhPrime) -> StepBack:
    def back(params: Params, step_cache: dict[str, np.ndarray], d_h: np.ndarray,
             d_c: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, Params]:
        if variant.h_for_h_prev:
            step_cache = _with_h_for_h_prev(step_cache, step_cache["so"] * step_cache["tc"])
        d_x, d_h_prev, d_c_prev, d_step = lstm_step_backward(
            params, step_cache, d_h, variant.c_carry * d_c, layout, tanh_prime=tanh)
        return d_x, d_h_prev, d_c_prev, d_step

    return back


def applicable(cells: Iterable[Cell]) -> list[Variant]:
    """The variants that mean something for these cells (the cell-state carry: LSTMs)."""
    kinds = {cell.kind for cell in cells}
    return [v for v in VARIANTS if not v.lstm_only or "lstm" in kinds]


def model_variants(shapes: ModelShapes, params: dict[str, np.ndarray],
                   batch: Batch) -> list[Signature]:
    """Every BPTT variant of the whole model, the mistake made in every recurrent layer (a
    user's BPTT is usually one function called for each layer)."""
    out = []
    for variant in applicable(shapes.cells):
        result = reference_gradients(
            shapes, params, batch,
            backward_for=lambda cell, v=variant: variant_backward(cell, v))  # type: ignore[misc]
        out.append(Signature(variant.key, variant.text, result.gradients))
    return out


def _gate_pairs(infos: Iterable[TensorInfo]) -> list[tuple[str, str]]:
    """The label pairs of equal-width column blocks (gates) within one tensor, in order."""
    pairs: list[tuple[str, str]] = []
    for info in infos:
        blocks = info.columns
        for first in range(len(blocks)):
            for second in range(first + 1, len(blocks)):
                a, b = blocks[first], blocks[second]
                if a.stop - a.start == b.stop - b.start and (a.label, b.label) not in pairs:
                    pairs.append((a.label, b.label))
    return pairs


def _swap_columns(value: np.ndarray, info: TensorInfo, pair: tuple[str, str]) -> np.ndarray | None:
    """``value`` with the column blocks labelled ``pair`` swapped; None when ``info`` does not
    have both at one width."""
    blocks = {block.label: block for block in info.columns}
    if pair[0] not in blocks or pair[1] not in blocks:
        return None
    a, b = blocks[pair[0]], blocks[pair[1]]
    if a.stop - a.start != b.stop - b.start:
        return None
    out = value.copy()
    out[..., a.start:a.stop] = value[..., b.start:b.stop]
    out[..., b.start:b.stop] = value[..., a.start:a.stop]
    return out


def forward_gate_swaps(infos: Iterable[TensorInfo], params: dict[str, np.ndarray],
                       gradients_at: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                       name_of: Callable[[TensorInfo], str] = lambda info: info.name,
                       ) -> list[Signature]:
    """A forward pass that reads two gates in each other's place (the slices
    ``r, u = ru[:, :n], ru[:, n:]`` written the other way round), in every tensor of
    ``infos`` that holds both.

    Such a model is the right one with those column blocks swapped in its weights, so its
    gradient is ``gradients_at`` (the reference) at the swapped weights: every tensor's, as a
    backward that packs the gates' gradients in the usual column order returns them; and, for
    the gate weights, swapped back, as a backward consistent with its own forward returns
    them. ``params`` and the gradients are keyed by ``name_of``."""
    infos = [info for info in infos if name_of(info) in params]
    out = []
    for pair in _gate_pairs(infos):
        swapped = dict(params)
        touched: list[tuple[str, TensorInfo]] = []
        for info in infos:
            value = _swap_columns(params[name_of(info)], info, pair)
            if value is not None:
                swapped[name_of(info)] = value
                touched.append((name_of(info), info))
        gradients = gradients_at(swapped)
        consistent = dict(gradients)
        for name, info in touched:
            consistent[name] = _swap_columns(gradients[name], info, pair)  # type: ignore[assignment]
        text = f"the gradient of a forward pass that reads {pair[0]} and {pair[1]} in each " \
               "other's place (gate order)"
        out.append(Signature(f"forward_swap_{pair[0]}_{pair[1]}", text, consistent))
        out.append(Signature(f"forward_swap_{pair[0]}_{pair[1]}_packed",
                             f"{text}, with its gradients packed in the usual column order",
                             {name: gradients[name] for name, _ in touched}))
    return out


# -- transforms of the right gradient ----------------------------------------------------------


def gate_swaps(infos: Iterable[TensorInfo], truth: dict[str, np.ndarray],
               name_of: Callable[[TensorInfo], str] = lambda info: info.name,
               ) -> list[Signature]:
    """Each pair of equal-width column blocks (gates) of each weight, swapped: the gradient a
    backward returns when it packs the gates in another order."""
    out = []
    for info in infos:
        name = name_of(info)
        blocks = info.columns
        if name not in truth or len(blocks) < 2:
            continue
        for first in range(len(blocks)):
            for second in range(first + 1, len(blocks)):
                a, b = blocks[first], blocks[second]
                if a.stop - a.start != b.stop - b.start:
                    continue
                swapped = truth[name].copy()
                swapped[..., a.start:a.stop] = truth[name][..., b.start:b.stop]
                swapped[..., b.start:b.stop] = truth[name][..., a.start:a.stop]
                out.append(Signature(f"swap_{a.label}_{b.label}",
                                     f"the gradient with the column blocks {a.label} and "
                                     f"{b.label} swapped (gate order)", {name: swapped}))
    return out


def scalings(truth: dict[str, np.ndarray],
             factors: Iterable[tuple[float, str, str]]) -> list[Signature]:
    """The right gradient times each (factor, key, what it means) — distinct factors ≠ 1."""
    out, seen = [], {1.0}
    for factor, key, story in factors:
        if factor in seen:
            continue
        seen.add(factor)
        scale = f"{factor:g}" if factor >= 1 else f"1/{1 / factor:g}"
        out.append(Signature(key, f"{scale} × the right gradient: {story}",
                             {name: value * factor for name, value in truth.items()}))
    return out


# -- naming the signature ----------------------------------------------------------------------


def identify(name: str, value: np.ndarray, truth: np.ndarray, signatures: list[Signature],
             tolerance: float) -> tuple[Signature, float] | None:
    """The signature ``value`` equals (the closest, within ``tolerance``), among those that
    differ from the truth for this tensor; None when it equals none of them. The difference
    is relative to the larger of the signature's and the truth's norms: a signature of zeros
    (no carry into an initial state) is not matched by any value smaller than 1 (found tried
    as a new user would: two gradients of 1e-28, swapped, were named "no carry of the cell
    state c from t+1 (relative error 4e-28)")."""
    best: tuple[Signature, float] | None = None
    for signature in signatures:
        candidate = signature.gradients.get(name)
        if candidate is None or candidate.shape != value.shape:
            continue
        if relative_error(candidate, truth) <= tolerance:  # the mistake leaves it right
            continue
        scale = max(float(np.linalg.norm(candidate)), float(np.linalg.norm(truth)))
        error = float(np.linalg.norm(np.asarray(value, np.float64) - candidate)) / (
            scale or 1.0)
        if error <= tolerance and (best is None or error < best[1]):
            best = (signature, error)
    return best


def describe(name: str, match: tuple[Signature, float]) -> str:
    """"your gru_1/w_ru equals the gradient with no carry from t+1 (relative error 2e-15)"."""
    signature, error = match
    return f"your {name} equals {signature.text} (relative error {error:.0e})"
