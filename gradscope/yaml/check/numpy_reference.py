"""The NumPy-reference witness: an independent float64 BPTT, written without TensorFlow
(``gradscope/cells/``), against TF autodiff on the same float64 model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gradscope.gradcheck import AMPLIFIED, WitnessResult, one_rounding_off, relative_error
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.check.context import CheckContext
from gradscope.yaml.data import Batch

if TYPE_CHECKING:
    from gradscope.yaml.reference import ReferenceResult

WITNESS = "numpy_reference"


def reference_gradients(shapes: ModelShapes, params: dict[str, np.ndarray],
                        batch: Batch) -> ReferenceResult:
    """The NumPy forward and BPTT (no TensorFlow: it may run before TensorFlow is imported)."""
    from gradscope._blas import blas_beside_tensorflow
    from gradscope.yaml.reference import reference_gradients as numpy_bptt

    # One BLAS thread (see gradscope/_blas.py): on the seed model 0.11 s instead of 0.8–3.4 s.
    with blas_beside_tensorflow():
        return numpy_bptt(shapes, params, batch)


#: Beyond this, what rounding alone moves the reference is more than the finite differences
#: resolve: the reference witnesses nothing there.
WIDEST = 1e-5
#: What a tensor was held to where rounding grows along the model (its tolerance says how
#: much), and why.
GROWN = (f"{AMPLIFIED:g} times what one float64 rounding of every input moves the "
         "reference: rounding grows that much along this model (a loss near its minimum, "
         "whose residual cancels)")
BEYOND = ("not witnessed: one float64 rounding of every input moves the reference by more "
          "than a tenth of what the finite differences resolve")


def reference_witness(ctx: CheckContext, reference: ReferenceResult) -> list[WitnessResult]:
    """Compare the NumPy reference (from :func:`reference_gradients`) with autodiff. A tensor
    that disagrees is held to :data:`~gradscope.gradcheck.AMPLIFIED` times what one float64
    rounding of every input moves the reference (:func:`rounding_moves`) where that is wider
    than the tolerance: near its targets a loss's residual (predictions − targets, 1e-6 of
    0.5) cancels, and rounding grows by as much (found tried as a new user would: a correct
    model at an mse of 1e-12 failed 7 tensors at 2.4e-9 > 1e-9, where one rounding of the
    inputs moves the reference by 1.8e-9)."""
    tolerance = ctx.tolerance(WITNESS)
    results = []
    loss_error = abs(reference.loss - ctx.autodiff.loss) / max(abs(ctx.autodiff.loss), 1e-300)
    results.append(WitnessResult(WITNESS, "loss", loss_error, tolerance, loss_error <= tolerance,
                                 f"NumPy {reference.loss:.12g} vs TF {ctx.autodiff.loss:.12g}"))
    moved: dict[str, float] | None = None
    for name, expected in ctx.autodiff_gradients().items():
        ours = reference.gradients.get(name)
        if ours is None:
            results.append(WitnessResult(WITNESS, name, None, tolerance, False,
                                         "the NumPy reference has no gradient for it"))
            continue
        error = relative_error(ours, expected)
        if error <= tolerance or not np.isfinite(error):
            results.append(WitnessResult(WITNESS, name, error, tolerance, error <= tolerance))
            continue
        if moved is None:
            moved = rounding_moves(ctx.shapes, ctx.params, ctx.batch, reference)
        allowed = AMPLIFIED * moved.get(name, 0.0)
        if error > allowed:
            results.append(WitnessResult(WITNESS, name, error, tolerance, False))
        elif allowed > WIDEST:
            results.append(WitnessResult(WITNESS, name, error, allowed, True, BEYOND,
                                         unresolved=True, left_out=BEYOND))
        else:
            results.append(WitnessResult(WITNESS, name, error, allowed, True, GROWN))
    return results


def rounding_moves(shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch,
                   reference: ReferenceResult) -> dict[str, float]:
    """Per tensor, how far (relative) the reference's gradient moves when every number of
    the weights, x, y and the initial states moves by one float64 rounding (signs from a
    fixed seed): what rounding inside the model and its loss is worth, grown as the model
    grows it."""
    rng = np.random.default_rng(0)

    def nudged(value: np.ndarray) -> np.ndarray:
        return one_rounding_off(value, 2.0 ** -53, rng)

    again = reference_gradients(
        shapes, {name: nudged(value) for name, value in params.items()},
        Batch(x=nudged(batch.x), y=nudged(batch.y),
              initial_states={k: nudged(v) for k, v in batch.initial_states.items()},
              source=batch.source))
    return {name: relative_error(again.gradients[name], value)
            for name, value in reference.gradients.items() if name in again.gradients}
