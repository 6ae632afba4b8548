"""Truncated BPTT with the carry (``check --chunks K``) as a witness: the model's recurrent
states cut into K chunks, each chunk's ∂L/∂(initial states) carried as the grad_ys of the
chunk before's final states, last chunk first (:mod:`~gradscope.keras.truncation`). Summed
over the chunks, the weight gradients must be the tape's full BPTT: the cut run steps each
layer's own cell in ``tf.scan``, not Keras' loop, and composes the chunks by hand.
"""

from __future__ import annotations

import numpy as np

from gradscope.gradcheck import WitnessResult, relative_error
from gradscope.keras.check.probing import Probing, Witnessed
from gradscope.keras.truncation import Chunked, chunked
from gradscope.report.models import CarryBoundaryEntry, CarryCheck, NamedShape

WITNESS = "tbptt_carry"


def witness(probing: Probing, chunks: int, rtol: float) -> tuple[Witnessed, CarryCheck]:
    """Every trainable weight's gradient, from the chunks carried, against the tape's."""
    probing.restore()
    try:
        result = chunked(probing.engine, probing.inputs, probing.targets,
                         probing.sample_weight, chunks)
    finally:
        probing.restore()
    found = Witnessed()
    lengths = "+".join(str(n) for n in _lengths(result))
    for path, value in result.carried.items():
        expected = probing.autodiff.gradients.get(path)
        found.shapes[path] = list(value.shape)
        if expected is None:
            # The tape found no path from this weight to the loss; the chunks must not either.
            expected = np.zeros_like(value)
        error = relative_error(value, expected)
        found.results.append(WitnessResult(
            WITNESS, path, error, rtol, bool(error <= rtol),
            f"{chunks} chunks of {lengths} steps, carried last to first"))
    return found, _carry_check(result)


def _lengths(result: Chunked) -> list[int]:
    loop = result.loops[0]
    return [b - a for a, b in zip(loop.starts, [*loop.starts[1:], loop.steps], strict=True)]


def _carry_check(result: Chunked) -> CarryCheck:
    """Per boundary (the first call's time axis; every call's states at it): what the chunk
    before ends with, and the gradient carried into it."""
    by_step: dict[int, CarryBoundaryEntry] = {}
    for boundary in result.boundaries:
        loop = boundary.loop
        last = loop.entering(boundary.chunk + 1)
        step = last + 1 if not loop.backwards else last
        entry = by_step.setdefault(step, CarryBoundaryEntry(step=step, ys=[], grad_ys=[]))
        for name, grad_y in zip(loop.names, boundary.grad_ys, strict=True):
            short = name[0] if name in ("h0", "c0") else name
            y = f"{loop.label}/{short}[t={last}]"
            shape = list(grad_y.shape)
            entry.ys.append(NamedShape(name=y, shape=shape))
            entry.grad_ys.append(NamedShape(name=f"∂L/∂{y}", shape=shape,
                                            norm=float(np.linalg.norm(grad_y))))
    return CarryCheck(chunks=result.chunks, chunk_lengths=_lengths(result),
                      boundaries=[by_step[step] for step in sorted(by_step)])
