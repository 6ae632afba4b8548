"""One module per (cell type, layout); what the cells share is in base.py, numpy_bptt.py (the
NumPy loop over time) and lstm.py (the NumPy LSTM of both layouts). Adding a cell = adding one
module and one line to :data:`CELLS`, the only registry: its TF and NumPy functions, and its
key, are found from its class."""

from __future__ import annotations

from gradscope.cells.base import Block, Cell, TensorInfo
from gradscope.cells.gru_block import GRUBlock
from gradscope.cells.gru_keras import GRUKeras
from gradscope.cells.lstm_block import LSTMBlock
from gradscope.cells.lstm_keras import LSTMKeras
from gradscope.cells.simple_rnn_block import SimpleRNNBlock
from gradscope.cells.simple_rnn_keras import SimpleRNNKeras

#: Every cell class, by ``<kind>_<layout>``.
CELLS: dict[str, type[Cell]] = {f"{cell.kind}_{cell.layout}": cell for cell in (
    GRUBlock, GRUKeras, LSTMBlock, LSTMKeras, SimpleRNNBlock, SimpleRNNKeras)}

__all__ = ["CELLS", "Block", "Cell", "TensorInfo"]
