"""How ``--chunks K`` cuts the time axis, and when carrying gradients across the cuts matters:
what the YAML wing's and the Keras wing's truncated BPTT share (no TensorFlow).
"""

from __future__ import annotations

import numpy as np

from gradscope.errors import ConfigError
from gradscope.formats import percent
from gradscope.report.models import CarryWeightEntry

#: Carrying "matters" when, for some weight, the carried gradients are at least this share of
#: the full gradient (‖g_full − g_truncated‖ / ‖g_full‖). Below it, truncated BPTT without the
#: carry changes every weight gradient by less than 1% of its norm (and turns it by less than
#: 0.6°): less than the noise of one mini-batch to the next, in typical training.
CARRIED_SHARE_THRESHOLD = 0.01


def chunk_lengths(time_steps: int, chunks: int, what: str = "time_steps") -> list[int]:
    """The lengths ``np.array_split`` gives: the first ``time_steps % chunks`` one longer.
    ``what`` names the time axis in the refusal (``time_steps``, ``lstm's 20 steps``)."""
    if chunks < 1:
        raise ConfigError(f"--chunks {chunks}: expected a positive integer", where="--chunks")
    if chunks > time_steps:
        raise ConfigError(
            f"--chunks {chunks} is more than {what} {time_steps}; expected at most "
            f"{time_steps} chunks (one step each)",
            where="--chunks",
        )
    return [len(part) for part in np.array_split(np.arange(time_steps), chunks)]


def chunk_starts(lengths: list[int]) -> list[int]:
    """The first step of every chunk: [0, T₀, T₀+T₁, …]."""
    return [int(s) for s in np.concatenate([[0], np.cumsum(lengths)[:-1]])]


def carried_weights(full: dict[str, np.ndarray], truncated: dict[str, np.ndarray],
                    names: list[str]) -> tuple[list[CarryWeightEntry], bool, str]:
    """Per weight of ``names``: ‖g_full‖, ‖g_truncated‖ and what the carry adds; whether
    carrying matters (:data:`CARRIED_SHARE_THRESHOLD`), and the verdict in one line."""
    weights = []
    for name in names:
        whole = float(np.linalg.norm(full[name]))
        carried = float(np.linalg.norm(np.asarray(full[name], np.float64)
                                       - np.asarray(truncated[name], np.float64)))
        weights.append(CarryWeightEntry(
            name=name, l2_full=whole, l2_truncated=float(np.linalg.norm(truncated[name])),
            l2_carried=carried, carried_share=carried / whole if whole > 0 else 0.0))
    threshold = CARRIED_SHARE_THRESHOLD
    largest = max(weights, key=lambda entry: entry.carried_share)
    reaching = sum(entry.carried_share >= threshold for entry in weights)
    share = percent(largest.carried_share)
    if reaching:
        verdict = (f"carrying matters: it changes {reaching} of {len(weights)} gradients by "
                   f"≥ {threshold:.0%} ({largest.name} by {share})")
    else:
        verdict = (f"carrying hardly matters: it changes every gradient by < {threshold:.0%} "
                   f"(at most {share}, {largest.name})")
    return weights, reaching > 0, verdict
