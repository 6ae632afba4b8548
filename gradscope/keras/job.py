"""A Keras model made ready for one command: its options checked once, its batch loaded.

The front door picks the wing once; this is the Keras wing's side of it. :func:`prepare`
refuses the YAML wing's options, checks its own, reads the model and its batch (no TensorFlow
for a saved file); :func:`guard` holds the memory estimate against the limit; :func:`run`
runs explain or check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from os import PathLike
from typing import Any

from gradscope.errors import ConfigError, GradscopeError, flag, given, whole_number
from gradscope.keras.checked_examples import DEFAULT_EXAMPLES, choose, examples_option
from gradscope.keras.data import time_steps
from gradscope.keras.explain import KerasJob
from gradscope.preflight import check_layer_options, check_witness_options
from gradscope.report.models import CheckedExamples

#: The YAML wing's options, and why a Keras model does not take them.
_OWN_BACKWARD = "{command} of your own backward is not available for Keras models yet"
YAML_ONLY = {
    "weights": "a Keras model carries its own weights",
    "against": _OWN_BACKWARD,
    "layer": _OWN_BACKWARD,
    "time_last": _OWN_BACKWARD,
    "params": "a Keras model carries its own weights",
    "equations": "the corrected GRUBlockCellGrad equations go with block-layout GRUs",
}


@dataclass(frozen=True)
class KerasOptions:
    """The batch and loss options, as the API takes them (the CLI's flags)."""

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
    def from_options(cls, options: dict[str, Any]) -> KerasOptions:
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            # The code a saved file needs is given where it is loaded (found tried as a new
            # user would: imports= refused with no word of where it goes).
            loading = ("; a saved model's code is given where it is loaded: "
                       "gradscope.load_model(path, imports=[...]) (or unsafe=True), then pass "
                       "the model" if unknown[0] in ("imports", "unsafe") else "")
            raise ConfigError(f"{unknown[0]}=: not an option for a Keras model; expected "
                              f"{', '.join(cls.names())}{loading}", where=unknown[0])
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
    if not whole_number(value) or value < smallest:  # type: ignore[operator]
        # As the user wrote it: --at -1 on the command line (found tried as a new user would:
        # "at=-1"), at=-1 in Python.
        raise ConfigError(f"{given(name, value)}: expected a whole number ≥ {smallest}",
                          where=name)
    options[name] = int(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class KerasCommand:
    """What one command runs on a Keras model: the job, and the command's own options."""

    command: str
    job: KerasJob
    flow: bool = False
    jacobians: bool = False
    per_example: bool = False
    chunks: int | None = None
    at: int | None = None
    heatmap: bool = False
    directions: int | None = None
    rtol: float | None = None
    atol: float | None = None
    #: check: at most this many examples (None: all), and those chosen.
    examples: int | None = DEFAULT_EXAMPLES
    chosen: CheckedExamples | None = None
    #: diagnose: how many Lyapunov exponents (None: the default).
    exponents: int | None = None
    #: diagnose: run each change on a copy of the model.
    counterfactuals: bool = True
    after_autodiff: Callable[[Any], None] | None = field(default=None, compare=False)


def prepare(command: str, source: Any, data: Any, x: Any, y: Any, sample_weight: Any,
            options: dict[str, Any]) -> KerasCommand:
    """``source`` (a ``.keras`` path or a model object) ready for ``command``: the YAML
    wing's options refused, the others checked, the model read and its batch loaded.
    ``data``: None or a :class:`~gradscope.arrays.DataFiles`."""
    options = dict(options)
    if command == "check":
        check_layer_options(options.get("against"), options.get("layer"),
                            options.get("time_last", False),
                            {name: options.get(name) for name in ("chunks", "atol", "equations")})
    for name in YAML_ONLY:
        value = options.pop(name, None)
        if hasattr(value, "shape"):
            raise ConfigError(f"{name}=: got an array; a Keras model's batch goes by keyword: "
                              f"gradscope.{command}(model, x=x, y=y)", where=name)
        if value is not None and value is not False:
            reason = YAML_ONLY[name].format(command=command)
            raise ConfigError(f"{flag(name)} is for YAML configs; {reason}", where=flag(name))
    check_witness_options(options.get("directions"), options.get("rtol"), options.get("atol"))
    taken = ("flow", "jacobians", "per_example", "chunks", "at", "heatmap", "directions",
             "rtol", "atol", "after_autodiff", "exponents", "counterfactuals")
    own: dict[str, Any] = {name: options.pop(name) for name in taken if name in options}
    if own.get("per_example") and command != "explain":
        raise ConfigError(f"{flag('per_example')} is an option of explain, not of {command}",
                          where=flag("per_example"))
    if own.get("counterfactuals") is None:
        own.pop("counterfactuals", None)
    elif not isinstance(own["counterfactuals"], bool):
        raise ConfigError(f"{given('counterfactuals', own['counterfactuals'])}: expected True "
                          "or False", where=flag("counterfactuals"))
    if own.get("exponents") is not None:
        whole(own, "exponents", smallest=1)
    if own.get("at") is not None:
        whole(own, "at", smallest=0)
    if own.get("chunks") is not None:
        whole(own, "chunks", smallest=1)
        if own["chunks"] < 2:  # one chunk has no boundary: a check of it cannot fail
            raise ConfigError(f"{given('chunks', own['chunks'])}: expected K ≥ 2 (the time "
                              "axis is cut into K chunks; with fewer there is no boundary to "
                              "carry gradients across)", where=flag("chunks"))
    most = None
    if command == "check":
        most = examples_option(options.pop("examples", None))
    elif options.get("examples") is None:  # estimate_memory's, for explain
        options.pop("examples", None)
    if isinstance(data, dict):
        raise ConfigError("data=: for a Keras model, the path of an .npz file; pass arrays "
                          "as x= and y=", where="data")
    checked = KerasOptions.from_options(options)
    _sizes_or_data(checked, data)
    from gradscope.keras.explain import prepare as read
    from gradscope.keras.live import is_live_model

    job = read(source if is_live_model(source) else str(source),
               data=None if data is None else data.data, x=x, y=y, sample_weight=sample_weight,
               batch_size=checked.batch_size, time_steps=checked.time_steps, loss=checked.loss,
               training=checked.training, pad=checked.pad, seed=checked.seed)
    if command == "diagnose":
        from gradscope.keras.diagnose import refuse_without_recurrent

        refuse_without_recurrent(job.graph, job.path)
    at = own.get("at")
    steps = time_steps(job.batch.inputs)
    if at is not None and at >= steps:
        raise ConfigError(f"{given('at', at)} is outside the {steps} time steps of the batch; "
                          f"expected 0 to {steps - 1}", where=flag("at"))
    chunks = own.get("chunks")
    if chunks is not None and chunks > steps:
        raise ConfigError(f"{given('chunks', chunks)} is more than the {steps} time steps of "
                          f"the batch; expected at most {steps} chunks (one step each)",
                          where=flag("chunks"))
    chosen = choose(job, most) if command == "check" else None
    return KerasCommand(command, job, examples=most, chosen=chosen, **own)


def _sizes_or_data(options: KerasOptions, data: Any) -> None:
    """``batch_size`` and ``time_steps`` size the synthetic batch; data brings its own, and a
    Keras model takes it as one .npz named after its inputs and outputs."""
    if data is None:
        return
    named = ("batch_size" if options.batch_size is not None
             else "time_steps" if options.time_steps is not None else None)
    if named is not None:
        source = given("data", data.data) if data.data is not None else given("x", data.x)
        raise GradscopeError(f"{flag(named)} does not go with {source}: the batch and time "
                             "sizes come from the data; expected one or the other",
                             where=flag(named))
    if data.x is not None or data.y is not None:
        raise ConfigError(f"{given('x', data.x or data.y)}: a Keras model takes its batch as "
                          f"{flag('data')} FILE.npz with arrays named after the model's inputs "
                          "and outputs (x and y for one of each)", where=flag("x"))


def shapes(source: Any) -> Any:
    from gradscope.keras.shapes import keras_shapes

    return keras_shapes(source if not isinstance(source, PathLike) else str(source))


def estimate(prepared: KerasCommand, across_time: bool = False) -> dict[str, int]:
    """Bytes by term; ``across_time`` (or the command's ``jacobians``) adds the state
    Jacobians' term of explain."""
    from gradscope.keras.memory import estimate as _estimate

    checked = prepared.chosen.checked if prepared.chosen is not None else None
    # diagnose keeps what explain keeps, one recurrent call's stepping at a time beside it.
    command = "explain" if prepared.command == "diagnose" else prepared.command
    flow = prepared.command == "explain" and (prepared.flow or prepared.heatmap
                                              or prepared.at is not None or across_time)
    return _estimate(prepared.job, command, checked, prepared.chunks, prepared.per_example,
                     jacobians=prepared.command == "explain" and (
                         prepared.jacobians or across_time), flow=flow)


def guard(prepared: KerasCommand, limit: int | None) -> None:
    from gradscope.guard import refuse_over

    refuse_over(estimate(prepared), limit, prepared.command)


def run(prepared: KerasCommand, progress: Callable[[str], None] | None,
        timings: bool) -> Any:
    if prepared.command == "diagnose":
        from gradscope.keras.diagnose import diagnose

        return diagnose(prepared.job, progress=progress, timings=timings,
                        exponents=prepared.exponents,
                        counterfactuals=prepared.counterfactuals)
    if prepared.command == "explain":
        from gradscope.keras.explain import explain

        return explain(prepared.job, progress=progress, timings=timings, flow=prepared.flow,
                       jacobians=prepared.jacobians, at=prepared.at,
                       heatmap=prepared.heatmap, chunks=prepared.chunks,
                       per_example=prepared.per_example)
    from gradscope.keras.check import check

    return check(prepared.job, directions=prepared.directions, rtol=prepared.rtol,
                 atol=prepared.atol, progress=progress, timings=timings,
                 after_autodiff=prepared.after_autodiff, examples=prepared.examples,
                 chosen=prepared.chosen, chunks=prepared.chunks)
