"""The shapes of the weights a saved ``.keras`` file stores, read without TensorFlow: for the
layers gradscope's algebra does not derive, ``shapes`` still lists every weight.

Keras 3 writes ``model.weights.h5`` with one group per layer (``layers/<key>``), whose
``vars`` subgroup is named after the layer (its ``name`` attribute) and holds the layer's
variables as datasets ``0``, ``1``… in the order the layer keeps them; a wrapped layer or cell
has a ``vars`` group of its own further down. Only names and shapes are read, never values.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from typing import Any

WEIGHTS_H5 = "model.weights.h5"


@dataclass(frozen=True)
class StoredWeight:
    name: str  # "time_distributed/conv2d/0": layer, the object holding it, its index
    shape: tuple[int, ...]


def stored_weights(path: str, layers: list[str]) -> dict[str, list[StoredWeight]]:
    """Every weight of the named layers, by layer, as the file stores them (empty for a layer
    the file does not hold, or for weights stored as .npz)."""
    found: dict[str, list[StoredWeight]] = {}
    if not layers:
        return found
    with zipfile.ZipFile(path) as archive:
        if WEIGHTS_H5 not in archive.namelist():
            return found
        import h5py  # Keras' own dependency; imported only when such a layer is there

        with archive.open(WEIGHTS_H5) as stream, h5py.File(stream, "r") as weights:
            groups = weights.get("layers")
            for key in groups or []:
                group = groups[key]
                name = _vars_name(group)
                if name in layers:
                    found[name] = list(_collect(group, name))
    return found


def _vars_name(group: Any) -> str | None:
    holder = group.get("vars") if hasattr(group, "get") else None
    value = holder.attrs.get("name") if holder is not None else None
    return value.decode() if isinstance(value, bytes) else value


def _collect(group: Any, layer: str) -> Any:
    """The datasets under ``group``, each named layer/owner/index (owner left out where it is
    the layer itself)."""
    owner = _vars_name(group)
    holder = group.get("vars")
    if holder is not None:
        for index in sorted(holder, key=int):
            prefix = layer if owner in (None, layer) else f"{layer}/{owner}"
            yield StoredWeight(name=f"{prefix}/{index}",
                               shape=tuple(int(d) for d in holder[index].shape))
    for key in group:
        if key != "vars" and hasattr(group[key], "keys"):
            yield from _collect(group[key], layer)
