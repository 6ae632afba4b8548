"""The options of a Keras model's batch and loss, as the API takes them (the CLI's flags), checked
once: a wrong type or value is a one-line ConfigError naming the option, never an error from
deep inside."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from gradscope.errors import ConfigError


@dataclass(frozen=True)
class KerasJobOptions:
    batch_size: int | None = None
    time_steps: int | None = None
    loss: str | None = None
    training: bool = False
    pad: int = 0
    seed: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> KerasJobOptions:
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise ConfigError(f"{unknown[0]}=: not an option for a Keras model; expected "
                              f"{', '.join(cls.names())}", where=unknown[0])
        for name in ("batch_size", "time_steps"):
            whole(options, name, smallest=1, optional=True)
        whole(options, "pad", smallest=0)
        whole(options, "seed", smallest=0)
        if not isinstance(options.get("training", False), bool):
            raise ConfigError(f"training={options['training']!r}: expected True or False",
                              where="training")
        loss = options.get("loss")
        if loss is not None and not isinstance(loss, str):
            raise ConfigError(f"loss={loss!r}: expected the name of a Keras loss (a string, "
                              "e.g. 'mse'); a compiled model's own loss needs no loss=",
                              where="loss")
        return cls(**options)


def whole(options: dict[str, Any], name: str, smallest: int, optional: bool = False) -> None:
    """``options[name]``, when given (or not ``optional``), is a whole number ≥ ``smallest``."""
    value = options.get(name)
    if value is None and (optional or name not in options):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
        raise ConfigError(f"{name}={value!r}: expected a whole number ≥ {smallest}", where=name)
