"""The YAML wing's options that depend on the spec (the time steps ``at`` and ``chunks``
name, ``--layer``) or on a file (``--weights``), checked before TensorFlow is imported."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gradscope.errors import ConfigError, GradscopeError, flag, given

if TYPE_CHECKING:
    from gradscope.yaml.config import Spec


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


def check_layer_name(spec: Spec, layer: str) -> None:
    """``layer`` must name one of the spec's recurrent layers."""
    recurrent = [item.name for item in spec.layers if item.recurrent]
    expected = f"expected one of the recurrent layers: {', '.join(str(n) for n in recurrent)}"
    for item in spec.layers:
        if item.name == layer and not item.recurrent:
            raise GradscopeError(f"{given('layer', layer)} is a {item.type} layer; "
                                 f"{flag('layer')} checks a recurrent layer's backward: "
                                 f"{expected}", where=flag("layer"))
    if layer not in recurrent:
        raise GradscopeError(f"{given('layer', layer)}: the model has no layer of that name; "
                             f"{expected}", where=flag("layer"))


def check_weights(path: object, option: str = "--weights") -> None:
    """``--weights PATH`` (or ``gradscope spec PATH``): an .npz file or a checkpoint that
    exists; nothing is read. (Weights given as a dict of arrays are checked as they map.)"""
    if not isinstance(path, str | os.PathLike):
        return
    from gradscope.yaml.weights import locate

    locate(path, option)
