"""The NumPy-reference witness: an independent float64 BPTT, written without TensorFlow
(``gradscope/reference.py``), against TF autodiff on the same float64 model."""

from __future__ import annotations

from gradscope.witnesses.context import CheckContext, WitnessResult, relative_error

WITNESS = "numpy_reference"


def reference_witness(ctx: CheckContext) -> list[WitnessResult]:
    from threadpoolctl import threadpool_limits

    from gradscope.reference import reference_gradients

    ctx.progress("NumPy reference: forward and BPTT")
    # One BLAS thread: the reference multiplies small matrices, one step at a time, and a
    # second BLAS thread waiting on a core that TensorFlow's threads still hold made it 8 to
    # 30 times slower (measured on 2 cores: 0.8–3.4 s instead of 0.11 s on the seed model).
    with threadpool_limits(limits=1, user_api="blas"):
        reference = reference_gradients(ctx.shapes, ctx.params, ctx.batch)
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
