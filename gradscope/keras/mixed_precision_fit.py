"""``GradientFlow`` under a mixed dtype policy: at each observation, explain's
``mixed_precision`` section (:mod:`~gradscope.keras.mixed_precision`) on the observed batch,
with the weights and the optimizer's loss scale of that moment.

The section needs two more passes of the batch: the mixed model's own backward with the loss
times the scale, and the float32 shadow's. Both are :class:`~gradscope.keras.traced_pass.
TracedPass`es, as the flow's own pass is, each traced once: beside training with the flow's
own (GradientFlow's warm-up, :meth:`MixedPrecisionRecord.warm`), else at the first
observation. Every observation then runs two traced functions on the training thread: an
observation under a mixed policy costs about three passes instead of one. The scale is a
constant of the scaled pass's trace: a LossScaleOptimizer that changes its scale (halved at a
non-finite step, doubled after ``dynamic_growth_steps`` finite ones) traces it again.

Where the float32 copy cannot be built (explain refuses such a model), training goes on and
each observation lists the section as not analysed, with the reason.

A model without a mixed policy goes no further than the first look of
:meth:`MixedPrecisionRecord.observe` (one scan of its layers' policies per model): no pass,
no copy, nothing recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope.keras.mixed_precision import compute_dtype, current_scale, section, shadow_engine
from gradscope.keras.traced_pass import TracedPass
from gradscope.keras.weight_names import live_names
from gradscope.report.models import FlowHistoryReport, KerasMixedPrecision


class MixedPrecisionWatch:
    """The two passes of one mixed model."""

    def __init__(self, engine: Any, dtype: str) -> None:
        from gradscope.keras.engine import KerasEngine

        self.engine = engine
        self.dtype = dtype
        # Its own engine on the same live model: the loss scale is this engine's, never the
        # flow pass's (whose trace, or its witness on the worker, must not see it).
        self.scaled_engine = KerasEngine(engine.user_model, engine.output_names, engine.plan,
                                         training=engine.training, seed=engine.seed)
        self.scaled = TracedPass(self.scaled_engine)
        self.shadow_engine = shadow_engine(engine)
        self.shadow = TracedPass(self.shadow_engine)
        self.names = live_names(engine)  # each weight as explain names it, by its path

    def take(self, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
             sample_weight: Any) -> KerasMixedPrecision:
        """The section of this batch, now: the shadow's weights set to the model's, the scaled
        pass at the optimizer's current scale."""
        model = self.engine.user_model
        scale, optimizer = current_scale(model)
        for mine, theirs in zip(self.shadow_engine.model.weights, model.weights, strict=True):
            mine.assign(np.asarray(theirs.numpy(), dtype=mine.dtype))
        if self.scaled_engine.loss_scale != scale:
            self.scaled_engine.loss_scale = scale
            self.scaled.forget()  # the scale is a constant of the trace
        shadow = _run(self.shadow, inputs, targets, sample_weight)
        scaled = _run(self.scaled, inputs, targets, sample_weight)
        return section(self.scaled_engine, self.dtype, scale, optimizer, scaled, shadow,
                       self.names)


def _run(traced: TracedPass, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
         sample_weight: Any) -> Any:
    """One traced pass, its loops probed; where it is the replay, witnessed by Keras' own call
    at once (as the flow's pass is at its first observation)."""
    result = traced.run(inputs, targets, sample_weight)
    witness = traced.witness(inputs, targets, result, sample_weight)
    if witness is not None:
        witness()
    return result


class MixedPrecisionRecord:
    """What one ``GradientFlow`` keeps of mixed precision: the engine last looked at, its
    passes (None for a model without a mixed policy), and the sections by observation index
    (across the models a callback watches, as its other series are)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.watch: MixedPrecisionWatch | None = None
        self.sections: dict[int, KerasMixedPrecision] = {}
        #: Why the engine's model, under a mixed policy, gets no section (its float32 copy
        #: cannot be built: the user's code does not run in float32), or None.
        self.refused: str | None = None
        self.refused_at: dict[int, str] = {}  # observation index → that reason

    def observe(self, engine: Any, inputs: dict[str, np.ndarray],
                targets: dict[str, np.ndarray], sample_weight: Any,
                ) -> Callable[[int], None] | None:
        """At one observation by ``engine``: under a mixed policy, the section taken now (on
        the main thread, with the weights of this moment), and the job that records it at
        the observation's index (run with the observation's own recording). None for a
        model without a mixed policy."""
        watch = self._watch_for(engine)
        if watch is None:
            refused = self.refused
            if refused is None:
                return None

            def say(index: int) -> None:
                self.refused_at[index] = refused

            return say
        taken = watch.take(inputs, targets, sample_weight)

        def record(index: int) -> None:
            self.sections[index] = taken

        return record

    def warm(self, engine: Any, inputs: list[Any], targets: list[Any]) -> None:
        """GradientFlow's warm-up, on its worker beside training: under a mixed policy, the
        float32 copy made and both passes traced for fit's specs (``tf.TensorSpec``s), the
        scaled one at the optimizer's scale of now, so that the first observation runs them
        as every later one does. The first observation waits for the warm-up before it
        looks here; where the warm-up fails, the observation makes what is missing on the
        training thread, and raises its error there."""
        watch = self._watch_for(engine)
        if watch is None:
            return
        watch.scaled_engine.loss_scale = current_scale(engine.user_model)[0]
        watch.shadow.warm(inputs, targets)
        watch.scaled.warm(inputs, targets)

    def _watch_for(self, engine: Any) -> MixedPrecisionWatch | None:
        """The passes of ``engine``'s model (made at its first look), None without a mixed
        policy. The engine is taken as seen only once its passes are made."""
        from gradscope.keras.engine import CopyFails

        if self.engine is not engine:
            dtype = compute_dtype(engine.model)
            self.watch, self.refused = None, None
            if dtype is not None:
                try:
                    self.watch = MixedPrecisionWatch(engine, dtype)
                except CopyFails as exc:  # said in the report; training goes on
                    self.refused = ("no mixed-precision section: its float32 shadow cannot "
                                    f"be built ({exc.reason})")
            self.engine = engine
        return self.watch

    def attached(self, report: FlowHistoryReport) -> FlowHistoryReport:
        """``report`` with the sections recorded, one per observation (None where none was
        taken) and the refusals in ``not_analysed``; as it is where no observation was under a
        mixed policy."""
        from gradscope.keras.flow_record import with_sections

        return with_sections(report, "mixed_precision", "mixed precision", self.sections,
                             self.refused_at)


__all__ = ["MixedPrecisionRecord", "MixedPrecisionWatch"]
