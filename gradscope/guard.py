"""The resource guard: estimate what a run will allocate, and refuse before TensorFlow is
imported when it will not fit.

The estimate is an upper-bound sketch, not an accountant: weights and their gradients, the
activations a backward pass keeps (every step of every layer, gates included), and the extra
work of ``check`` (float64 copies, finite-difference perturbations, the NumPy reference) and of
``explain --jacobians/--flow`` (one Jacobian row of every example per state unit).
"""

from __future__ import annotations

import os
import re

from gradscope.algebra import model_shapes
from gradscope.errors import ConfigError
from gradscope.spec import Spec

#: Per step and unit, how many numbers a cell keeps for its backward pass (gates, candidates).
KEPT_PER_UNIT = {"gru": 8, "lstm": 12, "simple_rnn": 3}
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


def estimate(spec: Spec, command: str, across_time: bool = False) -> dict[str, int]:
    """Bytes by term for ``command`` ("explain" or "check") on ``spec``."""
    algebra = model_shapes(spec)
    B, T, F = spec.batch_size, spec.time_steps, spec.input_size
    itemsize = 8 if command == "check" or spec.dtype == "float64" else 4
    weights = algebra.weight_count
    kept = sum(KEPT_PER_UNIT[cell.kind] * cell.units for cell in algebra.cells)
    dense = sum(layer.units for layer in algebra.dense) * (T if spec.sequence_output else 1)
    terms = {
        "weights and their gradients": 3 * weights * itemsize,
        "input batch and its gradient": 2 * B * T * F * itemsize,
        "activations kept for the backward pass": B * T * kept * itemsize + B * dense * itemsize,
    }
    if command == "check":
        # Finite differences: flattened weight copies per probe, and input copies in groups.
        probes = 2 * 6 * len(algebra.weights)
        terms["finite differences"] = probes * weights * 8 + 4 * (
            B * T * F * 8 + B * T * kept * 8)
        terms["NumPy reference caches"] = B * T * (kept + 2 * F) * 8
    if across_time:
        state = sum(cell.units * len(cell.state_names) for cell in algebra.cells)
        terms["state Jacobians"] = B * state * state * 8 + B * T * kept * itemsize
    return terms


def guard(spec: Spec, command: str, limit: int | None = None, across_time: bool = False) -> None:
    """Raise ConfigError (exit 2) when the estimate is over ``limit`` (default: RAM / 4)."""
    limit = default_limit() if limit is None else limit
    terms = estimate(spec, command, across_time)
    total = sum(terms.values())
    if total > limit:
        largest = max(terms, key=lambda name: terms[name])
        raise ConfigError(
            f"this {command} would need about {_human(total)}, more than the limit "
            f"{_human(limit)} (--max-memory; default a quarter of RAM); the largest term is "
            f"{largest}: {_human(terms[largest])}",
            where="--max-memory",
        )


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} PiB"
