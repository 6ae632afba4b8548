"""Attention (Luong-style): every query step takes a softmax-weighted average of the value
steps; the only weights are two optional scalars (``use_scale``, ``score_mode="concat"``)."""

from __future__ import annotations

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, Shape, WeightNote, register


def _dims(facts: LayerFacts) -> tuple[Shape, Shape, Shape]:
    """query, value and key shapes: the call takes [query, value] or [query, value, key]."""
    shapes = facts.input_shapes
    query = shapes[0] if shapes else ()
    value = shapes[1] if len(shapes) > 1 else query
    key = shapes[2] if len(shapes) > 2 else value
    return query, value, key


def _size(shape: Shape, axis: int, name: str) -> str:
    size = shape[axis] if -len(shape) <= axis < len(shape) else None
    return f"{name} {size}" if size is not None else name


def _same_source(facts: LayerFacts) -> bool:
    labels = facts.input_labels
    return len(labels) > 1 and len(set(labels)) == 1


@register
class AttentionExplainer(LayerExplainer):
    class_names = ("Attention",)

    def _scores(self, facts: LayerFacts) -> str:
        scale = facts.option("use_scale", False)
        if facts.option("score_mode", "dot") == "concat":
            inner = "scale·(q_i + k_j)" if scale else "q_i + k_j"
            return f"score[i, j] = concat_score_weight·Σ_d tanh({inner})[d]"
        return f"score[i, j] = {'scale·' if scale else ''}q_i·k_j"

    def summary(self, facts: LayerFacts) -> str:
        query, value, _ = _dims(facts)
        tq, tv = _size(query, 1, "Tq"), _size(value, 1, "Tv")
        dim = query[-1] if query and query[-1] is not None else "dim"
        self_attention = "; query and value are the same tensor (self-attention)" if (
            _same_source(facts)) else ""
        dropout = facts.option("dropout", 0.0)
        drop = f"; dropout {dropout} on the weights in training" if dropout else ""
        return (f"Attention of {tq} query steps over {tv} value steps ({dim} features): "
                f"{self._scores(facts)}, p[i, :] = softmax over the value steps, "
                f"out_i = Σ_j p[i, j]·v_j: the output (batch, {tq}, "
                f"{_size(value, -1, 'dim')}) holds weighted averages of the value vectors"
                f"{self_attention}{drop}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        notes = []
        query, value, _ = _dims(facts)
        pairs = (f"the batch × {_size(query, 1, 'Tq')} × {_size(value, 1, 'Tv')} "
                 "(query, value) pairs")
        if facts.option("use_scale", False):
            where = ("multiplies q_i + k_j inside the tanh" if
                     facts.option("score_mode", "dot") == "concat" else
                     "multiplies every score q_i·k_j (an inverse softmax temperature)")
            notes.append(WeightNote(
                key="scale", shape=(), formula="a scalar", role=f"learned scale: {where}",
                note=f"its gradient sums over {pairs}"))
        if facts.option("score_mode", "dot") == "concat":
            notes.append(WeightNote(
                key="concat_score_weight", shape=(), formula="a scalar",
                role="learned factor in front of every concat score",
                note=f"its gradient sums over {pairs}"))
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        query, value, _ = _dims(facts)
        tq, tv = _size(query, 1, "Tq"), _size(value, 1, "Tv")
        parts = [f"∂L/∂v_j = Σ_i p[i, j]·∂L/∂out_i: each of the {tv} value steps gets the "
                 f"gradient of the {tq} query steps, weighted by their attention to it",
                 "∂L/∂p passes the softmax Jacobian, row by row: ∂L/∂score[i, j] = "
                 "p[i, j]·(∂L/∂p[i, j] − Σ_k p[i, k]·∂L/∂p[i, k])",
                 (f"then ∂L/∂q_i = Σ_j ∂L/∂score[i, j]·k_j over {tv}, ∂L/∂k_j = Σ_i "
                  f"∂L/∂score[i, j]·q_i over {tq}"
                  if facts.option("score_mode", "dot") == "dot" else
                  f"then through the tanh of the concat score: ∂L/∂q_i sums over the {tv} "
                  f"value steps, ∂L/∂k_j over the {tq} query steps")]
        if facts.option("use_scale", False) and facts.option("score_mode", "dot") == "dot":
            parts[-1] += ", each times scale"
        if _same_source(facts):
            parts.append("query and value are the same tensor: its gradient is the sum of "
                         "the query, key and value paths")
        parts.append("a masked value step gets ≈0 weight and so ≈0 gradient; a masked query "
                     "step outputs 0 and passes none back")
        return "; ".join(parts)
