"""The gradient flow of a recurrent call, read from its probed loops
(:mod:`~gradscope.keras.state_probes`): for each direction, which states are shown, under which
names, and how much of ∂L/∂s the recurrence carries back (the whole state: h and c of an LSTM).
Shared by ``explain --flow`` and the GradientFlow callback.
"""

from __future__ import annotations

import functools
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
    ran: np.ndarray | None = None  # where each example's steps ran (B, T), processing order

    @property
    def shown(self) -> list[int]:
        """The states whose ‖∂L/∂s_t‖ is shown."""
        return [0] if self.class_name in H_SHOWN else list(range(len(self.names)))

    @functools.cached_property
    def whole(self) -> np.ndarray:
        """‖∂L/∂s_t‖² per example and step (B, T), every state joined."""
        return np.sum([example_squares(t) for t in self.totals.totals], axis=0)

    def rests_on(self) -> tuple[int, int] | None:
        """:func:`resting_on` of :meth:`carried`'s ratio."""
        found = self.totals
        return resting_on(found.carried_back if found.carried_back is not None else
                          self.whole, self.ran)

    def what(self, k: int) -> str:
        """``∂L/∂label/h_t``; a state the cell does not return as its output is moved only
        as the next step reads it, which its name says."""
        read = "" if k == self.totals.output_state else " (as step t+1 reads it)"
        return f"∂L/∂{self.label}/{self.names[k]}_t{read}"

    def carried(self) -> float | None:
        """:func:`~gradscope.keras.flow.carried_ratio` of the whole state (every state
        together), where what arrives from above at a step is the gradient of the cell's
        output, which is one of its states (where that is at every step, from what arrives
        at the last step carried back: :func:`back_ratio_of`); None where the output is not
        a state."""
        found = self.totals
        k = found.output_state
        if k is None or found.direct.shape != found.totals[k].shape:
            return None
        if found.carried_back is not None:  # a gradient from above at every step
            return back_ratio_of(found.carried_back, self.ran)
        # Where the gradient enters at the last step only: the product of the gains.
        carried = np.sum([example_squares(t - found.direct if i == k else t)
                          for i, t in enumerate(found.totals)], axis=0)
        return carried_ratio_of(carried, self.whole, self.ran)


def example_squares(gradient: np.ndarray) -> np.ndarray:
    """Σ g² per example and step (B, T): over every axis past time, in float64."""
    squares = np.square(gradient, dtype=np.float64)
    return squares.sum(axis=tuple(range(2, squares.ndim)))


def processing_ran(mask: Any, steps: int, backwards: bool) -> np.ndarray | None:
    """Where each example's steps ran (B, T), in processing order, from a call's mask (None:
    every step ran)."""
    if mask is None:
        return None
    ran = np.asarray(mask, bool).reshape(-1, steps)
    return ran[:, ::-1] if backwards else ran


def examples_ran(mask: Any, steps: int, backwards: bool = False) -> list[int] | None:
    """Per step (processing order), how many examples ran it, from a call's ``mask``; None
    where every example ran every step."""
    return counted(processing_ran(mask, steps, backwards))


def counted(ran: np.ndarray | None) -> list[int] | None:
    """Per step, how many examples ran it, from where each ran (B, T); None where every
    example ran every step."""
    return None if ran is None or ran.all() else [int(n) for n in ran.sum(axis=0)]


def loop_layers(layer: Any, label: str) -> list[tuple[str, Any]]:
    """The loops a call of ``layer`` runs, by label: both directions of a Bidirectional."""
    if class_label(layer) == "Bidirectional":
        return [(f"{label}/forward", layer.forward_layer),
                (f"{label}/backward", layer.backward_layer)]
    return [(label, layer)]


def loop_flows(layer: Any, label: str, found: list[StateTotals],
               mask: Any = None) -> list[LoopFlow]:
    """Each direction of a call of ``layer`` with its probed totals ``found`` (``mask``: the
    call's, in input order, or None)."""
    return [LoopFlow(label=name, class_name=class_label(sub),
                     names=_names(sub, len(totals.totals)), totals=totals,
                     ran=processing_ran(mask, totals.totals[0].shape[1], totals.backwards))
            for (name, sub), totals in zip(loop_layers(layer, label), found, strict=True)]


def _names(layer: Any, count: int) -> list[str]:
    """The states' names, as the initial states' (``h0`` → ``h``, ``cells[1]/c0`` →
    ``cells[1]/c``)."""
    names = [n.removesuffix("0") if n.rpartition("/")[2] in ("h0", "c0") else n
             for n in state_names(layer)]
    if len(names) == count:
        return names
    if count == 2 and class_label(layer).startswith("ConvLSTM"):
        return ["h", "c"]
    return ["h"] if count == 1 else [f"states[{k}]" for k in range(count)]


__all__ = ["LoopFlow", "back_ratio_of", "carried_ratio_of", "example_squares", "loop_flows",
           "counted", "examples_ran", "loop_layers", "processing_ran", "ran_ends", "resting_on"]


def _at_last_step(carried: np.ndarray, whole: np.ndarray, ran: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each example's steps moved right so that its last step that ran is the call's last,
    and where each moved example is present (B, T): on a batch padded after its sequences
    (a forward layer over post-padding), every example's gradient enters at its own last
    step, and a product of the batch's gains step by step would take each entry for a loss
    of what was carried before it (on examples of 10 to 40 steps, ×1.6e-07 where each kept
    ×1.1e-03 to ×7.0e-02). Aligned at their last steps, as a batch padded before them (or
    not at all) already is, and unmoved there, each step's gain is that of the examples
    that ran it."""
    steps = ran.shape[1]
    any_ran = ran.any(axis=1)
    last = np.where(any_ran, steps - 1 - np.argmax(ran[:, ::-1], axis=1), steps - 1)
    shift = (steps - 1 - last)[:, None]
    source = np.arange(steps)[None, :] - shift
    present = source >= 0
    index = np.clip(source, 0, None)

    def moved(values: np.ndarray, empty: Any) -> np.ndarray:
        return np.where(present, np.take_along_axis(values, index, axis=1), empty)

    return moved(carried, 0.0), moved(whole, 0.0), moved(ran, False), present


def carried_ratio_of(carried: np.ndarray, whole: np.ndarray,
                     ran: np.ndarray | None = None) -> float | None:
    """:func:`~gradscope.keras.flow.carried_ratio` from per-example squared norms (B, T), in
    processing order: ‖∂L/∂s_t − its part from above‖² (``carried``) and ‖∂L/∂s_t‖²
    (``whole``). Each step's gain back, ‖carried part at t‖ / ‖∂L/∂s_(t+1)‖, is taken over
    the examples whose step t+1 ran (``ran`` (B, T); None: all): an example that skipped
    step t+1 (masked) copied its state through it, so nothing went through the recurrence
    there, while the gradient its later, masked, outputs pass back to its last step that ran
    would count as carried (on a padded batch of uneven lengths, every example's last step
    then looked like a gain). The examples are first aligned at their last steps that ran
    (:func:`_at_last_step`), and no gain is taken before an example's first step that ran."""
    ran = np.ones(whole.shape, bool) if ran is None else np.asarray(ran, bool)
    carried, whole, ran, present = _at_last_step(carried, whole, ran)
    # Gains before an example's first step that ran (its padding, before or moved there)
    # are no gains of the recurrence: a batch padded before its sequences and one padded
    # after them then read the same.
    begun = np.cumsum(ran, axis=1) > 0
    moved = ran[:, 1:] & present[:, :-1] & begun[:, :-1]
    logs = []
    for t in range(whole.shape[1] - 1):
        rows = moved[:, t]
        after = float(np.sqrt(np.sum(whole[rows, t + 1])))
        if not after > 0:
            continue
        back = float(np.sqrt(np.sum(carried[rows, t])))
        if back == 0:
            return 0.0
        logs.append(np.log(back) - np.log(after))
    if not logs:
        return None
    return float(np.exp(np.clip(sum(logs), -700.0, 700.0)))


def back_ratio_of(squares: np.ndarray, ran: np.ndarray | None = None) -> float | None:
    """:func:`carried_ratio_of` where a gradient from above enters at every step, from the
    ‖v_t‖² (B, T) of what the loss puts on the state at each example's last step that ran,
    carried back through the recurrence alone
    (:func:`~gradscope.keras.state_probes.carried_back`): nothing enters v after that step,
    so it is carried whole, and the product of its gains is ‖v_0‖ / ‖v_last‖ (the batch's,
    aligned at each example's last step)."""
    return carried_ratio_of(squares, squares, ran)


def resting_on(squares: np.ndarray, ran: np.ndarray | None = None) -> tuple[int, int] | None:
    """Where some examples that ran get no gradient at their last step that ran, so that the
    carried ratio rests on the others alone: (how many it rests on, how many ran); None where
    it rests on every one. ``squares`` (B, T): ‖∂L/∂s_t‖² (or what is carried back from the
    last step) per example, processing order. (A masked ``go_backwards`` layer that returns
    its sequence: Keras keeps the output's mask in input order, while the sequence is in
    processing order, so an example padded after gets its gradient at steps it did not run.)"""
    rows, _, last = ran_ends(np.ones(squares.shape, bool) if ran is None else ran)
    if rows.size == 0:
        return None
    reached = int(np.count_nonzero(squares[rows, last] > 0))
    return None if reached == rows.size else (reached, int(rows.size))


def ran_ends(ran: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The examples that ran a step (their rows), and each one's first and last step that
    ran, from where each example's steps ran (B, T)."""
    ran = np.asarray(ran, bool)
    rows = np.nonzero(ran.any(axis=1))[0]
    return (rows, np.argmax(ran[rows], axis=1),
            ran.shape[1] - 1 - np.argmax(ran[rows, ::-1], axis=1))
