"""The YAML wing's options that name time steps (``at``, ``chunks``), checked before
TensorFlow is imported."""

from __future__ import annotations

from gradscope.errors import ConfigError, flag, given


def check_time_steps(time_steps: int, at: int | None = None, chunks: int | None = None) -> None:
    """Options that name time steps must fit the ``time_steps`` of the config or the data."""
    if at is not None and not 0 <= at < time_steps:
        raise ConfigError(f"{given('at', at)} is outside the {time_steps} time steps; "
                             f"expected 0 to {time_steps - 1}", where=flag("at"))
    if chunks is not None and chunks > time_steps:
        raise ConfigError(
            f"{given('chunks', chunks)} is more than time_steps {time_steps}; expected at "
            f"most {time_steps} chunks (one step each)",
            where=flag("chunks"),
        )


def check_chunks(chunks: int | None, time_steps: int | None = None) -> None:
    """``explain --chunks K``: at least one cut (K ≥ 2) and, once the time steps are known,
    at most one chunk per step.

    K need not divide the time steps: the chunks are cut as ``check --chunks`` cuts them
    (``np.array_split``: the first ``time_steps mod K`` chunks are one step longer).
    """
    if chunks is None:
        return
    if chunks < 2:
        raise ConfigError(
            f"{given('chunks', chunks)}: expected K ≥ 2 (the time axis is cut into K chunks; "
            "with fewer there is no boundary to carry gradients across)",
            where=flag("chunks"),
        )
    if time_steps is not None:
        check_time_steps(time_steps, chunks=chunks)
