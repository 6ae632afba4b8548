"""Hypothesis draws random functional Keras models; gradscope explains each exactly or refuses
it in one line.

Every example is a small program (the reproducer Hypothesis prints on a failure): Keras layers
of some fifty built-in types wired into a functional graph (shared layers and shared
sub-models, several inputs and outputs, dict outputs, masks, weight and activity
regularizers, Bidirectional, TimeDistributed, stateful recurrent layers), compiled with an
ordinary loss, and a batch. Two outcomes are allowed:

- ``gradscope.explain(model, x=x, y=y)`` gives Keras' own numbers: the loss and the L2 norm
  of every weight gradient equal those of Keras' GradientTape over ``model(x)`` and
  ``model.compute_loss`` on the same batch (rel 1e-5, float32), and the model's variables
  (weights, stateful layers' carried states, batch-norm statistics) are unchanged;
- or a refusal: a GradscopeError of exit code 2 (ConfigError, DataError) with a one-line
  message.

Anything else fails: a mismatch, an InternalError (gradscope disagreeing with itself) or any
other exception.

The default run draws 30 examples, derandomized so that CI sees the same models every time.
``GRADSCOPE_LONG_FUZZ=1`` draws 500 random ones (a new set each run; a failure prints its
program)::

    GRADSCOPE_LONG_FUZZ=1 .venv/bin/pytest tests/test_keras_generated.py \
        --hypothesis-show-statistics
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import gradscope
from gradscope.errors import GradscopeError, InternalError

#: ``GRADSCOPE_LONG_FUZZ=1``: 500 random examples instead of the 30 derandomized ones.
LONG = os.environ.get("GRADSCOPE_LONG_FUZZ", "").strip() == "1"
MAX_EXAMPLES = 500 if LONG else 30
RTOL = 1e-5

PRELUDE = "import numpy as np\nimport keras\nfrom keras import layers\n"
VOCAB = 8  # token ids of an integer input are below this; 0 is padding


class Code(str):
    """A piece of program text: repr() writes it as it is, not as a string literal."""

    def __repr__(self) -> str:
        return str(self)


REGULARIZERS = [Code("keras.regularizers.L2(0.01)"), Code("keras.regularizers.L1(0.01)"),
                Code("keras.regularizers.L1L2(l1=0.01, l2=0.01)")]
ACTIVATIONS = ["relu", "tanh", "sigmoid", "softmax", "elu", "gelu", "swish", "softplus",
               "linear"]
#: Per output: the loss, the activation of its Dense head ("any": drawn; None: linear) and
#: the targets. The regression losses also serve outputs without a head.
LOSSES = [
    ("'mse'", "any", "real"),
    ("'binary_crossentropy'", "sigmoid", "binary"),
    ("'categorical_crossentropy'", "softmax", "onehot"),
    ("'sparse_categorical_crossentropy'", "softmax", "classes"),
    ("'mae'", "any", "real"),
    ("'huber'", "any", "real"),
    ("'log_cosh'", "any", "real"),
    ("keras.losses.MeanSquaredError()", "any", "real"),
    ("keras.losses.BinaryCrossentropy(from_logits=True)", None, "binary"),
    ("keras.losses.CategoricalCrossentropy(from_logits=True)", None, "onehot"),
]
REGRESSION = [loss for loss in LOSSES if loss[2] == "real"]


@dataclass(frozen=True)
class _Tensor:
    name: str
    kind: str  # "tok" (int ids, 2-D), "seq" (float, 3-D), "vec" (float, 2-D)
    shape: tuple[int, ...]  # without the batch axis
    deps: frozenset[int]  # the model inputs it depends on


@dataclass(frozen=True)
class _Shareable:
    var: str
    kind: str
    shape: tuple[int, ...]
    whole_shape: bool  # a sub-model: its Input fixes every axis, not only the last


@dataclass(frozen=True)
class Recipe:
    """The program of one example: it builds ``model``, ``x`` and ``y``."""

    code: str
    stateful: bool
    #: Lines the generator drew but Keras refused while building (not in the program).
    left_out: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Recipe(stateful={self.stateful}) with the program:\n{self.code}"

    def features(self) -> list[str]:
        """What the program exercises, for Hypothesis' statistics."""
        marks = {"stateful": "stateful=True", "sub-model": "= keras.Model(i",
                 "Embedding mask": "mask_zero=True",
                 "Masking": "layers.Masking(", "Bidirectional": "layers.Bidirectional(",
                 "TimeDistributed": "layers.TimeDistributed(", "regularizer": "regularizer=",
                 "attention": "Attention("}
        found = [name for name, mark in marks.items() if mark in self.code]
        lines = self.code.splitlines()
        if any(line.startswith("model = keras.Model(") and "{" in line for line in lines):
            found.append("dict outputs")
        layer_vars = {line.split(" = ")[0] for line in lines
                      if " = layers." in line or " = keras.Model(i" in line}
        calls = [line.split(" = ")[-1].split("(")[0] for line in lines]
        if any(calls.count(var) > 1 for var in layer_vars):
            found.append("shared call")
        return found

    def build(self) -> dict[str, Any]:
        namespace: dict[str, Any] = {}
        exec(PRELUDE + self.code, namespace)  # noqa: S102 - the generated program
        return namespace


def _call(args: list[Any], kwargs: dict[str, Any]) -> str:
    return ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])


def _dict_text(keys: list[str], values: list[Any]) -> str:
    return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(keys, values, strict=True)) + "}"


class _Builder:
    """Writes the program line by line, running each line on Keras' symbolic tensors so that
    every later draw sees real shapes. A line Keras refuses is left out of the program."""

    def __init__(self, draw: Any, batch: int, stateful: bool) -> None:
        self.draw = draw
        self.batch = batch
        self.stateful = stateful
        self.lines: list[str] = []
        self.ns: dict[str, Any] = {}
        state = random.getstate()
        exec(PRELUDE, self.ns)  # noqa: S102
        random.setstate(state)
        self.pool: list[_Tensor] = []
        self.inputs: list[_Tensor] = []
        self.padded: list[bool] = []  # per input: whether its batch has padding
        self.shareable: list[_Shareable] = []
        self.count = 0
        self.rejected: list[str] = []

    # -- plumbing ---------------------------------------------------------------------------

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def emit(self, code: str, outs: list[str], deps: frozenset[int],
             share: tuple[str, _Tensor, bool] | None = None) -> list[_Tensor] | None:
        """Run ``code`` and add it to the program; None (and nothing added) when Keras
        refuses it."""
        state = random.getstate()  # Keras seeds a Dropout's generator from `random`
        try:
            exec(code, self.ns)  # noqa: S102
        except Exception as exc:  # Keras refuses the combination: leave it out
            self.rejected.append(f"{code!r}: {type(exc).__name__}: "
                                 f"{str(exc).strip()[:200]}")
            return None
        finally:
            random.setstate(state)
        self.lines.extend(code.splitlines())
        made = [t for t in (self.tensor(out, deps) for out in outs) if t is not None]
        self.pool.extend(made)
        if share is not None:
            var, source, whole = share
            self.shareable.append(_Shareable(var, source.kind, source.shape, whole))
        return made

    def tensor(self, name: str, deps: frozenset[int]) -> _Tensor | None:
        value = self.ns[name]
        shape = tuple(value.shape[1:])
        if any(d is None or d < 1 or d > 40 for d in shape):
            return None
        if "int" in str(value.dtype) and len(shape) == 1:
            return _Tensor(name, "tok", shape, deps)
        if "float" not in str(value.dtype):
            return None
        kind = {2: "seq", 1: "vec"}.get(len(shape))
        return None if kind is None else _Tensor(name, kind, shape, deps)

    def layer(self, cls: str, args: list[Any], kwargs: dict[str, Any], inputs: str,
              deps: frozenset[int], n_out: int = 1, source: _Tensor | None = None,
              call_kwargs: str = "") -> list[_Tensor] | None:
        """``var = layers.cls(...)`` then ``t = var(inputs)``; ``source``: the layer may be
        shared later with tensors like it."""
        var = self.fresh(cls.split(".")[-1].lower()[:10])
        outs = [self.fresh("t") for _ in range(n_out)]
        code = (f"{var} = {cls}({_call(args, {**kwargs, 'name': var})})\n"
                f"{', '.join(outs)} = {var}({inputs}{call_kwargs})")
        share = (var, source, False) if source is not None else None
        return self.emit(code, outs, deps, share)

    def units(self) -> int:
        return self.draw(st.integers(2, 5))

    def options(self, available: dict[str, Any]) -> dict[str, Any]:
        """A few optional keyword arguments (none when shrunk)."""
        chosen = self.draw(st.sets(st.sampled_from(sorted(available)), max_size=2))
        return {k: self.draw(v) if isinstance(v, st.SearchStrategy) else v
                for k, v in available.items() if k in chosen}

    def is_stateful(self) -> bool:
        """Whether a recurrent layer of a fixed-batch model keeps its state between batches
        (mostly)."""
        return self.stateful and self.draw(st.integers(0, 3)) != 0

    def partner(self, t: _Tensor, same: Any) -> _Tensor | None:
        """Another tensor of the pool (maybe ``t`` itself) for which ``same(other)`` holds."""
        candidates = [o for o in self.pool if same(o)]
        return self.draw(st.sampled_from(candidates)) if candidates else None

    # -- inputs -----------------------------------------------------------------------------

    def add_input(self, index: int, steps: int) -> None:
        integer = self.draw(st.integers(0, 3)) == 3
        features = self.draw(st.integers(2, 5))
        shape = (steps,) if integer else (steps, features)
        extra = f", batch_size={self.batch}" if self.stateful else ""
        extra += ', dtype="int32"' if integer else ""
        name = f"in{index}"
        made = self.emit(f"{name} = keras.Input({shape!r}{extra}, name={name!r})", [name],
                         frozenset({index}))
        assert made, self.rejected[-1]
        self.inputs.extend(made)
        # Padded batches (zero trailing steps) want masks: often one straight away.
        self.padded.append(self.draw(st.booleans()))
        if self.padded[-1] and self.draw(st.booleans()):
            (self.op_masking if not integer else self.op_embedding)(made[0])

    # -- operations -------------------------------------------------------------------------

    def op_dense(self, t: _Tensor) -> None:
        self.layer("layers.Dense", [self.units()], self.options({
            "activation": st.sampled_from(ACTIVATIONS), "use_bias": False,
            "kernel_regularizer": st.sampled_from(REGULARIZERS),
            "bias_regularizer": st.sampled_from(REGULARIZERS),
            "activity_regularizer": st.sampled_from(REGULARIZERS)}), t.name, t.deps, source=t)

    def recurrent_options(self, kind: str) -> dict[str, Any]:
        available: dict[str, Any] = {
            "go_backwards": True, "use_bias": False, "unroll": True, "dropout": 0.2,
            "recurrent_dropout": 0.2, "activation": st.sampled_from(["relu", "sigmoid"]),
            "kernel_regularizer": st.sampled_from(REGULARIZERS),
            "recurrent_regularizer": st.sampled_from(REGULARIZERS),
            "bias_regularizer": st.sampled_from(REGULARIZERS),
            "activity_regularizer": st.sampled_from(REGULARIZERS)}
        if kind == "GRU":
            available["reset_after"] = False
        if kind == "LSTM":
            available["unit_forget_bias"] = False
        return self.options(available)

    def op_recurrent(self, t: _Tensor) -> None:
        kind = self.draw(st.sampled_from(["GRU", "LSTM", "SimpleRNN"]))
        kwargs = self.recurrent_options(kind)
        units = self.units()
        initial: list[str] = []
        vectors = [o for o in self.pool if o.kind == "vec"]
        if vectors and self.draw(st.integers(0, 2)) == 2:  # initial_state from the graph
            first = self.draw(st.sampled_from(vectors))
            units = first.shape[0]
            initial = [first.name]
            if kind == "LSTM":
                initial.append(self.draw(st.sampled_from(
                    [o for o in vectors if o.shape == first.shape])).name)
        if self.draw(st.booleans()):
            kwargs["return_sequences"] = True
        if self.is_stateful():
            kwargs["stateful"] = True
        n_out = 1
        if self.draw(st.integers(0, 3)) == 3:
            kwargs["return_state"] = True
            n_out = 3 if kind == "LSTM" else 2
        deps = t.deps.union(*(o.deps for o in self.pool if o.name in initial))
        call = f", initial_state=[{', '.join(initial)}]" if initial else ""
        plain = not initial and n_out == 1
        self.layer(f"layers.{kind}", [units], kwargs, t.name, deps, n_out=n_out,
                   source=t if plain else None, call_kwargs=call)

    def op_rnn_cell(self, t: _Tensor) -> None:
        cells = []
        for _ in range(self.draw(st.integers(1, 2))):
            kind = self.draw(st.sampled_from(["GRUCell", "LSTMCell", "SimpleRNNCell"]))
            cells.append(Code(f"layers.{kind}({self.units()}, name={self.fresh('cell')!r})"))
        cell = cells[0] if len(cells) == 1 else Code(f"layers.StackedRNNCells({cells!r})")
        kwargs = self.options({"return_sequences": True, "go_backwards": True,
                               "unroll": True})
        if self.is_stateful():
            kwargs["stateful"] = True
        self.layer("layers.RNN", [cell], kwargs, t.name, t.deps, source=t)

    def op_bidirectional(self, t: _Tensor) -> None:
        kind = self.draw(st.sampled_from(["GRU", "LSTM", "SimpleRNN"]))
        inner = {**self.recurrent_options(kind)}
        inner.pop("go_backwards", None)
        if self.draw(st.booleans()):
            inner["return_sequences"] = True
        if self.is_stateful():
            inner["stateful"] = True
        units = self.units()
        forward = Code(f"layers.{kind}({_call([units], {**inner, 'name': self.fresh('fw')})})")
        mode = self.draw(st.sampled_from(["concat", "sum", "ave", "mul", None]))
        kwargs: dict[str, Any] = {"merge_mode": mode}
        if self.draw(st.integers(0, 3)) == 3:  # a backward layer of its own
            back = self.draw(st.sampled_from(["GRU", "LSTM", "SimpleRNN"]))
            back_kwargs = {"go_backwards": True, "name": self.fresh("bw")}
            for key in ("return_sequences", "stateful"):
                if key in inner:
                    back_kwargs[key] = inner[key]
            kwargs["backward_layer"] = Code(f"layers.{back}({_call([units], back_kwargs)})")
        self.layer("layers.Bidirectional", [forward], kwargs, t.name, t.deps,
                   n_out=2 if mode is None else 1, source=t if mode is not None else None)

    def op_time_distributed(self, t: _Tensor) -> None:
        inner = self.draw(st.sampled_from([
            f"layers.Dense({self.units()}, activation='tanh', name={self.fresh('td')!r})",
            f"layers.Dense({self.units()}, name={self.fresh('td')!r})",
            f"layers.LayerNormalization(name={self.fresh('td')!r})"]))
        self.layer("layers.TimeDistributed", [Code(inner)], {}, t.name, t.deps, source=t)

    def op_conv1d(self, t: _Tensor) -> None:
        steps = t.shape[0]
        size = self.draw(st.integers(1, 3))
        padding = self.draw(st.sampled_from(["same", "causal", "valid"]))
        if padding == "valid" and steps - size + 1 < 2:
            padding = "same"
        kwargs: dict[str, Any] = {"padding": padding, **self.options({
            "activation": st.sampled_from(ACTIVATIONS), "use_bias": False,
            "kernel_regularizer": st.sampled_from(REGULARIZERS),
            "activity_regularizer": st.sampled_from(REGULARIZERS)})}
        if self.draw(st.integers(0, 3)) == 3:
            if padding == "valid":
                kwargs["strides"] = 2
            else:
                kwargs["dilation_rate"] = 2
        self.layer("layers.Conv1D", [self.units(), size], kwargs, t.name, t.deps, source=t)

    def op_normalize(self, t: _Tensor) -> None:
        cls = self.draw(st.sampled_from(["LayerNormalization", "BatchNormalization",
                                         "UnitNormalization"]))
        kwargs: dict[str, Any] = {}
        if cls != "UnitNormalization":
            kwargs = self.options({"center": False, "scale": False,
                                   "gamma_regularizer": st.sampled_from(REGULARIZERS),
                                   "epsilon": 0.1})
        self.layer(f"layers.{cls}", [], kwargs, t.name, t.deps, source=t)

    def op_noise(self, t: _Tensor) -> None:
        choices = ["Dropout(0.3", "GaussianNoise(0.1", "GaussianDropout(0.2",
                   "ActivityRegularization(l1=0.01, l2=0.02"]
        if t.kind == "seq":
            choices.append("SpatialDropout1D(0.3")
        cls = self.draw(st.sampled_from(choices))
        var = self.fresh(cls.split("(")[0].lower()[:10])
        out = self.fresh("t")
        self.emit(f"{var} = layers.{cls}, name={var!r})\n{out} = {var}({t.name})", [out],
                  t.deps, share=(var, t, False))

    def op_activation(self, t: _Tensor) -> None:
        layer = self.draw(st.sampled_from([
            f"Activation({self.draw(st.sampled_from(ACTIVATIONS))!r}", "ReLU(max_value=1.0",
            "LeakyReLU(negative_slope=0.2", "Softmax(", "ELU(", "PReLU("]))
        var = self.fresh(layer.split("(")[0].lower()[:10])
        out = self.fresh("t")
        sep = ", " if not layer.endswith("(") else ""
        self.emit(f"{var} = layers.{layer}{sep}name={var!r})\n{out} = {var}({t.name})", [out],
                  t.deps, share=(var, t, False))

    def op_pool_global(self, t: _Tensor) -> None:
        cls = self.draw(st.sampled_from(["GlobalAveragePooling1D", "GlobalMaxPooling1D"]))
        self.layer(f"layers.{cls}", [], {}, t.name, t.deps, source=t)

    def op_pool_local(self, t: _Tensor) -> None:
        cls = self.draw(st.sampled_from(["MaxPooling1D", "AveragePooling1D"]))
        padding = "valid" if t.shape[0] >= 2 and self.draw(st.booleans()) else "same"
        self.layer(f"layers.{cls}", [2], {"padding": padding}, t.name, t.deps, source=t)

    def op_reshape(self, t: _Tensor) -> None:
        steps, features = t.shape
        kind = self.draw(st.sampled_from(["flatten", "vector", "swap", "permute"]))
        if kind == "flatten":
            self.layer("layers.Flatten", [], {}, t.name, t.deps, source=t)
        elif kind == "vector":
            self.layer("layers.Reshape", [(steps * features,)], {}, t.name, t.deps)
        elif kind == "swap":
            self.layer("layers.Reshape", [(features, steps)], {}, t.name, t.deps)
        else:
            self.layer("layers.Permute", [(2, 1)], {}, t.name, t.deps, source=t)

    def op_time_axis(self, t: _Tensor) -> None:
        steps = t.shape[0]
        kinds = ["pad"] + (["crop"] if steps >= 3 else []) + (["up"] if steps <= 4 else [])
        kind = self.draw(st.sampled_from(kinds))
        if kind == "pad":
            amount = (self.draw(st.integers(0, 2)), self.draw(st.integers(1, 2)))
            self.layer("layers.ZeroPadding1D", [amount], {}, t.name, t.deps, source=t)
        elif kind == "crop":
            start = self.draw(st.integers(0, 1))
            self.layer("layers.Cropping1D", [(start, 1)], {}, t.name, t.deps, source=t)
        else:
            self.layer("layers.UpSampling1D", [2], {}, t.name, t.deps, source=t)

    def op_masking(self, t: _Tensor) -> None:
        self.layer("layers.Masking", [], {"mask_value": 0.0}, t.name, t.deps, source=t)

    def op_multi_head_attention(self, t: _Tensor) -> None:
        value = self.partner(t, lambda o: o.kind == "seq")
        assert value is not None  # t itself
        key = self.partner(t, lambda o: o.kind == "seq" and o.shape[0] == value.shape[0])
        assert key is not None
        kwargs = self.options({"value_dim": st.integers(2, 3), "use_bias": False,
                               "dropout": 0.2,
                               "kernel_regularizer": st.sampled_from(REGULARIZERS)})
        form = self.draw(st.sampled_from(["positional", "key", "keyword"]))
        if form == "positional":
            inputs = f"{t.name}, {value.name}"
        elif form == "key":
            inputs = f"{t.name}, {value.name}, {key.name}"
        else:
            inputs = f"query={t.name}, value={value.name}"
        extra = ""
        if t.shape[0] == value.shape[0] and self.draw(st.booleans()):
            extra = ", use_causal_mask=True"
        deps = t.deps | value.deps | (key.deps if form == "key" else frozenset())
        self.layer("layers.MultiHeadAttention", [], {
            "num_heads": self.draw(st.integers(1, 2)), "key_dim": self.draw(st.integers(2, 3)),
            **kwargs}, inputs, deps, call_kwargs=extra)

    def op_attention(self, t: _Tensor) -> None:
        value = self.partner(t, lambda o: o.kind == "seq" and o.shape[-1] == t.shape[-1])
        assert value is not None
        key = self.partner(t, lambda o: o.kind == "seq" and o.shape == value.shape)
        assert key is not None
        cls = self.draw(st.sampled_from(["Attention", "AdditiveAttention"]))
        kwargs = self.options({"use_scale": False} if cls == "AdditiveAttention" else
                              {"use_scale": True, "score_mode": "concat"})
        with_key = self.draw(st.booleans())
        inputs = f"[{t.name}, {value.name}" + (f", {key.name}]" if with_key else "]")
        extra = ""
        if t.shape[0] == value.shape[0] and self.draw(st.booleans()):
            extra = ", use_causal_mask=True"
        deps = t.deps | value.deps | (key.deps if with_key else frozenset())
        self.layer(f"layers.{cls}", [], kwargs, inputs, deps, call_kwargs=extra)

    def op_merge(self, t: _Tensor) -> None:
        cls = self.draw(st.sampled_from(["Add", "Concatenate", "Subtract", "Multiply",
                                         "Average", "Maximum", "Minimum"]))
        kwargs: dict[str, Any] = {}
        if cls == "Concatenate":
            along_time = t.kind == "seq" and self.draw(st.booleans())
            if along_time:
                kwargs["axis"] = 1
                other = self.partner(t, lambda o: o.kind == t.kind and
                                     o.shape[1:] == t.shape[1:])
            else:
                other = self.partner(t, lambda o: o.kind == t.kind and
                                     o.shape[:-1] == t.shape[:-1])
        else:
            other = self.partner(t, lambda o: o.kind == t.kind and o.shape == t.shape)
        assert other is not None
        group = [t, other]
        if cls not in ("Subtract",) and self.draw(st.integers(0, 3)) == 3:
            third = self.partner(t, lambda o: o.kind == t.kind and o.shape == t.shape)
            if third is not None and cls != "Concatenate":
                group.append(third)
        inputs = "[" + ", ".join(o.name for o in group) + "]"
        self.layer(f"layers.{cls}", [], kwargs, inputs, frozenset().union(*(o.deps
                                                                              for o in group)))

    def op_dot(self, t: _Tensor) -> None:
        other = self.partner(t, lambda o: o.kind == "vec" and o.shape == t.shape)
        assert other is not None
        self.layer("layers.Dot", [], {"axes": 1, **self.options({"normalize": True})},
                   f"[{t.name}, {other.name}]", t.deps | other.deps)

    def op_repeat(self, t: _Tensor) -> None:
        self.layer("layers.RepeatVector", [self.draw(st.integers(2, 5))], {}, t.name, t.deps,
                   source=t)

    def op_vector_to_sequence(self, t: _Tensor) -> None:
        (size,) = t.shape
        factors = [a for a in range(2, size) if size % a == 0]
        if not factors:
            self.op_repeat(t)
            return
        steps = self.draw(st.sampled_from(factors))
        self.layer("layers.Reshape", [(steps, size // steps)], {}, t.name, t.deps, source=t)

    def op_embedding(self, t: _Tensor) -> None:
        kwargs = {"mask_zero": self.draw(st.integers(0, 2)) != 0, **self.options(
            {"embeddings_regularizer": st.sampled_from(REGULARIZERS)})}
        self.layer("layers.Embedding", [self.draw(st.integers(VOCAB, VOCAB + 2)),
                                        self.units()], kwargs, t.name, t.deps, source=t)

    def op_shared(self, t: _Tensor) -> None:
        """A layer or sub-model already called on a tensor like ``t``, called on ``t`` too."""
        fits = [s for s in self.shareable if s.kind == t.kind and (
            s.shape == t.shape if s.whole_shape else s.shape[-1:] == t.shape[-1:])]
        if not fits:
            return
        shared = self.draw(st.sampled_from(fits))
        out = self.fresh("t")
        self.emit(f"{out} = {shared.var}({t.name})", [out], t.deps)

    def op_submodel(self, t: _Tensor) -> None:
        """A keras.Model of one to two layers, called on ``t`` and maybe on a second tensor
        of the same shape."""
        entry = self.fresh("i")
        batch = f", batch_size={self.batch}" if self.stateful else ""
        dtype = ', dtype="int32"' if t.kind == "tok" else ""
        lines = [f"{entry} = keras.Input({t.shape!r}{batch}{dtype}, name={entry!r})"]
        hidden, kind, outputs = entry, t.kind, []
        if kind == "tok":
            name, hidden, kind = self.fresh("emb"), self.fresh("h"), "seq"
            lines.append(f"{hidden} = layers.Embedding({VOCAB}, {self.units()}, "
                         f"mask_zero={self.draw(st.booleans())}, name={name!r})({entry})")
        elif kind == "seq" and self.draw(st.integers(0, 3)) == 3:  # a mask made inside
            name, hidden = self.fresh("mask"), self.fresh("h")
            lines.append(f"{hidden} = layers.Masking(0.0, name={name!r})({entry})")
        for _ in range(self.draw(st.integers(1, 2))):
            menu = ["Dense", "LayerNormalization"] + (
                ["GRU", "LSTM", "Conv1D", "BidirectionalGRU"] if kind == "seq" else [])
            cls = self.draw(st.sampled_from(menu))
            name, out = self.fresh(cls.lower()[:5]), self.fresh("h")
            regular = self.options({"activity_regularizer": st.sampled_from(REGULARIZERS),
                                    "kernel_regularizer": st.sampled_from(REGULARIZERS)})
            if cls == "LayerNormalization":
                regular = {}
            args: list[Any] = [] if cls == "LayerNormalization" else [self.units()]
            if cls in ("GRU", "LSTM"):
                if self.draw(st.booleans()):
                    regular["return_sequences"] = True
                else:
                    kind = "vec"
            if cls == "Conv1D":
                args.append(2)
                regular["padding"] = "same"
            text = f"layers.{cls}({_call(args, {**regular, 'name': name})})"
            if cls == "BidirectionalGRU":
                text = (f"layers.Bidirectional(layers.GRU({self.units()}, "
                        f"return_sequences=True), name={name!r})")
            lines.append(f"{out} = {text}({hidden})")
            outputs.append(out)
            hidden = out
        two = len(outputs) == 2 and self.draw(st.integers(0, 3)) == 3
        result = f"[{outputs[-1]}, {outputs[0]}]" if two else outputs[-1]
        model = self.fresh("sub")
        lines.append(f"{model} = keras.Model({entry}, {result}, name={model!r})")
        calls = [t]
        again = self.partner(t, lambda o: o.kind == t.kind and o.shape == t.shape)
        if again is not None and self.draw(st.booleans()):
            calls.append(again)
        outs: list[str] = []
        for source in calls:
            names = [self.fresh("t") for _ in range(2 if two else 1)]
            outs.extend(names)
            lines.append(f"{', '.join(names)} = {model}({source.name})")
        self.emit("\n".join(lines), outs, frozenset().union(*(c.deps for c in calls)),
                  share=None if two else (model, t, True))

    OPS = {
        "tok": ["embedding", "shared", "submodel"],
        "seq": ["dense", "recurrent", "rnn_cell", "bidirectional", "time_distributed",
                "conv1d", "normalize", "noise", "activation", "pool_global", "pool_local",
                "reshape", "time_axis", "masking", "multi_head_attention", "attention",
                "merge", "shared", "submodel"],
        "vec": ["dense", "normalize", "noise", "activation", "repeat", "vector_to_sequence",
                "merge", "dot", "shared", "submodel"],
    }

    def step(self) -> None:
        t = self.draw(st.sampled_from(self.pool))
        op = self.draw(st.sampled_from(self.OPS[t.kind]))
        getattr(self, f"op_{op}")(t)

    # -- outputs, loss and batch ------------------------------------------------------------

    def must(self, made: list[_Tensor] | None) -> _Tensor:
        """The one tensor of a line the generator needs: Keras refusing it is a bug of the
        generator."""
        assert made is not None and len(made) == 1, (
            "Keras refuses a line the generator needs:\n" + "\n".join(self.lines) + "\n"
            + self.rejected[-1])
        return made[0]

    def to_vector(self, t: _Tensor) -> _Tensor:
        """``t`` as a vector, for joining an input that no output depends on yet."""
        if t.kind == "tok":
            t = self.must(self.layer("layers.Embedding", [VOCAB, 2], {}, t.name, t.deps))
        if t.kind == "seq":
            t = self.must(self.layer("layers.GlobalAveragePooling1D", [], {}, t.name,
                                     t.deps))
        return t

    def finish(self, seed: int) -> Recipe:
        bodies = [o for o in self.pool if o.kind != "tok" and o not in self.inputs]
        if not bodies:  # every drawn operation was refused by Keras, or only Embeddings
            bodies = [self.to_vector(self.draw(st.sampled_from(self.pool)))]
        # Mostly the tensors nothing consumes yet, so that few layers are left out of the model.
        leaves = [b for b in bodies if not any(
            re.search(rf"\b{b.name}\b", line.split(" = ", 1)[-1]) for line in self.lines)]
        count = self.draw(st.integers(1, 3))
        chosen = [self.draw(st.sampled_from(leaves if leaves and self.draw(st.integers(0, 3))
                                            else bodies)) for _ in range(count)]
        covered = frozenset().union(*(c.deps for c in chosen))
        missing = [i for i in range(len(self.inputs)) if i not in covered]
        if missing:  # join the inputs no output depends on into the first output
            parts = [self.to_vector(chosen[0])] + [self.to_vector(self.inputs[i])
                                                   for i in missing]
            joined = self.must(self.layer("layers.Concatenate", [], {},
                                          "[" + ", ".join(p.name for p in parts) + "]",
                                          frozenset(range(len(self.inputs)))))
            chosen[0] = joined
        heads: list[tuple[str, str, str]] = []  # (tensor, loss, targets)
        raw_used: set[str] = set()
        for body in chosen:
            if body.name not in raw_used and self.draw(st.integers(0, 3)) == 3:
                loss, _, targets = self.draw(st.sampled_from(REGRESSION))
                heads.append((body.name, loss, targets))
                raw_used.add(body.name)
                continue
            loss, activation, targets = self.draw(st.sampled_from(LOSSES))
            size = 1 if targets == "binary" else self.draw(st.integers(2, 4))
            if activation == "any":
                activation = self.draw(st.sampled_from([None, *ACTIVATIONS]))
            kwargs = {"activation": activation} if activation else {}
            head = self.must(self.layer("layers.Dense", [size], kwargs, body.name,
                                        body.deps))
            heads.append((head.name, loss, targets))
        container = "single" if len(heads) == 1 else "list"
        if self.draw(st.integers(0, 2)) == 2 or (len(heads) > 1 and self.draw(st.booleans())):
            container = "dict"
        keys = ["a", "b", "c"][:len(heads)]
        inputs = [i.name for i in self.inputs]
        inputs_text = inputs[0] if len(inputs) == 1 else "[" + ", ".join(inputs) + "]"
        if container == "single":
            outputs_text = heads[0][0]
            loss_text = heads[0][1]
        elif container == "list":
            outputs_text = "[" + ", ".join(h[0] for h in heads) + "]"
            loss_text = "[" + ", ".join(h[1] for h in heads) + "]"
        else:
            outputs_text = _dict_text(keys, [h[0] for h in heads])
            loss_text = _dict_text(keys, [h[1] for h in heads])
        compile_text = f"loss={loss_text}"
        if container != "single" and self.draw(st.booleans()):
            weights = [self.draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in heads]
            compile_text += ", loss_weights=" + (
                repr(weights) if container == "list"
                else _dict_text(keys, weights))
        model_code = (f"model = keras.Model({inputs_text}, {outputs_text})\n"
                      f"model.compile({compile_text})")
        if self.emit(model_code, [], frozenset()) is None:
            raise AssertionError("Keras refuses the model the generator wrote:\n"
                                 + "\n".join(self.lines) + "\n" + self.rejected[-1])
        return self.batch_code(seed, heads, container, keys)

    def batch_code(self, seed: int, heads: list[tuple[str, str, str]], container: str,
                   keys: list[str]) -> Recipe:
        b = self.batch
        data = [f"rng = np.random.default_rng({seed})"]
        for index, t in enumerate(self.inputs):
            steps = t.shape[0]
            pad = self.padded[index]  # zero trailing steps: padding for the masks
            keep = f" * (np.arange({steps}) < rng.integers(1, {steps + 1}, ({b}, 1)))"
            if t.kind == "tok":
                data.append(f"x{index} = (rng.integers(1, {VOCAB}, ({b}, {steps}))"
                            f"{keep if pad else ''}).astype('int32')")
            else:
                data.append(f"x{index} = rng.standard_normal(({b}, {steps}, {t.shape[1]}))"
                            ".astype('float32')")
                if pad:
                    data.append(f"x{index} *= ({keep[3:]})[..., None]")
        names = [f"x{i}" for i in range(len(self.inputs))]
        data.append("x = " + (names[0] if len(names) == 1 else "[" + ", ".join(names) + "]"))
        targets = []
        for index, (head, _, kind) in enumerate(heads):
            shape = (b, *self.ns[head].shape[1:])
            *lead, size = shape
            if kind == "real":
                expr = f"rng.standard_normal({shape!r}).astype('float32')"
            elif kind == "binary":
                expr = f"rng.integers(0, 2, {shape!r}).astype('float32')"
            elif kind == "onehot":
                expr = f"np.eye({size}, dtype='float32')[rng.integers(0, {size}, {tuple(lead)!r})]"
            else:
                expr = f"rng.integers(0, {size}, {tuple(lead)!r})"
            data.append(f"y{index} = {expr}")
            targets.append(f"y{index}")
        if container == "single":
            data.append(f"y = {targets[0]}")
        elif container == "list":
            data.append("y = [" + ", ".join(targets) + "]")
        else:
            data.append("y = " + _dict_text(keys, targets))
        if self.stateful:
            data.append("model(x)  # the stateful layers carry a state that is not zero")
        program = [f"keras.utils.set_random_seed({seed})", *self.lines, *data]
        return Recipe("\n".join(program), self.stateful, tuple(self.rejected))


@st.composite
def keras_models(draw: Any) -> Recipe:
    """A functional Keras model, compiled, with a batch: a Recipe whose program builds
    ``model``, ``x`` and ``y``."""
    stateful = draw(st.integers(0, 4)) == 4
    batch = draw(st.integers(2, 4))
    steps = draw(st.integers(3, 6))
    seed = draw(st.integers(0, 2**16))
    builder = _Builder(draw, batch, stateful)
    for index in range(draw(st.integers(1, 3))):
        other = draw(st.integers(0, 4)) == 4  # an input of another length
        builder.add_input(index, draw(st.integers(3, 6)) if other else steps)
    if stateful:  # a stateful recurrent layer first, on the first input
        first = builder.inputs[0]
        if first.kind == "tok":
            builder.op_embedding(first)
            first = builder.pool[-1]
        getattr(builder, "op_" + draw(st.sampled_from(["recurrent", "rnn_cell",
                                                      "bidirectional"])))(first)
    for _ in range(draw(st.integers(1, 6))):
        builder.step()
    recipe = builder.finish(seed)
    for refused in builder.rejected:
        note(f"left out, Keras refuses it: {refused}")
    return recipe


def _keras_truth(tf: Any, model: Any, x: Any, y: Any
                 ) -> tuple[float, dict[str, tuple[float, int] | None]]:
    """Keras' own loss and, per weight, the L2 norm of its gradient's finite entries and the
    count of the others (None: no gradient), as fit computes them."""
    with tf.GradientTape() as tape:
        prediction = model(x, training=False)
        loss = model.compute_loss(x=x, y=y, y_pred=prediction, training=False)
    grads = tape.gradient(loss, model.trainable_variables)
    truth: dict[str, tuple[float, int] | None] = {}
    for variable, gradient in zip(model.trainable_variables, grads, strict=True):
        if gradient is None:
            truth[variable.path] = None
            continue
        values = tf.convert_to_tensor(gradient).numpy().ravel()
        finite = np.isfinite(values)
        truth[variable.path] = (float(np.linalg.norm(values[finite])),
                                int(values.size - finite.sum()))
    return float(loss), truth


def _snapshot(model: Any) -> dict[str, np.ndarray]:
    return {f"{i}:{v.path}": np.array(v.numpy(), copy=True)
            for i, v in enumerate(model.variables)}


def explain_or_refuse(tf: Any, recipe: Recipe) -> str:
    """Build the recipe's model and batch, and assert that gradscope explains it with Keras'
    numbers or refuses it in one line. Returns how (``explained`` or ``refused: ...``)."""
    program = recipe.build()
    model, x, y = program["model"], program["x"], program["y"]
    before = _snapshot(model)
    report: Any
    try:
        report = gradscope.explain(model, x=x, y=y)
    except InternalError as error:
        raise AssertionError(f"InternalError (gradscope disagrees with itself): {error}") \
            from error
    except GradscopeError as error:
        message = str(error)
        assert error.exit_code == 2, (type(error).__name__, message)
        assert message.strip() and "\n" not in message, repr(message)
        note(f"refused: {message}")
        return f"refused: {type(error).__name__}"
    after = _snapshot(model)
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert not changed, f"explain changed the model's variables: {changed}"
    loss, truth = _keras_truth(tf, model, x, y)
    if np.isfinite(loss):
        assert report.loss.value == pytest.approx(loss, rel=RTOL), \
            f"loss: gradscope {report.loss.value!r}, Keras {loss!r}"
    else:  # Keras' own loss is NaN or Inf (an average over no unmasked step): so is ours
        assert report.loss.value is None, f"loss: gradscope {report.loss.value!r}, Keras {loss}"
        assert any("not finite" in warning for warning in report.warnings)
    frozen = [g.path for g in report.gradients if not g.trainable and g.stats is not None]
    assert not frozen, f"a non-trainable variable with a gradient: {frozen}"
    ours = {g.path: (None if g.stats is None else (g.stats.l2, g.stats.nonfinite))
            for g in report.gradients if g.trainable}
    assert sorted(ours) == sorted(truth), (sorted(ours), sorted(truth))
    mismatches = {path: (ours[path], expected) for path, expected in truth.items()
                  if (expected is None) != (ours[path] is None)
                  or (expected is not None and ours[path] is not None
                      and (ours[path][1] != expected[1]
                           or ours[path][0] != pytest.approx(expected[0], rel=RTOL)))}
    assert not mismatches, f"gradient (L2 of the finite entries, non-finite count) " \
        f"(gradscope, Keras): {mismatches}"
    return "explained"


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=not LONG, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          print_blob=True)
@given(data=st.data())
def test_a_random_keras_model_is_explained_exactly_or_refused_in_one_line(tf, data):
    recipe = data.draw(keras_models(), label="recipe")
    note(f"the program:\n{recipe.code}")
    for feature in recipe.features():
        event(feature)
    event(explain_or_refuse(tf, recipe))
