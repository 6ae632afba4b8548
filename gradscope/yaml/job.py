"""A YAML spec made ready for one command: its options checked once, its batch loaded.

The front door picks the wing once; this is the YAML wing's side of it. :func:`prepare`
refuses a Keras model's options, checks its own against the spec (the time steps ``at`` and
``chunks`` name, ``--layer``), and loads the batch; :func:`guard` holds the memory estimate
against the limit; :func:`run` runs explain or check. Nothing here imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from os import PathLike
from typing import Any

from gradscope.errors import ConfigError, flag
from gradscope.preflight import check_layer_options, check_witness_options
from gradscope.yaml.config import Spec, load_spec
from gradscope.yaml.data import Batch
from gradscope.yaml.options import (
    check_chunks,
    check_layer_name,
    check_time_steps,
    check_weights,
)

#: A Keras model's options, and why a YAML config does not take them.
_SETS_ITS_LOSS = "a YAML config sets its loss and has no training mode or padding"
_SETS_SIZES = "set batch_size and time_steps in the YAML config"
KERAS_ONLY = {
    "loss": _SETS_ITS_LOSS,
    "training": _SETS_ITS_LOSS,
    "pad": _SETS_ITS_LOSS,
    "batch_size": _SETS_SIZES,
    "time_steps": _SETS_SIZES,
    "seed": "a YAML config sets its seed",
    "examples": "a YAML config's batch is checked whole (set batch_size in it)",
    "per_example": "per-example gradients are computed on a Keras model (save yours, or pass "
                   "the model object)",
}
#: Each command's own options for a YAML spec.
OWN = {
    "explain": ("weights", "chunks", "flow", "jacobians", "at", "heatmap"),
    "check": ("weights", "chunks", "against", "layer", "time_last", "directions", "rtol",
              "atol", "equations", "params", "after_autodiff"),
}


@dataclass(frozen=True)
class YamlCommand:
    """What one command runs on a YAML spec: the spec, its batch (None: synthetic), and the
    command's own options by name."""

    command: str
    spec: Spec
    batch: Batch | None
    options: dict[str, Any]


def as_spec(source: Any) -> Spec:
    """What the API's first argument names, as a validated Spec: a YAML path, a dict, a Spec,
    or None (the embedded seed model). Anything else is refused in one line."""
    if isinstance(source, Spec):
        return source
    if source is None or isinstance(source, str | PathLike | dict):
        return load_spec(source)
    raise ConfigError(f"the model: got an object of type {type(source).__name__}; expected a "
                      "YAML path, a dict or a Spec (gradscope.load_spec), a saved model.keras "
                      "path, or a Keras model object", where="spec")


def prepare(command: str, source: Any, data: Any, x: Any, y: Any, sample_weight: Any,
            options: dict[str, Any]) -> YamlCommand:
    """``source`` (a YAML path, a dict, a Spec or None) ready for ``command``: a Keras model's
    options refused, the others checked, the spec loaded and the batch read. ``data``: None,
    a :class:`~gradscope.arrays.DataFiles` or a dict of arrays."""
    own = {name: options[name] for name in OWN[command] if name in options}
    other = {name: value for name, value in options.items() if name not in own}
    check_chunks(own.get("chunks"))  # one chunk has no boundary: a check cannot fail
    if command != "explain":
        check_layer_options(own.get("against"), own.get("layer"), own.get("time_last", False),
                            {name: own.get(name) for name in ("chunks", "atol", "equations")})
        check_witness_options(own.get("directions"), own.get("rtol"), own.get("atol"))
    for name, value in other.items():
        if name in KERAS_ONLY and value not in (None, False, 0):
            raise ConfigError(f"{flag(name)} is for Keras models; {KERAS_ONLY[name]}",
                              where=flag(name))
    unknown = sorted(set(other) - set(KERAS_ONLY))
    if unknown:
        raise ConfigError(f"{' and '.join(flag(n) for n in unknown)}: not options of "
                          f"{command} for a YAML spec; see help(gradscope.{command})",
                          where=unknown[0])
    if x is not None or y is not None or sample_weight is not None:
        raise ConfigError("x=, y= and sample_weight= are for a Keras model; for a YAML spec "
                          "pass data={'x': ..., 'y': ...}", where="x")
    check_weights(own.get("weights"))
    spec, batch = _batch(as_spec(source), data)
    check_time_steps(spec.time_steps, at=own.get("at"), chunks=own.get("chunks"))
    if own.get("layer") is not None:
        check_layer_name(spec, own["layer"])
    if own.get("equations") and not any(layer.type == "gru" and layer.layout == "block"
                                        for layer in spec.layers):
        # Found tried as a new user would: an LSTM spec's --equations printed nothing.
        raise ConfigError("--equations: the corrected GRUBlockCellGrad equations go with "
                          "block-layout GRU layers, and this spec has none", where="--equations")
    if command == "explain":
        own["flow"] = bool(own.get("flow") or own.get("heatmap") or own.get("at") is not None)
    return YamlCommand(command, spec, batch, own)


def _batch(spec: Spec, data: Any) -> tuple[Spec, Batch | None]:
    """The spec resized to the user's batch, and the batch (None: synthetic)."""
    if data is None:
        return spec, None
    from gradscope.yaml.data import load_batch, validate_batch

    if isinstance(data, dict):
        return validate_batch(spec, data, origin="the data")
    return load_batch(spec, data=data.data, x=data.x, y=data.y)


def shapes(source: Any) -> Any:
    from gradscope.yaml.shapes import shapes as _shapes

    return _shapes(as_spec(source))


def estimate(prepared: YamlCommand, across_time: bool = False) -> dict[str, int]:
    from gradscope.yaml.memory import estimate as _estimate

    own = prepared.options
    return _estimate(prepared.spec, prepared.command,
                     across_time=across_time or bool(own.get("flow") or own.get("jacobians")),
                     chunks=own.get("chunks"))


def guard(prepared: YamlCommand, limit: int | None) -> None:
    from gradscope.guard import refuse_over

    refuse_over(estimate(prepared), limit, prepared.command)


def run(prepared: YamlCommand, progress: Callable[[str], None] | None, timings: bool) -> Any:
    """Explain or check. ``weights``: what :mod:`gradscope.yaml.weights` reads, or an object
    whose ``read()`` gives it (a saved ``.keras`` file, read by the Keras wing)."""
    spec, batch, own = prepared.spec, prepared.batch, dict(prepared.options)
    if callable(getattr(own.get("weights"), "read", None)):
        own["weights"] = own["weights"].read()
    if prepared.command == "explain":
        from gradscope.yaml.explain import explain

        return explain(spec, data=batch, weights=own.get("weights"), chunks=own.get("chunks"),
                       flow=own["flow"], jacobians=bool(own.get("jacobians")),
                       at=own.get("at"), heatmap=bool(own.get("heatmap")), progress=progress,
                       timings=timings)
    if own.get("layer") is not None:
        from gradscope.yaml.check.layer_backward import check_layer

        return check_layer(spec, own["against"], own["layer"],
                           time_last=bool(own.get("time_last")), rtol=own.get("rtol"),
                           data=batch, params=own.get("params"), weights=own.get("weights"),
                           progress=progress, timings=timings)
    from gradscope.gradcheck import PER_TENSOR_DIRECTIONS
    from gradscope.yaml.check import check

    directions = own.get("directions")
    report = check(spec, against=own.get("against"), chunks=own.get("chunks"),
                   directions=PER_TENSOR_DIRECTIONS if directions is None else directions,
                   rtol=own.get("rtol"), atol=own.get("atol"), data=batch,
                   weights=own.get("weights"), params=own.get("params"), progress=progress,
                   timings=timings)
    if own.get("equations"):
        from gradscope.yaml.check.block_kernel import CORRECTED_EQUATIONS

        report.show_equations(CORRECTED_EQUATIONS)
    return report
