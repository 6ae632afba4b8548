"""A subclassed model (``class MyModel(keras.Model)`` with its own ``call``): its graph is its
code, so gradscope reads it by looking on one symbolic call.

The numbers never depend on this graph: the loss and every gradient come from Keras' own call
of the model under the tape, as for any model. The graph serves the explanations: Keras traces
``call`` with symbolic tensors of the model's build shape (``compute_output_spec``: no weight,
statistic or state moves), and each call of one of the model's own layers is recorded with the
tensors it received and returned. Tensors the call computes outside a layer (``x / 255``, a
sum of two layers' outputs) are attributed to the model's own call, which is listed as such.
Layers appear in the order the call made them.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from gradscope.errors import ConfigError, first_line
from gradscope.keras.graph import YOUR_CALL, Call, LayerNode, ModelGraph, Ref, qualify_custom


def is_subclassed(model: Any) -> bool:
    """Whether the model's graph is its own ``call`` (not a Sequential or functional model, nor
    a subclass of one that keeps the functional ``call``)."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    for kind in (Sequential, Functional):
        if isinstance(model, kind):
            return type(model).call is not kind.call
    return True


def tracked_layers(model: Any) -> list[Any]:
    """The layers the model holds directly (those its ``call`` calls)."""
    return list(model._flatten_layers(include_self=False, recursive=False))


#: The dtypes of the data a subclassed model's graph was read with (:func:`observed_graph`'s
#: ``data``): a later read of the same model takes them too.
_DATA_DTYPES: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()


def data_dtypes(x: Any) -> list[str] | None:
    """The dtype of each input of ``x`` (arrays, tensors or ``tf.TensorSpec``s: one, or a list
    or tuple of them); None for anything else (a dict: such a model is refused anyway)."""
    if x is None or isinstance(x, dict):
        return None
    items = list(x) if isinstance(x, list | tuple) else [x]
    found = [getattr(getattr(item, "dtype", None), "name", getattr(item, "dtype", None))
             for item in items]
    return [str(d) for d in found] if all(d is not None for d in found) else None


def file_dtypes(path: str) -> list[str] | None:
    """:func:`data_dtypes` of a data file's inputs, as a subclassed model's are named there
    (``x``; or ``x_1``, ``x_2``, …); None where the file is not such an .npz (its own errors
    are said where the batch is read)."""
    from gradscope.arrays import read_npz

    try:
        arrays = read_npz(path)
    except Exception:  # noqa: BLE001  (said where the batch is read, with the model's names)
        return None
    if "x" in arrays:
        return data_dtypes(arrays["x"])
    numbered = [arrays[f"x_{k}"] for k in range(1, len(arrays) + 1) if f"x_{k}" in arrays]
    return data_dtypes(numbered) if numbered else None


def input_dtypes(model: Any, count: int, data: list[str] | None,
                 floats: str | None = None) -> list[str]:
    """The dtype of each of the ``count`` inputs of ``model``: ``floats`` (default: the model's
    policy's variable dtype), but the data's own where that is whole numbers or booleans
    (token ids: a float would not index); ``data``: the user's inputs' dtypes, else those a
    read of the model's graph was given (:func:`observed_graph`)."""
    policy = floats or str(getattr(getattr(model, "dtype_policy", None), "variable_dtype",
                                   "float32"))
    data = data if data is not None and len(data) == count else _DATA_DTYPES.get(model)
    if data is None or len(data) != count:
        return [policy] * count
    return [d if _whole(d) else policy for d in data]


def _whole(dtype: str) -> bool:
    """Whether ``dtype`` holds whole numbers or booleans (token ids: a float would not
    index)."""
    return dtype.startswith(("int", "uint", "bool"))


def observed_graph(model: Any, label: str, data: list[str] | None = None) -> ModelGraph:
    """The graph of a subclassed model, from one symbolic call (see the module). ``data``: the
    dtypes of the user's inputs (:func:`data_dtypes`), where known: an input of whole numbers
    is traced as one (found tried as a new user would: a model whose call one-hot encodes
    its int32 ids could not be read from float32 ones). Where they are not known, an input
    only Embedding layers read is token ids, traced as int32, as explain feeds it (found
    tried as a new user would: ``shapes`` listed such ids as float32)."""
    known = data if data is not None and len(data) == len(_input_shapes(model, label)) \
        else _DATA_DTYPES.get(model)
    graph = _observed(model, label, known)
    if known is not None:
        if data is not None:
            _DATA_DTYPES[model] = list(data)
        return graph
    embedded = [_embedded(graph, ref) for ref in graph.inputs]
    if not any(embedded):
        return graph
    return _observed(model, label, ["int32" if ids else str(ref.dtype)
                                    for ref, ids in zip(graph.inputs, embedded, strict=True)])


def _embedded(graph: ModelGraph, ref: Ref) -> bool:
    """Whether every layer that reads ``ref`` is an Embedding (and one does)."""
    readers = graph.consumers(ref)
    return bool(readers) and all(layer.class_name == "Embedding" for layer, _ in readers)


def _observed(model: Any, label: str, known: list[str] | None) -> ModelGraph:
    """:func:`observed_graph`, its inputs traced with ``known`` dtypes (see
    :func:`input_dtypes`)."""
    import keras

    from gradscope.keras.observed_call import layers_wrapped

    shapes = _input_shapes(model, label)
    dtypes = input_dtypes(model, len(shapes), known)
    names = ["x"] if len(shapes) == 1 else [f"x_{k + 1}" for k in range(len(shapes))]
    specs = [keras.KerasTensor(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes,
                                                                            strict=True)]
    typed = dict(zip(names, dtypes, strict=True))
    produced: dict[int, Ref] = {}
    calls: dict[str, list[Call]] = {}
    order: list[Any] = []
    yours = _yours(model)
    model_call = model.call
    returned: list[Any] = []  # what the call returned, before Keras wraps it

    def inputs_seen(*args: Any, **kwargs: Any) -> Any:
        # The model's call, with the symbolic inputs Keras made: they are the graph's inputs.
        for name, tensor in zip(names, _flat(args[:1] if len(names) == 1 else args),
                                strict=False):
            produced[id(tensor)] = Ref(name, 0, 0, _shape(tensor), typed[name])
        returned[:] = [model_call(*args, **kwargs)]
        return returned[0]

    def wrap(layer: Any, keras_call: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = keras_call(*args, **kwargs)
            node = len(calls.setdefault(layer.name, []))
            if layer not in order:
                order.append(layer)
            calls[layer.name].append(Call(
                args=tuple(_ref(t, produced, yours) for t in args),
                kwargs={key: _ref(value, produced, yours) for key, value in kwargs.items()
                        if key != "training"}))
            for index, tensor in enumerate(_flat(out)):
                produced[id(tensor)] = Ref(layer.name, node, index, _shape(tensor),
                                           _dtype(tensor))
            return out

        return call

    object.__setattr__(model, "call", inputs_seen)  # not tracked: a hook, not the model's
    try:
        with layers_wrapped(tracked_layers(model), wrap):
            result = model.compute_output_spec(specs if len(specs) > 1 else specs[0])
    except Exception as exc:  # the user's call, traced: anything
        # Found tried as a new user would: a call that one-hot encodes int32 ids, explained
        # with no batch, failed on float32 ones, and nothing said how to give their dtype.
        unknown = known is None and not all(_whole(d) for d in dtypes)
        hint = (f" (its inputs read as {', '.join(sorted(set(dtypes)))}, as no batch of yours "
                "gave their dtypes: given one, x=… in Python or --data on the command line, "
                "they are read with its dtypes)" if unknown else "")
        raise ConfigError(f"{label}: gradscope reads a subclassed model's graph from one "
                          f"symbolic call of it, which fails: {first_line(exc)}{hint}",
                          where=label) from None
    finally:
        object.__delattr__(model, "call")
    outputs = tuple(produced.get(id(t), Ref(yours, 0, k, _shape(t)))
                    for k, t in enumerate(_flat(returned[0] if returned else result)))
    inputs = tuple(Ref(name, 0, 0, tuple(shape), typed[name])
                   for name, shape in zip(names, shapes, strict=True))
    layers = [LayerNode(name=name, class_name="InputLayer", module="keras.layers",
                        registered_name=None,
                        config={"batch_shape": list(shape), "dtype": typed[name], "name": name},
                        calls=()) for name, shape in zip(names, shapes, strict=True)]
    for layer in order:
        entry = _serialised(layer)
        qualify_custom(entry)
        layers.append(LayerNode(name=layer.name, class_name=str(entry.get("class_name")),
                                module=entry.get("module"),
                                registered_name=entry.get("registered_name"),
                                config=entry.get("config") or {},
                                calls=tuple(calls[layer.name])))
    layers.append(LayerNode(name=yours, class_name=YOUR_CALL,
                            module=type(model).__module__, registered_name=None, config={},
                            calls=()))
    compile_config = None
    if getattr(model, "compiled", False):
        compile_config = json.loads(json.dumps(model.get_compile_config(), default=str))
    return ModelGraph(source=label, name=getattr(model, "name", "model"), kind="Subclassed",
                      layers=tuple(layers), inputs=inputs, outputs=outputs,
                      compile_config=compile_config)


def _yours(model: Any) -> str:
    return f"{type(model).__name__}.call"


def _input_shapes(model: Any, label: str) -> list[tuple[int | None, ...]]:
    """The model's input shapes, from its build (``model.build(shape)`` or a first call)."""
    config = model.get_build_config() if hasattr(model, "get_build_config") else None
    shape = (config or {}).get("input_shape")
    if shape is None:
        raise ConfigError(f"{label}: is a subclassed model that is not built yet (no input "
                          "shape); call it once on a batch, or model.build(input_shape)",
                          where=label)
    if isinstance(shape, dict):
        raise ConfigError(f"{label}: is a subclassed model that takes a dict of inputs; "
                          "gradscope reads subclassed models with one input or a list of "
                          "them", where=label)
    shapes = shape if shape and all(isinstance(s, list | tuple) for s in shape) else [shape]
    # The batch it was built with is any batch.
    return [(None, *(None if d is None else int(d) for d in s[1:])) for s in shapes]


def _serialised(layer: Any) -> dict[str, Any]:
    """A layer's config as a saved file holds it; a layer whose ``get_config`` fails keeps its
    class and module."""
    from keras.saving import serialize_keras_object

    try:
        entry = json.loads(json.dumps(serialize_keras_object(layer), default=str))
    except Exception:  # noqa: BLE001  (the user's get_config)
        entry = {"class_name": type(layer).__name__, "module": type(layer).__module__,
                 "config": {"name": layer.name}}
    return entry if isinstance(entry, dict) else {}


def _flat(value: Any) -> list[Any]:
    import keras

    return [t for t in keras.tree.flatten(value) if hasattr(t, "shape")]


def _ref(value: Any, produced: dict[int, Ref], yours: str) -> Any:
    """The tensors in an argument as Refs (unknown ones: what the model's call computed,
    ``yours``); plain values as they are, anything else as None."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return produced.get(id(value), Ref(yours, 0, 0, _shape(value), _dtype(value)))
    if isinstance(value, list | tuple):
        return tuple(_ref(item, produced, yours) for item in value)
    if isinstance(value, dict):
        return {key: _ref(item, produced, yours) for key, item in value.items()}
    return value if isinstance(value, str | int | float | bool | type(None)) else None


def _shape(tensor: Any) -> tuple[int | None, ...]:
    return tuple(None if d is None else int(d) for d in tensor.shape)


def _dtype(tensor: Any) -> str:
    return str(getattr(tensor.dtype, "name", tensor.dtype))
