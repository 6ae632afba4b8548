"""``gradscope diff BASE.json NEW.json`` (``gradscope.diff``): what a change of code did to the
gradients, read from two explain reports (say, a pull request's base and head, in CI).

Read without TensorFlow. Two reports are compared only when they explain the same thing (the
same source, data, batch size, seed, mode and model inputs): otherwise the comparison would
measure the data, not the code, and is refused (exit 2) naming the first field that differs.
The data is compared by its contents where both reports carry their digest
(``model.data_digest``), else by its description.
Within that, everything the model's code may change is reported: tensors added or removed
(or renamed: the same layer's weight of the same shape under another path), shapes, ‖g‖ and
the loss beyond ``rtol``, new NaN/Inf, vanishing/exploding flags (docs/ci.md).
"""

from __future__ import annotations

import json
import math
from os import PathLike
from pathlib import Path
from typing import Any

from gradscope.errors import ConfigError
from gradscope.formats import shape_text
from gradscope.report.models import DiffChange, DiffReport

#: Default relative tolerance of ‖g‖ and of the loss: float32 rounding (threaded reductions on
#: other machines and thread counts) stays far below it; any change of the model, its weights
#: or its loss is far above it.
DEFAULT_RTOL = 1e-4

#: What must be equal for two reports to be compared, by source: dotted paths in the report.
_SAME_KERAS = ("source", "model.data", "model.batch_size", "model.seed", "model.mode",
               "model.inputs")
_SAME_YAML = ("source", "model.data", "model.batch_size", "model.seed", "model.input_size",
              "model.time_steps", "model.dtype")


def diff(base: Any, new: Any, rtol: float = DEFAULT_RTOL) -> DiffReport:
    """Compare two explain reports: each a path to an ``explain --json`` document, the dict
    of one, or a report object (``gradscope.explain(...)``)."""
    if isinstance(rtol, bool) or not isinstance(rtol, int | float) or not rtol > 0:
        raise ConfigError(f"diff(rtol={rtol!r}): expected a number > 0", where="rtol")
    base_doc, base_name = _document(base, "base")
    new_doc, new_name = _document(new, "new")
    _refuse_other_inputs(base_doc, new_doc, base_name, new_name)
    changes: list[DiffChange] = []
    before, after = _tensors(base_doc), _tensors(new_doc)
    renamed = _renamed(before, after)
    changes += _loss_change(base_doc, new_doc, rtol)
    changes += _tensor_changes(before, after, renamed, rtol)
    changes += _flag_changes(base_doc, new_doc)
    compared = len(before.keys() & after.keys()) + len(renamed)
    return DiffReport(base=base_name, new=new_name, rtol=rtol,
                      source=str(base_doc.get("source", "yaml")),
                      loss_base=_number(base_doc, "loss.value"),
                      loss_new=_number(new_doc, "loss.value"),
                      compared_tensors=compared, changes=changes,
                      # A name Keras numbered otherwise is no drift: the tensor is compared
                      # under its new name, and what changed of it is a change of its own.
                      drifted=any(change.kind != "renamed" for change in changes))


def _document(source: Any, role: str) -> tuple[dict[str, Any], str]:
    """The report as a dict, and how to name it."""
    if hasattr(source, "to_dict") and callable(source.to_dict):
        document, name = source.to_dict(), f"the {role} report"
    elif isinstance(source, dict):
        document, name = source, f"the {role} report"
    elif isinstance(source, str | PathLike):
        path = Path(source)
        name = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file; expected an explain report written "
                              "with gradscope explain --json", where=name) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read it: {exc}", where=name) from None
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not JSON (line {exc.lineno}: {exc.msg}); expected an "
                              "explain report written with gradscope explain --json",
                              where=name) from None
    else:
        raise ConfigError(f"diff: the {role} report is a {type(source).__name__}; expected a "
                          "path to an explain --json document, its dict, or an explain report",
                          where=role)
    if not isinstance(document, dict) or document.get("command") != "explain":
        found = (f"a {type(document).__name__}" if not isinstance(document, dict)
                 else "no command field (not a gradscope report)"
                 if document.get("command") is None else f"a {document['command']!r} report")
        raise ConfigError(f"{name}: {found}; expected an explain report "
                          "(gradscope explain --json)", where=name)
    if document.get("schema_version") != "1":
        raise ConfigError(f"{name}: schema_version {document.get('schema_version')!r}; this "
                          "gradscope reads explain reports of schema version '1'", where=name)
    _validated(document, name)
    return document, name


def _validated(document: dict[str, Any], name: str) -> None:
    """The document as gradscope explain --json writes it: its report model's fields and
    types, and no NaN or Inf (the JSON writes null for a number that is not finite). Found
    tried as a new user would: an l2 of NaN read "NO DRIFT", one of "abc" "no gradient
    now"."""
    from pydantic import ValidationError

    from gradscope.report.models import ExplainReport, KerasExplainReport

    model = KerasExplainReport if document.get("source") == "keras" else ExplainReport
    try:
        model.model_validate(document)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ConfigError(f"{name}: {where}: {error['msg']}; expected an explain report as "
                          "gradscope explain --json writes it", where=name) from None
    found = _not_finite_at(document)
    if found is not None:
        raise ConfigError(f"{name}: {found} is not a finite number; expected an explain "
                          "report as gradscope explain --json writes it (null for a number "
                          "that is not finite)", where=name)


def _not_finite_at(value: Any, path: str = "") -> str | None:
    """Where the first NaN or Inf of a JSON document is (a dotted path), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "the document"
    items = (value.items() if isinstance(value, dict) else
             enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        found = _not_finite_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _get(document: dict[str, Any], dotted: str) -> Any:
    value: Any = document
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if dotted == "source" and value is None:
        return "yaml"  # a YAML report carries no source field
    return value


def _number(document: dict[str, Any], dotted: str) -> float | None:
    value = _get(document, dotted)
    return float(value) if isinstance(value, int | float) else None


def _refuse_other_inputs(base: dict[str, Any], new: dict[str, Any], base_name: str,
                         new_name: str) -> None:
    fields: tuple[str, ...] = _SAME_KERAS if _get(base, "source") == "keras" else _SAME_YAML
    digests = _get(base, "model.data_digest"), _get(new, "model.data_digest")
    if None not in digests:
        # The batches' contents, whatever their files are named (found tried as a new user
        # would: the same batch under two names was refused, and another batch under the
        # same name read as drift).
        fields = tuple("model.data_digest" if f == "model.data" else f for f in fields)
    for dotted in fields:
        a, b = _get(base, dotted), _get(new, dotted)
        if a != b and dotted == "model.data_digest":
            raise ConfigError(
                f"{new_name}: its batch's arrays differ from {base_name}'s (model.data "
                f"{json.dumps(_get(new, 'model.data'), ensure_ascii=False)} and "
                f"{json.dumps(_get(base, 'model.data'), ensure_ascii=False)}, "
                f"model.data_digest {str(b)[:12]}… and {str(a)[:12]}…): the gradients would "
                "measure the data, not the code; explain both with the same data",
                where=new_name)
        if a != b:
            raise ConfigError(
                f"{new_name}: {dotted} is {json.dumps(b, ensure_ascii=False)}, "
                f"{base_name} has {json.dumps(a, ensure_ascii=False)}: the reports explain "
                "different models or data, so their gradients cannot be compared; explain "
                "both with the same data, batch size and seed", where=new_name)


def _tensors(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every gradient of the report by name: weights, then initial states."""
    found: dict[str, dict[str, Any]] = {}
    for key in ("gradients", "initial_state_gradients"):
        for entry in document.get(key) or []:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                found[entry["name"]] = entry
    return found


def _norm(entry: dict[str, Any]) -> float | None:
    stats = entry.get("stats")
    value = stats.get("l2") if isinstance(stats, dict) else None
    return float(value) if isinstance(value, int | float) else None


def _nonfinite(entry: dict[str, Any]) -> int:
    stats = entry.get("stats")
    value = stats.get("nonfinite") if isinstance(stats, dict) else None
    return int(value) if isinstance(value, int) else 0


def _relative(base: float, new: float) -> float:
    if base == new:
        return 0.0
    return abs(new - base) / max(abs(base), abs(new), math.ulp(0.0))


def _loss_change(base: dict[str, Any], new: dict[str, Any], rtol: float) -> list[DiffChange]:
    changes = []
    a, b = _number(base, "loss.value"), _number(new, "loss.value")
    if a is not None and b is not None and _relative(a, b) > rtol:
        changes.append(DiffChange(tensor="loss", kind="loss", base=a, new=b,
                                  relative=_relative(a, b),
                                  detail=f"relative change {_relative(a, b):.2e}"))
    elif (a is None) != (b is None):
        # A loss that became (or stopped being) n/a: not finite, in a report that says so.
        def said(value: float | None) -> str:
            return "n/a (not finite)" if value is None else f"{value:.6g}"

        changes.append(DiffChange(tensor="loss", kind="loss", base=a, new=b,
                                  detail=f"the loss was {said(a)}, is {said(b)}"))
    name_a, name_b = _get(base, "loss.name"), _get(new, "loss.name")
    if name_a != name_b:
        changes.append(DiffChange(tensor="loss", kind="loss", detail=f"the loss was {name_a}, "
                                  f"is {name_b}"))
    return changes


def _tensor_changes(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
                    renamed: dict[str, str], rtol: float) -> list[DiffChange]:
    """What changed of each tensor (``before`` and ``after`` by :func:`_tensors`, ``renamed``
    by :func:`_renamed`)."""
    changes = []
    for name, entry in before.items():
        if name in after:
            changes.extend(_compared(name, entry, after[name], rtol))
        elif name in renamed:
            other = renamed[name]
            changes.append(DiffChange(
                tensor=other, kind="renamed", base_shape=entry.get("shape"),
                new_shape=after[other].get("shape"),
                detail=f"was {name}: the same layer's {name.split('/')[-1]} and shape "
                       "(Keras' numbering, or a cell's name in the path); compared as one"))
            changes.extend(_compared(other, entry, after[other], rtol))
        else:
            changes.append(DiffChange(tensor=name, kind="removed", base_shape=entry.get("shape"),
                                      base=_norm(entry), detail="no longer in the model"))
    paired = set(renamed.values())
    gone = [(name, entry) for name, entry in before.items()
            if name not in after and name not in renamed]
    for name, entry in after.items():
        if name not in before and name not in paired:
            twin = _same_as(name, entry, gone, rtol)
            detail = "new in the model" + (
                f"; the shape and ‖g‖ of the removed {twin} (a layer renamed?)" if twin else "")
            changes.append(DiffChange(tensor=name, kind="added", new_shape=entry.get("shape"),
                                      new=_norm(entry), detail=detail))
    return changes


def _same_as(name: str, entry: dict[str, Any], gone: list[tuple[str, dict[str, Any]]],
             rtol: float) -> str | None:
    """The one removed tensor of ``name``'s last part (``kernel``, ``h0``), ``entry``'s shape
    and its ‖g‖ within ``rtol``: the same weight under a name the user gave its layer
    (a renamed layer is not paired, its tensors' names sharing nothing), said as a hint."""
    norm = _norm(entry)
    if norm is None:
        return None
    last = name.split("/")[-1]
    found = [other_name for other_name, other in gone
             if other_name.split("/")[-1] == last and other.get("shape") == entry.get("shape")
             and (value := _norm(other)) is not None
             and abs(value - norm) <= rtol * max(abs(value), abs(norm))]
    return found[0] if len(found) == 1 else None


def _renamed(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
             ) -> dict[str, str]:
    """Tensors under another name in ``after``: a name of ``before`` that ``after`` lacks, and
    one of ``after`` that ``before`` lacks, paired where they alone share their layer (the
    first part of the name), their last part (``kernel``, ``h0``) and their shape. Keras
    numbers what it names as it makes it (``both/forward_lstm/kernel``, then
    ``both/forward_lstm_1/kernel``), and a report of an earlier gradscope kept a custom cell's
    numbered scope (``rnn/minimal_rnn_cell_1/kernel``), so that the same weight is named
    otherwise from one run to another. A Bidirectional's
    directions are told apart (``both/forward_enc/kernel`` and ``both/backward_enc/kernel``
    are two: the part that starts with ``forward`` or ``backward``)."""
    def key(name: str, entry: dict[str, Any]) -> tuple[str, str, str, str]:
        parts = name.split("/")
        direction = next((way for part in parts[1:-1] for way in ("forward", "backward")
                          if part.startswith(way)), "")
        return parts[0], direction, parts[-1], json.dumps(entry.get("shape"))

    gone: dict[tuple[str, str, str, str], list[str]] = {}
    came: dict[tuple[str, str, str, str], list[str]] = {}
    for name, entry in before.items():
        if name not in after and "/" in name:
            gone.setdefault(key(name, entry), []).append(name)
    for name, entry in after.items():
        if name not in before and "/" in name:
            came.setdefault(key(name, entry), []).append(name)
    return {gone[k][0]: came[k][0] for k in gone
            if len(gone[k]) == 1 and len(came.get(k, [])) == 1}


def _compared(name: str, entry: dict[str, Any], other: dict[str, Any],
              rtol: float) -> list[DiffChange]:
    """What changed of one tensor present in both reports (``other`` is its new entry)."""
    shape_a, shape_b = entry.get("shape"), other.get("shape")
    if shape_a != shape_b:
        return [DiffChange(tensor=name, kind="shape", base_shape=shape_a, new_shape=shape_b,
                           base=_norm(entry), new=_norm(other),
                           detail=f"shape {_shape(shape_a)} → {_shape(shape_b)}")]
    if _nonfinite(other) > _nonfinite(entry):
        return [DiffChange(
            tensor=name, kind="nonfinite", base=_norm(entry), new=_norm(other),
            detail=f"{_nonfinite(other)} values NaN or Inf (base: {_nonfinite(entry)})")]
    a, b = _norm(entry), _norm(other)
    if a is None or b is None:
        if (a is None) != (b is None):
            return [DiffChange(
                tensor=name, kind="norm", base=a, new=b,
                detail="no gradient now" if b is None else "a gradient now, none before")]
        return []
    if _relative(a, b) > rtol:
        return [DiffChange(tensor=name, kind="norm", base=a, new=b, relative=_relative(a, b),
                           detail=f"‖g‖: relative change {_relative(a, b):.2e}")]
    return []


def _flags(document: dict[str, Any]) -> dict[str, str]:
    flow = document.get("gradient_flow")
    flags = flow.get("flags") if isinstance(flow, dict) else None
    return {f["what"]: f["kind"] for f in flags or [] if isinstance(f, dict) and "what" in f}


def _flag_changes(base: dict[str, Any], new: dict[str, Any]) -> list[DiffChange]:
    if base.get("gradient_flow") is None or new.get("gradient_flow") is None:
        return []  # flags are compared only where both reports ran --flow
    before, after = _flags(base), _flags(new)
    changes = []
    for what in sorted(before.keys() | after.keys()):
        a, b = before.get(what), after.get(what)
        if a != b:
            changes.append(DiffChange(tensor=what, kind="flag", detail=f"flag {a or 'none'} → "
                                      f"{b or 'none'}"))
    return changes


def _shape(shape: Any) -> str:
    return shape_text(shape) if isinstance(shape, list) else "none"


__all__ = ["DEFAULT_RTOL", "diff"]
