"""The name a report gives each weight of a Keras model: its layer and its key inside that layer
(``gru/kernel``, ``bilstm/forward_lstm/kernel``), where Keras' own path may leave the layer out
(a saved file's cell weights are ``minimal_rnn_cell/kernel``, ``forward_lstm/lstm_cell/
kernel``) or name the cell's scope (``gru/gru_cell/kernel``). explain, check and GradientFlow
name a weight alike; explain's and check's reports keep Keras' path beside the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradscope.keras.graph import ModelGraph
from gradscope.keras.layers.base import variable_key


@dataclass(frozen=True)
class WeightName:
    """A weight's layer (the model's own call where no layer holds it) and its key there."""

    layer: str
    key: str

    @property
    def name(self) -> str:
        return f"{self.layer}/{self.key}"


def weight_names(graph: ModelGraph, operation: Any, model: Any) -> dict[int, WeightName]:
    """Each weight of ``model`` (by ``id``) as its report names it: the first computing layer of
    ``graph`` that holds it (``operation(name)``: the model's layer of that name), else the
    model's own call (a subclassed model's ``self.add_weight``)."""
    found: dict[int, WeightName] = {}
    for node in graph.computing_layers:
        layer = operation(node.name)
        keys = weight_keys(node.name, layer)
        for variable in getattr(layer, "weights", []):
            found.setdefault(id(variable), WeightName(node.name, keys[id(variable)]))
    owner = graph.your_call or graph.name
    for variable in model.weights:
        found.setdefault(id(variable), WeightName(owner, variable.path.rsplit("/", 1)[-1]))
    return found


def names_by_path(graph: ModelGraph, operation: Any, model: Any) -> dict[str, str]:
    """Each weight's name (:func:`weight_names`) by its Keras path; none where two weights
    would share a name (then the paths name them)."""
    names = weight_names(graph, operation, model)
    found = {v.path: names[id(v)].name for v in model.weights if id(v) in names}
    return found if len(set(found.values())) == len(found) else {}


def live_names(engine: Any) -> dict[str, str]:
    """Each weight's name (:func:`weight_names`) by its Keras path, for the live model of
    ``engine``; where its graph cannot be read, none: the paths name them."""
    from gradscope.keras.live import read_live_graph

    try:
        return names_by_path(read_live_graph(engine.model), engine.operation, engine.model)
    except Exception:  # noqa: BLE001  (the user's model: named by its paths instead)
        return {}


def weight_keys(name: str, layer: Any) -> dict[int, str]:
    """Each weight's key inside its layer: cell scopes left out (``gru_cell/kernel`` →
    ``kernel``), unless two weights would then share one: their layer's keys then keep every
    scope. The cells of a StackedRNNCells by their place (``cells[0]/kernel``): Keras numbers
    their scopes as it makes them (``gru_cell``, ``gru_cell_1``; ``gru_cell_2`` for the same
    model built again), and the first one's scope left out read as the whole layer's kernel."""
    weights = list(getattr(layer, "weights", []))
    stacked = _stacked_keys(layer)
    if stacked is not None and set(stacked) == {id(v) for v in weights}:
        return stacked
    short = {id(v): variable_key(v.path, name, layer.path) for v in weights}
    if len(set(short.values())) == len(short):
        return short
    prefix = (layer.path + "/") if layer.path else ""
    return {id(v): v.path[len(prefix):] if v.path.startswith(prefix) else v.path
            for v in weights}


def _stacked_keys(layer: Any) -> dict[int, str] | None:
    """An RNN over a StackedRNNCells: each weight by its cell's place and its own last part
    (``cells[1]/recurrent_kernel``); None for another layer, or where two weights of a cell
    share a last part."""
    cells = getattr(getattr(layer, "cell", None), "cells", None)
    if not isinstance(cells, list | tuple):
        return None
    keys: dict[int, str] = {}
    for index, cell in enumerate(cells):
        own = {id(v): f"cells[{index}]/{v.path.rsplit('/', 1)[-1]}"
               for v in getattr(cell, "weights", [])}
        if len(set(own.values())) < len(own):
            return None
        keys.update(own)
    return keys


__all__ = ["WeightName", "names_by_path", "weight_keys", "weight_names"]
