"""The NumPy-reference witness: an independent float64 BPTT, written without TensorFlow
(``gradscope/cells/``), against TF autodiff on the same float64 model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gradscope.gradcheck import WitnessResult, relative_error
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


def reference_witness(ctx: CheckContext, reference: ReferenceResult) -> list[WitnessResult]:
    """Compare the NumPy reference (from :func:`reference_gradients`) with autodiff."""
    tolerance = ctx.tolerance(WITNESS)
    results = []
    loss_error = abs(reference.loss - ctx.autodiff.loss) / max(abs(ctx.autodiff.loss), 1e-300)
    results.append(WitnessResult(WITNESS, "loss", loss_error, tolerance, loss_error <= tolerance,
                                 f"NumPy {reference.loss:.12g} vs TF {ctx.autodiff.loss:.12g}"))
    for name, expected in ctx.autodiff_gradients().items():
        ours = reference.gradients.get(name)
        if ours is None:
            results.append(WitnessResult(WITNESS, name, None, tolerance, False,
                                         "the NumPy reference has no gradient for it"))
            continue
        error = relative_error(ours, expected)
        results.append(WitnessResult(WITNESS, name, error, tolerance, error <= tolerance))
    return results
