"""Finite differences along joint directions: every tensor moved at once.

A probe of one tensor costs two forward passes of the whole model, and a long recurrent
model's forward pass is what check's time is made of. So check first moves every weight, float
input and zero initial state together along a few random directions, and compares the central
difference of the loss with autodiff's directional derivative, the sum of ``⟨g_t, δ_t⟩`` over
the tensors. Only where a joint direction disagrees (or sits at a kink) are the tensors probed
one by one, which names the tensor: a pass costs a few forward passes, and a failure is as
precise as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gradscope.gradcheck import LARGER, ROUNDING, rounding_noise

#: Joint directions, unless the user asks for another number (``--directions``): a relative
#: error ε in one tensor's gradient escapes one direction with a chance of about 1.6·rtol/ε,
#: both with its square (3e-4 for an error of 0.1%, 3e-6 for 1%).
JOINT_DIRECTIONS = 2


@dataclass(frozen=True)
class Part:
    """One tensor in the joint directions: its gradient (from autodiff), its value, and where
    it may move (1) or not (0; masked steps of an input)."""

    name: str
    gradient: np.ndarray
    value: np.ndarray
    keep: np.ndarray | None = None

    @property
    def moving(self) -> int:
        return int(self.gradient.size if self.keep is None else np.count_nonzero(self.keep))

    def typical(self) -> float:
        """The typical size of ``⟨g, u⟩`` for a random unit ``u`` over the elements that move."""
        gradient = self.gradient if self.keep is None else self.gradient * self.keep
        return float(np.linalg.norm(gradient)) / np.sqrt(max(self.moving, 1))


@dataclass(frozen=True)
class JointResult:
    error: float
    passed: bool
    detail: str


def directions(parts: list[Part], count: int, rng: np.random.Generator, loss: float,
               rtol: float, step: float, rounding: float = ROUNDING,
               ) -> tuple[float, list[dict[str, np.ndarray]]]:
    """``m`` and ``count`` joint directions: per tensor, ``a_t·u_t``."""
    # Each tensor's part of a direction is scaled so that it moves the loss about as much as
    # every other part: a random unit direction u_t of a tensor moves the loss by ⟨g_t, u_t⟩,
    # of typical size typ_t = ‖g_t‖/√n_t. A part is a_t·u_t with a_t = min(1, m/typ_t), where
    # m is the smallest typ_t, or noise/rtol (the loss's rounding amplified by 1/step, over the
    # tolerance) where a tensor's is below that: a tensor below it moves by a whole step. A
    # relative error ε in one tensor's gradient then moves the joint derivative by about ε·m
    # times a standard normal, and the comparison allows rtol·m plus the rounding (at most as
    # much again): an error is caught jointly about where the tensor's own probe would catch
    # it, within a factor of two.
    floor = float(rounding_noise(loss, step, rounding)) / rtol
    typical = {part.name: part.typical() for part in parts}
    # A tensor below the floor moves by a whole step, and its errors are caught beyond
    # rtol·m + noise: m = floor keeps that at twice the rounding, as its own probe would.
    resolved = bool(typical) and all(t >= floor for t in typical.values())
    m = min(typical.values()) if resolved else floor
    drawn = []
    for _ in range(count):
        direction = {}
        for part in parts:
            u = rng.standard_normal(part.value.shape)
            if part.keep is not None:
                u = u * part.keep
            norm = float(np.linalg.norm(u))
            if norm == 0:
                continue
            scale = 1.0 if typical[part.name] <= m else m / typical[part.name]
            direction[part.name] = scale * u / norm
        drawn.append(direction)
    return m, drawn


def compare(parts: list[Part], direction: dict[str, np.ndarray], step: float, m: float,
            loss: float, rtol: float, atol: float | None,
            loss_at: Callable[[dict[str, np.ndarray]], float],
            rounding: float = ROUNDING) -> tuple[float, float, float]:
    """The central difference along ``direction`` at ``step`` against autodiff, from the values
    the probes really took (rounded to each tensor's dtype, so the rounding of a small part
    costs nothing): (normalised error, finite difference, autodiff)."""
    plus = {p.name: (p.value + step * direction[p.name]).astype(p.value.dtype)
            for p in parts if p.name in direction}
    minus = {p.name: (p.value - step * direction[p.name]).astype(p.value.dtype)
             for p in parts if p.name in direction}
    numerical = (loss_at(plus) - loss_at(minus)) / (2 * step)
    analytic = sum(float(np.sum(np.asarray(p.gradient, np.float64)
                                * (plus[p.name].astype(np.float64)
                                   - minus[p.name].astype(np.float64))))
                   for p in parts if p.name in direction) / (2 * step)
    allowed = m + (float(rounding_noise(loss, step, rounding)) + (atol or 0.0)) / rtol
    return abs(numerical - analytic) / allowed, numerical, analytic


def joint_check(parts: list[Part], count: int, rng: np.random.Generator, loss: float,
                rtol: float, atol: float | None, step: float,
                loss_at: Callable[[dict[str, np.ndarray]], float],
                rounding: float = ROUNDING) -> JointResult:
    """Every part along ``count`` joint directions. The first direction that disagrees ends
    the joint check: the tensors are probed one by one next, where a kink (relu's corner, a
    tie in a max) is told apart from a wrong gradient tensor by tensor."""
    m, drawn = directions(parts, count, rng, loss, rtol, step, rounding)
    worst: tuple[float, int, float, float, bool] | None = None
    for k, direction in enumerate(drawn, start=1):
        error, numerical, analytic = compare(parts, direction, step, m, loss, rtol, atol,
                                             loss_at, rounding)
        larger = False
        if error > rtol:
            # A loss whose terms cancel rounds as their sizes do, not as its own (found by
            # hypothesis: 740 terms of up to 10 summing to 1.1, 2.1e-5 off at 1e-5 and
            # 2.8e-7 at 1e-4): at ten times the step, whose rounding is a tenth, a right
            # gradient agrees; a wrong one disagrees there too.
            again = compare(parts, direction, LARGER * step, m, loss, rtol, atol, loss_at,
                            rounding)
            if again[0] <= rtol:
                (error, numerical, analytic), larger = again, True
        if worst is None or error > worst[0]:
            worst = (error, k, numerical, analytic, larger)
        if error > rtol:
            break
    assert worst is not None
    error, k, numerical, analytic, larger = worst
    others = len(parts) - 1
    detail = (f"jointly with {others} other tensor{'s' if others != 1 else ''}: {count} random "
              f"direction{'s' if count != 1 else ''} moving every tensor at once, each "
              "tensor's part scaled to move the loss about as much as the others; worst: "
              f"direction {k}, finite difference {numerical:.6e} vs autodiff {analytic:.6e}"
              + (f" (at {LARGER * step:g}: at {step:g} the loss's rounding was larger)"
                 if larger else ""))
    return JointResult(error=error, passed=error <= rtol, detail=detail)
