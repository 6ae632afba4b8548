"""Embedding: a lookup table; each integer token id selects one row of ``embeddings``."""

from __future__ import annotations

from math import prod

from gradscope.cells.base import Block
from gradscope.keras.layers.base import LayerExplainer, LayerFacts, WeightNote, register


def _positions(facts: LayerFacts) -> str:
    """The positions one batch looks up: every axis of the ids after the batch."""
    axes = list(facts.input_shape[1:])
    if not axes:
        return "one id per example"
    if any(axis is None for axis in axes):
        return "every position of the sequence"
    known = [int(axis) for axis in axes if axis is not None]
    if len(known) == 1:
        return f"{known[0]} ids per example"
    return f"{' × '.join(str(axis) for axis in known)} = {prod(known)} ids per example"


@register
class EmbeddingExplainer(LayerExplainer):
    class_names = ("Embedding",)

    def summary(self, facts: LayerFacts) -> str:
        vocab, dim = int(facts.config["input_dim"]), int(facts.config["output_dim"])
        text = (f"Embedding of {vocab} token ids into {dim} dimensions: each id i in "
                f"0…{vocab - 1} is replaced by row i of the {vocab} × {dim} table "
                f"({_positions(facts)}, each becomes a vector of {dim})")
        if facts.option("mask_zero"):
            text += ("; mask_zero: id 0 is padding, and the mask it makes tells the layers "
                     "after it (an RNN, attention) to skip those positions")
        if facts.option("lora_rank"):
            text += (f"; LoRA rank {facts.option('lora_rank')}: the table used is embeddings "
                     "+ (lora_alpha / rank)·A·B, and embeddings itself is frozen")
        return text

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        vocab, dim = int(facts.config["input_dim"]), int(facts.config["output_dim"])
        rows = (Block(0, vocab, "token ids (row i is id i)"),)
        columns = (Block(0, dim, "embedding dimensions"),)
        sparse = ("its gradient has a row for each id that occurs in the batch (an "
                  "IndexedSlices); the rows of the other ids get nothing")
        if facts.option("mask_zero"):
            sparse += ("; row 0 (padding) gets zeros from a layer that honours the mask "
                       "(a masked RNN step does not use its input)")
        rank = facts.option("lora_rank")
        table = WeightNote(
            key="embeddings", shape=(vocab, dim),
            formula=f"input_dim {vocab} × output_dim {dim}",
            role="the lookup table: row i is the vector of token id i",
            rows=rows, columns=columns,
            note=(sparse if not rank else
                  "frozen by LoRA: non-trainable, it gets no gradient"))
        if not rank:
            return [table]
        rank = int(rank)
        return [table,
                WeightNote(key="lora_embeddings_a", shape=(vocab, rank),
                           formula=f"input_dim {vocab} × lora_rank {rank}",
                           role="LoRA factor A: row i is id i's low-rank code", rows=rows,
                           note="only the rows of the ids that occur in the batch get a "
                                "non-zero gradient (dense, through A·B)"),
                WeightNote(key="lora_embeddings_b", shape=(rank, dim),
                           formula=f"lora_rank {rank} × output_dim {dim}",
                           role="LoRA factor B: maps the low-rank code to the embedding",
                           columns=columns,
                           note="dense gradient: every occurring id's row of A feeds it")]

    def gradient_note(self, facts: LayerFacts) -> str:
        vocab, dim = int(facts.config["input_dim"]), int(facts.config["output_dim"])
        text = (f"the gradient of the {vocab} × {dim} table is a tf.IndexedSlices: only the "
                "rows of the token ids that occur in the batch receive a gradient, each the "
                f"sum of the {dim}-dim ∂L/∂output over every position holding that id (dense "
                "conversion sums repeated ids); the ids are integers and get no gradient")
        if facts.option("mask_zero"):
            text += ("; mask_zero: padded positions still look up row 0, but a layer that "
                     "honours the mask sends them no gradient")
        if facts.option("lora_rank"):
            text += ("; LoRA: embeddings itself is frozen, so this gradient goes on to A (the "
                     "rows of the ids that occur) and to B")
        return text
