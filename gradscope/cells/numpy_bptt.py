"""BPTT in NumPy, float64, no TensorFlow: the loop over time that every cell's NumPy step and
step backward (in the cell's own module) share; the ``numpy_reference`` witness of check.

The one line every hand-written BPTT must get right: h_t feeds the layer above at step t and
the same layer at step t+1, so its total gradient is the sum

    ∂L/∂h_t = (gradient from above at step t) + (gradient carried back from step t+1)
    d_h     =  d_h_seq[t]                     +  d_h_next

Forgetting ``d_h_next`` gives gradients that are right at the last step only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

Params = dict[str, np.ndarray]  # one layer's weights by short name: w_ru, b_ru, …
StepCache = dict[str, np.ndarray]  # what one forward step keeps for its backward step
Cache = list[StepCache]  # one StepCache per time step, in time order
Step = Callable[[Params, np.ndarray, np.ndarray], tuple[np.ndarray, StepCache]]  # → h_t, cache
Forward = Callable[[Params, np.ndarray, np.ndarray], tuple[np.ndarray, Cache]]


class Backward(Protocol):
    """BPTT of one layer: ``(params, cache, d_h_seq, d_h_final)`` → (d_x_seq, d_h0 — a tuple
    (d_h0, d_c0) for an LSTM —, the weight gradients).

    ``d_c_final`` (LSTM only) is a gradient on c_T from outside the sequence. ``totals``, when
    given, receives the total ∂L/∂h_t of every step (B, u), in time order: what arrives from
    above at step t plus what flows back from t+1. Neither changes any other result. With
    ``inputs=False``, d_x_seq is not computed (None): a caller that feeds each layer the
    gradient from above itself, as check's reference does, saves a product a step. With
    ``sketch``, the wide weight gradients come back projected (:class:`Sketch`).
    """

    def __call__(self, params: Params, cache: Cache, d_h_seq: np.ndarray,
                 d_h_final: np.ndarray | None = None, *, d_c_final: np.ndarray | None = None,
                 totals: list[np.ndarray] | None = None, inputs: bool = True,
                 sketch: Sketch | None = None) -> tuple[np.ndarray | None, Any, Params]: ...

TanhPrime = Callable[[np.ndarray], np.ndarray]  # the derivative of tanh, from a = tanh(z)


class StepBackward(Protocol):
    """Backward through one step of a one-state cell: ``(params, cache, d_h)`` → (d_x_t,
    d_h_{t−1}, this step's weight gradients). ``tanh_prime`` is 1 − a² unless a diagnosis asks
    for a wrong one. With ``sums`` (a BPTT loop's), the weight products go into it and are not
    returned, and d_x_t is None unless ``sums.inputs``."""

    def __call__(self, params: Params, cache: StepCache, d_h: np.ndarray, *,
                 tanh_prime: TanhPrime = ..., sums: WeightSums | None = None,
                 ) -> tuple[np.ndarray | None, np.ndarray, Params]: ...


# -- small pieces ---------------------------------------------------------------------------


def sigmoid(a: np.ndarray) -> np.ndarray:
    """σ(a) = 1 / (1 + e^(−a)), accurate to an ulp or two whether e^(−a) is small or large.
    Below a ≈ −709.8, e^(−a) overflows to ∞ and σ comes out 0, where its true value is under
    the smallest normal float64 (1e-308). One pass of exp over the gates: at user sizes their
    elementwise work weighs as much as a step's products."""
    with np.errstate(over="ignore"):
        s = np.exp(-a)
    s += 1.0
    return np.reciprocal(s, out=s)


def tanh_derivative(a: np.ndarray) -> np.ndarray:
    """d tanh(z)/dz written with a = tanh(z): 1 − a². Every step backward takes it as
    ``tanh_prime``, so a diagnosis can recompute the gradient a user gets with a wrong one."""
    return 1.0 - a**2


def interpolate_backward(d_h: np.ndarray, gate: np.ndarray, h_prev: np.ndarray,
                         candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward through the GRU output h_t = g∘h_{t−1} + (1−g)∘c (g: the update gate).

        d_g         = d_h∘(h_{t−1} − c)
        d_c         = d_h∘(1 − g)
        d_h_{t−1}  += d_h∘g            (the direct path; the gates add more)

    Returns (d_gate, d_candidate, the direct part of d_h_prev).
    """
    return d_h * (h_prev - candidate), d_h * (1.0 - gate), d_h * gate


class Sketch:
    """A weight gradient G (rows × cols) kept as G·S, where S is a cols × k matrix of random
    signs: check's reference compares G·S with the tape's gradient times the same S, which
    costs a product with k columns per block of steps instead of one with cols columns.

    It loses no power against comparing G itself. Take the element where the reference and
    the tape differ most, e_ij of the difference E. In any column l of S, (E·S)_il is
    e_ij·s_jl plus the rest of row i, Σ_{m≠j} e_im·s_ml, which does not depend on s_jl:
    whatever the rest is, one of the two signs of s_jl makes the two add, so |(E·S)_il| ≥
    |e_ij| with chance at least 1/2. Over k independent columns, max |E·S| ≥ max |E| but for
    a chance of at most 2⁻ᵏ (1.5e-5 at k = 16). It is at most cols·max |E|, and the
    projection adds float64 rounding of about cols·1e-16 of max |G|, far below check's
    tolerance for the reference (1e-9).

    Only wide weights are projected (at least :attr:`FROM_COLUMNS` columns): for the small
    ones, the whole product costs little more than the projection.
    """

    #: Columns of S.
    COLUMNS = 16
    #: Weights with fewer columns are kept whole.
    FROM_COLUMNS = 128

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._signs: dict[int, np.ndarray] = {}

    def applies(self, columns: int) -> bool:
        return columns >= self.FROM_COLUMNS

    def signs(self, columns: int) -> np.ndarray:
        """S for a weight with this many columns (one S per width: every call and every
        slice of one weight's gradient is projected the same way)."""
        if columns not in self._signs:
            rng = np.random.default_rng([self.seed, columns])
            self._signs[columns] = rng.choice([-1.0, 1.0], size=(columns, self.COLUMNS))
        return self._signs[columns]

    def project(self, gradient: np.ndarray) -> np.ndarray:
        """G·S for a wide 2-D gradient, G itself for any other."""
        if gradient.ndim != 2 or not self.applies(gradient.shape[1]):
            return gradient
        return gradient @ self.signs(gradient.shape[1])


class WeightSums:
    """A BPTT loop's weight gradients Σ_t a_tᵀ·b_t (x_tᵀ·d_z_t, h_{t−1}ᵀ·d_z_t), a block of
    steps at a time.

    Summed a step at a time, every step adds a weight-sized matrix into the total; at user
    sizes (256 units and more) those additions, which only move memory, cost more than the
    products. Here a block's a_t and b_t are stacked, and one product over the block's rows
    adds them all: the same sum, in another order of additions (float64 rounding only).
    ``inputs``: whether the loop's caller reads ∂L/∂x_t. ``sketch``: the sums of wide weights
    are kept projected, Σ_t a_tᵀ·(b_t·S) (see :class:`Sketch`).
    """

    #: Steps per product: rows of BLOCK·batch.
    BLOCK = 32

    def __init__(self, inputs: bool = True, sketch: Sketch | None = None) -> None:
        self.inputs = inputs
        self.sketch = sketch
        self._pending: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._totals: Params = {}

    def product(self, name: str, a: np.ndarray, b: np.ndarray) -> None:
        """Add aᵀ·b into the gradient of weight ``name``."""
        left, right = self._pending.setdefault(name, ([], []))
        left.append(a)
        right.append(b)
        if len(left) == self.BLOCK:
            self._flush(name)

    def _flush(self, name: str) -> None:
        left, right = self._pending.pop(name)
        stacked = np.concatenate(right)
        if self.sketch is not None:
            stacked = self.sketch.project(stacked)
        block = np.concatenate(left).T @ stacked
        if name in self._totals:
            self._totals[name] += block
        else:
            self._totals[name] = block

    def add_into(self, total: Params) -> None:
        """Everything summed so far, added into ``total`` (a projected sum replaces the
        weight's entry by its projection first)."""
        for name in list(self._pending):
            self._flush(name)
        for name, value in self._totals.items():
            if total[name].shape != value.shape and self.sketch is not None:
                total[name] = self.sketch.project(total[name])
            total[name] += value
        self._totals = {}


def weight_gradients(products: dict[str, tuple[np.ndarray, np.ndarray]], rest: Params,
                     sums: WeightSums | None) -> Params:
    """This step's weight gradients: aᵀ·b for each of ``products``, and ``rest`` (the biases,
    Σ over the batch); with ``sums``, the products go into it and only ``rest`` is returned."""
    if sums is None:
        return {**{name: a.T @ b for name, (a, b) in products.items()}, **rest}
    for name, (a, b) in products.items():
        sums.product(name, a, b)
    return rest


def wants_inputs(sums: WeightSums | None) -> bool:
    return sums is None or sums.inputs


def zeros_like(params: Params) -> Params:
    return {name: np.zeros_like(value) for name, value in params.items()}


def add_into(total: Params, part: Params) -> None:
    """total += part, weight by weight: the weights are shared by every step, so their
    gradients are sums over the steps."""
    for name, value in part.items():
        total[name] += value


def time_major(seq: np.ndarray) -> np.ndarray:
    """(B, T, ·) ↔ (T, B, ·)."""
    return np.swapaxes(seq, 0, 1)


def _scan(step: Step, params: Params, x_seq: np.ndarray,
          h0: np.ndarray) -> tuple[np.ndarray, Cache]:
    """Run ``step`` over x_seq (B, T, F) from h0 (B, u): h_t = step(x_t, h_{t−1}).

    Returns h_seq (B, T, u), holding h_1 … h_T, and the per-step caches.
    """
    h = h0
    outputs: list[np.ndarray] = []
    cache: Cache = []
    for t in range(x_seq.shape[1]):
        h, step_cache = step(params, x_seq[:, t], h)
        outputs.append(h)
        cache.append(step_cache)
    return np.stack(outputs, axis=1), cache


def bptt(step_backward: StepBackward, params: Params, cache: Cache, d_h_seq: np.ndarray,
         d_h_final: np.ndarray | None = None, totals: list[np.ndarray] | None = None,
         inputs: bool = True, sketch: Sketch | None = None,
         ) -> tuple[np.ndarray | None, np.ndarray, Params]:
    """Backpropagation through time for any cell with one state, given its step backward.

    d_h_seq (B, T, u) is ∂L/∂h_t arriving from above at every step: from the next layer, or
    from the dense head (zeros except the last step when the head sees h_T only).
    d_h_final (B, u) is a gradient on h_T from outside the sequence (a truncated-BPTT carry).

        for t = T−1 … 0:
            d_h = d_h_seq[t] + d_h_next        (d_h_next: carried back from step t+1)
            d_x_t, d_h_next, d_W_t = step backward(d_h)
            d_W += d_W_t

    Returns d_x_seq (B, T, F) (None with ``inputs=False``), d_h0 = ∂L/∂h_0 (B, u), and the
    weight gradients, summed a block of steps at a time (:class:`WeightSums`; with
    ``sketch``, the wide ones projected). ``totals``, when given, is filled with every step's
    d_h, in time order.
    """
    d_h_seq = time_major(d_h_seq)  # from here on, d_h_seq[t] is step t's (B, u) slice
    d_x_seq = np.zeros((len(cache), *cache[0]["x"].shape)) if inputs else None
    d_params = zeros_like(params)
    sums = WeightSums(inputs, sketch)
    d_h_next = np.zeros_like(d_h_seq[0]) if d_h_final is None else d_h_final
    for t in reversed(range(len(cache))):
        # h_t went up to the layer above AND on to step t+1: add the gradient carried back
        # from t+1. Dropping "+ d_h_next" is the classic BPTT bug.
        d_h = d_h_seq[t] + d_h_next
        if totals is not None:
            totals.insert(0, d_h)
        d_x_t, d_h_next, d_params_t = step_backward(params, cache[t], d_h, sums=sums)
        if d_x_seq is not None:
            d_x_seq[t] = d_x_t
        add_into(d_params, d_params_t)
    sums.add_into(d_params)
    d_h0 = d_h_next  # after step 0, the carry is ∂L/∂h_0
    return None if d_x_seq is None else time_major(d_x_seq), d_h0, d_params


def single_state(step: Step, step_backward: StepBackward) -> tuple[Forward, Backward]:
    """The forward pass (:func:`_scan`) and BPTT (:func:`bptt`) of a one-state cell, from its
    step and step backward."""

    def forward(params: Params, x_seq: np.ndarray, h0: np.ndarray) -> tuple[np.ndarray, Cache]:
        return _scan(step, params, x_seq, h0)

    def backward(params: Params, cache: Cache, d_h_seq: np.ndarray,
                 d_h_final: np.ndarray | None = None, *, d_c_final: np.ndarray | None = None,
                 totals: list[np.ndarray] | None = None, inputs: bool = True,
                 sketch: Sketch | None = None) -> tuple[np.ndarray | None, np.ndarray, Params]:
        if d_c_final is not None:
            raise ValueError("d_c_final: this cell has no cell state c")
        return bptt(step_backward, params, cache, d_h_seq, d_h_final, totals, inputs, sketch)

    return forward, backward
