"""TF's GRUBlockCellGrad kernel as a witness, and the errata of its public documentation.

For every block-layout GRU layer, every time step at once: the (B, T) positions are folded
into one batch of B·T rows, since each step is independent once h_{t−1} and the total
∂L/∂h_t are known. ``tf.raw_ops.GRUBlockCell`` gives r, u, c; ``tf.raw_ops.GRUBlockCellGrad``
gives d_x, d_h_prev, d_c_bar and d_r_bar_u_bar; the weight gradients are assembled as the old
Python wrapper did. The kernel exists in float32 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.gradcheck import WitnessResult, relative_error
from gradscope.yaml.check.context import CheckContext

WITNESS = "gru_block_kernel"

CORRECTED_EQUATIONS = """\
Forward (one step; x: (B, F), h_prev: (B, u); w_ru: (F+u, 2u) columns [r | u]; w_c: (F+u, u)):
  r_bar, u_bar = [x, h_prev]·w_ru + b_ru          r = σ(r_bar), u = σ(u_bar)
  c_bar        = [x, r∘h_prev]·w_c + b_c          c = tanh(c_bar)
  h            = u∘h_prev + (1 − u)∘c

Backward, given d_h = the TOTAL ∂L/∂h (from above at this step plus what came back from t+1):
  d_c_bar   = d_h∘(1 − u)∘(1 − c∘c)
  d_u_bar   = d_h∘(h_prev − c)∘u∘(1 − u)          (h_prev, not the new h)
  [d_x_2, d_hr] = d_c_bar·w_cᵀ                      (split at row F)
  d_r_bar   = (d_hr∘h_prev)∘r∘(1 − r)               (missing from the documentation)
  [d_x_1, d_h_1] = [d_r_bar, d_u_bar]·w_ruᵀ         (w_ru's r columns AND its u columns)
  d_x       = d_x_1 + d_x_2
  d_h_prev  = d_h_1 + d_hr∘r + d_h∘u                (the last term is d_h∘u, not u)

Weight gradients (the Python wrapper, summed over the batch and over every step):
  d_w_ru = [x, h_prev]ᵀ·[d_r_bar, d_u_bar]          shape (F+u, 2u)
  d_w_c  = [x, r∘h_prev]ᵀ·d_c_bar                  shape (F+u, u)
  d_b_ru = Σ_batch [d_r_bar, d_u_bar]               shape (2u,) = [b_r | b_u]
  d_b_c  = Σ_batch d_c_bar                          shape (u,)"""


@dataclass(frozen=True)
class Erratum:
    number: int
    documented: str
    actual: str
    evidence: str
    confirmed: bool


@dataclass(frozen=True)
class _Folded:
    """One block GRU layer's steps folded into B·T rows, with the kernel's outputs."""

    name: str
    steps: int
    F: int
    u: int
    x: np.ndarray
    h_prev: np.ndarray
    d_h: np.ndarray
    weights: dict[str, np.ndarray]
    kernel: dict[str, np.ndarray]  # r, u, c, h, d_x, d_h_prev, d_c_bar, d_r_bar_u_bar


def _block_layers(ctx: CheckContext) -> list[tuple[Any, np.ndarray]]:
    """(cell, its input sequence (B, T, F)) for every block GRU layer."""
    out = []
    previous = ctx.batch.x
    sequences = ctx.autodiff.sequences or {}
    for cell in ctx.shapes.cells:
        if cell.kind == "gru" and cell.layout == "block":
            out.append((cell, previous))
        previous = sequences.get(f"{cell.name}/h", previous)
    return out


def _fold(ctx: CheckContext, cell: Any, inputs: np.ndarray) -> _Folded:
    tf = ctx.tf
    name = cell.name
    assert ctx.autodiff.sequences is not None and ctx.autodiff.sequence_gradients is not None
    h_seq = ctx.autodiff.sequences[f"{name}/h"]
    h0 = ctx.batch.initial_states[f"{name}/h0"]
    h_prev = np.concatenate([h0[:, None], h_seq[:, :-1]], axis=1)
    batch, steps = h_seq.shape[:2]

    def rows(a: np.ndarray) -> np.ndarray:  # (B, T, n) → (B·T, n), float32 for the kernel
        return np.ascontiguousarray(a.reshape(batch * steps, -1), dtype=np.float32)

    x, hp, d_h = rows(inputs), rows(h_prev), rows(ctx.autodiff.sequence_gradients[f"{name}/h"])
    weights = {k: ctx.params[f"{name}/{k}"].astype(np.float32)
               for k in ("w_ru", "b_ru", "w_c", "b_c")}
    r, u, c, h = tf.raw_ops.GRUBlockCell(x=x, h_prev=hp, **weights)
    d_x, d_h_prev, d_c_bar, d_ru_bar = tf.raw_ops.GRUBlockCellGrad(
        x=x, h_prev=hp, r=r, u=u, c=c, d_h=d_h, **weights)
    kernel = {key: value.numpy().astype(np.float64) for key, value in
              {"r": r, "u": u, "c": c, "h": h, "d_x": d_x, "d_h_prev": d_h_prev,
               "d_c_bar": d_c_bar, "d_r_bar_u_bar": d_ru_bar}.items()}
    return _Folded(name, steps, cell.input_size, cell.units, x.astype(np.float64),
                   hp.astype(np.float64), d_h.astype(np.float64),
                   {k: v.astype(np.float64) for k, v in weights.items()}, kernel)


def _step_autodiff(ctx: CheckContext, folded: _Folded) -> tuple[np.ndarray, np.ndarray]:
    """Autodiff of one step on every folded row (float64): d_x and d_h_prev."""
    tf = ctx.tf
    u = folded.u
    x, h_prev = tf.constant(folded.x), tf.constant(folded.h_prev)
    w = {k: tf.constant(v) for k, v in folded.weights.items()}
    with tf.GradientTape() as tape:
        tape.watch([x, h_prev])
        ru = tf.sigmoid(tf.concat([x, h_prev], 1) @ w["w_ru"] + w["b_ru"])
        r, z = ru[:, :u], ru[:, u:]
        c = tf.tanh(tf.concat([x, r * h_prev], 1) @ w["w_c"] + w["b_c"])
        h = z * h_prev + (1 - z) * c
    d_x, d_h_prev = tape.gradient(h, [x, h_prev], output_gradients=tf.constant(folded.d_h))
    return d_x.numpy(), d_h_prev.numpy()


def _per_step(name: str, label: str, ours: np.ndarray, expected: np.ndarray, steps: int,
              tolerance: float) -> WitnessResult:
    """Compare per time step; locate the first bad step counting back from the end."""
    a = ours.reshape(-1, steps, ours.shape[-1])
    b = expected.reshape(-1, steps, expected.shape[-1])
    errors = np.array([relative_error(a[:, t], b[:, t]) for t in range(steps)])
    bad = [t for t in range(steps) if errors[t] > tolerance]
    worst = int(np.argmax(errors))
    return WitnessResult(
        WITNESS, f"{name}/{label} (per step)", float(errors.max()), tolerance, not bad,
        f"worst at t={worst}: {errors[worst]:.2e} over {steps} steps", max(bad) if bad else None)


def kernel_witness(ctx: CheckContext) -> list[WitnessResult]:
    tolerance = ctx.tolerance(WITNESS, "float32")
    autodiff = ctx.autodiff_gradients()
    results: list[WitnessResult] = []
    for cell, inputs in _block_layers(ctx):
        folded = _fold(ctx, cell, inputs)
        k, u = folded.kernel, folded.u
        xh = np.concatenate([folded.x, folded.h_prev], axis=1)
        xrh = np.concatenate([folded.x, k["r"] * folded.h_prev], axis=1)
        assembled = {
            "w_ru": xh.T @ k["d_r_bar_u_bar"], "b_ru": k["d_r_bar_u_bar"].sum(axis=0),
            "w_c": xrh.T @ k["d_c_bar"], "b_c": k["d_c_bar"].sum(axis=0),
        }
        for short, value in assembled.items():
            name = f"{cell.name}/{short}"
            error = relative_error(value, autodiff[name])
            results.append(WitnessResult(WITNESS, name, error, tolerance, error <= tolerance,
                                         "GRUBlockCellGrad + the wrapper's assembly"))
        d_h0 = k["d_h_prev"].reshape(-1, folded.steps, u)[:, 0]
        error = relative_error(d_h0, autodiff[f"{cell.name}/h0"])
        results.append(WitnessResult(WITNESS, f"{cell.name}/h0", error, tolerance,
                                     error <= tolerance, "the kernel's d_h_prev at t=0"))
        step_d_x, step_d_h_prev = _step_autodiff(ctx, folded)
        steps = folded.steps
        results.append(_per_step(cell.name, "d_x", k["d_x"], step_d_x, steps, tolerance))
        results.append(_per_step(cell.name, "d_h_prev", k["d_h_prev"], step_d_h_prev, steps,
                                 tolerance))
        h_seq = np.asarray(ctx.autodiff.sequences[f"{cell.name}/h"])  # type: ignore[index]
        results.append(_per_step(cell.name, "h (forward)", k["h"],
                                 h_seq.reshape(-1, u), steps, tolerance))
    return results


def errata_evidence(ctx: CheckContext) -> list[Erratum]:
    """Each documented error, evaluated against the kernel on this model's first block GRU."""
    layers = _block_layers(ctx)
    if not layers:
        return []
    folded = _fold(ctx, *layers[0])
    tol = ctx.tolerance(WITNESS, "float32")
    k, F, u, w = folded.kernel, folded.F, folded.u, folded.weights
    r, z, c, h = k["r"], k["u"], k["c"], k["h"]
    d_h, h_prev = folded.d_h, folded.h_prev
    d_c_bar, d_ru = k["d_c_bar"], k["d_r_bar_u_bar"]
    d_r_bar, d_u_bar = d_ru[:, :u], d_ru[:, u:]
    d_xc = d_c_bar @ w["w_c"].T
    d_hr = d_xc[:, F:]
    w_r_x, w_u_x = w["w_ru"][:F, :u], w["w_ru"][:F, u:]
    comp1_h = d_ru @ w["w_ru"][F:].T
    name = folded.name

    def verdict(doc: np.ndarray, fixed: np.ndarray, kernel: np.ndarray) -> tuple[str, bool]:
        doc_error, fixed_error = relative_error(doc, kernel), relative_error(fixed, kernel)
        confirmed = doc_error > tol and fixed_error <= tol
        return (f"documented formula off by {doc_error:.2e} (relative); corrected "
                f"{fixed_error:.2e}", confirmed)

    errata = [Erratum(
        1, "d_w_ru = x_h_prevrᵀ·d_c_bar and d_w_c = x_h_prevᵀ·d_r_bar_u_bar",
        "swapped: d_w_ru = [x, h_prev]ᵀ·d_r_bar_u_bar, d_w_c = [x, r∘h_prev]ᵀ·d_c_bar",
        f"the documented d_w_ru of {name} would be ({F + u}, {u}), but w_ru is "
        f"({F + u}, {2 * u}): (input {F} + units {u}) × 2·units {u}",
        True)]
    evidence, ok = verdict(comp1_h + d_hr * r + z, comp1_h + d_hr * r + d_h * z, k["d_h_prev"])
    errata.append(Erratum(2, "d_h_prev = … + d_h_prevr∘r + u", "… + d_h_prevr∘r + d_h∘u",
                          evidence, ok))
    formula = (d_hr * h_prev) * r * (1 - r)
    error = relative_error(formula, d_r_bar)
    errata.append(Erratum(3, "no formula for d_r_bar", "d_r_bar = (d_hr∘h_prev)∘r∘(1−r)",
                          f"this formula matches the kernel's d_r_bar to {error:.2e}",
                          error <= tol))
    doc_dx = d_r_bar @ w_r_x.T + d_u_bar @ w_r_x.T + d_xc[:, :F]
    fixed_dx = d_r_bar @ w_r_x.T + d_u_bar @ w_u_x.T + d_xc[:, :F]
    evidence, ok = verdict(doc_dx, fixed_dx, k["d_x"])
    errata.append(Erratum(4, "d_x_component_1 = d_r_bar·w_r_xᵀ + d_u_bar·w_r_xᵀ (w_r twice)",
                          "… + d_u_bar·w_u_xᵀ (and w_u_h_prev in d_h_prev_component_1)",
                          evidence, ok))
    doc_du = d_h * (h - c) * z * (1 - z)
    fixed_du = d_h * (h_prev - c) * z * (1 - z)
    evidence, ok = verdict(doc_du, fixed_du, d_u_bar)
    errata.append(Erratum(5, "d_u_bar = d_h∘(h − c)∘u∘(1−u)", "d_h∘(h_prev − c)∘u∘(1−u)",
                          evidence, ok))
    errata.append(Erratum(
        6, "b_ru = [b_ru_x b_ru_h], b_c = [b_c_x b_c_h]",
        "one b_ru of size 2u = [b_r | b_u] and one b_c of size u",
        f"GRUBlockCell takes b_ru of shape ({2 * u},) and b_c of shape ({u},) for {name}; "
        "there is no separate input and recurrent bias",
        tuple(w["b_ru"].shape) == (2 * u,) and tuple(w["b_c"].shape) == (u,)))
    return errata
