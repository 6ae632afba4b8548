"""One module per (cell type, layout). Adding a cell = adding one module and one registry line."""

from __future__ import annotations

from gradscope.cells.base import Block, Cell, TensorInfo
from gradscope.cells.gru_block import GRUBlock
from gradscope.cells.gru_keras import GRUKeras

CELLS: dict[str, type[Cell]] = {
    "gru_block": GRUBlock,
    "gru_keras": GRUKeras,
}

__all__ = ["CELLS", "Block", "Cell", "TensorInfo"]
