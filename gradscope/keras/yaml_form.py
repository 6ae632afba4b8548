"""A saved Keras model in the YAML spec's terms (``gradscope spec MODEL.keras``, ``--weights
MODEL.keras``), so that a model of the spec's kind gets what the YAML wing offers
(``check --against``, ``--layer``, ``--chunks``, the TF1 block layout).

Only a chain of Keras GRU, LSTM and SimpleRNN layers, then Dense ones, qualifies, every layer
read from ``config.json`` before TensorFlow loads; anything else is refused by name, with the
way to explain the model as it is. The weights are then Keras' own, keyed ``<layer
name>/<weight name>``, with a random batch and what Keras predicts on it, so that the spec's
own forward pass can be held against the model's (docs/weights.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradscope.errors import ConfigError
from gradscope.keras.graph import LayerNode, ModelGraph, Ref, read_graph, refuse_code
from gradscope.keras.live import is_builtin
from gradscope.keras.loss import plan_loss

SPEC_KINDS = {"GRU": "gru", "LSTM": "lstm", "SimpleRNN": "simple_rnn"}

#: What a recurrent layer's config must say for the YAML spec's cell to be the same function.
_RECURRENT_KEYS: dict[str, Any] = {
    "activation": "tanh", "use_bias": True, "go_backwards": False, "stateful": False,
    "return_state": False, "dropout": 0.0, "recurrent_dropout": 0.0,
}
_GATED_KEYS = {"recurrent_activation": "sigmoid"}
_DENSE_KEYS: dict[str, Any] = {"activation": "linear", "use_bias": True}
#: Config keys that add to the loss: none may be set.
_LOSS_KEYS = ("kernel_regularizer", "recurrent_regularizer", "bias_regularizer",
              "activity_regularizer")

#: A compiled loss's settings that keep it the YAML spec's loss: Keras' defaults.
DEFAULT_SETTINGS: dict[str, Any] = {"label_smoothing": 0.0, "reduction": "sum_over_batch_size",
                                    "axis": -1}

#: Examples and, where the model leaves them open, time steps of the batch the spec's forward
#: pass is held against the model's on.
PROBE_EXAMPLES = 3
PROBE_TIME_STEPS = 20


@dataclass(frozen=True)
class SavedForm:
    """What a saved model tells the spec beyond its weights' shapes."""

    source: str
    #: ``<layer>/<weight>`` → array, the chain's layers in order.
    arrays: dict[str, np.ndarray]
    #: time_steps, batch_size, loss, dtype → (value, why, whether the file says it).
    facts: dict[str, tuple[Any, str, bool]]
    #: Random inputs (B, T, F) and what Keras' own forward pass makes of them.
    probe_x: np.ndarray
    probe_predictions: np.ndarray


def spec_layers(graph: ModelGraph, fix: str) -> list[LayerNode]:
    """The recurrent then dense layers of ``graph``, in the order data flows through them;
    ConfigError (exit 2) names the first layer, key or wiring the YAML spec cannot hold.
    ``fix`` ends every refusal: how to explain the model as it is."""
    source = graph.source
    layers = graph.computing_layers
    if len(graph.inputs) != 1 or len(graph.outputs) != 1:
        raise ConfigError(f"{source}: a model with {len(graph.inputs)} inputs and "
                          f"{len(graph.outputs)} outputs; the YAML spec holds one of each; "
                          f"{fix}", where=source)
    previous = graph.inputs[0]
    seen_dense = False
    for layer in layers:
        # TimeDistributed(Dense) is a Dense at every step, as the YAML's dense layers are.
        inner = layer.inner if layer.class_name == "TimeDistributed" else None
        config = inner.config if inner is not None and inner.class_name == "Dense" and \
            is_builtin(inner.module) else layer.config
        kind = SPEC_KINDS.get(layer.class_name) or (
            "dense" if layer.class_name == "Dense" or config is not layer.config else None)
        if kind is None or not is_builtin(layer.module):
            what = (f"a {layer.class_name}" if is_builtin(layer.module) else
                    f"your own class '{layer.registered_name or layer.class_name}'")
            raise ConfigError(f"{source}: layer '{layer.name}' is {what}; the YAML spec holds "
                              "Keras GRU, LSTM and SimpleRNN layers, then Dense layers; "
                              f"{fix}", where=layer.name)
        calls = [call.input_refs() for call in layer.calls]
        extra = [key for call in layer.calls for key in call.kwarg_refs()]
        if len(calls) != 1 or calls[0] != [previous] or extra:
            raise ConfigError(f"{source}: layer '{layer.name}' is not fed by the layer before "
                              "it alone (the YAML spec is a chain of layers, each called "
                              f"once on the one before; no mask or initial state); {fix}",
                              where=layer.name)
        if kind == "dense":
            seen_dense = True
            expected = _DENSE_KEYS
        elif seen_dense:
            raise ConfigError(f"{source}: layer '{layer.name}' ({layer.class_name}) comes "
                              "after a Dense layer; the YAML spec holds its recurrent layers "
                              f"first; {fix}", where=layer.name)
        else:
            expected = {**_RECURRENT_KEYS, **(_GATED_KEYS if kind != "simple_rnn" else {})}
        for key, wanted in expected.items():
            found = config.get(key, wanted)
            if found != wanted:
                raise ConfigError(f"{source}: layer '{layer.name}' has {key} {found!r}; the "
                                  f"YAML spec's {'Dense' if kind == 'dense' else layer.class_name}"
                                  f" has {wanted!r}; {fix}", where=layer.name)
        for key in _LOSS_KEYS:
            if config.get(key) is not None or layer.config.get(key) is not None:
                raise ConfigError(f"{source}: layer '{layer.name}' has a {key}, which adds "
                                  f"to the loss; the YAML spec's loss has no such term; {fix}",
                                  where=layer.name)
        previous = Ref(layer.name, 0, 0)
    recurrent = [layer for layer in layers if layer.class_name in SPEC_KINDS]
    if not recurrent:
        raise ConfigError(f"{source}: no GRU, LSTM or SimpleRNN layer; the YAML spec starts "
                          f"with one; {fix}", where=source)
    for layer in recurrent[:-1]:
        if not layer.config.get("return_sequences"):
            raise ConfigError(f"{source}: layer '{layer.name}' has return_sequences False but "
                              "a recurrent layer follows it; the YAML spec's recurrent layers "
                              f"hand their whole sequence on; {fix}", where=layer.name)
    if graph.outputs[0] != previous:
        raise ConfigError(f"{source}: the model's output is not its last layer's; {fix}",
                          where=source)
    return layers


def _dtype(layer: LayerNode) -> str:
    policy = layer.config.get("dtype")
    if isinstance(policy, dict):
        policy = (policy.get("config") or {}).get("name")
    return str(policy or "float32")


def facts(graph: ModelGraph, layers: list[LayerNode], fix: str) -> dict[str, tuple[Any, str,
                                                                                   bool]]:
    """What the file says of the time steps, batch size, loss and dtype; a default where it
    says nothing the spec can hold."""
    source = graph.source
    dtypes = {_dtype(layer) for layer in layers}
    if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
        raise ConfigError(f"{source}: the layers compute in {', '.join(sorted(dtypes))}; the "
                          f"YAML spec computes in float32 or float64 throughout; {fix}",
                          where=source)
    found: dict[str, tuple[Any, str, bool]] = {}
    (dtype,) = dtypes
    found["dtype"] = (dtype, f"the layers' dtype policy is {dtype}", True)
    shape = list(graph.layer(graph.inputs[0].layer).config.get("batch_shape") or ())
    batch, steps, features = shape if len(shape) == 3 else (None, None, None)
    if steps is not None:
        found["time_steps"] = (int(steps), f"the model's input is ({batch}, {steps}, "
                               f"{features}): {steps} steps", True)
    if batch is not None:
        found["batch_size"] = (int(batch), f"the model's input has batch size {batch}", True)
    last = [layer for layer in layers if layer.class_name in SPEC_KINDS][-1]
    sequence = bool(last.config.get("return_sequences"))
    found["sequence_output"] = (sequence, f"layer '{last.name}' has return_sequences "
                                f"{sequence}", True)
    loss = _loss(graph)
    if loss is not None:
        found["loss"] = loss
    return found


def _loss(graph: ModelGraph) -> tuple[Any, str, bool] | None:
    """The YAML loss the compiled loss is (read as the Keras wing reads it,
    :func:`~gradscope.keras.loss.plan_loss`), the reason it is none, or None for a model
    saved without one."""
    plan = plan_loss(graph)
    if plan.source != "compiled" or len(plan.outputs) != 1:
        return None
    (output,) = plan.outputs
    # Settings that are not Keras' defaults (the label says the logits and a loss weight).
    unusual = [f"{key} {output.settings[key]!r}" for key, default in DEFAULT_SETTINGS.items()
               if output.settings.get(key, default) != default]
    plain = output.weight == 1.0 and not unusual
    if output.loss in ("categorical_crossentropy", "sparse_categorical_crossentropy") and \
            output.from_logits and plain:
        return ("softmax_cross_entropy",
                f"the model was compiled with {output.loss} from logits", True)
    if output.loss == "mean_squared_error" and plain:
        return "mse", "the model was compiled with mean_squared_error", True
    return (None, f"the model was compiled with {output.label}"
            + (f" ({', '.join(unusual)})" if unusual else "")
            + ", which the YAML spec does not hold (softmax_cross_entropy from logits or mse): "
            "a default; set the one you want", False)


def read_saved_form(path: str, imports: tuple[str, ...] = (), unsafe: bool = False
                    ) -> SavedForm:
    """The chain's weights and facts of the saved model at ``path``; everything the YAML spec
    cannot hold is refused before TensorFlow is imported."""
    graph = read_graph(path)
    name = Path(path).name
    code = "".join(f" --import {module}" for module in imports) + (" --unsafe" if unsafe
                                                                   else "")
    fix = f"explain the model as it is: gradscope explain {name}{code}"
    if not imports and not unsafe:
        refuse_code(graph)
    layers = spec_layers(graph, fix)
    found = facts(graph, layers, fix)

    from gradscope.keras.user_code import load_user_model

    model = load_user_model(path, imports, unsafe)
    arrays: dict[str, np.ndarray] = {}
    for node in layers:
        for weight in model.get_layer(node.name).weights:
            short = weight.path.rsplit("/", 1)[-1]
            arrays[f"{node.name}/{short}"] = np.asarray(weight.numpy())
    steps = found.get("time_steps", (PROBE_TIME_STEPS,))[0]
    features = int(np.asarray(model.inputs[0].shape)[-1])
    rng = np.random.default_rng(0)
    examples = found.get("batch_size", (PROBE_EXAMPLES,))[0]
    probe = rng.standard_normal((examples, steps, features)).astype(found["dtype"][0])
    predictions = np.asarray(model(probe, training=False))
    return SavedForm(source=str(path), arrays=arrays, facts=found, probe_x=probe,
                     probe_predictions=predictions)


__all__ = ["SavedForm", "read_saved_form", "spec_layers"]
