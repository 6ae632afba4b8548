"""MultiHeadAttention: query, key and value projected per head (EinsumDense sublayers "query",
"key", "value"), scaled dot-product attention in each head, and the heads projected back
together by "attention_output"."""

from __future__ import annotations

from math import prod
from typing import Any

from gradscope.cells.base import Block
from gradscope.keras.layers.base import LayerExplainer, LayerFacts, Shape, WeightNote, register


class Heads:
    """The numbers of one MultiHeadAttention call."""

    def __init__(self, facts: LayerFacts) -> None:
        shapes = facts.input_shapes
        self.query_shape: Shape = shapes[0] if shapes else ()
        self.value_shape: Shape = shapes[1] if len(shapes) > 1 else self.query_shape
        self.key_shape: Shape = shapes[2] if len(shapes) > 2 else self.value_shape
        labels = facts.input_labels
        self.query_label = labels[0] if labels else "input"
        self.value_label = labels[1] if len(labels) > 1 else self.query_label
        self.key_label = labels[2] if len(labels) > 2 else self.value_label
        self.heads = int(facts.config["num_heads"])
        self.key_dim = int(facts.config["key_dim"])
        self.value_dim = int(facts.config.get("value_dim") or self.key_dim)
        self.use_bias = bool(facts.config.get("use_bias", True))
        self.use_gate = bool(facts.config.get("use_gate", False))
        self.query_features = self._last(self.query_shape, "query", facts.name)
        self.key_features = self._last(self.key_shape, "key", facts.name)
        self.value_features = self._last(self.value_shape, "value", facts.name)
        output: Any = facts.config.get("output_shape")
        if isinstance(output, int):
            output = (output,)
        self.output_shape: tuple[int, ...] = (tuple(int(d) for d in output) if output
                                              else (self.query_features,))
        self.custom_output = bool(output)

    @staticmethod
    def _last(shape: Shape, role: str, name: str) -> int:
        last = shape[-1] if shape else None
        if last is None:
            raise ValueError(f"layer {name}: the last axis of its {role} input is unknown")
        return int(last)

    @property
    def same_source(self) -> bool:
        return self.query_label == self.value_label == self.key_label

    def positions(self, shape: Shape) -> str:
        middle = list(shape[1:-1])
        if not middle:
            return "the batch"
        if any(d is None for d in middle):
            return "the batch and every position"
        sizes = [int(d) for d in middle if d is not None]
        return f"the batch × {' × '.join(str(d) for d in sizes)} positions"


@register
class MultiHeadAttentionExplainer(LayerExplainer):
    class_names = ("MultiHeadAttention",)

    def summary(self, facts: LayerFacts) -> str:
        h = Heads(facts)
        out = " × ".join(str(d) for d in h.output_shape)
        source = (" (self-attention: query, key and value are the same tensor)"
                  if h.same_source else "")
        gate = ("; use_gate: each head's result is multiplied by σ(query·W_gate + b) first"
                if h.use_gate else "")
        window = facts.option("sliding_window")
        extra = f"; sliding_window {window}: a query attends to at most that many steps" if (
            window) else ""
        return (f"MultiHeadAttention, {h.heads} heads{source}: head n computes q = query·"
                f"Wq[:, n, :] ({h.query_features} → key_dim {h.key_dim}), k = key·Wk[:, n, :] "
                f"({h.key_features} → {h.key_dim}), v = value·Wv[:, n, :] ({h.value_features} → "
                f"value_dim {h.value_dim}), then softmax(q·kᵀ / √{h.key_dim}) over the key "
                f"steps weights v; attention_output maps the {h.heads} × {h.value_dim} head "
                f"results to {out} output features{gate}{extra}")

    def _projection(self, h: Heads, name: str, features: int, label: str, width: int,
                    width_name: str, role: str, shape: Shape) -> list[WeightNote]:
        sums = f"its gradient sums over {h.positions(shape)}"
        notes = [WeightNote(
            key=f"{name}/kernel", shape=(features, h.heads, width),
            formula=f"{label} {features} × num_heads {h.heads} × {width_name} {width}",
            role=f"{role}: [:, n, :] is head n's {features} × {width} projection",
            rows=(Block(0, features, f"{label} features"),),
            columns=(Block(0, width, f"{width_name} of one head"),),
            note=f"axis 1: the {h.heads} heads; {sums}")]
        if h.use_bias:
            notes.append(WeightNote(
                key=f"{name}/bias", shape=(h.heads, width),
                formula=f"num_heads {h.heads} × {width_name} {width}",
                role=f"bias of {role}, one row per head",
                rows=(Block(0, h.heads, "heads"),),
                columns=(Block(0, width, width_name),), note=sums))
        return notes

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        h = Heads(facts)
        notes = self._projection(h, "query", h.query_features, h.query_label, h.key_dim,
                                 "key_dim", "query projection", h.query_shape)
        notes += self._projection(h, "key", h.key_features, h.key_label, h.key_dim,
                                  "key_dim", "key projection", h.key_shape)
        notes += self._projection(h, "value", h.value_features, h.value_label, h.value_dim,
                                  "value_dim", "value projection", h.value_shape)
        if h.use_gate:
            notes += self._projection(h, "gate", h.query_features, h.query_label,
                                      h.value_dim, "value_dim", "gate projection (sigmoid)",
                                      h.query_shape)
        out = h.output_shape
        out_text = " × ".join(str(d) for d in out)
        out_name = "output_shape" if h.custom_output else "query features"
        sums = f"its gradient sums over {h.positions(h.query_shape)}"
        notes.append(WeightNote(
            key="attention_output/kernel", shape=(h.heads, h.value_dim, *out),
            formula=f"num_heads {h.heads} × value_dim {h.value_dim} × {out_name} {out_text}",
            role=f"maps the {h.heads} heads' {h.value_dim}-dim results together to the "
                 f"{prod(out)} outputs",
            rows=(Block(0, h.heads, "heads"),),
            columns=(Block(0, out[-1], "output features"),),
            note=f"axis 1: value_dim {h.value_dim} of each head; {sums}"))
        if h.use_bias:
            notes.append(WeightNote(
                key="attention_output/bias", shape=out,
                formula=f"{out_name} {out_text}", role="bias of the outputs",
                columns=(Block(0, out[-1], "output features"),), note=sums))
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        h = Heads(facts)
        parts = [f"∂L/∂out goes back through attention_output to each of the {h.heads} heads' "
                 f"{h.value_dim}-dim results",
                 "in each head ∂L/∂v_j = Σ_i p[i, j]·∂L/∂result_i, and the scores' gradient "
                 "passes the softmax Jacobian p∘(g − Σ p g) row by row",
                 f"1/√key_dim = 1/√{h.key_dim} scales the scores' gradient before it reaches q "
                 "(·k) and k (·q)",
                 "then each projection's transpose carries it back to its input"]
        if h.same_source:
            parts.append("query, key and value are the same tensor: its gradient is the sum "
                         "of the three paths")
        if h.use_gate:
            parts.append("use_gate: the gate scales each head's gradient by σ and receives "
                         "∂L/∂(gated)∘result∘σ(1−σ)")
        dropout = facts.option("dropout", 0.0)
        if dropout:
            parts.append(f"dropout {dropout} zeroes some attention weights, and their "
                         "gradient, in training")
        return "; ".join(parts)
