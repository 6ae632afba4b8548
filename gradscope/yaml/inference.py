"""``gradscope spec PATH``: the shape algebra run backwards, for a user who has trained weights
but no config.

From the variable shapes of a checkpoint or an .npz file, the config that explains them: the
variables named and grouped as ``--weights`` does (:mod:`gradscope.yaml.weights`), each layer's
sizes read off its shapes with every shape cross-checked, and the layers chained. Values no
weight file holds get a default and a comment that says so. The YAML is then loaded by
gradscope itself, with the file's weights mapped onto it, so what is printed is known to work.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import yaml

from gradscope.errors import ConfigError
from gradscope.report.models import IgnoredVariable, Inference, SpecInference
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import NAME_PATTERN, Spec, spec_from_yaml
from gradscope.yaml.reference import predictions
from gradscope.yaml.weights import (
    FORMATS,
    Group,
    NonFiniteWeights,
    WeightsError,
    _shape,
    group_variables,
    load_weights,
    open_weights,
    order,
    untold_orders,
)

#: How a saved Keras model's spec names its source.
SAVED_FORMAT = "saved Keras model"

#: Defaults for what a weight file cannot hold; --data replaces the sizes.
DEFAULT_TIME_STEPS = 100
DEFAULT_BATCH_SIZE = 32

_CELL_NAMES = {
    ("gru", "block"): "TF1 GRUCell, block layout",
    ("gru", "keras"): "Keras GRU",
    ("lstm", "block"): "TF1 LSTMCell, block layout",
    ("lstm", "keras"): "Keras LSTM",
    ("simple_rnn", "block"): "TF1 BasicRNNCell, block layout",
    ("simple_rnn", "keras"): "Keras SimpleRNN",
}
_KIND_TITLES = {"gru": "a GRU", "lstm": "an LSTM", "simple_rnn": "a SimpleRNN"}


class SavedModel(Protocol):
    """A saved model's word on what its weights' shapes cannot say
    (:class:`gradscope.keras.yaml_form.SavedForm`)."""

    @property
    def source(self) -> str: ...
    @property
    def facts(self) -> dict[str, tuple[Any, str, bool]]:
        """time_steps, batch_size, loss, dtype, sequence_output → (value, why, said by the
        file)."""
    @property
    def probe_x(self) -> np.ndarray: ...
    @property
    def probe_predictions(self) -> np.ndarray: ...


def infer_spec(source: str | os.PathLike[str] | Mapping[str, Any],
               saved: SavedModel | None = None) -> SpecInference:
    """The config ``source``'s shapes imply, with the reason for every value.

    With ``saved``, ``source`` holds a saved model's weights keyed ``<layer>/<weight>``, its
    layers in the order data flows: that order and those names are kept, the model's facts
    replace the defaults, and the spec's own NumPy forward pass must reproduce what the model
    predicted on ``saved.probe_x``, or the spec is refused."""
    weight_file = open_weights(source, option="")
    origin = weight_file.origin if saved is None else saved.source
    shown = (saved.source if saved is not None else
             str(source) if not isinstance(source, Mapping) else "the arrays")
    file_format = FORMATS[weight_file.format] if saved is None else SAVED_FORMAT
    groups = group_variables(weight_file)
    if saved is None:
        recurrent, dense = order(groups)
    else:  # the model's own order, and its own layer names
        recurrent = [group for group in groups if group.kind != "dense"]
        dense = [group for group in groups if group.kind == "dense"]
    untold = untold_orders(dense) if saved is None else []
    if untold:
        raise WeightsError(origin, [f"the names {pair} do not say which dense layer comes "
                                    "first; refusing to pick an order" for pair in untold])
    if not recurrent:
        raise WeightsError(origin, ["no recurrent layer's weights found (expected a GRUCell's "
                                    "gates/kernel, an LSTMCell's lstm_cell/kernel, or a Keras "
                                    f"recurrent_kernel); found {_listing(groups)}"])
    problems: list[str] = []
    size_of = {id(group): _recurrent_sizes(group, problems) for group in recurrent}
    dense_sizes = [_dense_sizes(group, problems) for group in dense]
    if problems:
        raise WeightsError(origin, problems)
    order_note = ""
    if saved is None and untold_orders(recurrent):
        recurrent = _forced_by_shapes(recurrent, size_of, dense_sizes, origin)
        order_note = (" (the names do not say the order of the recurrent layers; their shapes "
                      "chain in this order only)")
    sizes = [size_of[id(group)] for group in recurrent]
    # Layers matched by their order alone need no names; a forced order is kept by naming
    # each layer after its scope, so that --weights matches by name.
    names = _scope_names([*recurrent, *dense], origin) if order_note else {}
    if saved is not None:
        names = {id(group): group.scope for group in (*recurrent, *dense)}
        for group in (*recurrent, *dense):
            if not NAME_PATTERN.match(group.scope):
                raise ConfigError(f"{origin}: layer '{group.scope}': a name a YAML layer "
                                  "cannot have; expected letters, digits, '_', '.' or '-' "
                                  "starting with a letter (rename it in Keras)",
                                  where=group.scope)

    inferences: list[Inference] = []
    first = recurrent[0]
    input_size = sizes[0][0]
    inferences.append(Inference(
        key="input_size", value=input_size, variables=_names(first), known=True,
        reason=f"{_rows_source(first, sizes[0])}: {input_size} input features"))
    layers: list[dict[str, Any]] = []
    layout = first.layout or "block"
    previous_units, previous_scope = input_size, None
    for index, (group, (features, units)) in enumerate(zip(recurrent, sizes, strict=True)):
        if previous_scope is not None and features != previous_units:
            problems.append(f"{group.shown} sees {features} input features, but the layer "
                            f"before it ({previous_scope}) has {previous_units} units: they "
                            "do not chain")
        layer: dict[str, Any] = {group.kind: units}
        if id(group) in names:
            layer["name"] = names[id(group)]
        if group.layout != layout:
            layer["layout"] = group.layout
        if group.kind == "gru" and group.layout == "keras":
            layer["reset_after"] = bool(group.reset_after)
        if saved is not None and group is recurrent[-1] and not saved.facts.get(
                "sequence_output", (True,))[0]:
            layer["return_sequences"] = False
        layers.append(layer)
        name = f"layers[{index}]"
        extra = (f", reset_after {str(group.reset_after).lower()} (bias "
                 f"{_shape(group.members['bias'].shape)})" if "reset_after" in layer else "")
        inferences.append(Inference(
            key=name, value=layer, variables=_names(group), known=True,
            reason=f"{_shapes_text(group)} under {group.shown}: "
                   f"{_KIND_TITLES[group.kind]} with {units} units on {features} inputs "
                   f"({_CELL_NAMES[(group.kind, group.layout or 'block')]}{extra})"
                   + order_note))
        previous_units, previous_scope = units, group.shown
    for offset, (group, (features, units)) in enumerate(zip(dense, dense_sizes, strict=True)):
        if features != previous_units:
            problems.append(f"{group.members['kernel'].name} is "
                            f"{_shape(group.members['kernel'].shape)}: {features} inputs, but "
                            f"the layer before it ({previous_scope}) has {previous_units} "
                            "units: they do not chain")
        dense_layer: dict[str, Any] = {"dense": units}
        if id(group) in names:
            dense_layer["name"] = names[id(group)]
        layers.append(dense_layer)
        inferences.append(Inference(
            key=f"layers[{len(recurrent) + offset}]", value=dense_layer,
            variables=_names(group), known=True,
            reason=f"{_shapes_text(group)} under {group.shown}: a dense layer from "
                   f"{features} to {units} outputs"))
        previous_units, previous_scope = units, group.shown
    if problems:
        raise WeightsError(origin, problems)
    dtype = "float64" if all(v.dtype == "float64" for v in weight_file.variables) else "float32"
    loss = "softmax_cross_entropy" if previous_units > 1 else "mse"
    defaults = [
        Inference(key="layout", value=layout, variables=[], known=True,
                  # Found tried as a new user would: gradscope's own names (gru_1/w_ru)
                  # were said to be TF1's.
                  reason="the first recurrent layer's weights are "
                         + ("in blocks (gates and candidate apart)" if layout == "block"
                            else "Keras weights (kernel, recurrent_kernel)")),
        Inference(key="time_steps", value=DEFAULT_TIME_STEPS, variables=[], known=False,
                  reason="no weight depends on it: a default; --data sets it from x"),
        Inference(key="batch_size", value=DEFAULT_BATCH_SIZE, variables=[], known=False,
                  reason="no weight depends on it: a default; --data sets it from x"),
        Inference(key="loss", value=loss, variables=[], known=False,
                  reason="a weight file does not hold the loss: a default "
                         f"({'several outputs: classes' if loss != 'mse' else 'one output'}); "
                         "set softmax_cross_entropy or mse as you train"),
        Inference(key="dtype", value=dtype, variables=[], known=True,
                  reason=f"the file's weights are {dtype}"),
    ]
    if saved is not None:
        defaults = [_said_by(item, saved) for item in defaults]
    inferences[1:1] = defaults
    said = {item.key: item.value for item in defaults}
    config = {"input_size": input_size, "time_steps": said["time_steps"],
              "batch_size": said["batch_size"], "layout": layout, "layers": layers,
              "loss": said["loss"], "seed": 0, "dtype": said["dtype"]}
    text = render_yaml(config, inferences, shown, file_format)
    # What is printed must load, and the file's weights must map onto it.
    spec = spec_from_yaml(text, origin=f"the spec inferred from {origin}")
    try:
        loaded = load_weights(spec, source)
    except NonFiniteWeights:
        raise  # the file's numbers: as explain --weights says it
    except ConfigError as exc:
        raise ConfigError(f"internal error: the inferred spec does not take {origin}'s "
                          f"weights: {exc.message}", where="spec") from None
    if saved is not None:
        _same_function(spec, loaded.params, saved)
    return SpecInference(
        source=shown, format=file_format, yaml=text, config=config,
        inferences=inferences,
        ignored=[IgnoredVariable(variable=k, reason=r) for k, r in weight_file.ignored])


def _said_by(item: Inference, saved: SavedModel) -> Inference:
    """``item``, as the saved model says it where it does (a loss it holds in another form
    keeps the default, with the reason)."""
    if item.key not in saved.facts:
        return item
    value, reason, known = saved.facts[item.key]
    return Inference(key=item.key, value=item.value if value is None else value, variables=[],
                     known=known, reason=reason)


#: How far the spec's float64 forward pass may be from the model's, relative to the largest
#: prediction, by the model's dtype: a float32 model rounds each step, and no more.
SAME_FUNCTION_RTOL = {"float32": 1e-4, "float64": 1e-9}


def _same_function(spec: Spec, params: dict[str, np.ndarray], saved: SavedModel) -> None:
    """The spec's own NumPy forward pass, with the model's weights, must predict what Keras
    predicted on the same random batch: else gradscope read the model wrong, and refuses."""
    shapes = model_shapes(spec)
    ours = predictions(shapes, params, np.asarray(saved.probe_x, dtype=np.float64))
    theirs = np.asarray(saved.probe_predictions, dtype=np.float64)
    scale = max(1.0, float(np.max(np.abs(theirs)))) if theirs.size else 1.0
    if ours.shape == theirs.shape:
        error = np.abs(ours - theirs)
        worst = np.unravel_index(int(np.argmax(error)), error.shape)
        if float(error[worst]) <= SAME_FUNCTION_RTOL[spec.dtype] * scale:
            return
        found = (f"prediction {list(map(int, worst))} is {theirs[worst]:.6g} by Keras and "
                 f"{ours[worst]:.6g} by the spec")
    else:
        found = (f"Keras predicts {tuple(theirs.shape)} and the spec "
                 f"{tuple(ours.shape)}")
    raise ConfigError(f"{saved.source}: the spec read from its layers does not compute what "
                      f"the model computes on a random batch ({found}); refusing to print "
                      "the spec of another model", where=saved.source)


def _scope_names(groups: list[Group], origin: str) -> dict[int, str]:
    """For each group, the first part of its scope that no other group's scope has."""
    names: dict[int, str] = {}
    for group in groups:
        others = {part for other in groups if other is not group
                  for part in other.scope.split("/")}
        unique = [part for part in group.scope.split("/") if part not in others
                  and NAME_PATTERN.match(part)]
        if not unique:
            raise WeightsError(origin, [f"{group.shown}: no part of the scope tells this layer "
                                        "apart from the others, so the layer cannot be named "
                                        "after it; refusing to pick an order"])
        names[id(group)] = unique[0]
    return names


def _forced_by_shapes(recurrent: list[Group], size_of: dict[int, tuple[int, int]],
                      dense_sizes: list[tuple[int, int]], origin: str) -> list[Group]:
    """The one order of the recurrent layers in which each one's input is the units of the
    one before (and the first dense layer's input the last one's units); refused when no
    order or several orders chain."""
    from itertools import permutations

    if len(recurrent) > 6:
        raise WeightsError(origin, [f"the names of {len(recurrent)} recurrent scopes do not say "
                                    "their order; refusing to pick one"])
    chaining = []
    for candidate in permutations(recurrent):
        sizes = [size_of[id(group)] for group in candidate]
        fits = all(after[0] == before[1] for before, after in zip(sizes, sizes[1:],
                                                                   strict=False))
        if dense_sizes:
            fits = fits and dense_sizes[0][0] == sizes[-1][1]
        if fits:
            chaining.append(list(candidate))
    if len(chaining) != 1:
        scopes = ", ".join(group.shown for group in recurrent)
        found = "no order" if not chaining else f"{len(chaining)} orders"
        raise WeightsError(origin, [f"the names of the recurrent scopes ({scopes}) do not say "
                                    f"their order, and {found} of their shapes chain; refusing "
                                    "to pick one"])
    return chaining[0]


def _recurrent_sizes(group: Group, problems: list[str]) -> tuple[int, int]:
    """(input features F, units u) of a recurrent layer, every shape cross-checked."""
    members = group.members
    if group.layout == "block":
        if group.kind == "gru":
            wanted = {"w_ru": 2, "b_ru": 1, "w_c": 2, "b_c": 1}
            units_from, ratio = "w_c", 1
        else:
            wanted = {"kernel": 2, "bias": 1}
            units_from, ratio = "kernel", 4 if group.kind == "lstm" else 1
    else:
        wanted = {"kernel": 2, "recurrent_kernel": 2, "bias": 1}
        units_from, ratio = "recurrent_kernel", 0
    missing = [role for role in wanted if role not in members]
    if missing:
        problems.append(f"{group.shown}: {_KIND_TITLES[group.kind]} "
                        f"({_CELL_NAMES[(group.kind, group.layout or 'block')]}) without "
                        f"{', '.join(missing)} (found {group.names()})")
        return 0, 0
    for role, ndim in wanted.items():
        shape = members[role].shape
        if len(shape) != ndim and not (group.kind == "gru" and group.layout == "keras"
                                       and role == "bias" and len(shape) == 2):
            problems.append(f"{members[role].name} is {_shape(shape)}; expected "
                            f"{'a matrix' if ndim == 2 else 'a vector'}")
            return 0, 0
    source = members[units_from].shape
    if ratio == 0:
        units = source[0]
    elif source[1] % ratio:
        problems.append(f"{members[units_from].name} is {_shape(source)}: {source[1]} columns "
                        f"are not {ratio}·units for any whole number of units")
        return 0, 0
    else:
        units = source[1] // ratio
    rows = members["kernel"].shape[0] if "kernel" in members else members["w_c"].shape[0]
    features = rows if group.layout == "keras" else rows - units
    if features <= 0:
        problems.append(f"{members[units_from].name} is {_shape(source)}: {units} units leave "
                        f"no input features in {rows} rows")
        return 0, 0
    from gradscope.cells import CELLS

    options = {"reset_after": bool(group.reset_after)} if (
        group.kind == "gru" and group.layout == "keras") else {}
    cell = CELLS[f"{group.kind}_{group.layout}"](name=group.shown, units=units,
                                                 input_size=features, input_label="input",
                                                 options=options)
    for info in cell.weights():
        variable = members.get(info.short)
        if variable is not None and variable.shape != info.shape:
            problems.append(f"{variable.name} is {_shape(variable.shape)} but {info.formula} "
                            f"gives {_shape(info.shape)} (from {units} units read off "
                            f"{members[units_from].name} {_shape(source)})")
    extra = set(members) - {info.short for info in cell.weights()}
    for role in sorted(extra):
        problems.append(f"{members[role].name} {_shape(members[role].shape)}: extra: "
                        f"{_KIND_TITLES[group.kind]} in this layout has no {role}")
    return features, units


def _dense_sizes(group: Group, problems: list[str]) -> tuple[int, int]:
    kernel, bias = group.members.get("kernel"), group.members.get("bias")
    if kernel is None or bias is None or len(kernel.shape) != 2:
        problems.append(f"{group.shown}: expected a dense layer's 2-D kernel and its bias, "
                        f"found {group.names()}")
        return 0, 0
    if bias.shape != (kernel.shape[1],):
        problems.append(f"{bias.name} is {_shape(bias.shape)} but the kernel "
                        f"{kernel.name} {_shape(kernel.shape)} gives ({kernel.shape[1]},)")
    return kernel.shape[0], kernel.shape[1]


def _names(group: Group) -> list[str]:
    return [variable.name for variable in group.ordered()]


def _shapes_text(group: Group) -> str:
    shapes = [_shape(v.shape) for v in group.ordered() if len(v.shape) == 2]
    if len(shapes) == 1:
        return shapes[0]
    return ", ".join(shapes[:-1]) + f" and {shapes[-1]}"


def _rows_source(group: Group, sizes: tuple[int, int]) -> str:
    features, units = sizes
    if group.layout == "keras":
        kernel = group.members["kernel"]
        return f"{kernel.name} is {_shape(kernel.shape)}: {features} rows"
    variable = group.members.get("w_c") or group.members["kernel"]
    return (f"{variable.name} is {_shape(variable.shape)}: {variable.shape[0]} rows "
            f"[x_t, h_{{t−1}}] − {units} units")


def _listing(groups: list[Group]) -> str:
    return "; ".join(group.names() for group in groups) or "no variables"


def render_yaml(config: dict[str, Any], inferences: list[Inference], origin: str,
                file_format: str) -> str:
    """The config as YAML, each value with its reason as a comment."""
    reasons = {item.key: item for item in inferences}

    def line(key: str, value: Any) -> list[str]:
        text = f"{key}: {_scalar(value)}"
        item = reasons.get(key)
        return [text] if item is None else _commented(text, item.reason)

    lines = [*_commented("", f"Inferred by `gradscope spec` from {origin} ({file_format}). "
                             "Values the file cannot hold are defaults, said so below; "
                             "--data sets the batch and time sizes.")]
    for key in ("input_size", "time_steps", "batch_size", "layout"):
        lines += line(key, config[key])
    lines.append("layers:")
    for index, layer in enumerate(config["layers"]):
        flow = yaml.safe_dump(layer, default_flow_style=True, sort_keys=False).strip()
        if len(layer) == 1:
            flow = flow.strip("{}")
        item = reasons.get(f"layers[{index}]")
        lines += ([f"  - {flow}"] if item is None else _commented(f"  - {flow}", item.reason))
    for key in ("loss", "seed", "dtype"):
        if key == "seed":
            lines += _commented("seed: 0", "draws the synthetic batch (the weights come from "
                                           "--weights)")
            continue
        lines += line(key, config[key])
    return "\n".join(lines) + "\n"


#: The column a value's comment starts at, and the width its lines keep within.
COMMENT_COLUMN, YAML_WIDTH = 31, 80


def _commented(text: str, reason: str) -> list[str]:
    """``text`` with ``reason`` as its comment from :data:`COMMENT_COLUMN`, wrapped onto
    comment lines of their own within :data:`YAML_WIDTH` columns (a name longer than that
    stays whole). Found tried as a new user would: lines of 91–155 columns on stdout."""
    import textwrap

    column = COMMENT_COLUMN if text else 0
    parts = textwrap.wrap(reason, YAML_WIDTH - column - 2, break_long_words=False,
                          break_on_hyphens=False) or [""]
    first = f"{text:<{column - 1}} # {parts[0]}" if text else f"# {parts[0]}"
    if text and len(text) >= column - 1:  # a long value: its comment on the next line
        return [text, *(f"{'':<{column}}# {part}" for part in parts)]
    return [first, *(f"{'':<{column}}# {part}" if text else f"# {part}" for part in parts[1:])]


def _scalar(value: Any) -> str:
    return str(yaml.safe_dump(value, default_flow_style=True)).strip().removesuffix("...").strip()


__all__ = ["SavedModel", "infer_spec", "render_yaml"]
