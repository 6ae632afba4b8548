"""A user's trained weights (``--weights PATH``: an ``.npz`` archive or a TensorFlow
checkpoint) read, named and laid out for a spec's layers, so that explain and check run at the
weights the user trained, under their own names.

A name becomes a weight without guessing: its last part gives its role, the roles and shapes
of a scope give the layer's kind and layout, and scopes meet the spec's layers in the order of
their names, number by number. A name with no known role, an order the names do not fix, and
every missing, extra or misshapen variable are refused (exit 2); another layout is rearranged
exactly; optimizer state is listed as ignored. The rules in full: docs/weights.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradscope.arrays import read_npz
from gradscope.cells import CELLS
from gradscope.cells.base import TensorInfo
from gradscope.errors import ConfigError, first_line, one_line
from gradscope.report.models import IgnoredVariable, WeightMapEntry, WeightsEntry
from gradscope.yaml.algebra import ModelShapes, model_shapes
from gradscope.yaml.config import Spec

FORMATS = {
    "keras": "saved Keras model",
    "npz": ".npz archive",
    "arrays": "arrays",
    "tf1_checkpoint": "TF1 name-based checkpoint",
    "tf2_checkpoint": "TF2 object-based checkpoint",
}

#: TF1's LSTMCell adds this to the forget gate inside the cell; Keras keeps it in the bias.
FORGET_BIAS = 1.0


class WeightsError(ConfigError):
    """One line per variable that is missing, extra, misshapen or not understood. Exit 2."""

    def __init__(self, origin: str, lines: list[str]) -> None:
        lines = [one_line(line) for line in lines]
        if len(lines) == 1:
            text = f"{origin}: {lines[0]}"
        else:
            text = "\n".join([f"{origin}: {len(lines)} problems, one per line:",
                              *(f"  {line}" for line in lines)])
        super().__init__(lines[0], where="--weights")
        self.message = text
        self.lines = lines

    def __str__(self) -> str:
        return self.message


# -- reading ----------------------------------------------------------------------------------


class NonFiniteWeights(WeightsError):
    """Every variable fits the spec, but some value is not finite: the file's numbers, not
    its names or shapes. Exit 2."""


@dataclass(frozen=True)
class StoredVariable:
    """One variable of the file: its name without ``:0`` or TF2's attribute suffix."""

    name: str
    key: str  # the key in the file
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass
class WeightFile:
    origin: str
    format: str
    variables: list[StoredVariable]
    ignored: list[tuple[str, str]]
    read: Callable[[str], np.ndarray]
    #: Lines for variables that are read but cannot be weights (a non-float dtype); reported
    #: with every other problem by :func:`group_variables` and :func:`load_weights`.
    problems: list[str] = field(default_factory=list)


def locate(path: str | os.PathLike[str], option: str = "--weights") -> tuple[str, str]:
    """``(kind, path)``: ``("npz", file)``, ``("checkpoint", prefix)`` or ``("keras",
    file)`` (whose weights :func:`gradscope.infer_spec`'s reader gives); pure Python.

    A checkpoint may be given by its prefix (``model.ckpt``), its ``.index`` or ``.data-…``
    file, or its folder (the ``checkpoint`` file there names the latest prefix).
    """
    text = str(path)
    shown = f"{option} {text}" if option else text
    if text.endswith(".npz"):
        if not Path(text).is_file():
            raise ConfigError(f"{shown}: file not found", where="--weights")
        return "npz", text
    if Path(text).is_dir():
        latest = _latest_in_folder(Path(text))
        if latest is None:
            raise ConfigError(f"{shown}: a folder without a 'checkpoint' file; "
                              "expected an .npz file or a checkpoint prefix such as "
                              "model.ckpt (with model.ckpt.index beside it)", where="--weights")
        text = latest
    text = re.sub(r"\.index$", "", text)
    text = re.sub(r"\.data-\d+-of-\d+$", "", text)
    if Path(text + ".index").is_file():
        return "checkpoint", text
    if Path(text).is_file() and text.endswith(".keras"):
        return "keras", text
    if Path(text).is_file():
        raise ConfigError(f"{shown}: neither an .npz file nor a TensorFlow "
                          f"checkpoint (no {Path(text).name}.index beside it); expected "
                          "FILE.npz or a checkpoint prefix", where="--weights")
    raise ConfigError(f"{shown}: file not found (nor {Path(text).name}.index); expected "
                      "FILE.npz or a checkpoint prefix such as model.ckpt", where="--weights")


def _latest_in_folder(folder: Path) -> str | None:
    index = folder / "checkpoint"
    if not index.is_file():
        return None
    match = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', index.read_text("utf-8", "replace"),
                      re.MULTILINE)
    if match is None:
        return None
    name = match.group(1)
    return name if os.path.isabs(name) else str(folder / name)


class SavedArrays(dict[str, np.ndarray]):
    """A saved Keras model's weights, ``<layer>/<weight>`` in the order data flows through the
    layers (:func:`gradscope.keras.yaml_form.read_saved_form`), with the file they came from."""

    def __init__(self, arrays: Mapping[str, np.ndarray], origin: str) -> None:
        super().__init__(arrays)
        self.origin = origin


def open_weights(source: str | os.PathLike[str] | Mapping[str, Any],
                 option: str = "--weights") -> WeightFile:
    """Read the names and shapes of ``source`` (values on demand): an .npz, a checkpoint, a
    saved Keras model's :class:`SavedArrays`, or a dict of arrays. ``option`` starts every
    error message (``--weights FILE: …``)."""
    if isinstance(source, SavedArrays):
        return _from_arrays(f"{option} {source.origin}".strip(), "keras", dict(source))
    if isinstance(source, Mapping):
        arrays = {str(k): np.asarray(v) for k, v in source.items()}
        return _from_arrays(f"{option} (arrays)" if option else "the arrays", "arrays", arrays)
    shown = f"{option} {source}" if option else str(source)
    kind, path = locate(source, option)
    if kind == "keras":  # read by Keras, through gradscope.infer_spec / explain / check
        raise ConfigError(f"{shown}: a saved Keras model; its weights are read by "
                          "gradscope.infer_spec, explain or check, not here", where="--weights")
    if kind == "npz":
        arrays = read_npz(path, shown, "an .npz archive of named weights", ConfigError,
                          "--weights")
        return _from_arrays(shown, "npz", arrays)
    return _from_checkpoint(shown, path)


def _from_arrays(origin: str, kind: str, arrays: dict[str, np.ndarray]) -> WeightFile:
    variables, ignored, problems = [], [], []
    for key, value in arrays.items():
        name = re.sub(r":\d+$", "", key)
        reason = _bookkeeping(name, value.shape)
        if reason:
            ignored.append((key, reason))
            continue
        if value.dtype.kind != "f":
            problems.append(f"{key} has dtype {value.dtype}; expected float weights")
            if role_of(name) is None:  # one line for it is enough
                continue
        variables.append(StoredVariable(name, key, tuple(int(n) for n in value.shape),
                                        str(value.dtype)))
    return WeightFile(origin, kind, variables, ignored, read=lambda key: arrays[key],
                      problems=problems)


def _from_checkpoint(origin: str, prefix: str) -> WeightFile:
    from gradscope._tf import import_tensorflow, native_stderr_silenced

    tf = import_tensorflow()
    try:
        with native_stderr_silenced():
            reader = tf.train.load_checkpoint(prefix)
            shapes = reader.get_variable_to_shape_map()
            dtypes = reader.get_variable_to_dtype_map()
    except Exception as exc:  # TF raises a zoo of error types for damaged files
        first = first_line(exc)
        raise ConfigError(f"{origin}: not a readable TensorFlow checkpoint: {first}",
                          where="--weights") from None
    object_based = "_CHECKPOINTABLE_OBJECT_GRAPH" in shapes
    variables, ignored, problems = [], [], []
    for key in sorted(shapes):
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH":
            continue
        name = key.removesuffix("/.ATTRIBUTES/VARIABLE_VALUE")
        shape = tuple(int(n) for n in shapes[key])
        reason = _bookkeeping(name, shape)
        if reason:
            ignored.append((key, reason))
            continue
        if not dtypes[key].is_floating:
            problems.append(f"{name} has dtype {dtypes[key].name}; expected float weights")
            if role_of(name) is None:  # one line for it is enough
                continue
        variables.append(StoredVariable(name, key, shape, dtypes[key].name))

    def read(key: str) -> np.ndarray:
        with native_stderr_silenced():
            return np.asarray(reader.get_tensor(key))

    return WeightFile(origin, "tf2_checkpoint" if object_based else "tf1_checkpoint",
                      variables, ignored, read, problems)


#: Names of optimizer and bookkeeping state in TF1 and TF2 checkpoints.
_BOOKKEEPING = re.compile(
    r"(^|/)(global_step|beta1_power|beta2_power|save_counter|learning_rate|iterations?)$"
    r"|/\.OPTIMIZER_SLOT/|^optimizer/|^Optimizer/|/(Adam|Adam_1|Momentum|RMSProp|RMSProp_1|"
    r"Adagrad|Adadelta|Adadelta_1|Ftrl|Ftrl_1|ExponentialMovingAverage)$")


def _bookkeeping(name: str, shape: tuple[int, ...]) -> str:
    """Why a variable is not a model weight ("" when it may be one)."""
    if "/.OPTIMIZER_SLOT/" in name or re.search(
            r"/(Adam|Adam_1|Momentum|RMSProp|RMSProp_1|Adagrad|Adadelta|Adadelta_1|Ftrl|Ftrl_1)$",
            name):
        return "optimizer slot"
    if _BOOKKEEPING.search(name):
        return "optimizer or training state"
    if shape == ():
        return "a scalar (no weight of a recurrent or dense layer is one)"
    return ""


# -- naming: variable → (scope, role) ---------------------------------------------------------

_GRU_BLOCK_PAIRS = {("gates", "kernel"): "w_ru", ("gates", "bias"): "b_ru",
                    ("candidate", "kernel"): "w_c", ("candidate", "bias"): "b_c"}
_KERNEL = re.compile(r"^(kernel|w|weights?|.*_(w|weights?|kernel))$", re.IGNORECASE)
_BIAS = re.compile(r"^(bias|biases|b|.*_(b|bias|biases))$", re.IGNORECASE)

#: Words of a scope name part that say which layer the variables below it belong to, for the
#: roles that do not say it themselves (a lone kernel + bias). Matched nearest part first.
_SCOPE_WORDS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"lstm", re.IGNORECASE), "lstm"),
    (re.compile(r"^(basic_rnn_cell|simple_rnn(_cell)?(_\d+)?|rnn_cell)$", re.IGNORECASE),
     "simple_rnn"),
    (re.compile(r"gru", re.IGNORECASE), "gru"),
    (re.compile(r"dense|^fc|_fc|output|logits|linear|projection|classifier|softmax",
                re.IGNORECASE), "dense"),
)


def role_of(name: str) -> tuple[str, str] | None:
    """``(scope, role)`` of a variable name, or None when its last part names no weight."""
    parts = name.split("/")
    if len(parts) >= 2 and (parts[-2], parts[-1]) in _GRU_BLOCK_PAIRS:
        return "/".join(parts[:-2]), _GRU_BLOCK_PAIRS[(parts[-2], parts[-1])]
    leaf = parts[-1].lstrip("_")
    scope = "/".join(parts[:-1])
    if leaf in ("w_ru", "b_ru", "w_c", "b_c", "recurrent_kernel"):
        return scope, leaf
    if _KERNEL.match(leaf):
        return scope, "kernel"
    if _BIAS.match(leaf):
        return scope, "bias"
    return None


def scope_word(scope: str) -> str | None:
    """The layer kind the nearest telling part of ``scope`` names, if any."""
    for part in reversed(scope.split("/")):
        for pattern, kind in _SCOPE_WORDS:
            if pattern.search(part):
                return kind
    return None


def natural_key(scope: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key comparing numbers as numbers: cell_2 < cell_10, gru < gru_1."""
    key: list[tuple[int, int, str]] = []
    for part in re.split(r"(\d+)", scope.lower()):
        if part.isdigit():
            key.append((0, int(part), ""))
        elif part:
            key.append((1, 0, part))
    return tuple(key)


def _order_is_told(first: str, second: str) -> bool:
    """Do the names alone say that ``first`` comes before ``second``? Yes when they first
    differ in a number (cell_0/cell_1, Layer1/Layer2), or when ``second`` is ``first`` with
    a numbered suffix (Keras' gru, gru_1)."""
    a, b = natural_key(first), natural_key(second)
    for x, y in zip(a, b, strict=False):
        if x != y:
            if x[0] == 0 and y[0] == 0:
                return True
            # "gru" then "gru_1": text that only grows by "_" before a number.
            return x[0] == 1 and y[0] == 1 and y[2] == x[2] + "_" and len(b) == len(a) + 1
    return len(a) < len(b) and b[len(a)][0] == 0


_ROLE_ORDER = ["w_ru", "b_ru", "w_c", "b_c", "kernel", "recurrent_kernel", "bias"]


@dataclass
class Group:
    """The variables under one scope: one layer of the file."""

    scope: str
    members: dict[str, StoredVariable] = field(default_factory=dict)
    kind: str = ""  # gru, lstm, simple_rnn, dense
    layout: str | None = None  # block or keras; None for dense
    reset_after: bool | None = None

    @property
    def shown(self) -> str:
        return self.scope or "(top level)"

    def ordered(self) -> list[StoredVariable]:
        """The members in a fixed role order (kernels before biases)."""
        return [self.members[role] for role in sorted(self.members, key=_ROLE_ORDER.index)]

    def names(self) -> str:
        return ", ".join(f"{v.name} {_shape(v.shape)}" for v in self.ordered())


def group_variables(weight_file: WeightFile) -> list[Group]:
    """Variables grouped by scope and classified; unknown names and clashes are refused."""
    groups, _, problems = _grouped(weight_file)
    if problems:
        raise WeightsError(weight_file.origin, problems)
    return groups


def _grouped(weight_file: WeightFile) -> tuple[list[Group], list[str], list[str]]:
    """``(groups, refused, problems)``: the scopes that were classified, the shown names of
    those that could not be, and one line per problem (the file's own ones first)."""
    problems: list[str] = list(weight_file.problems)
    groups: dict[str, Group] = {}
    for variable in weight_file.variables:
        found = role_of(variable.name)
        if found is None:
            problems.append(f"{variable.name} {_shape(variable.shape)}: not a weight name "
                            "gradscope knows (expected a GRUCell's gates/kernel, …, a kernel, "
                            "recurrent_kernel or bias, or a gradscope name such as gru_1/w_ru)")
            continue
        scope, role = found
        group = groups.setdefault(scope, Group(scope))
        if role in group.members:
            other = group.members[role]
            problems.append(f"{variable.name} and {other.name} are both the {role} of "
                            f"{group.shown}: ambiguous, expected one")
            continue
        group.members[role] = variable
    classified, refused = [], []
    for group in groups.values():
        problem = _classify(group)
        if problem:
            problems.append(problem)
            refused.append(group.shown)
        else:
            classified.append(group)
    return classified, refused, problems


def _classify(group: Group) -> str:
    roles = set(group.members)
    word = scope_word(group.scope)
    if roles & {"w_ru", "b_ru", "w_c", "b_c"}:
        if not roles <= {"w_ru", "b_ru", "w_c", "b_c"}:
            return (f"{group.shown} mixes GRUCell weights with others ({group.names()}); "
                    "expected the four of a GRUCell (gates/kernel, gates/bias, "
                    "candidate/kernel, candidate/bias) alone")
        group.kind, group.layout = "gru", "block"
        return ""
    if "recurrent_kernel" in roles:
        recurrent = group.members["recurrent_kernel"].shape
        if len(recurrent) != 2 or recurrent[0] == 0 or recurrent[1] % recurrent[0]:
            return (f"{group.members['recurrent_kernel'].name} is {_shape(recurrent)}; a Keras "
                    "recurrent_kernel is (units, k·units) with k = 1, 3 or 4")
        kinds = {1: "simple_rnn", 3: "gru", 4: "lstm"}
        ratio = recurrent[1] // recurrent[0]
        if ratio not in kinds:
            return (f"{group.members['recurrent_kernel'].name} is {_shape(recurrent)}: "
                    f"{ratio}·units columns, but a Keras SimpleRNN, GRU or LSTM has 1, 3 or 4")
        group.kind, group.layout = kinds[ratio], "keras"
        if word in ("gru", "lstm", "simple_rnn") and word != group.kind:
            return (f"{group.shown}: the name says {word} but recurrent_kernel "
                    f"{_shape(recurrent)} has {ratio}·units columns, a {group.kind}; "
                    "ambiguous, refused")
        if group.kind == "gru" and "bias" in group.members:
            group.reset_after = len(group.members["bias"].shape) == 2
        return ""
    if word in ("lstm", "simple_rnn"):
        group.kind, group.layout = word, "block"
    elif word == "gru":
        return (f"{group.shown}: a GRU scope with {group.names()}; expected a GRUCell's "
                "gates/kernel, gates/bias, candidate/kernel, candidate/bias, or a Keras "
                "kernel, recurrent_kernel and bias")
    else:
        group.kind = "dense"
    return ""


def order(groups: list[Group]) -> tuple[list[Group], list[Group]]:
    """Recurrent groups, then dense groups, each in the order their names tell."""
    recurrent = sorted((g for g in groups if g.kind != "dense"), key=lambda g: natural_key(g.scope))
    dense = sorted((g for g in groups if g.kind == "dense"), key=lambda g: natural_key(g.scope))
    return recurrent, dense


def untold_orders(groups: list[Group]) -> list[str]:
    """Consecutive scopes whose names do not say which comes first."""
    return [f"{a.shown} and {b.shown}" for a, b in zip(groups, groups[1:], strict=False)
            if not _order_is_told(a.scope, b.scope)]


# -- matching to a spec -----------------------------------------------------------------------


@dataclass
class LoadedWeights:
    """The spec's weights by gradscope name (float64 copies) and how each was found."""

    params: dict[str, np.ndarray]
    entry: WeightsEntry


def chosen_weights(spec: Spec, weights: Any, params: dict[str, np.ndarray] | None,
                   say: Callable[[str], None]
                   ) -> tuple[dict[str, np.ndarray] | None, WeightsEntry | None]:
    """The weights a run uses, by gradscope name, and where they came from: ``weights`` (a
    file or dict to map, see :func:`load_weights`) or ``params`` (by gradscope name, taken as
    they are), never both; ``(None, None)`` for the seeded initial weights."""
    if weights is None:
        return params, None
    if params is not None:
        raise ConfigError("give weights= or params=, not both: params are the weights "
                          "by gradscope name, weights a file or dict to be mapped",
                          where="--weights")
    say("reading the weights")
    loaded = load_weights(spec, weights)
    return loaded.params, loaded.entry


def load_weights(spec: Spec, source: str | os.PathLike[str] | Mapping[str, Any]
                 ) -> LoadedWeights:
    """Map ``source`` onto ``spec``'s layers (see the module docstring); raise WeightsError
    (exit 2) with one line per variable that does not fit, every such line at once."""
    weight_file = open_weights(source)
    algebra = model_shapes(spec)
    groups, refused, problems = _grouped(weight_file)
    recurrent, dense = order(groups)
    matched: tuple[list[Group | None], list[Group | None]] | None
    extras: list[str]
    by_name = _by_layer_names(spec, groups)
    if by_name is not None:
        matched_by = "the spec's layer names"
        matched, extras = (list(by_name[0]), list(by_name[1])), []
    else:
        matched_by = "kind and the order of their names"
        matched, extras = _by_kind_and_order(spec, recurrent, dense)
    plans: list[tuple[Any, Group, str]] = []
    if matched is not None:
        expected = _expected_weights(algebra)
        owner = dict(zip([layer.name for layer in spec.recurrent_layers], matched[0],
                         strict=True))
        for cell in algebra.cells:
            spec_layer = next(item for item in spec.layers if item.name == cell.name)
            group = owner[cell.name]
            if group is None:
                problems.append(_missing_layer(cell.name, spec_layer.type, recurrent, refused,
                                               expected))
                continue
            problem = _kind_problem(spec_layer.type, cell, group)
            if problem:
                problems.append(problem)
                continue
            problems += _shape_problems(_file_layout_infos(cell, group), group)
            plans.append((cell, group, "recurrent"))
        dense_infos = _dense_infos(algebra)
        for dense_layer, dense_group in zip(algebra.dense, matched[1], strict=True):
            if dense_group is None:
                problems.append(_missing_layer(dense_layer.name, "dense", dense, refused,
                                               expected))
                continue
            problems += _shape_problems(dense_infos[dense_layer.name], dense_group)
            plans.append((dense_layer, dense_group, "dense"))
    problems += extras

    # The values are read (and checked to be finite) only for variables whose scope fits.
    values: list[dict[str, np.ndarray]] = []
    unreadable = bool(problems)
    for _, group, _ in plans:
        arrays = {}
        for role, variable in group.members.items():
            value = np.asarray(weight_file.read(variable.key), dtype=np.float64)
            bad = np.argwhere(~np.isfinite(value))
            if bad.size:
                index = tuple(int(i) for i in bad[0])
                problems.append(f"{variable.name} has a non-finite value "
                                f"({value[index]}) at index {index}")
            arrays[role] = value
        values.append(arrays)
    if problems:
        raise (WeightsError if unreadable else NonFiniteWeights)(weight_file.origin, problems)

    params: dict[str, np.ndarray] = {}
    mapping: list[WeightMapEntry] = []
    for (target, group, what), arrays in zip(plans, values, strict=True):
        if what == "dense":
            converted = {"kernel": (arrays["kernel"], ""), "bias": (arrays["bias"], "")}
        else:
            converted = convert(target, group, arrays)
        for short, (value, how) in converted.items():
            name = f"{target.name}/{short}"
            params[name] = value
            sources = _sources(target, group, short)
            mapping.append(WeightMapEntry(
                name=name, variables=[group.members[s].name for s in sources],
                shape=list(value.shape), conversion=how))
    order_of = {info.name: index for index, info in enumerate(algebra.weights)}
    mapping.sort(key=lambda item: order_of[item.name])
    entry = WeightsEntry(
        source=(source.origin if isinstance(source, SavedArrays) else
                "arrays" if isinstance(source, Mapping) else str(source)),
        format=FORMATS[weight_file.format], matched_by=matched_by,
        mapping=mapping,
        ignored=[IgnoredVariable(variable=k, reason=r) for k, r in weight_file.ignored],
    )
    _check_against_algebra(algebra, params)
    return LoadedWeights(params=params, entry=entry)


def _expected_weights(algebra: ModelShapes) -> dict[str, str]:
    """``{layer: "gru_2/w_ru (96, 64), …"}``: what a layer missing from the file would hold."""
    out: dict[str, list[str]] = {}
    for info in algebra.weights:
        out.setdefault(info.layer, []).append(f"{info.name} {_shape(info.shape)}")
    return {layer: ", ".join(names) for layer, names in out.items()}


def _missing_layer(name: str, kind: str, found: list[Group], refused: list[str],
                   expected: dict[str, str]) -> str:
    """The line for a spec layer no scope of the file was matched to."""
    listing = ", ".join(g.shown if kind == "dense" else f"{g.shown} ({_KIND_WORDS[g.kind]})"
                        for g in found) or "none"
    if kind == "dense":
        text = (f"{name}: missing: no dense layer's weights left for it in the file (it has "
                f"{len(found)}: {listing}")
    else:
        text = (f"{name}: missing: the spec makes it {_KIND_WORDS[kind]} layer, and no such "
                f"weights are left for it in the file (its recurrent layers: {listing}")
    if refused:
        text += f"; not counted: {', '.join(refused)}, refused above"
    return text + f"); expected {expected.get(name, '?')}"


def _by_layer_names(spec: Spec, groups: list[Group]) -> tuple[list[Group], list[Group]] | None:
    """When every scope holds exactly one of the spec's layer names as a name part, and each
    layer name is held by one scope, that is the matching (e.g. gradscope names)."""
    names = {layer.name for layer in spec.layers}
    owner: dict[str, Group] = {}
    for group in groups:
        held = [part for part in group.scope.split("/") if part in names]
        if len(held) != 1 or held[0] in owner:
            return None
        owner[held[0]] = group
    if set(owner) != names:
        return None
    recurrent = [owner[layer.name or ""] for layer in spec.recurrent_layers]
    dense = [owner[layer.name or ""] for layer in spec.dense_layers]
    if any(g.kind == "dense" for g in recurrent) or any(g.kind != "dense" for g in dense):
        return None
    return recurrent, dense


def _by_kind_and_order(spec: Spec, recurrent: list[Group], dense: list[Group]
                       ) -> tuple[tuple[list[Group | None], list[Group | None]] | None,
                                  list[str]]:
    """The spec's layers of each kind take the file's scopes of that kind in name order.

    Returns ``((recurrent, dense), extras)``: the group of each of the spec's recurrent and
    dense layers in their order (None where the file has none left for it) and one line per
    scope left over; ``(None, problems)`` when the names do not say an order.

    The kinds make the order across kinds (a Keras path ``gru`` before ``lstm`` says nothing):
    only scopes of the same kind need names that say which comes first.
    """
    problems: list[str] = []
    kinds = {layer.type for layer in spec.recurrent_layers} | {g.kind for g in recurrent}
    queues = {kind: [g for g in recurrent if g.kind == kind] for kind in kinds}
    for kind, queue in queues.items():
        if sum(layer.type == kind for layer in spec.recurrent_layers) > 1 or len(queue) > 1:
            problems += [f"the names {pair} do not say which {kind} layer comes first, and the "
                         "spec's layer names do not appear in them; name the spec's layers "
                         "after the scopes, or save the weights under gradscope names "
                         "(gru_1/w_ru, …)" for pair in untold_orders(queue)]
    problems += [f"the names {pair} do not say which dense layer comes first; name the spec's "
                 "layers after the scopes" for pair in untold_orders(dense)]
    if problems:
        return None, problems
    ordered: list[Group | None] = [queues[layer.type].pop(0) if queues[layer.type] else None
                                   for layer in spec.recurrent_layers]
    for queue in queues.values():
        for group in queue:
            problems.append(f"{group.names()}: extra: {_KIND_WORDS[group.kind]} layer that "
                            "the spec does not have")
    layers = spec.dense_layers
    for group in dense[len(layers):]:
        problems.append(f"{group.names()}: extra: the spec has {len(layers)} dense "
                        f"layer{'s' if len(layers) != 1 else ''}, the file "
                        f"{len(dense)} ({', '.join(g.shown for g in dense)})")
    dense_ordered: list[Group | None] = [dense[i] if i < len(dense) else None
                                         for i in range(len(layers))]
    return (ordered, dense_ordered), problems


_KIND_WORDS = {"gru": "a GRU", "lstm": "an LSTM", "simple_rnn": "a SimpleRNN", "dense": "dense"}


def _kind_problem(spec_type: str, cell: Any, group: Group) -> str:
    if group.kind != spec_type:
        return (f"{group.shown} ({group.names()}) is {_KIND_WORDS[group.kind]} layer, but the "
                f"spec's {cell.name} is {_KIND_WORDS[spec_type]}")
    if group.kind == "gru" and "block" in (group.layout, cell.layout):
        keras_reset_after = (group.reset_after if group.layout == "keras"
                             else cell.options.get("reset_after", True))
        if group.layout != cell.layout and keras_reset_after:
            return (f"{group.shown} is a {group.layout}-layout GRU but the spec's {cell.name} "
                    f"is a {cell.layout}-layout GRU with reset_after true: a Keras GRU with "
                    "reset_after=True computes r∘(h·U + b), which no block-layout (TF1 GRUCell) "
                    "weights can; use the file's layout (and reset_after) for this layer")
    if (group.kind == "gru" and group.layout == "keras" and cell.layout == "keras"
            and group.reset_after is not None
            and group.reset_after != cell.options.get("reset_after", True)):
        bias = group.members["bias"]
        return (f"{bias.name} is {_shape(bias.shape)}: a Keras GRU with reset_after "
                f"{str(group.reset_after).lower()}, but the spec's {cell.name} has reset_after "
                f"{str(not group.reset_after).lower()}; set reset_after: "
                f"{str(group.reset_after).lower()} on it")
    return ""


def _file_layout_infos(cell: Any, group: Group) -> list[TensorInfo]:
    """The spec layer's weights as the file's layout would hold them."""
    layout = group.layout or cell.layout
    options = dict(cell.options)
    if group.kind == "gru" and layout == "keras":
        options["reset_after"] = (group.reset_after if group.reset_after is not None
                                  else options.get("reset_after", False))
    if layout == cell.layout and options == cell.options:
        return list(cell.weights())
    twin = CELLS[f"{group.kind}_{layout}"](name=cell.name, units=cell.units,
                                            input_size=cell.input_size,
                                            input_label=cell.input_label, options=options)
    return list(twin.weights())


def _dense_infos(algebra: ModelShapes) -> dict[str, list[TensorInfo]]:
    out: dict[str, list[TensorInfo]] = {}
    for info in algebra.weights:
        if info.layer in {layer.name for layer in algebra.dense}:
            out.setdefault(info.layer, []).append(info)
    return out


def _shape_problems(infos: list[TensorInfo], group: Group) -> list[str]:
    problems = []
    wanted = {info.short: info for info in infos}
    for short, info in wanted.items():
        variable = group.members.get(short)
        if variable is None:
            problems.append(f"{_missing_name(group, short)}: missing: {info.layer}/{short} "
                            f"{_shape(info.shape)} = {info.formula} has no variable in "
                            f"{group.shown} (found {group.names()})")
        elif variable.shape != info.shape:
            problems.append(f"{variable.name} is {_shape(variable.shape)} but "
                            f"{_explain_mismatch(variable.shape, info)}")
    for role, variable in group.members.items():
        if role not in wanted:
            problems.append(f"{variable.name} {_shape(variable.shape)}: extra: "
                            f"{infos[0].layer} has no {role} in this layout "
                            f"(expected {', '.join(wanted)})")
    return problems


def _missing_name(group: Group, short: str) -> str:
    """The name the missing variable would have in the file, in the naming of its scope's
    other variables (TF1's ``gates/kernel`` or gradscope's ``w_ru``)."""
    names = {"w_ru": "gates/kernel", "b_ru": "gates/bias", "w_c": "candidate/kernel",
             "b_c": "candidate/bias"}
    tf1 = any(tuple(v.name.split("/")[-2:]) in _GRU_BLOCK_PAIRS for v in group.members.values())
    leaf = names.get(short, short) if tf1 else short
    return f"{group.scope}/{leaf}" if group.scope else leaf


def _explain_mismatch(found: tuple[int, ...], info: TensorInfo) -> str:
    """"(input 200 + units 64) gives 264 rows": the formula of the axis that differs."""
    axes = info.formula.split(" × ")
    if len(found) != len(info.shape) or len(axes) != len(info.shape):
        return f"{info.formula} gives {_shape(info.shape)} ({info.layer}/{info.short})"
    words = ["rows", "columns"] if len(info.shape) == 2 else ["entries"]
    parts = [f"{axis} gives {size} {word}"
             for axis, size, got, word in zip(axes, info.shape, found, words, strict=True)
             if size != got]
    return " and ".join(parts) + f" ({info.layer}/{info.short} {_shape(info.shape)})"


def _sources(target: Any, group: Group, short: str) -> list[str]:
    """The file roles one spec weight is made of."""
    if group.layout in (None, getattr(target, "layout", None)):
        return [short] if short in group.members else list(group.members)
    if group.layout == "keras":  # keras → block: every block weight is cut from all three
        bias = ["bias"]
        return {"w_ru": ["kernel", "recurrent_kernel"], "w_c": ["kernel", "recurrent_kernel"],
                "b_ru": bias, "b_c": bias, "kernel": ["kernel", "recurrent_kernel"],
                "bias": bias}[short]
    if group.kind == "gru":
        return {"kernel": ["w_ru", "w_c"], "recurrent_kernel": ["w_ru", "w_c"],
                "bias": ["b_ru", "b_c"]}[short]
    return {"kernel": ["kernel"], "recurrent_kernel": ["kernel"], "bias": ["bias"]}[short]


# -- layout conversions -----------------------------------------------------------------------


def convert(cell: Any, group: Group, arrays: dict[str, np.ndarray]
            ) -> dict[str, tuple[np.ndarray, str]]:
    """The file's arrays in the spec layer's layout: ``{short: (array, how)}``.

    Exact rearrangements (and, for an LSTM, the forget bias moved between the cell and the
    bias); the pairs that have none were refused by :func:`_kind_problem`.
    """
    if group.layout == cell.layout:
        return {short: (value, "") for short, value in arrays.items()}
    F, u = cell.input_size, cell.units
    if group.kind == "gru" and group.layout == "block":
        return gru_block_to_keras(arrays, F, u)
    if group.kind == "gru":
        return gru_keras_to_block(arrays, F, u)
    if group.kind == "lstm" and group.layout == "block":
        return lstm_block_to_keras(arrays, F, u)
    if group.kind == "lstm":
        return lstm_keras_to_block(arrays, F, u)
    if group.layout == "block":
        kernel = arrays["kernel"]
        how = "rows {} of the TF1 kernel"
        return {"kernel": (kernel[:F], how.format(f"0–{F - 1} (x_t)")),
                "recurrent_kernel": (kernel[F:], how.format(f"{F}–{F + u - 1} (h_{{t−1}})")),
                "bias": (arrays["bias"], "")}
    return {"kernel": (np.concatenate([arrays["kernel"], arrays["recurrent_kernel"]], 0),
                       "Keras kernel over recurrent_kernel (rows [x_t | h_{t−1}])"),
            "bias": (arrays["bias"], "")}


def gru_keras_to_block(arrays: dict[str, np.ndarray], F: int, u: int
                       ) -> dict[str, tuple[np.ndarray, str]]:
    """Keras GRU (reset_after=False) → TF1 GRUCell. Keras columns [z | r | h]; TF1's w_ru has
    columns [r | u] (u is Keras' z) and rows [x_t | h_{t−1}]."""
    kernel, recurrent, bias = arrays["kernel"], arrays["recurrent_kernel"], arrays["bias"]
    z, r, h = slice(0, u), slice(u, 2 * u), slice(2 * u, 3 * u)
    both = np.concatenate([kernel, recurrent], axis=0)  # rows [x_t | h_{t−1}]
    return {
        "w_ru": (np.concatenate([both[:, r], both[:, z]], axis=1),
                 "Keras kernel over recurrent_kernel, columns [r | z] of Keras' [z | r | h]"),
        "b_ru": (np.concatenate([bias[r], bias[z]]), "Keras bias [r | z] of [z | r | h]"),
        "w_c": (both[:, h], "Keras kernel over recurrent_kernel, columns h of [z | r | h]"),
        "b_c": (bias[h].copy(), "Keras bias h of [z | r | h]"),
    }


def gru_block_to_keras(arrays: dict[str, np.ndarray], F: int, u: int
                       ) -> dict[str, tuple[np.ndarray, str]]:
    """TF1 GRUCell → Keras GRU (reset_after=False): the inverse of :func:`gru_keras_to_block`."""
    w_ru, b_ru, w_c, b_c = arrays["w_ru"], arrays["b_ru"], arrays["w_c"], arrays["b_c"]
    r, z = slice(0, u), slice(u, 2 * u)
    columns = np.concatenate([w_ru[:, z], w_ru[:, r], w_c], axis=1)  # [z | r | h]
    return {
        "kernel": (columns[:F], f"rows 0–{F - 1} of TF1 gates/kernel [u | r] and "
                                "candidate/kernel, as Keras columns [z | r | h]"),
        "recurrent_kernel": (columns[F:], f"rows {F}–{F + u - 1} of TF1 gates/kernel [u | r] "
                                          "and candidate/kernel, as Keras [z | r | h]"),
        "bias": (np.concatenate([b_ru[z], b_ru[r], b_c]),
                 "TF1 gates/bias [u | r] and candidate/bias, as Keras [z | r | h]"),
    }


def lstm_keras_to_block(arrays: dict[str, np.ndarray], F: int, u: int
                        ) -> dict[str, tuple[np.ndarray, str]]:
    """Keras LSTM [i | f | c | o] → TF1 LSTMCell [i | j | f | o] (j is Keras' c); TF1 adds
    forget_bias 1.0 to f inside the cell, so the bias's f block is Keras' minus 1.0."""
    i, f, c, o = (slice(k * u, (k + 1) * u) for k in range(4))
    both = np.concatenate([arrays["kernel"], arrays["recurrent_kernel"]], axis=0)
    bias = arrays["bias"]
    return {
        "kernel": (np.concatenate([both[:, i], both[:, c], both[:, f], both[:, o]], axis=1),
                   "Keras kernel over recurrent_kernel, columns [i | c | f | o] of Keras' "
                   "[i | f | c | o]"),
        "bias": (np.concatenate([bias[i], bias[c], bias[f] - FORGET_BIAS, bias[o]]),
                 f"Keras bias [i | c | f − {FORGET_BIAS:g} | o] (TF1 adds forget_bias "
                 f"{FORGET_BIAS:g} in the cell)"),
    }


def lstm_block_to_keras(arrays: dict[str, np.ndarray], F: int, u: int
                        ) -> dict[str, tuple[np.ndarray, str]]:
    """TF1 LSTMCell → Keras LSTM: the inverse of :func:`lstm_keras_to_block`."""
    i, j, f, o = (slice(k * u, (k + 1) * u) for k in range(4))
    kernel, bias = arrays["kernel"], arrays["bias"]
    columns = np.concatenate([kernel[:, i], kernel[:, f], kernel[:, j], kernel[:, o]], axis=1)
    return {
        "kernel": (columns[:F], f"rows 0–{F - 1} of the TF1 kernel, columns [i | f | j | o] "
                                "of TF1's [i | j | f | o]"),
        "recurrent_kernel": (columns[F:], f"rows {F}–{F + u - 1} of the TF1 kernel, columns "
                                          "[i | f | j | o]"),
        "bias": (np.concatenate([bias[i], bias[f] + FORGET_BIAS, bias[j], bias[o]]),
                 f"TF1 bias [i | f + {FORGET_BIAS:g} | j | o] (Keras keeps the forget bias "
                 "in the bias)"),
    }


def _check_against_algebra(algebra: ModelShapes, params: dict[str, np.ndarray]) -> None:
    """Every weight the algebra names, of its shape: a conversion bug would be loud."""
    from gradscope.errors import InternalError

    for info in algebra.weights:
        value = params.get(info.name)
        if value is None or tuple(value.shape) != info.shape:
            raise InternalError(f"internal error: --weights gave {info.name} "
                                f"{None if value is None else _shape(value.shape)}, the "
                                f"algebra says {_shape(info.shape)}")


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    shape = tuple(shape)
    return f"({shape[0]},)" if len(shape) == 1 else str(shape)


__all__ = ["LoadedWeights", "WeightsError", "load_weights", "locate", "open_weights"]
