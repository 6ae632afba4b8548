"""YAML config → validated, fully resolved :class:`Spec`.

The keys are the public contract (see docs/config.md). Validation uses pydantic in strict mode, and
every pydantic error is turned into one line that names the key, what was found and what was
expected, e.g. ``key 'layers[0].units': expected a positive integer of at most 2147483647,
found -3``.

This module never imports TensorFlow.
"""

from __future__ import annotations

import difflib
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gradscope.errors import ConfigError

RECURRENT_TYPES = ("gru", "lstm", "simple_rnn")
LAYER_TYPES = (*RECURRENT_TYPES, "dense")
LAYOUTS = ("block", "keras")
LOSSES = ("softmax_cross_entropy", "mse")
DTYPES = ("float32", "float64")

LayerType = Literal["gru", "lstm", "simple_rnn", "dense"]
Layout = Literal["block", "keras"]

NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")

#: The embedded default: exactly the model of the seed question (input 200, batch 34,
#: 100 steps, GRU 64 → GRU 32 → dense 3). ``sample_configs/seed.yaml`` holds the same text.
DEFAULT_CONFIG_YAML = """\
# The seed model: a stacked GRU -> dense classifier, TF1 GRUCell weights.
input_size: 200        # features per time step
time_steps: 100
batch_size: 34
layout: block          # block = TF1 GRUCell/GRUBlockCell weights; keras = Keras 3 weights
layers:
  - gru: 64
  - gru: 32
  - dense: 3
loss: softmax_cross_entropy   # or mse
seed: 0
dtype: float32
"""

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)


#: The largest size a config may give (TensorFlow's shapes are int32 in places, and NumPy's
#: shape arithmetic int64: a larger number is a typo, refused by name rather than overflowing).
MOST = 2**31 - 1


class LayerSpec(BaseModel):
    """One layer. After :class:`Spec` validation, ``name`` and ``layout`` are always set."""

    model_config = _STRICT

    type: LayerType
    units: int = Field(gt=0, le=MOST)
    name: str | None = None
    layout: Layout | None = None
    reset_after: bool | None = None
    return_sequences: bool | None = None

    @property
    def recurrent(self) -> bool:
        return self.type in RECURRENT_TYPES

    @property
    def cell_key(self) -> str:
        """``gru_block``, ``gru_keras``, …: the module in ``gradscope/cells`` for this layer."""
        return f"{self.type}_{self.layout}"

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        if value is not None and not NAME_PATTERN.match(value):
            raise ValueError(
                f"expected a name of letters, digits, '_', '.' or '-' starting with a letter "
                f"(at most 64 characters), found {value!r}"
            )
        return value


class Spec(BaseModel):
    """A validated model description. Layers are resolved: names, layouts and flags are set."""

    model_config = _STRICT

    input_size: int = Field(gt=0, le=MOST)
    time_steps: int = Field(gt=0, le=MOST)
    batch_size: int = Field(gt=0, le=MOST)
    layers: tuple[LayerSpec, ...] = Field(min_length=1)
    layout: Layout = "block"
    loss: Literal["softmax_cross_entropy", "mse"] = "softmax_cross_entropy"
    seed: int = Field(default=0, ge=0)
    dtype: Literal["float32", "float64"] = "float32"

    @field_validator("layers", mode="before")
    @classmethod
    def _expand_short_forms(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return tuple(_expand_layer(index, item) for index, item in enumerate(value))

    @model_validator(mode="after")
    def _resolve_layers(self) -> Spec:
        counts: Counter[str] = Counter()
        resolved: list[LayerSpec] = []
        seen_dense = None
        recurrent_indices = [i for i, layer in enumerate(self.layers) if layer.recurrent]
        last_recurrent = recurrent_indices[-1] if recurrent_indices else None
        for index, layer in enumerate(self.layers):
            counts[layer.type] += 1
            where = f"layers[{index}]"
            name = layer.name or f"{layer.type}_{counts[layer.type]}"
            if layer.recurrent:
                if seen_dense is not None:
                    raise _spec_error(
                        where,
                        f"a dense layer ({seen_dense}) comes before this recurrent layer "
                        f"({name}); expected every recurrent layer first, then the dense layers",
                    )
                layout = layer.layout or self.layout
                keras_gru = layer.type == "gru" and layout == "keras"
                if layer.reset_after is not None and not keras_gru:
                    raise _spec_error(
                        f"{where}.reset_after",
                        f"only a keras-layout GRU has reset_after, but {name} is a "
                        f"{layout}-layout {layer.type}",
                    )
                reset_after = layer.reset_after if layer.reset_after is not None else True
                return_sequences = (
                    layer.return_sequences if layer.return_sequences is not None else True
                )
                if not return_sequences and index != last_recurrent:
                    raise _spec_error(
                        f"{where}.return_sequences",
                        f"found false on {name}, but the next recurrent layer needs its whole "
                        "sequence; expected false only on the last recurrent layer",
                    )
                resolved.append(
                    layer.model_copy(
                        update={
                            "name": name,
                            "layout": layout,
                            "reset_after": reset_after if keras_gru else None,
                            "return_sequences": return_sequences,
                        }
                    )
                )
            else:
                if index == 0:
                    raise _spec_error(
                        where,
                        "found a dense layer first; expected a recurrent layer "
                        f"({', '.join(RECURRENT_TYPES)}) first and dense layers after it",
                    )
                for key in ("layout", "reset_after", "return_sequences"):
                    if getattr(layer, key) is not None:
                        raise _spec_error(
                            f"{where}.{key}", f"a dense layer has no {key}; remove it from {name}"
                        )
                seen_dense = name
                resolved.append(layer.model_copy(update={"name": name}))
        duplicates = [n for n, c in Counter(layer.name for layer in resolved).items() if c > 1]
        if duplicates:
            raise _spec_error("layers", f"the layer name {duplicates[0]!r} is used twice")
        object.__setattr__(self, "layers", tuple(resolved))
        return self

    # -- convenient views -------------------------------------------------------------------

    @property
    def recurrent_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.recurrent)

    @property
    def dense_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if not layer.recurrent)

    @property
    def sequence_output(self) -> bool:
        """True when the output (and the targets) have a time axis."""
        return bool(self.recurrent_layers[-1].return_sequences)

    @property
    def output_size(self) -> int:
        return self.layers[-1].units

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec, long form, as plain data (what ``--json`` reports)."""
        return self.model_dump(exclude_none=True)


class _SpecError(ValueError):
    """Raised inside validators; carries the key path so the message can name it."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where
        self.message = message


def _spec_error(where: str, message: str) -> _SpecError:
    return _SpecError(where, message)


def _expand_layer(index: int, item: Any) -> Any:
    """``{gru: 64, name: x}`` → ``{type: gru, units: 64, name: x}``; long forms pass through."""
    where = f"layers[{index}]"
    if not isinstance(item, dict):
        raise _spec_error(
            where,
            f"expected a mapping such as {{gru: 64}} or {{type: gru, units: 64}}, "
            f"found {_describe(item)}",
        )
    if "type" in item:
        return item
    type_keys = [key for key in item if key in LAYER_TYPES]
    if len(type_keys) == 1:
        kind = type_keys[0]
        rest = {key: value for key, value in item.items() if key != kind}
        if "units" in rest:
            raise _spec_error(f"{where}.units", f"units is given twice: as '{kind}:' and 'units:'")
        return {"type": kind, "units": item[kind], **rest}
    if len(type_keys) > 1:
        raise _spec_error(
            where, f"found two layer types ({', '.join(type_keys)}); expected one per list item"
        )
    other_keys = [str(key) for key in item if key not in LayerSpec.model_fields]
    unknown = other_keys[0] if other_keys else None
    hint = _did_you_mean(unknown, LAYER_TYPES) if unknown else ""
    found = f"unknown layer type {unknown!r}{hint}" if unknown else "no layer type"
    raise _spec_error(where, f"{found}; expected one of {', '.join(LAYER_TYPES)}")


# -- loading ----------------------------------------------------------------------------------

MAX_CONFIG_BYTES = 1 << 20


def load_spec(source: str | os.PathLike[str] | dict[str, Any] | None = None) -> Spec:
    """Load and validate a spec from a YAML path, a dict, or (``None``) the embedded default."""
    if source is None:
        return spec_from_yaml(DEFAULT_CONFIG_YAML, origin="<embedded default>")
    if isinstance(source, dict):
        return spec_from_dict(source, origin="<dict>")
    return spec_from_yaml(read_config_text(Path(source)), origin=str(source))


#: What a file of these suffixes is, given where a YAML config or a ``.keras`` model is
#: expected, and what to pass instead.
_SAVE_IT = ("save the model with model.save('model.keras') and pass that (with --import "
            "FILE.py where its classes are your own), or give the model object to gradscope's "
            "Python API, as in gradscope.diagnose(model, x=..., y=...)")
_HDF5 = ("is an HDF5 file; expected a YAML config or a whole Keras model saved as .keras "
         "(keras.models.load_model reads a legacy .h5 model, and model.save('model.keras') "
         "saves it so)")
_ARRAYS = "is an array file; expected a YAML config or a .keras model, and the batch in --data"
_NOT_A_CONFIG = {
    ".py": f"is Python source, which gradscope does not run as a model; {_SAVE_IT}",
    ".ipynb": f"is a notebook, which gradscope does not run as a model; {_SAVE_IT}",
    ".h5": _HDF5, ".hdf5": _HDF5, ".npz": _ARRAYS, ".npy": _ARRAYS,
}


def read_config_text(path: Path) -> str:
    """Read a config file, turning every OS-level failure into a one-line ConfigError."""
    shown = str(path)
    if not path.exists():
        raise ConfigError(f"{shown}: file not found", where=shown)
    if path.is_dir():
        if (path / "saved_model.pb").exists():
            raise ConfigError(f"{shown}: is a TensorFlow SavedModel, which gradscope does not "
                              "read; expected a YAML config or a Keras model saved with "
                              "model.save('model.keras')", where=shown)
        raise ConfigError(f"{shown}: is a directory; expected a YAML config file", where=shown)
    unread = _NOT_A_CONFIG.get(path.suffix.lower())
    if unread is not None:
        # Found tried as a new user would: `gradscope diagnose train.py` said "expected a
        # mapping of keys at the top level, found 'import keras …'".
        raise ConfigError(f"{shown}: {unread}", where=shown)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot read: {exc.strerror or exc}", where=shown) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{shown}: the file is larger than {MAX_CONFIG_BYTES} bytes; expected a small "
            "YAML config",
            where=shown,
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{shown}: not UTF-8 text (byte {exc.start}); expected a YAML config", where=shown
        ) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (plain YAML silently keeps the last one)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def spec_from_yaml(text: str, origin: str = "<string>") -> Spec:
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{origin}: not valid YAML: {problem}{at}", where=origin) from None
    if data is None:
        raise ConfigError(
            f"{origin}: the config is empty; expected a mapping with input_size, time_steps, "
            "batch_size and layers",
            where=origin,
        )
    return spec_from_dict(data, origin=origin)


def spec_from_dict(data: Any, origin: str = "<dict>") -> Spec:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{origin}: expected a mapping of keys at the top level, found {_describe(data)}",
            where=origin,
        )
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise ConfigError(
            f"{origin}: key {bad_keys[0]!r} is not a string; expected keys such as input_size",
            where=origin,
        )
    try:
        return Spec.model_validate(data)
    except _SpecError as exc:
        raise ConfigError(f"{origin}: key '{exc.where}': {exc.message}", where=exc.where) from None
    except ValidationError as exc:
        where, message = _explain_validation_error(exc, data)
        raise ConfigError(f"{origin}: {message}", where=where) from None


# -- error messages ---------------------------------------------------------------------------

_EXPECTED = {
    "input_size": f"a positive integer (features per time step) of at most {MOST}",
    "time_steps": f"a positive integer of at most {MOST}",
    "batch_size": f"a positive integer of at most {MOST}",
    "units": f"a positive integer of at most {MOST}",
    "seed": "a non-negative integer",
    "name": "a string",
    "layers": "a list of layers such as [{gru: 64}, {dense: 3}]",
    "layout": f"one of {', '.join(LAYOUTS)}",
    "loss": f"one of {', '.join(LOSSES)}",
    "dtype": f"one of {', '.join(DTYPES)}",
    "type": f"one of {', '.join(LAYER_TYPES)}",
    "reset_after": "true or false",
    "return_sequences": "true or false",
}


def _explain_validation_error(exc: ValidationError, data: dict[str, Any]) -> tuple[str, str]:
    errors = exc.errors(include_url=False)
    # A typo'd key also makes the key it was meant to be "missing": report the typo first.
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = error["loc"]
    kind = error["type"]
    where = _format_loc(loc)
    field = next((str(part) for part in reversed(loc) if isinstance(part, str)), "")
    expected = _EXPECTED.get(field, "a valid value")
    found = _describe(error.get("input"))

    if isinstance(error.get("ctx", {}).get("error"), _SpecError):
        inner: _SpecError = error["ctx"]["error"]
        return inner.where, f"key '{inner.where}': {inner.message}"
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc)
        hint = _did_you_mean(field, allowed)
        return where, (
            f"unknown key '{where}'{hint}; expected one of {', '.join(allowed)}"
        )
    if kind == "missing":
        return where, f"missing required key '{where}': expected {expected}"
    if kind == "literal_error":
        choices = _EXPECTED.get(field, "").removeprefix("one of ").split(", ")
        hint = _did_you_mean(str(error.get("input")), choices)
        noun = "layer type" if field == "type" else field
        return where, f"key '{where}': unknown {noun} {found}{hint}; expected {expected}"
    if kind == "too_short":
        return where, f"key '{where}': found an empty list; expected at least one layer"
    if kind == "value_error":
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        return where, f"key '{where}': {message}"
    return where, f"key '{where}': expected {expected}, found {found}"


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model = LayerSpec if "layers" in loc[:-1] else Spec
    keys = list(model.model_fields)
    if model is LayerSpec:
        keys += list(LAYER_TYPES)
    return keys


def _format_loc(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _did_you_mean(word: str | None, choices: Any) -> str:
    if not word:
        return ""
    names = [str(c) for c in choices]
    # The same but for case first (found tried as a new user would: 'GRU', the likeliest
    # slip, had no hint, where 'grux' had one).
    same = [name for name in names if name.lower() == str(word).lower()]
    match = same or difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _describe(value: Any) -> str:
    """A short, safe description of a found value for error messages."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"{value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return repr(shown)
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"
