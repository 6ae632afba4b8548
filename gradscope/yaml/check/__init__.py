"""``gradscope check`` of a YAML config's model: every gradient of TF autodiff, on a float64
copy of the model (same weights, same batch), held to witnesses that do not share its code.

One module per witness: ``finite_differences``, ``numpy_reference`` (a NumPy forward and BPTT),
``block_kernel`` (TF's GRUBlockCellGrad, for block-layout GRUs, float32), ``carry``
(``--chunks``: truncated BPTT with the carry), ``user_backward`` (``--against``) and
``layer_backward`` (``--layer``); ``variants`` names a wrong array by the mistake it equals.
:func:`_witnesses` runs each where it costs least on 2 cores: while one thread traces a
function (Python), the other's TensorFlow or BLAS work goes on. The witnesses and their
tolerances: docs/check.md.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope._tf import native_stderr_silenced
from gradscope.gradcheck import TOLERANCES, WitnessResult, checked_tensors, unwitnessed
from gradscope.report.models import (
    CarryBoundaryEntry,
    CarryCheck,
    CheckReport,
    CheckSummary,
    ErratumEntry,
    LossEntry,
    NamedShape,
)
from gradscope.timing import Clock, Progress
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.check.context import CheckContext
from gradscope.yaml.config import Spec
from gradscope.yaml.data import Batch, initial_params, synthetic_batch


def check(spec: Spec, against: str | Callable[..., Any] | None = None,
          chunks: int | None = None, directions: int = 3, rtol: float | None = None,
          atol: float | None = None, data: Batch | None = None,
          progress: Progress | None = None, timings: bool = False,
          params: dict[str, np.ndarray] | None = None, weights: Any = None) -> CheckReport:
    """Verify every gradient of ``spec``'s model; see the module docstring for the witnesses.

    ``against`` is ``"FILE.py:FUNC"`` or a callable with the contract
    ``FUNC(params, x, y, h0) -> dict`` (see docs/check.md). ``rtol`` overrides the relative
    tolerance of every float64 witness; ``atol`` adds an absolute allowance to finite
    differences.
    ``params`` are the weights by gradscope name, taken as they are; ``weights`` (an .npz
    path, a TF checkpoint or a dict, see :mod:`gradscope.yaml.weights`) is mapped onto the spec's
    layers first and the mapping reported. Either replaces the seeded initial weights.
    """
    from gradscope.yaml.shapes import model_entry
    from gradscope.yaml.weights import chosen_weights

    say = progress or (lambda message: None)
    clock = Clock()
    user_function = _user_function(against, say)
    algebra = model_shapes(spec)
    batch = (data if data is not None else synthetic_batch(algebra)).astype("float64")
    params, weights_entry = chosen_weights(spec, weights, params, say)
    if params is None:
        params = initial_params(algebra)
    params = {name: value.astype(np.float64) for name, value in params.items()}

    seen = _witnesses(algebra, params, batch, user_function, directions, rtol, atol, say, clock)
    ctx, results = seen.ctx, seen.results
    witnesses = ["finite_differences", "numpy_reference"]
    if seen.errata is not None:
        witnesses.append("gru_block_kernel")
    carry = None
    if chunks is not None:
        say(f"truncated BPTT in {chunks} chunks")
        witnesses.append("tbptt_carry")
        carried, carry = _carry(ctx, chunks)
        results += carried
        clock.lap("tbptt_carry")
    if user_function is not None:
        witnesses.append("against")
        results += seen.against

    shapes = _shapes_by_name(ctx)
    tensors = checked_tensors(results, list(shapes), shapes)
    failed = [t.name for t in tensors if not t.passed]
    left_out = unwitnessed(results)
    overflows = _in_its_dtype(ctx, say)
    return CheckReport(
        model=model_entry(algebra, data=batch.source),
        loss=LossEntry(name=spec.loss, value=seen.loss),
        tolerances={w: ctx.tolerance(w, "float32" if w == "gru_block_kernel" else "float64")
                    for w in witnesses},
        tensors=tensors,
        carry=carry,
        errata=seen.errata,
        against=against if isinstance(against, str) else (
            getattr(against, "__name__", "function") if against is not None else None),
        against_not_returned=seen.not_returned,
        not_finite=overflows,
        summary=CheckSummary(
            passed=not failed and overflows is None,
            checked_tensors=len(tensors),
            failed_tensors=failed,
            witnesses=witnesses,
            comparisons=len(results),
            failures=sum(not r.passed for r in results),
            unwitnessed_tensors=[t.name for t in tensors if t.name in left_out],
        ),
        weights=weights_entry,
        timings=clock.laps(timings),
    )


def _user_function(against: str | Callable[..., Any] | None,
                   say: Progress) -> Callable[..., Any] | None:
    if isinstance(against, str):
        from gradscope.yaml.check.user_backward import load_against

        say(f"loading {against}")
        return load_against(against)
    return against


@dataclass
class _Witnessed:
    ctx: CheckContext
    loss: float
    results: list[WitnessResult]  # finite differences, NumPy reference, kernel
    errata: list[ErratumEntry] | None  # None without a block-layout GRU
    against: list[WitnessResult]  # the user's function's
    not_returned: list[str] | None


def _witnesses(algebra: Any, params: dict[str, np.ndarray], batch: Batch,
               user_function: Callable[..., Any] | None, directions: int,
               rtol: float | None, atol: float | None, say: Progress,
               clock: Clock) -> _Witnessed:
    """TF autodiff in float64 and the witnesses of every tensor, each where it costs least:
    the NumPy reference while TensorFlow is imported, most finite-difference evaluations
    beside the autodiff pass, the reference's comparison and GRUBlockCellGrad beside the
    rest of the finite differences."""
    from gradscope.yaml.check.block_kernel import errata_evidence, kernel_witness
    from gradscope.yaml.check.finite_differences import FiniteDifferences
    from gradscope.yaml.check.numpy_reference import reference_gradients, reference_witness
    from gradscope.yaml.engine import Engine

    block = any(cell.kind == "gru" and cell.layout == "block" for cell in algebra.cells)
    finite: FiniteDifferences | None = None
    with native_stderr_silenced(), ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="gradscope-witness") as pool:
        say("NumPy reference: forward and BPTT")
        reference = pool.submit(clock.timed, "numpy_reference",
                                lambda: reference_gradients(algebra, params, batch))
        try:
            say("importing TensorFlow")
            engine = Engine(algebra, dtype="float64")
            clock.lap("import_and_build")
            finite = FiniteDifferences(algebra, params, batch, engine, directions, say)
            finite.begin()
            say("TF autodiff in float64")
            autodiff = engine.run(params, batch, per_step=True)
            clock.lap("autodiff")
            # --rtol applies to the float64 witnesses; the float32 kernel keeps its own.
            overrides = {w: rtol for w in TOLERANCES
                         if rtol is not None and w != "gru_block_kernel"}
            ctx = CheckContext(algebra, params, batch, engine, autodiff, rtol=overrides,
                               atol=atol, directions=directions, progress=say)

            against_results: list[WitnessResult] = []
            not_returned: list[str] | None = None
            if user_function is not None:
                # First, so a function that breaks the contract (raises, returns no known
                # name) is reported at once; its column still comes last.
                from gradscope.yaml.check import user_backward

                say("comparing with the user's backward")
                against_results = user_backward.against_witness(ctx, user_function)
                not_returned = user_backward.not_returned(ctx, against_results)
                clock.lap("against")

            def beside() -> tuple[list[WitnessResult], list[WitnessResult], list[Any] | None]:
                compared = reference_witness(ctx, reference.result())
                if not block:
                    return compared, [], None
                say("GRUBlockCellGrad kernel")
                kernel = clock.timed("gru_block_kernel",
                                     lambda: (kernel_witness(ctx), errata_evidence(ctx)))
                return compared, kernel[0], kernel[1]

            others = pool.submit(beside)
            results: list[WitnessResult] = clock.timed("finite_differences",
                                                       lambda: finite.finish(ctx))
            reference_results, kernel_results, evidence = others.result()
        finally:
            if finite is not None:
                finite.close()
    clock.lap("witnesses")
    errata = None if evidence is None else [ErratumEntry(**vars(e)) for e in evidence]
    return _Witnessed(ctx, float(autodiff.loss), results + reference_results + kernel_results,
                      errata, against_results, not_returned)


def _carry(ctx: CheckContext, chunks: int) -> tuple[list[WitnessResult], CarryCheck]:
    """Truncated BPTT in ``chunks`` chunks, the carry as grad_ys, against full BPTT."""
    from gradscope.yaml.check.carry import carry_witness

    outcome = carry_witness(ctx, chunks)
    return outcome.results, CarryCheck(
        chunks=chunks,
        chunk_lengths=list(outcome.chunk_lengths),
        boundaries=[
            CarryBoundaryEntry(
                step=b.step,
                ys=[NamedShape(name=n, shape=list(s)) for n, s in b.ys],
                grad_ys=[NamedShape(name=n, shape=list(s), norm=float(norm))
                         for (n, s), norm in zip(b.grad_ys, b.grad_ys_norm, strict=True)],
            )
            for b in outcome.boundaries
        ],
    )


def _in_its_dtype(ctx: CheckContext, say: Progress) -> str | None:
    """Where the spec's own dtype is not float64 and the float64 pass comes near its range
    (:func:`~gradscope.gradcheck.near_range`), the model run in that dtype: where its loss or a
    gradient is not finite there, in words (:func:`gradscope.yaml.explain.not_finite`);
    else None."""
    from gradscope.gradcheck import near_range
    from gradscope.yaml.engine import Engine
    from gradscope.yaml.explain import not_finite

    dtype = ctx.shapes.spec.dtype
    autodiff = ctx.autodiff
    if not near_range([autodiff.loss, *autodiff.weight_gradients.values(),
                       *autodiff.state_gradients.values()], dtype):
        return None  # float64 itself never is
    say(f"the float64 numbers near {dtype}'s range: the model in {dtype}")
    params = {name: value.astype(dtype) for name, value in ctx.params.items()}
    own = Engine(ctx.shapes).run(params, ctx.batch.astype(dtype), watch_input=False)
    return not_finite(ctx.shapes, ctx.params, ctx.batch, own.loss,
                      {**own.weight_gradients, **own.state_gradients})


def _shapes_by_name(ctx: CheckContext) -> dict[str, list[int]]:
    shapes = {info.name: list(info.shape) for info in (*ctx.shapes.weights, *ctx.shapes.states)}
    shapes["x"] = list(ctx.batch.x.shape)
    return shapes


__all__ = ["check"]
