"""The batch a Keras model is explained on: synthetic (seeded NumPy) or the user's arrays, named
after the model's inputs and outputs. No TensorFlow.

Synthetic inputs are standard normal, except the ones an Embedding reads: token ids below its
``input_dim``. ``pad`` puts padded steps at the end of every sequence (the Masking layer's
``mask_value``, or token 0 for an Embedding with ``mask_zero``). Targets follow the loss:
one-hot classes, integer classes for sparse losses, 0/1 labels for binary ones, standard normal
otherwise.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradscope.arrays import check_numeric, open_checked, read_npz
from gradscope.errors import ConfigError, DataError, one_line
from gradscope.keras.graph import LayerNode, ModelGraph, Ref
from gradscope.keras.loss import LossPlan

Shape = tuple[int | None, ...]


def _or(names: list[str], shorthand: str) -> str:
    """`` (or x)`` where a model's one input (``y``: output) may be given as ``shorthand``."""
    return f" (or {shorthand})" if len(names) == 1 and names[0] != shorthand else ""


def time_steps(inputs: dict[str, np.ndarray]) -> int:
    """The longest time axis (axis 1) among a batch's inputs; 0 for a batch without one."""
    return max((int(v.shape[1]) for v in inputs.values() if v.ndim >= 2), default=0)


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: Shape  # batch axis None
    dtype: str
    vocabulary: int | None = None  # the smallest input_dim of the Embeddings that read it
    pad_value: float = 0.0
    pad_reader: str | None = None  # the Masking or Embedding layer that reads the padding

    @property
    def is_integer(self) -> bool:
        return self.vocabulary is not None or self.dtype.startswith(("int", "uint"))


#: Sample weights: None, one array (every output), or a dict of arrays by output name.
SampleWeight = np.ndarray | dict[str, np.ndarray] | None


@dataclass(frozen=True)
class KerasBatch:
    inputs: dict[str, np.ndarray]
    targets: dict[str, np.ndarray] | None  # None: synthetic, drawn once the outputs are known
    source: str
    pad: int = 0
    #: As fit takes them: None, one array for every output, or one per output (by name).
    sample_weight: SampleWeight = None
    #: The .npz file it was read from (None: arrays, or drawn): what its errors start with.
    path: str | None = None

    def digest(self) -> str:
        """sha256 of the batch's arrays (each part's dtypes, shapes and bytes, in the model's
        order): the same data gives the same digest under any file name (``gradscope diff``
        compares it). Not their names: Keras numbers an input it names (``input_layer_1``),
        and ``diff`` compares the model's inputs apart, naming them. Synthetic targets, drawn
        later from the seed, are left out (the seed is compared)."""
        found = hashlib.sha256()
        weights = self.sample_weight
        if weights is not None and not isinstance(weights, dict):
            weights = {"": weights}
        for part, arrays in (("inputs", self.inputs), ("targets", self.targets),
                             ("sample_weight", weights)):
            for position, value in enumerate((arrays or {}).values()):
                value = np.ascontiguousarray(value)
                found.update(f"{part}/{position}:{value.dtype.str}:{value.shape};".encode())
                found.update(value.tobytes())
        return found.hexdigest()




def input_specs(graph: ModelGraph) -> list[InputSpec]:
    specs = []
    for ref in graph.inputs:
        layer = graph.layer(ref.layer)
        shape = tuple(layer.config.get("batch_shape") or layer.config.get("batch_input_shape")
                      or (None,))
        vocabulary, pad_value, reader = None, 0.0, None
        for consumer in _readers(graph, ref):
            if consumer.class_name == "Embedding":
                dim = int(consumer.config["input_dim"])
                vocabulary = dim if vocabulary is None else min(vocabulary, dim)
                if consumer.config.get("mask_zero"):
                    reader = consumer.name
            elif consumer.class_name == "Masking":
                pad_value = float(consumer.config.get("mask_value", 0.0))
                reader = consumer.name
        specs.append(InputSpec(name=ref.layer, shape=tuple(shape),
                               dtype=str(layer.config.get("dtype", "float32")),
                               vocabulary=vocabulary, pad_value=pad_value, pad_reader=reader))
    return specs


def _readers(graph: ModelGraph, ref: Ref) -> list[LayerNode]:
    return [layer for layer, _ in graph.consumers(ref)]


def resolve_shape(spec: InputSpec, batch: int, steps: int | None) -> tuple[int, ...]:
    dims: list[int] = [batch]
    for axis, dim in enumerate(spec.shape[1:], start=1):
        if dim is not None:
            dims.append(int(dim))
        else:
            if axis != 1 or steps is None:
                raise ConfigError(
                    f"input '{spec.name}' has shape {spec.shape}: its axis {axis} is None; "
                    + ("pass --time-steps" if axis == 1 else "supply the data with --data"),
                    where="--time-steps" if axis == 1 else "--data")
            dims.append(steps)
    return tuple(dims)


#: The ids a synthetic batch draws for an integer input no Embedding reads.
UNRANGED_IDS = 10


def unranged(specs: list[InputSpec]) -> list[str]:
    """The integer inputs no Embedding reads: nothing in the model says which values are
    valid (a CTC loss's labels, an index a layer of the user's takes)."""
    return [spec.name for spec in specs if spec.is_integer and spec.vocabulary is None]


def synthetic_inputs(specs: list[InputSpec], batch: int, steps: int | None, pad: int,
                     seed: int) -> KerasBatch:
    rng = np.random.default_rng([seed, 1])
    inputs: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = resolve_shape(spec, batch, steps)
        if spec.is_integer:
            low = 1 if spec.pad_reader and pad else 0  # keep token 0 for the padding
            high = spec.vocabulary if spec.vocabulary is not None else UNRANGED_IDS
            value = rng.integers(low, max(high, low + 1), size=shape)
            value = value.astype(spec.dtype if spec.dtype.startswith(("int", "uint"))
                                 else "int32")
        else:
            value = rng.standard_normal(shape).astype(spec.dtype)
        if pad:
            if len(shape) < 2 or pad >= shape[1]:
                raise ConfigError(f"--pad {pad}: input '{spec.name}' has "
                                  f"{shape[1] if len(shape) > 1 else 0} steps; expected fewer "
                                  "padded steps than steps", where="--pad")
            value[:, shape[1] - pad:] = spec.pad_value
        inputs[spec.name] = value
    # Found tried as a new user would: a CTC model's labels drawn 0–9 for its 6 classes gave a
    # negative loss, said nowhere.
    guessed = unranged(specs)
    drawn = (f"; {', '.join(guessed)} drawn 0–{UNRANGED_IDS - 1}: no Embedding gives "
             f"{'their' if len(guessed) > 1 else 'its'} range" if guessed else "")
    detail = (f"synthetic (seed {seed}" + (f", last {pad} steps padded" if pad else "")
              + drawn + ")")
    return KerasBatch(inputs=inputs, targets=None, source=detail, pad=pad)


def batch_targets(plan: LossPlan, given: dict[str, np.ndarray] | None,
                  output_shapes: dict[str, tuple[int, ...]], seed: int,
                  path: str | None = None) -> dict[str, np.ndarray]:
    """A target for every output, as the engine feeds them: the given ones (checked against
    the loss; ``path``: the file they were read from, which the error then names), and
    synthetic ones, matching the loss, for the outputs none was given for (an output the loss
    does not read takes a synthetic one that nothing reads)."""
    targets = synthetic_targets(plan, output_shapes, seed)
    if given is not None:
        try:
            check_targets(plan, given, output_shapes)
        except DataError as exc:  # as every other problem of the file is said
            if path is None:
                raise
            raise DataError(f"{path}: {exc.message}", where=exc.where) from None
        targets.update(given)
    return targets


def unused_targets(plan: LossPlan, given: dict[str, np.ndarray] | None) -> list[str]:
    """The outputs whose given targets the loss never reads (compiled with no loss, or with
    ``None`` for that output)."""
    if given is None or plan.source != "compiled" or plan.custom_compute_loss:
        return []
    read = {entry.output for entry in plan.outputs}
    return [name for name in given if name not in read]


#: The batch's source where x came without y (the Python API).
DRAWN_TARGETS = "supplied (x; synthetic targets)"


def drawn_targets(plan: LossPlan, batch: KerasBatch) -> str | None:
    """A warning where the user gave x and no y and the loss reads targets: its gradients are
    of targets drawn at random, not of the user's data (found tried as a new user would: a
    diagnose with y forgotten said so in the header's data line alone); else None."""
    if batch.source != DRAWN_TARGETS or (plan.added_only and not plan.custom_compute_loss):
        return None
    return ("no targets were given (y): the loss and every gradient are of targets drawn at "
            "random to match the loss, not of your data; give y for the gradients fit takes")


def synthetic_targets(plan: LossPlan, output_shapes: dict[str, tuple[int, ...]],
                      seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 2])
    targets: dict[str, np.ndarray] = {}
    losses = {entry.output: entry for entry in plan.outputs}
    for name, shape in output_shapes.items():
        entry = losses.get(name)
        kind = entry.target if entry is not None else "real"
        if kind == "classes":
            targets[name] = rng.integers(0, shape[-1], size=shape[:-1]).astype("int32")
        elif kind == "one_hot":
            targets[name] = np.eye(shape[-1], dtype="float32")[
                rng.integers(0, shape[-1], size=shape[:-1])]
        elif kind == "binary":
            targets[name] = rng.integers(0, 2, size=shape).astype("float32")
        else:
            targets[name] = rng.standard_normal(shape).astype("float32")
    return targets


class DataProblems(DataError):
    """Every problem of one ``--data`` file at once, one line each (exit 2); a single problem
    is its own message, as before."""

    def __init__(self, path: str, problems: list[tuple[str, str]]) -> None:
        first, where = problems[0]
        super().__init__(first, where=where if len(problems) == 1 else path)
        if len(problems) > 1:
            prefix = f"{path}: "
            lines = [one_line(text.removeprefix(prefix)) for text, _ in problems]
            self.message = "\n".join([f"{path}: {len(lines)} problems, one per line:",
                                      *(f"  {line}" for line in lines)])
        self.lines = [one_line(text) for text, _ in problems]


#: The name of the sample weights in a --data file (SAMPLE_WEIGHT/NAME: one output's).
SAMPLE_WEIGHT = "sample_weight"


def _session_names(arrays: Collection[str]) -> str:
    """Why arrays named ``keras_tensor…`` name no input: found tried as a new user would,
    an .npz keyed by ``model.inputs[0].name`` ("keras_tensor") was refused without a word of
    why."""
    if not any(name.startswith("keras_tensor") for name in arrays):
        return ""
    return ("; keras_tensor… is the name Keras gives an input's tensor in one session "
            "(model.inputs[i].name), which the saved model does not keep: name each array "
            "after its input layer, as listed")


def load_named(path: str, specs: list[InputSpec], outputs: list[str],
               aliases: dict[str, str] | None = None,
               read: Collection[str] | None = None) -> KerasBatch:
    """An .npz whose arrays are named after the model's inputs (or ``x`` for a single input)
    and its outputs (or ``y`` for a single output). ``aliases``: other names of outputs (an
    output layer's name where the outputs are a dict keyed otherwise) → the output's name.

    Every problem of the file (arrays that are not numbers, missing inputs or targets,
    misshapen inputs, unknown arrays, a batch size the arrays disagree on) is one line of a
    single DataError. ``read``: the outputs whose targets the loss reads (None: every one); the
    others need none."""
    open_checked(Path(path), "an .npz file")
    arrays = read_npz(path, single="an .npz archive of arrays named after the model's inputs "
                      "and outputs (x and y for one of each), as np.savez writes it")
    problems: list[tuple[str, str]] = []  # (message, where)

    def numeric(key: str, finite: bool = True) -> bool:
        try:
            check_numeric(key, arrays[key], finite)
        except DataError as exc:
            problems.append((exc.message, exc.where or key))
            return False
        return True

    inputs: dict[str, np.ndarray] = {}
    targets: dict[str, np.ndarray] = {}
    used: set[str] = set()
    labels: dict[str, str] = {}  # input or output → the array's name in the file
    input_names = [spec.name for spec in specs]
    missing = False  # an input or output without its array (its line names every array)
    for spec in specs:
        key = spec.name if spec.name in arrays else ("x" if len(specs) == 1 and "x" in arrays
                                                     else None)
        if key is None:
            missing = True
            problems.append((f"{path}: has no array for the input '{spec.name}' (found "
                             f"{', '.join(sorted(arrays)) or 'no arrays'}); expected arrays "
                             f"named {', '.join(input_names)}"
                             + _or(input_names, "x")
                             + _session_names(arrays), spec.name))
            continue
        used.add(key)
        labels[spec.name] = key
        if not numeric(key, finite=False):
            continue
        try:
            inputs[spec.name] = _checked_input(spec, arrays[key], key)
        except DataError as exc:  # found tried as a new user would: the one said without
            problems.append((f"{path}: {exc.message}", exc.where or key))  # its file
            inputs[spec.name] = arrays[key]  # still counted for the batch size
    for name in outputs:
        other = next((alias for alias, to in (aliases or {}).items()
                      if to == name and alias in arrays), None)
        key = (name if name in arrays else other if other is not None
               else "y" if len(outputs) == 1 and "y" in arrays else None)
        if key is None and read is not None and name not in read:
            continue
        if key is None:
            missing = True
            problems.append((f"{path}: has no targets for the output '{name}' (found "
                             f"{', '.join(sorted(arrays)) or 'no arrays'}); expected arrays "
                             f"named {', '.join(outputs)}"
                             + _or(outputs, "y"), name))
            continue
        used.add(key)
        labels[name] = key
        if numeric(key, finite=False):
            targets[name] = arrays[key]
    weights: dict[str, np.ndarray] = {}
    for key in sorted(k for k in arrays if k == SAMPLE_WEIGHT
                      or k.startswith(SAMPLE_WEIGHT + "/")):
        output = key.partition("/")[2]
        output = (aliases or {}).get(output, output)
        if output and output not in outputs:
            problems.append((f"{path}: array '{key}' weighs an output the model does not have; "
                             f"expected {SAMPLE_WEIGHT} or {SAMPLE_WEIGHT}/NAME for an output "
                             f"NAME of {', '.join(outputs)}", key))
        elif numeric(key):
            try:
                _check_weights(key, arrays[key])
            except DataError as exc:
                problems.append((f"{path}: {exc.message}", key))
                continue
            weights[output] = arrays[key]
            labels[f"{SAMPLE_WEIGHT}/{output}" if output else SAMPLE_WEIGHT] = key
        used.add(key)
    if "" in weights and len(weights) > 1:
        problems.append((f"{path}: has both {SAMPLE_WEIGHT} (every output) and "
                         f"{SAMPLE_WEIGHT}/NAME arrays; expected one or the other",
                         SAMPLE_WEIGHT))
    # A line for an input or output without its array names every array found: one that
    # only repeats that (no name near it to suggest) is not said again.
    extras = sorted(set(arrays) - used)
    for extra in extras:
        hint = difflib.get_close_matches(extra, input_names + outputs, n=1)
        if missing and not hint and extra not in ("x", "y"):
            continue
        did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
        if extra in ("x", "y") and not hint:  # the shorthand of a model with one of them
            did_you_mean = (f" ({extra} names the {'input' if extra == 'x' else 'output'} "
                            f"of a model with one)")
        # Found tried as a new user would: a file that held the batch as x and y and a
        # validation split beside it was told "expected the inputs input_layer and the
        # outputs dense", names it had not used.
        alone = (not missing and not hint and extra not in ("x", "y")
                 and extra == extras[-1])  # said once, after the last
        problems.append((
            f"{path}: unknown array '{extra}'{did_you_mean}; expected the inputs "
            f"{', '.join(input_names)}{_or(input_names, 'x')} and the outputs "
            f"{', '.join(outputs)}{_or(outputs, 'y')}"
            + ("; the file holds the one batch gradscope reads: keep other arrays (a "
               "validation split, say) in another" if alone else ""), extra))
    weighed = {(f"{SAMPLE_WEIGHT}/{k}" if k else SAMPLE_WEIGHT): v for k, v in weights.items()}
    batches = {labels[name]: value.shape[0]
               for name, value in {**inputs, **targets, **weighed}.items() if value.ndim}
    if len(set(batches.values())) > 1:
        listed = ", ".join(f"{name} {size}" for name, size in batches.items())
        problems.append((f"{path}: the arrays disagree on the batch size ({listed}); expected "
                         "one batch size along axis 0", path))
    else:
        problems += [(f"{path}: {key} {said}", key)
                     for key, said in _weights_against_targets(weights, targets, labels)]
    if problems:
        raise DataProblems(path, problems)
    return KerasBatch(inputs=inputs, targets=targets, source=f"supplied ({path})",
                      sample_weight=weights.get("") if "" in weights else
                      (weights or None), path=str(path))


def _weights_against_targets(weights: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                             labels: dict[str, str]) -> list[tuple[str, str]]:
    """Sample weights whose shape is not the leading axes of their target's (per example,
    or per example and step), said before Keras' loss raises on them: (the weights' key,
    what is wrong, after their name)."""
    problems = []
    for output, weight in weights.items():
        for name, target in targets.items() if not output else [(output,
                                                                 targets.get(output))]:
            if target is None or weight.ndim == 0:
                continue
            if weight.ndim > target.ndim or weight.shape != target.shape[:weight.ndim]:
                key = f"{SAMPLE_WEIGHT}/{output}" if output else SAMPLE_WEIGHT
                problems.append((key, (
                    f"has shape {weight.shape}, which does not fit the targets "
                    f"{labels.get(name, name)} {target.shape}; expected one weight per example "
                    f"{target.shape[:1]}, or the leading axes of the targets' shape (per "
                    "example and step, for targets per step)")))
    return problems


def _checked_input(spec: InputSpec, value: np.ndarray, key: str) -> np.ndarray:
    if value.ndim != len(spec.shape):
        raise DataError(f"{key} has {value.ndim} dimensions {value.shape}; the input "
                        f"'{spec.name}' expects {len(spec.shape)}: {_shape_text(spec.shape)}",
                        where=key)
    # Every axis that differs, at once (found tried as a new user would: the first alone).
    wrong = [f"{found} along axis {axis}" for axis, (found, wanted)
             in enumerate(zip(value.shape, spec.shape, strict=True))
             if wanted is not None and found != wanted]
    if wrong:
        expected = [f"{wanted}" for found, wanted in zip(value.shape, spec.shape, strict=True)
                    if wanted is not None and found != wanted]
        raise DataError(f"{key} has {' and '.join(wrong)} but the input '{spec.name}' "
                        f"expects {' and '.join(expected)}: {_shape_text(spec.shape)}",
                        where=key)
    if value.shape[0] == 0:
        raise DataError(f"{key} has no examples; expected at least one", where=key)
    if spec.vocabulary is not None:
        if value.dtype.kind not in "iu":
            raise DataError(f"{key} has dtype {value.dtype}; the input '{spec.name}' feeds an "
                            "Embedding and expects integer token ids", where=key)
        if value.min() < 0 or value.max() >= spec.vocabulary:
            bad = int(value.min() if value.min() < 0 else value.max())
            raise DataError(f"{key} holds the token id {bad}; the Embedding it feeds has "
                            f"input_dim {spec.vocabulary}: expected ids 0 to "
                            f"{spec.vocabulary - 1}", where=key)
    return value


def _shape_text(shape: Shape) -> str:
    return "(" + ", ".join("batch" if i == 0 else ("any" if d is None else str(d))
                           for i, d in enumerate(shape)) + ")"


# -- arrays from Python (the API's x= and y=) --------------------------------------------------


def arrays_batch(specs: list[InputSpec], outputs: list[str], x: Any, y: Any,
                 aliases: dict[str, str] | None = None,
                 sample_weight: Any = None) -> KerasBatch:
    """The batch of ``gradscope.explain(model, x=…, y=…)``: NumPy or TensorFlow arrays, each
    ``x``/``y`` one array (one input/output), a list in the model's order, or a dict by name.
    ``y`` None: synthetic targets that match the loss. ``sample_weight``: as fit takes it,
    one array for every output, or a list or dict of arrays by output."""
    input_names = [spec.name for spec in specs]
    raw = _named("x", x, input_names, "input")
    inputs = {}
    for spec in specs:
        key, value = raw[spec.name]
        if value.dtype.kind == "f" and spec.dtype.startswith("float") and spec.vocabulary is None:
            # What Keras' Functional does with its inputs: cast to the Input's dtype.
            value = value.astype(spec.dtype)
        inputs[spec.name] = _checked_input(spec, value, key)
    labels = {name: key for name, (key, _) in raw.items()}
    targets = None
    if y is not None:
        if isinstance(y, dict) and aliases:
            y = {aliases.get(key, key) if key not in outputs else key: value
                 for key, value in y.items()}
        named = _named("y", y, outputs, "output")
        targets = {name: value for name, (_, value) in named.items()}
        labels.update({name: key for name, (key, _) in named.items()})
    weights: SampleWeight = None
    weighed: dict[str, np.ndarray] = {}
    if sample_weight is not None:
        if y is None:
            raise DataError("sample_weight= was given without y=; the weights weigh the loss "
                            "of your targets: pass y too", where="sample_weight")
        if isinstance(sample_weight, dict | list | tuple):
            if isinstance(sample_weight, dict) and aliases:
                sample_weight = {aliases.get(k, k) if k not in outputs else k: v
                                 for k, v in sample_weight.items()}
            named = _named("sample_weight", sample_weight, outputs, "output")
            weights = {name: value for name, (_, value) in named.items()}
            weighed = {f"sample_weight/{name}": value for name, value in weights.items()}
            labels.update({f"sample_weight/{name}": key for name, (key, _) in named.items()})
        else:
            weights = _array("sample_weight", sample_weight)
            weighed = {"sample_weight": weights}
            labels["sample_weight"] = "sample_weight"
        for name, value in weighed.items():
            _check_weights(labels[name], value)
    sizes = {labels[name]: value.shape[0]
             for name, value in {**inputs, **(targets or {}), **weighed}.items() if value.ndim}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name} {size}" for name, size in sizes.items())
        raise DataError(f"the arrays disagree on the batch size ({listed}); expected one batch "
                        "size along axis 0", where=next(iter(sizes)))
    if weights is not None and targets is not None:
        by_output = weights if isinstance(weights, dict) else {"": weights}
        for key, said in _weights_against_targets(by_output, targets, labels):
            raise DataError(f"{labels.get(key, 'sample_weight=')} {said}", where=key)
    return KerasBatch(inputs=inputs, targets=targets,
                      source=("supplied (x, y, sample_weight)" if weights is not None else
                              "supplied (x, y)" if y is not None else DRAWN_TARGETS),
                      sample_weight=weights)


def _check_weights(name: str, value: np.ndarray) -> None:
    """Sample weights have a batch axis (Keras takes them so; that they are finite real
    numbers is checked where every array is read)."""
    if value.ndim == 0:
        raise DataError(f"{name} is a scalar; expected one weight per example (batch,) or "
                        "per position (batch, time)", where=name)


def _named(what: str, value: Any, names: list[str],
           kind: str) -> dict[str, tuple[str, np.ndarray]]:
    """name → (how the user wrote it: x, x[1], x['tokens']; the array)."""
    listed = ", ".join(names)
    if isinstance(value, dict):
        unknown = [key for key in value if key not in names]
        if unknown:
            hint = difflib.get_close_matches(str(unknown[0]), names, n=1)
            did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise DataError(f"{what}[{unknown[0]!r}]: the model has no {kind} of that "
                            f"name{did_you_mean}; expected {listed}", where=what)
        missing = [name for name in names if name not in value]
        if missing:
            raise DataError(f"{what} has no array for the {kind} '{missing[0]}'; expected "
                            f"arrays for {listed}", where=what)
        return {name: (f"{what}[{name!r}]", _array(f"{what}[{name!r}]", value[name], False))
                for name in names}
    if isinstance(value, list | tuple):
        if len(value) != len(names):
            raise DataError(f"{what} is a list of {len(value)} arrays; the model has "
                            f"{len(names)} {kind}{'' if len(names) == 1 else 's'} ({listed})",
                            where=what)
        return {name: (f"{what}[{k}]", _array(f"{what}[{k}]", item, False))
                for k, (name, item) in enumerate(zip(names, value, strict=True))}
    if len(names) != 1:
        raise DataError(f"{what} is one array; the model has {len(names)} {kind}s ({listed}): "
                        f"pass {what} as a list in that order or a dict by name", where=what)
    return {names[0]: (what, _array(what, value, False))}


def _array(name: str, value: Any, finite: bool = True) -> np.ndarray:
    """A NumPy copy of an array-like (NumPy, a TF tensor, nested lists), checked numeric
    (and, with ``finite``, free of NaN and Inf)."""
    if hasattr(value, "numpy") and callable(value.numpy):
        try:
            value = value.numpy()
        except Exception as exc:  # a symbolic tensor has no value
            raise DataError(f"{name} is a {type(value).__name__} without a value ({exc}); "
                            "expected a NumPy array or an eager TensorFlow tensor",
                            where=name) from None
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name} is not an array ({exc}); expected a NumPy array or a "
                        "TensorFlow tensor", where=name) from None
    check_numeric(name, array, finite)
    if array.ndim == 0:
        raise DataError(f"{name} is a scalar; expected an array with a batch axis", where=name)
    return array


def check_targets(plan: LossPlan, targets: dict[str, np.ndarray],
                  output_shapes: dict[str, tuple[int, ...]]) -> None:
    """Targets the loss reads against the outputs' shapes (for the losses gradscope knows;
    a custom compiled loss may read any shape)."""
    from gradscope.keras.loss import KNOWN

    for entry in plan.outputs:
        value, shape = targets.get(entry.output), output_shapes.get(entry.output)
        if value is None or shape is None or entry.loss not in KNOWN:
            continue
        wanted = shape[:-1] if entry.target == "classes" else shape
        found = value.shape
        if _squeezed(found) != _squeezed(wanted):
            what = ("integer classes" if entry.target == "classes" else "targets")
            raise DataError(f"the targets of the output '{entry.output}' have shape {found}; "
                            f"{entry.loss} expects {what} of shape {wanted} (the output is "
                            f"{shape})", where=entry.output)
        if entry.target == "classes" and (value.dtype.kind == "f"
                                          and not np.all(value == np.round(value))):
            raise DataError(f"the targets of the output '{entry.output}' are not whole "
                            f"numbers; {entry.loss} expects class ids", where=entry.output)
        if entry.target == "classes" and value.size and (value.min() < 0
                                                         or value.max() >= shape[-1]):
            bad = value.min() if value.min() < 0 else value.max()
            raise DataError(f"the targets of the output '{entry.output}' hold the class "
                            f"{bad:g}; the output has {shape[-1]} classes: expected 0 to "
                            f"{shape[-1] - 1}", where=entry.output)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without a trailing axis of 1 (Keras' losses squeeze or expand it)."""
    return shape[:-1] if len(shape) > 1 and shape[-1] == 1 else shape
