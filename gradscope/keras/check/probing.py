"""What every witness of a Keras model's check works from, and what it hands back.

The witnesses probe one model, as the tape saw it: the same batch, weights and non-trainable
state, the loss of Keras' own call. :class:`Probing` holds that once; each witness returns
:class:`Witnessed`, and the check merges them into the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope.gradcheck import ROUNDING, WitnessResult
from gradscope.keras.engine import KerasEngine, KerasPass
from gradscope.keras.whole_model import restore, whole_model_loss
from gradscope.report.models import NotWitnessed


@dataclass(frozen=True)
class Probing:
    """The model as the tape saw it, and how closely to hold a witness to the tape."""

    engine: KerasEngine
    autodiff: KerasPass
    inputs: dict[str, np.ndarray]
    targets: dict[str, np.ndarray]
    #: The non-trainable variables (batch-norm statistics, dropout seeds) and the states of
    #: stateful layers, restored before every evaluation, so that every one sees the same
    #: model (a probe restores the weights it moves itself).
    frozen: list[tuple[Any, np.ndarray]]
    #: The sample weights as ``compute_loss`` takes them (:meth:`KerasEngine.weight_tensors`).
    sample_weight: Any
    #: Every weight's value as the tape saw it (read only, shared by the witnesses' threads):
    #: what each probe restores.
    weights: dict[str, np.ndarray]
    seed: int
    #: The finite differences' tolerance, which the cell steps and own backward share.
    rtol: float
    atol: float | None
    #: The loss's rounding relative to max(|loss|, 1): float64's bound, or what
    #: :func:`~gradscope.keras.check.precision.measured_rounding` found in the model's dtype.
    rounding: float = ROUNDING

    @property
    def tf(self) -> Any:
        return self.engine.tf

    @property
    def dtype(self) -> str:
        return self.engine.dtype_name

    def restore(self) -> None:
        restore(self.frozen)

    def tensors(self) -> tuple[list[Any], list[Any]]:
        """The inputs and the targets as tensors, in the order Keras' call takes them."""
        return self.engine.tensors(self.inputs, self.targets)

    def keras_loss(self, feed: list[Any], targets: list[Any]) -> Any:
        """The loss of Keras' own call of the whole model, never gradscope's replay: a witness
        must not share the engine's reading of the model."""
        engine = self.engine
        return whole_model_loss(
            engine.model, lambda f, t, o: engine.compute_loss(f, t, o, self.sample_weight),
            feed, targets, engine.training)


@dataclass(frozen=True)
class Witnessed:
    """What one witness found: its verdicts in the order of the report, the shapes of the
    tensors it named, and the calls it could not stand in for, with why."""

    results: list[WitnessResult] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    not_witnessed: list[NotWitnessed] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(result.passed for result in self.results)
