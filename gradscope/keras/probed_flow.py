"""The gradient flow of a recurrent call, read from its probed loops
(:mod:`~gradscope.keras.state_probes`): for each direction, which states are shown, under which
names, and how much of ∂L/∂s the recurrence carries back (the whole state: h and c of an LSTM).
Shared by ``explain --flow`` and the GradientFlow callback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.keras.engine import class_label, state_names
from gradscope.keras.state_probes import StateTotals

#: Layers whose state after a step is shown by its output h alone (their other state, an
#: LSTM's c, is read with it by the recurrence flag); any other loop shows every state.
H_SHOWN = frozenset({"GRU", "LSTM", "SimpleRNN", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D"})


@dataclass
class LoopFlow:
    """One direction of a probed recurrent call."""

    label: str  # "decoder", "both/forward"
    class_name: str
    names: list[str]  # each state's name: "h", "c", "states[1]"
    totals: StateTotals

    @property
    def shown(self) -> list[int]:
        """The states whose ‖∂L/∂s_t‖ is shown."""
        return [0] if self.class_name in H_SHOWN else list(range(len(self.names)))

    def what(self, k: int) -> str:
        """``∂L/∂label/h_t``; a state the cell does not return as its output is moved only
        as the next step reads it, which its name says."""
        read = "" if k == self.totals.output_state else " (as step t+1 reads it)"
        return f"∂L/∂{self.label}/{self.names[k]}_t{read}"

    def carried(self) -> float | None:
        """:func:`~gradscope.keras.flow.carried_ratio` of the whole state (every state
        together), where what arrives from above at a step is the gradient of the cell's
        output, which is one of its states; None where the output is not a state."""

        found = self.totals
        k = found.output_state
        if k is None or found.direct.shape != found.totals[k].shape:
            return None
        carried = sum(_squares(t - found.direct if i == k else t)
                      for i, t in enumerate(found.totals))
        whole = sum(_squares(t) for t in found.totals)
        return carried_ratio_of(list(np.sqrt(carried)), list(np.sqrt(whole)))


def _squares(gradient: np.ndarray) -> np.ndarray:
    """Σ g² over every axis but the time axis 1, in float64."""
    squares = np.square(gradient, dtype=np.float64)
    return squares.sum(axis=tuple(i for i in range(squares.ndim) if i != 1))


def loop_layers(layer: Any, label: str) -> list[tuple[str, Any]]:
    """The loops a call of ``layer`` runs, by label: both directions of a Bidirectional."""
    if class_label(layer) == "Bidirectional":
        return [(f"{label}/forward", layer.forward_layer),
                (f"{label}/backward", layer.backward_layer)]
    return [(label, layer)]


def loop_flows(layer: Any, label: str, found: list[StateTotals]) -> list[LoopFlow]:
    """Each direction of a call of ``layer`` with its probed totals ``found``."""
    return [LoopFlow(label=name, class_name=class_label(sub),
                     names=_names(sub, len(totals.totals)), totals=totals)
            for (name, sub), totals in zip(loop_layers(layer, label), found, strict=True)]


def _names(layer: Any, count: int) -> list[str]:
    """The states' names, as the initial states' (``h0`` → ``h``)."""
    names = [n.removesuffix("0") if n in ("h0", "c0") else n for n in state_names(layer)]
    if len(names) == count:
        return names
    if count == 2 and class_label(layer).startswith("ConvLSTM"):
        return ["h", "c"]
    return ["h"] if count == 1 else [f"states[{k}]" for k in range(count)]


__all__ = ["LoopFlow", "loop_flows", "loop_layers"]


def carried_ratio_of(carried: list[float], totals: list[float]) -> float | None:
    """:func:`~gradscope.keras.flow.carried_ratio` from its per-step norms: ‖∂L/∂h_t − its
    part from above‖ and ‖∂L/∂h_t‖ for every t."""
    logs = []
    for t in range(len(totals) - 1):
        after = totals[t + 1]
        if not after > 0:
            continue
        if carried[t] == 0:
            return 0.0
        logs.append(np.log(carried[t]) - np.log(after))
    if not logs:
        return None
    return float(np.exp(np.clip(sum(logs), -700.0, 700.0)))
