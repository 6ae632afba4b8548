"""A saved model's structure as a graph of layer calls, read from ``config.json`` alone.

Keras records, for every layer, each call (an "inbound node") with the tensors it received:
``keras_history = [layer, node, index]`` names the layer call that produced a tensor and which
of its outputs it is. This module turns that record into :class:`ModelGraph` without TensorFlow,
so that structural refusals happen before TensorFlow is imported.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradscope.errors import ConfigError, load_it, on_the_command_line
from gradscope.keras.archive import read_config

#: Layers that hold Python code (bytecode or a function reference): never loaded.
CODE_LAYERS = {"Lambda", "TFOpLambda", "TorchModuleWrapper", "JaxLayer", "FlaxLayer"}
#: Model classes that appear as layers inside a model.
MODEL_CLASSES = {"Functional", "Sequential", "Model"}
#: The class name of the node that stands, in a subclassed model's graph, for what the model's
#: own ``call`` computes outside its layers (see :mod:`~gradscope.keras.subclassed`).
YOUR_CALL = "(your call)"


@dataclass(frozen=True)
class Ref:
    """One tensor: output ``index`` of call ``node`` of ``layer``."""

    layer: str
    node: int
    index: int
    shape: tuple[int | None, ...] | None = field(default=None, compare=False)
    dtype: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.layer if (self.node, self.index) == (0, 0) else \
            f"{self.layer}[{self.node}][{self.index}]"


@dataclass(frozen=True)
class Call:
    """One call of a layer: its positional and keyword arguments, tensors as :class:`Ref`."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def refs(self) -> list[Ref]:
        """Every tensor the call received, positional first."""
        return list(_refs(self.args)) + list(_refs(self.kwargs))

    def input_refs(self) -> list[Ref]:
        """The tensors the call computes on: positional ones, then those passed by keyword
        as inputs (``MultiHeadAttention(query=…, value=…)``), in :data:`INPUT_KEYWORDS`
        order. Masks and initial states are not among them."""
        refs = list(_refs(self.args))
        for key in INPUT_KEYWORDS:
            if key in self.kwargs:
                refs += list(_refs(self.kwargs[key]))
        return refs

    def kwarg_refs(self) -> dict[str, list[Ref]]:
        return {key: list(_refs(value)) for key, value in self.kwargs.items()
                if any(True for _ in _refs(value))}


#: Keyword arguments that carry a layer's inputs, in the order of Keras' call signatures
#: (``inputs``, ``sequences``; attention's ``query``, ``value``, ``key``).
INPUT_KEYWORDS = ("inputs", "sequences", "query", "value", "key")


@dataclass(frozen=True)
class LayerNode:
    name: str
    class_name: str
    module: str | None
    registered_name: str | None
    config: dict[str, Any]
    calls: tuple[Call, ...]
    input_shape: Any = None  # from build_config, when the layer was built

    @property
    def is_input(self) -> bool:
        return self.class_name == "InputLayer"

    @property
    def inner(self) -> LayerNode | None:
        """The wrapped layer of TimeDistributed or Bidirectional."""
        wrapped = self.config.get("layer")
        return _layer_node(wrapped, calls=()) if isinstance(wrapped, dict) else None


@dataclass(frozen=True)
class ModelGraph:
    source: str
    name: str
    kind: str  # "Sequential" or "Functional"
    layers: tuple[LayerNode, ...]
    inputs: tuple[Ref, ...]
    outputs: tuple[Ref, ...]
    compile_config: dict[str, Any] | None = None
    #: The keys of a model built with a dict of outputs (``Model(x, {"zeta": …})``), in the
    #: order of ``outputs`` (sorted, as Keras flattens them); None otherwise.
    output_keys: tuple[str, ...] | None = None

    def layer(self, name: str) -> LayerNode:
        return next(layer for layer in self.layers if layer.name == name)

    @property
    def your_call(self) -> str | None:
        """The node of what a subclassed model's call computes outside its layers (None for
        any other model)."""
        return next((layer.name for layer in self.layers if layer.class_name == YOUR_CALL),
                    None)

    @property
    def computes_between(self) -> bool:
        """Whether a subclassed model's call computed a tensor outside its layers that a layer
        received or the model returned (``x / 255``, a sum of two layers' outputs); False
        where it only passed its inputs and each layer's output on, and for any other
        model."""
        yours = self.your_call
        received = [ref for layer in self.layers for call in layer.calls
                    for ref in call.refs()]
        return yours is not None and any(ref.layer == yours
                                         for ref in [*received, *self.outputs])

    @property
    def computing_layers(self) -> list[LayerNode]:
        return [layer for layer in self.layers
                if not layer.is_input and layer.class_name != YOUR_CALL]

    def consumers(self, ref: Ref) -> list[tuple[LayerNode, int]]:
        """The (layer, call index) pairs that receive ``ref``."""
        return [(layer, k) for layer in self.layers for k, call in enumerate(layer.calls)
                if ref in call.refs()]

    def walk(self) -> Iterator[LayerNode]:
        """Every layer, nested ones (wrappers, sub-models) included."""
        for layer in self.layers:
            yield from _walk(layer)


def mode_effects(graph: ModelGraph) -> list[str] | None:
    """What inference mode changes in ``graph``'s layers: dropout (a dropout or noise layer,
    a layer's ``dropout`` or ``recurrent_dropout`` above 0) and batch normalisation; None
    where a layer, or a subclassed model's own call, is code of the user's (what it does in
    training mode is not known)."""
    from gradscope.report.models import BATCH_NORM, DROPOUT, NOISE

    found = set()
    for layer in graph.walk():
        if layer.is_input:
            continue
        # Keras writes no module for a layer of the user's own script.
        if layer.class_name == YOUR_CALL or not _is_keras_module(layer.module or ""):
            return None
        name, config = layer.class_name, layer.config
        if ("Dropout" in name
                or any(_positive(config.get(key)) for key in ("dropout", "recurrent_dropout"))):
            found.add(DROPOUT)
        if "Noise" in name:
            found.add(NOISE)
        if "BatchNormalization" in name:
            found.add(BATCH_NORM)
    return [effect for effect in (DROPOUT, NOISE, BATCH_NORM) if effect in found]


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def read_graph(path: str | Path) -> ModelGraph:
    """The graph of a saved model; ConfigError (exit 2) for what is not a Keras model."""
    return graph_from_config(read_config(path), str(path))


def graph_from_config(config: dict[str, Any], source: str,
                      what: str = "config.json") -> ModelGraph:
    """The graph of a serialised model (config.json's structure); ``source`` names it."""
    try:
        return _graph(config, source)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ConfigError(f"{source}: {what} is not a Keras 3 model config this version "
                          f"of gradscope reads ({type(exc).__name__}: {exc})",
                          where=source) from None


def refuse_code(graph: ModelGraph) -> None:
    """Layers whose behaviour is Python code in (or referenced by) the file are never loaded."""
    for layer in graph.walk():
        if layer.class_name in CODE_LAYERS:
            raise ConfigError(
                f"{graph.source}: layer '{layer.name}' is a {layer.class_name}: it holds Python "
                "code, which gradscope never loads or runs unasked (Keras' safe_mode refuses "
                "it too); replace it with built-in layers, or "
                + ("pass --unsafe if you trust the file (it runs the code stored in it)"
                   if on_the_command_line() else
                   load_it(graph.source, "unsafe=True",
                           "if you trust the file (it runs the code stored in it)")),
                where=layer.name)
        module = layer.module or ""
        if not _is_keras_module(module):
            raise ConfigError(
                f"{graph.source}: layer '{layer.name}' is a custom class "
                f"'{layer.registered_name or layer.class_name}' (module {module or 'unknown'}): "
                "its code is not in the file, and gradscope imports no code unasked; "
                f"{_import_hint(module, graph.source)}", where=layer.name)
        for key, found in _custom_objects(layer.config, ()):
            name = found.get("registered_name") or found.get("class_name")
            module = found.get("module") or ""
            raise ConfigError(
                f"{graph.source}: layer '{layer.name}' holds a custom class '{name}' (module "
                f"{module or 'unknown'}) as its "
                f"{'/'.join(part for part in key if part != 'config')}: its code is not "
                "in the file, and gradscope imports no code unasked; "
                f"{_import_hint(module, graph.source)}", where=layer.name)


def qualify_custom(config: Any) -> None:
    """Every serialised object whose class is not Keras' own: class_name → module.class_name.
    """
    if isinstance(config, dict):
        # A function (a loss, a regularizer) is saved as the class "function" of the module
        # "builtins", named by its config: not a class to qualify.
        module = config.get("module")
        if isinstance(module, str) and not _is_keras_module(module) and module != "builtins" \
                and isinstance(config.get("class_name"), str):
            config["class_name"] = f"{module}.{config['class_name']}"
        for value in config.values():
            qualify_custom(value)
    elif isinstance(config, list):
        for item in config:
            qualify_custom(item)


def _import_hint(module: str, source: str) -> str:
    """The option that brings a custom class's code: its module by name where the file says
    it, else the file that defines it; in Python, :func:`gradscope.load_model`'s
    ``imports``."""
    known = bool(module) and module not in ("__main__", "builtins")
    if on_the_command_line():
        return (f"add --import {module} (the module that defines it; or --import "
                "path/to/its_file.py)" if known
                else "add --import path/to/the_file.py that defines and registers it")
    if known:
        return load_it(source, f"imports=[{module!r}]",
                       "(the module that defines it; or the path of its .py file)")
    return load_it(source, "imports=['path/to/the_file.py']",
                   "(the file that defines and registers it)")


def _is_keras_module(module: str) -> bool:
    return module == "keras" or module.startswith("keras.")


def _custom_objects(config: Any, key: tuple[str, ...]
                    ) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every serialised object inside a layer's config (a cell inside RNN, the cells of
    StackedRNNCells, a regularizer, an initializer…) whose class is not Keras' own, with the
    config keys that lead to it. Plain values (tuples, tensors, Keras' own functions) are
    serialised with module "builtins" or none; a function the user registered carries a
    registered name "package>name"."""
    if isinstance(config, dict):
        if "class_name" in config and "config" in config:
            module = config.get("module")
            registered = str(config.get("registered_name") or "")
            if (module not in (None, "builtins") and not _is_keras_module(str(module))) or (
                    module == "builtins" and ">" in registered):
                yield key, config
                return
        for name, value in config.items():
            yield from _custom_objects(value, (*key, str(name)))
    elif isinstance(config, list):
        for index, item in enumerate(config):
            yield from _custom_objects(item, (*key, str(index)))


# -- parsing ---------------------------------------------------------------------------------------


def _graph(config: dict[str, Any], source: str) -> ModelGraph:
    kind = config["class_name"]
    body = config["config"]
    compile_config = config.get("compile_config")
    if kind == "Sequential":
        return _sequential(body, source, config.get("build_config"), compile_config)
    if kind not in MODEL_CLASSES:
        module = str(config.get("module") or "")
        if module and not _is_keras_module(module):
            raise ConfigError(
                f"{source}: holds a model of your own class "
                f"'{config.get('registered_name') or kind}' (module {module}): its code is not "
                f"in the file, and gradscope imports no code unasked; "
                f"{_import_hint(module, source)}",
                where=source)
        raise ConfigError(f"{source}: config.json holds a {kind}, not a model; expected a "
                          "Sequential or functional model", where=source)
    layers = tuple(_layer_node(entry) for entry in body["layers"])
    return ModelGraph(source=source, name=body.get("name", "model"), kind="Functional",
                      layers=layers, inputs=_history_list(body["input_layers"]),
                      outputs=_history_list(body["output_layers"]),
                      compile_config=compile_config,
                      output_keys=_dict_keys(body["output_layers"]))


def _sequential(body: dict[str, Any], source: str, build_config: Any,
                compile_config: dict[str, Any] | None) -> ModelGraph:
    entries = list(body["layers"])
    nodes: list[LayerNode] = []
    if entries and entries[0]["class_name"] == "InputLayer":
        first = _layer_node(entries.pop(0), calls=())
    else:
        shape = (build_config or {}).get("input_shape")
        if shape is None:
            raise ConfigError(f"{source}: the Sequential model was saved before it was built "
                              "(no input shape); build or call it once before saving",
                              where=source)
        first = LayerNode(name="input", class_name="InputLayer", module="keras.layers",
                          registered_name=None, config={"batch_shape": shape, "name": "input"},
                          calls=())
    nodes.append(first)
    previous = Ref(first.name, 0, 0, _shape(first.config.get("batch_shape")))
    named: dict[str, int] = {}
    for entry in entries:
        # A Sequential config keeps no inbound nodes: each layer's build_config has its input.
        shape = _shape((entry.get("build_config") or {}).get("input_shape"))
        received = Ref(previous.layer, previous.node, previous.index, shape or previous.shape)
        node = _layer_node(entry, calls=(Call(args=(received,), kwargs={}),),
                           name=_unnamed(entry, named))
        nodes.append(node)
        previous = Ref(node.name, 0, 0)
    return ModelGraph(source=source, name=body.get("name", "sequential"), kind="Sequential",
                      layers=tuple(nodes), inputs=(Ref(first.name, 0, 0),),
                      outputs=(previous,), compile_config=compile_config)


@contextlib.contextmanager
def fresh_names() -> Iterator[None]:
    """Keras' counters of automatic names as in a new process, for a load (Keras is
    imported): a layer saved without a name (a Sequential's custom layer whose ``__init__``
    takes ``**kw`` and has no ``get_config``) is then named as gradscope's graph names it
    (:func:`_unnamed`), whatever the user's process made before."""
    import collections

    from keras.src.backend.common import global_state

    kept = global_state.get_global_attribute("object_name_uids")
    global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
    try:
        yield
    finally:
        global_state.set_global_attribute("object_name_uids", kept)


def _unnamed(entry: dict[str, Any], named: dict[str, int]) -> str | None:
    """The name Keras gives a layer of a Sequential saved without one, as it loads the file
    (or None where the config names it): its class in snake case, numbered from the second of
    that class on (``keras.src.utils.naming.auto_name``, its counters fresh:
    :func:`fresh_names`). A custom layer whose ``__init__`` takes
    ``**kw`` (any name but ``kwargs``) and has no ``get_config`` of its own is saved so."""
    if saved_name(entry):
        return None
    word = re.sub(r"\W+", "", str(entry["class_name"]).rsplit(".", 1)[-1])
    word = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", word)
    word = re.sub("([a-z])([A-Z])", r"\1_\2", word).lower()
    count = named.get(word, 0)
    named[word] = count + 1
    return f"{word}_{count}" if count else word


def saved_name(entry: dict[str, Any]) -> str | None:
    """A serialised layer's name, where its entry or its config holds one."""
    return entry.get("name") or (entry.get("config") or {}).get("name") or None


def _layer_node(entry: dict[str, Any], calls: tuple[Call, ...] | None = None,
                name: str | None = None) -> LayerNode:
    config = entry.get("config") or {}
    if calls is None:
        calls = tuple(Call(args=tuple(_value(arg) for arg in node.get("args", [])),
                           kwargs={key: _value(value)
                                   for key, value in (node.get("kwargs") or {}).items()})
                      for node in entry.get("inbound_nodes", []))
    name = name or saved_name(entry) or entry["class_name"]
    return LayerNode(name=str(name), class_name=str(entry["class_name"]),
                     module=entry.get("module"), registered_name=entry.get("registered_name"),
                     config=config, calls=calls,
                     input_shape=(entry.get("build_config") or {}).get("input_shape"))


def _value(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("class_name") == "__keras_tensor__":
            tensor = value["config"]
            layer, node, index = tensor["keras_history"]
            return Ref(str(layer), int(node), int(index), _shape(tensor.get("shape")),
                       tensor.get("dtype"))
        return {key: _value(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_value(item) for item in value)
    return value


def _refs(value: Any) -> Iterator[Ref]:
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _refs(item)


def _history_list(value: Any) -> tuple[Ref, ...]:
    """``input_layers``/``output_layers``: one [name, node, index], a list of them, or a dict.

    A dict is read in sorted key order: Keras flattens a model's dict of inputs (and outputs)
    that way (``keras.tree.flatten``), whatever order the config lists them in."""
    if isinstance(value, dict):
        return tuple(ref for key in sorted(value) for ref in _history_list(value[key]))
    if len(value) == 3 and isinstance(value[0], str):
        return (Ref(value[0], int(value[1]), int(value[2])),)
    return tuple(ref for item in value for ref in _history_list(item))


def _dict_keys(value: Any) -> tuple[str, ...] | None:
    """The keys of a dict of single outputs, in flattening order; None for any other form."""
    if isinstance(value, dict) and all(len(_history_list(item)) == 1 for item in value.values()):
        return tuple(str(key) for key in sorted(value))
    return None


def _shape(value: Any) -> tuple[int | None, ...] | None:
    return None if value is None else tuple(None if d is None else int(d) for d in value)


def _walk(layer: LayerNode) -> Iterator[LayerNode]:
    yield layer
    inner = layer.inner
    if inner is not None:
        yield from _walk(inner)
    for key in ("forward_layer", "backward_layer"):
        wrapped = layer.config.get(key)
        if isinstance(wrapped, dict):
            yield from _walk(_layer_node(wrapped, calls=()))
    for nested in layer.config.get("layers", []) if layer.class_name in MODEL_CLASSES else []:
        yield from _walk(_layer_node(nested))
