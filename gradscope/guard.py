"""The resource guard: estimate what a run will allocate, and refuse before TensorFlow is
imported when it will not fit.

The estimate is the process's peak resident memory: TensorFlow itself (a constant, measured),
plus terms that grow with the model: weights and their gradients, the activations a backward
pass keeps (every step of every layer, gates included), and the extra work of ``check``
(float64, finite-difference perturbations, the NumPy reference) and of
``explain --jacobians/--flow`` (every Jacobian row carried through one backward scan). The
per-unit constants were measured, not derived; ``bench/memory_estimate.py`` prints the
estimate beside the measured peak at several sizes (target: within 1.5× either way).
"""

from __future__ import annotations

import os
import re

from gradscope.errors import ConfigError
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import Spec

MIB = 1 << 20
#: Peak RSS of ``gradscope explain`` on a model of 2 steps, 1 example and 2 units, where no
#: term below matters: 622 MiB (TensorFlow 2.21 CPU, Python 3.11, Linux x86-64). Importing
#: TensorFlow and running one op alone peaks at 549 MiB; the rest is gradscope's own modules
#: and TensorFlow's tracing and graph optimisation. ``check`` on the same model: 626 MiB.
PROCESS_BASELINE = 620 * MIB
BASELINE_TERM = "TensorFlow itself"
#: Per step and unit, how many numbers a cell's forward and backward pass hold at the peak:
#: the gates and candidates kept for the backward pass, the input projections, the outputs
#: and their gradients. Measured as the slope of peak RSS from 100 to 1000 steps (two layers
#: of 256 units, batch 32, float32, both layouts): GRU 16.7–17.0, LSTM 20.3–20.5,
#: SimpleRNN 5.1–5.6 numbers per step and unit.
KEPT_PER_UNIT = {"gru": 17, "lstm": 21, "simple_rnn": 6}
#: Forward passes of finite-difference probes at once: two ``tf.map_fn`` calls (one per thread
#: of the witness's queue) of ``PARALLEL_ITERATIONS`` = 5 iterations each
#: (gradscope/witnesses/finite_differences.py).
FORWARD_PASSES_AT_ONCE = 10
UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
         "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_limit() -> int:
    """A quarter of physical memory."""
    return physical_memory() // 4


def parse_size(text: str) -> int:
    """'4G', '512M', '1.5GB', '1000000' → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?B?)\s*", text.upper())
    if not match:
        raise ConfigError(f"--max-memory {text!r}: expected a size such as 4G, 512M or 1.5GB",
                          where="--max-memory")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def estimate(spec: Spec, command: str, across_time: bool = False,
             chunks: int | None = None) -> dict[str, int]:
    """Bytes by term for ``command`` ("explain" or "check") on ``spec``; the sum is the
    estimated peak resident memory of the whole process. ``chunks``: ``explain --chunks``."""
    algebra = model_shapes(spec)
    B, T, F = spec.batch_size, spec.time_steps, spec.input_size
    itemsize = 8 if command == "check" or spec.dtype == "float64" else 4
    weights = algebra.weight_count
    kept = sum(KEPT_PER_UNIT[cell.kind] * cell.units for cell in algebra.cells)
    dense = sum(layer.units for layer in algebra.dense) * (T if spec.sequence_output else 1)
    #: One forward pass's per-step numbers: the input and every layer's input projections.
    projections = F + 3 * sum(cell.units for cell in algebra.cells)
    activations = B * T * kept * itemsize + B * dense * itemsize
    terms = {
        BASELINE_TERM: PROCESS_BASELINE,
        "weights and their gradients": 3 * weights * itemsize,
        "input batch and its gradient": 2 * B * T * F * itemsize,
        "activations kept for the backward pass": activations,
    }
    if command == "check":
        # The autodiff pass also returns every state sequence and its total gradient.
        terms["per-step sequences and gradients"] = 2 * B * T * sum(
            cell.units for cell in algebra.cells) * 8
        # Finite differences: the perturbed weight rows (NumPy, TF and the loop's copy), the
        # forward passes the loop runs at once, and input copies in groups of four.
        probes = 2 * 6 * len(algebra.weights)
        terms["finite differences"] = (
            3 * probes * weights * 8
            + FORWARD_PASSES_AT_ONCE * B * T * projections * 8
            + 4 * B * T * (F + kept) * 8
        )
        terms["NumPy reference caches"] = B * T * (kept + 2 * F) * 8
    if chunks is not None and command == "explain":
        # Two float64 passes in one graph (full and truncated BPTT), each with its kept
        # activations, and the edge tensors and their gradients (T, B, units) per state. On
        # the seed model: 96 MiB estimated, 111 MiB measured (peak 676 → 787 MiB).
        state = sum(cell.units * len(cell.state_names) for cell in algebra.cells)
        terms["truncated BPTT (float64)"] = (
            2 * B * T * kept * 8 + 4 * B * T * state * 8 + 4 * weights * 8)
    if across_time:
        state = sum(cell.units * len(cell.state_names) for cell in algebra.cells)
        # Every Jacobian row (one per state unit, plus the influence rows) is carried through
        # the backward scan at once, stacked in the batch axis: each step's states and
        # projections, repeated once per row (measured: about 4 copies of them at the peak);
        # and the forward trajectory and the Jacobian blocks.
        rows = state + algebra.cells[-1].units if algebra.cells else 0
        terms["state Jacobians"] = (
            4 * rows * B * 3 * sum(cell.units for cell in algebra.cells) * itemsize
            + 2 * B * T * state * itemsize
            + 2 * B * state * state * 8
        )
    return terms


def guard(spec: Spec, command: str, limit: int | None = None, across_time: bool = False,
          chunks: int | None = None) -> None:
    """Raise ConfigError (exit 2) when the estimate is over ``limit`` (default: RAM / 4)."""
    limit = default_limit() if limit is None else limit
    terms = estimate(spec, command, across_time, chunks)
    total = sum(terms.values())
    if total > limit:
        largest = max((name for name in terms if name != BASELINE_TERM),
                      key=lambda name: terms[name])
        raise ConfigError(
            f"this {command} would need about {_human(total)}, more than the limit "
            f"{_human(limit)} (--max-memory; default a quarter of RAM); TensorFlow itself "
            f"takes about {_human(terms[BASELINE_TERM])}, and the largest term is "
            f"{largest}: {_human(terms[largest])}",
            where="--max-memory",
        )


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} PiB"
