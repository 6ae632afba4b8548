"""The resource guard, for both wings: the limit (``--max-memory``, default a quarter of RAM)
and the refusal, before TensorFlow is imported, of a run whose estimate is over it.

Each wing estimates its own runs (``gradscope/yaml/memory.py``, ``gradscope/keras/memory.py``)
as the process's peak resident memory: TensorFlow itself (a constant, measured here) plus terms
that grow with the model. Their constants were measured, not derived;
``bench/memory_estimate.py`` prints each estimate beside the measured peak at several sizes
(target: within 1.5× either way).
"""

from __future__ import annotations

import os
import re

from gradscope.errors import ConfigError

MIB = 1 << 20
#: Peak RSS of ``gradscope explain`` on a model of 2 steps, 1 example and 2 units, where no
#: term below matters: 622 MiB (TensorFlow 2.21 CPU, Python 3.11, Linux x86-64). Importing
#: TensorFlow and running one op alone peaks at 549 MiB; the rest is gradscope's own modules
#: and TensorFlow's tracing and graph optimisation. ``check`` on the same model: 626 MiB.
PROCESS_BASELINE = 620 * MIB
BASELINE_TERM = "TensorFlow itself"
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


def memory_limit(max_memory: int | str | None) -> int | None:
    """``max_memory`` in bytes, given as bytes or as a size such as ``"4G"``."""
    return parse_size(max_memory) if isinstance(max_memory, str) else max_memory


def refuse_over(terms: dict[str, int], limit: int | None, command: str) -> None:
    """Raise ConfigError (exit 2) when the estimate, the sum of ``terms`` (bytes by term), is
    over ``limit`` (default: RAM / 4), naming the largest term."""
    limit = default_limit() if limit is None else limit
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


def give_back_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). After a long tape, the process keeps hundreds of MiB it no longer uses, on top
    of which the next phase would set the peak."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} PiB"
