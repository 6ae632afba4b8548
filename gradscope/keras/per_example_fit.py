"""``GradientFlow(per_example=True)``: at each observation, explain's ``per_example`` section
(:mod:`~gradscope.keras.per_example`) on the observed batch, with the weights of that moment.

The section is explain's own function, called on the flow's engine (the live model, inference
mode, the loss fit minimises) with the batch the observation saw: each example's ‖∂L_i/∂θ‖ per
layer and in total, the top share, the outliers and the gradient noise scale B_simple. Its
traced functions are kept across the observations (traced once, at the first; again only for
another batch shape), so that an observation costs one more run of them on the training
thread: about 1.7 batched backward passes where the split serves (docs/performance.md).

Where the section cannot be taken (a loss that is no sum of one share per example: a
reduction that divides by the sample weights; the numbers of the batch not finite), training
goes on and the observation lists it as not analysed, with the reason, as explain would refuse
it. A refusal of the model's loss (explain's ConfigError) holds for every batch: the later
observations of that model list the first one's reason without trying again. An error of
gradscope's own (the examples' gradients not adding up to the batch's) is raised, as in
explain.

Without ``per_example=True`` none of this runs: no record is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope.errors import ConfigError
from gradscope.report.models import FlowHistoryReport, KerasPerExample

#: How an observation whose section could not be taken names it in ``not_analysed``.
NOT_ANALYSED = "per-example gradients"


def weight_layers(engine: Any) -> dict[str, str]:
    """Each weight's path → the layer explain's report names it by: the first layer of the
    model's graph that holds it, else the model's own call (a subclassed model's own weights,
    or the model's name), as explain's ``gradients`` entries name them."""
    from gradscope.keras.live import read_live_graph

    graph = read_live_graph(engine.user_model)
    names: dict[str, str] = {}
    seen: set[int] = set()
    for node in graph.computing_layers:
        for variable in getattr(engine.operation(node.name), "weights", []):
            if id(variable) not in seen:
                seen.add(id(variable))
                names[variable.path] = node.name
    owner = graph.your_call or graph.name
    for variable in engine.model.weights:
        if id(variable) not in seen:
            seen.add(id(variable))
            names[variable.path] = owner
    return names


def _as_job_weights(engine: Any, sample: Any) -> Any:
    """The callback's sample weights (None, one tensor, or a list of tensors in the order of
    the engine's outputs) as explain's job holds them: None, an array, or a dict by output."""
    if sample is None:
        return None
    if isinstance(sample, list):
        return {name: np.asarray(value) for name, value in
                zip(engine.output_names, sample, strict=True) if value is not None}
    return np.asarray(sample)


class PerExampleRecord:
    """What one ``GradientFlow(per_example=True)`` keeps: the engine last looked at, its
    layer names and traced functions, and the sections and refusals by observation index
    (across the models a callback watches, as its other series are)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.layer_of: dict[str, str] = {}
        self.traced: dict[Any, Any] = {}
        self.trainable: list[int] = []  # the ids of the variables ``traced`` differentiates
        #: Why the engine's loss gives no section (explain's refusal, on its first batch).
        self.refused: str | None = None
        self.sections: dict[int, KerasPerExample] = {}
        self.refused_at: dict[int, str] = {}  # observation index → why no section

    def observe(self, engine: Any, inputs: dict[str, np.ndarray],
                targets: dict[str, np.ndarray], sample: Any, result: Any,
                ) -> Callable[[int], None]:
        """At one observation by ``engine`` whose flow pass gave ``result``: the section taken
        now (on the training thread, with the weights of this moment), and the job that
        records it, or why it was not taken, at the observation's index."""
        from gradscope.keras.nonfinite import all_finite
        from gradscope.keras.per_example import per_example

        trainable = [id(v) for v in engine.model.trainable_variables]
        if self.engine is not engine or trainable != self.trainable:
            # The traced functions differentiate the variables they were traced with.
            self.layer_of, self.traced = weight_layers(engine), {}
            self.engine, self.trainable, self.refused = engine, trainable, None
        taken: KerasPerExample | None = None
        why: str | None = None
        if self.refused is not None:
            why = self.refused
        elif not all_finite(result):
            why = ("not computed: the loss or a gradient of this batch is not finite "
                   "(explain's nonfinite diagnosis says where it was born)")
        else:
            try:
                taken = per_example(engine, inputs, targets, _as_job_weights(engine, sample),
                                    self.layer_of, self.traced)
            except ConfigError as exc:  # said in the report; training goes on
                why = self.refused = str(exc)

        def record(index: int) -> None:
            if taken is not None:
                self.sections[index] = taken
            else:
                assert why is not None
                self.refused_at[index] = why

        return record

    def attached(self, report: FlowHistoryReport) -> FlowHistoryReport:
        """``report`` with the sections recorded, one per observation (None where none was
        taken) and the refusals in ``not_analysed``; as it is where nothing was recorded."""
        from gradscope.keras.flow_record import with_sections

        return with_sections(report, "per_example", NOT_ANALYSED, self.sections,
                             self.refused_at)


__all__ = ["NOT_ANALYSED", "PerExampleRecord", "weight_layers"]
