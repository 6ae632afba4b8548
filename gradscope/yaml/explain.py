"""``gradscope explain`` for a YAML config: one forward and backward pass in TensorFlow, every
gradient explained (the shapes come from :mod:`gradscope.yaml.shapes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gradscope.cells.base import TensorInfo
from gradscope.chunks import CARRIED_SHARE_THRESHOLD, carried_weights
from gradscope.dynamics import singular_summary
from gradscope.errors import ConfigError, InternalError
from gradscope.gradient_stats import carried_flag, flow_flags, per_example_norms, stats
from gradscope.report.models import (
    CarryEntry,
    CarryPair,
    CarryProductEntry,
    ExplainReport,
    FlowSection,
    GradientEntry,
    InfluenceMap,
    JacobianEntry,
    LossEntry,
    StateGradientEntry,
)
from gradscope.timing import Clock, Progress
from gradscope.yaml.algebra import ModelShapes, model_shapes
from gradscope.yaml.config import Spec
from gradscope.yaml.data import Batch, initial_params, synthetic_batch
from gradscope.yaml.shapes import model_entry, tensor_entry
from gradscope.yaml.truncation import CarryNumbers, state_names

if TYPE_CHECKING:
    from gradscope.yaml.dynamics import Dynamics, JacobianBlock




def explain(spec: Spec, data: Batch | None = None, progress: Progress | None = None,
            timings: bool = False, jacobians: bool = False, flow: bool = False,
            at: int | None = None, heatmap: bool = False,
            params: dict[str, np.ndarray] | None = None,
            weights: Any = None, chunks: int | None = None) -> ExplainReport:
    """Build the model in TF, run one forward/backward pass, explain every gradient.

    ``jacobians`` adds ∂h_T/∂h_0 between every pair of layers; ``flow`` adds the gradient
    norms per step and the influence ‖∂h_t/∂x_s‖ of every input step (t = ``at``, by
    default the last step); ``heatmap`` adds ‖∂h_t/∂x_s‖ for up to 16 steps t. ``params``
    replaces the seeded initial weights by gradscope name, as they are; ``weights`` (an .npz
    path, a TF checkpoint or a dict named any way :mod:`gradscope.yaml.weights` reads) is mapped
    onto the spec's layers first, and the mapping is reported. An .npz is read and checked
    before TensorFlow is imported. ``chunks`` (K ≥ 2) cuts the time axis into K chunks and
    adds, under ``carry``, how much carrying gradients across the cuts changes each weight
    gradient (see :mod:`gradscope.yaml.truncation`). The options are checked by
    :func:`gradscope.explain`, before this runs.
    """
    say = progress or (lambda message: None)
    clock = Clock()
    algebra = model_shapes(spec)
    batch = data if data is not None else synthetic_batch(algebra)
    from gradscope.yaml.weights import chosen_weights

    params, weights_entry = chosen_weights(spec, weights, params, say)
    if weights_entry is not None:
        # Each gradient is shown under the file's own variable name(s).
        algebra = model_shapes(spec, aliases={
            item.name: " + ".join(item.variables) for item in weights_entry.mapping})
    params = initial_params(algebra) if params is None else params
    from gradscope.yaml.engine import Engine  # imports TensorFlow

    say("importing TensorFlow")
    engine = Engine(algebra)
    clock.lap("import_and_build")
    state_jacobians = gradient_flow = None
    if not (jacobians or flow):
        say("running one forward and backward pass")
        result = engine.run(params, batch, watch_input=False)
        clock.lap("forward_backward")
    else:
        from gradscope.yaml.dynamics import dynamics

        steps = batch.x.shape[1]
        if at is not None and not 0 <= at < steps:
            raise ConfigError(f"--at {at} is outside the {steps} time steps; expected 0 to "
                              f"{steps - 1}", where="--at")
        say("forward, backward, state Jacobians and gradient flow")
        result, found = dynamics(engine, params, batch, at)
        state_jacobians = ([jacobian_entry(algebra, block) for block in found.jacobians]
                           if jacobians else None)
        gradient_flow = flow_entry(found) if flow else None
        if heatmap and gradient_flow is not None:
            from gradscope.gradient_stats import map_rows
            from gradscope.yaml.dynamics import influence_map

            rows = map_rows(steps, at)
            say("influence map ‖∂h_t/∂x_s‖")
            values = influence_map(engine, params, batch, rows)
            gradient_flow = gradient_flow.model_copy(update={"influence_map": InfluenceMap(
                steps=rows, values=[[float(v) for v in row] for row in values])})
        clock.lap("across_time")

    weight_gradients = _checked_against_algebra(algebra.weights, result.weight_gradients)
    state_gradients = _checked_against_algebra(algebra.states, result.state_gradients)
    gradients = [
        GradientEntry(**tensor_entry(info).model_dump(), stats=stats(weight_gradients[info.name]))
        for info in algebra.weights
    ]
    state_entries = [
        state_gradient_entry(info, state_gradients[info.name]) for info in algebra.states
    ]
    clock.lap("statistics")
    carry = carry_entry(algebra)
    if chunks is not None:
        from gradscope.chunks import chunk_lengths
        from gradscope.yaml.truncation import carry_numbers

        say(f"full and truncated BPTT in {chunks} chunks (float64)")
        lengths = chunk_lengths(int(batch.x.shape[1]), chunks)
        carry = carried_entry(carry, algebra, carry_numbers(algebra, params, batch, lengths))
        clock.lap("carry")
    broken = not_finite(algebra, params, batch, result.loss,
                        {**weight_gradients, **state_gradients})
    if broken is not None and (gradient_flow is not None or state_jacobians is not None):
        # Norms of NaN and Inf mean nothing (found tried as a new user would: the flow's
        # sparklines and its JSON failed on them).
        gradient_flow = state_jacobians = None
        broken += "; --flow and --jacobians are left out"
    return ExplainReport(
        model=model_entry(algebra, data=batch.source),
        loss=LossEntry(name=spec.loss, value=_finite_or_none(result.loss)),
        not_finite=broken,
        gradients=gradients,
        initial_state_gradients=state_entries,
        carry=carry,
        state_jacobians=state_jacobians,
        gradient_flow=gradient_flow,
        weights=weights_entry,
        timings=clock.laps(timings),
    )


# -- pieces ---------------------------------------------------------------------------------------






def state_gradient_entry(info: TensorInfo, gradient: np.ndarray) -> StateGradientEntry:
    return StateGradientEntry(
        name=info.name,
        alias=info.alias,
        layer=info.layer,
        shape=list(gradient.shape),
        formula=info.formula,
        stats=stats(gradient),
        per_example_norm=per_example_norms(gradient),
    )


def carry_entry(algebra: ModelShapes) -> CarryEntry:
    """Truncated BPTT: this batch's ∂L/∂h0 are the grad_ys of the previous batch's final states."""
    pairs = [
        CarryPair(
            y=info.name.replace(f"/{info.short}", f"/{info.short[0]}_T"),
            y_shape=list(info.shape),
            grad_y=info.name,
            grad_y_shape=list(info.shape),
        )
        for info in algebra.states
    ]
    n_ys, n_weights = len(pairs), len(algebra.weights)
    error = f"Passed {n_weights} grad_ys for {n_ys} ys"
    ys = ", ".join(pair.y for pair in pairs)
    grad_ys = ", ".join(f"∂L/∂{pair.grad_y}" for pair in pairs)
    explanation = [
        f"ys are the previous batch's final states ({ys}); grad_ys are this batch's "
        f"initial-state gradients ({grad_ys}): one grad_y per y, of the same shape.",
        "TF2: tape.gradient(target=[" + ys + "], sources=previous_weights, "
        "output_gradients=[" + grad_ys + "]); add the result to the previous batch's own "
        "weight gradients.",
        f"Passing the {n_weights} weight gradients as grad_ys instead raises "
        f"'{error}': grad_ys must match ys one to one, in number and shape.",
    ]
    return CarryEntry(
        pairs=pairs,
        ys_count=n_ys,
        weight_gradient_count=n_weights,
        wrong_call_error=error,
        explanation=explanation,
    )


def carried_entry(carry: CarryEntry, algebra: ModelShapes, numbers: CarryNumbers) -> CarryEntry:
    """``carry`` with the numbers of ``explain --chunks``: per weight, per chunk and state.

    Non-finite gradients have no carried share: the run is refused (exit 2), not reported
    with numbers that mean nothing."""
    for kind, gradients in (("full", numbers.full), ("truncated", numbers.truncated)):
        for name, value in gradients.items():
            if not np.all(np.isfinite(value)):
                raise ConfigError(
                    f"--chunks: the {kind} BPTT gradient of {name} has NaN or Inf values (in "
                    "float64), so no carried share can be given; expected finite gradients "
                    "(explain without --chunks shows where)", where="--chunks")
    weights, matters, verdict = carried_weights(numbers.full, numbers.truncated,
                                                [info.name for info in algebra.weights])
    products = []
    for chunk in numbers.products:
        for name in state_names(algebra):
            layer, state = name.rsplit("/", 1)
            x = name if chunk.chunk == 0 else f"{layer}/{state[0]}[t={chunk.start - 1}]"
            products.append(CarryProductEntry(
                chunk=chunk.chunk, start=chunk.start, stop=chunk.stop, layer=layer, x=x,
                y=f"{layer}/{state[0]}[t={chunk.stop - 1}]",
                l2_grad_y=float(np.linalg.norm(chunk.grad_ys[name])),
                l2_product=float(np.linalg.norm(chunk.products[name]))))
    return carry.model_copy(update={
        "chunks": len(numbers.chunk_lengths), "chunk_lengths": numbers.chunk_lengths,
        "weights": weights, "products": products, "threshold": CARRIED_SHARE_THRESHOLD,
        "matters": matters, "verdict": verdict,
    })


def _checked_against_algebra(infos: tuple[TensorInfo, ...],
                             gradients: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """Every number is real: a TF gradient whose shape differs from the algebra is a bug."""
    checked: dict[str, np.ndarray] = {}
    for info in infos:
        gradient = gradients.get(info.name)
        if gradient is None:
            raise InternalError(
                f"internal error: TensorFlow returned no gradient for {info.name}; the algebra "
                f"expects one of shape {info.shape}"
            )
        if tuple(gradient.shape) != info.shape:
            raise InternalError(
                f"internal error: the TF gradient of {info.name} has shape "
                f"{tuple(gradient.shape)}, but the shape algebra says {info.shape} "
                f"= {info.formula}"
            )
        checked[info.name] = gradient
    return checked


def _state_label(algebra: ModelShapes, layer: str, final: bool) -> str:
    """gru_1/h_T, or lstm_1/[h_T, c_T] for a two-state cell; h0 and [h0, c0] for sources."""
    cell = next(cell for cell in algebra.cells if cell.name == layer)
    names = [f"{s[0]}_T" if final else s for s in cell.state_names]
    return f"{layer}/{names[0]}" if len(names) == 1 else f"{layer}/[{', '.join(names)}]"


def jacobian_entry(algebra: ModelShapes, block: JacobianBlock) -> JacobianEntry:
    return JacobianEntry(
        target=_state_label(algebra, block.target_layer, final=True),
        source=_state_label(algebra, block.source_layer, final=False),
        shape=list(block.shape),
        **singular_summary(block.blocks, float(np.finfo(np.dtype(algebra.spec.dtype)).eps)),
    )



def flow_entry(found: Dynamics) -> FlowSection:
    steps = len(found.input_gradient_norms)
    # A recurrent layer is flagged by what its recurrence carries back (a loss at every step
    # keeps the total ∂L/∂h_t from fading), as a Keras layer is; x_t by its total.
    flags = [flag for layer, ratio in found.carried_ratios.items()
             if (flag := carried_flag(f"∂L/∂{layer}/h_t", ratio, f"from t={steps - 1} to t=0",
                                      found.joined[layer])) is not None]
    flags += flow_flags({"∂L/∂x_t": found.input_gradient_norms})
    return FlowSection(
        steps=len(found.input_gradient_norms),
        state_gradient_norms={name: [float(v) for v in norms]
                              for name, norms in found.state_gradient_norms.items()},
        input_gradient_norms=[float(v) for v in found.input_gradient_norms],
        influence_layer=found.influence_layer,
        influence_step=found.influence_step,
        influence=[float(v) for v in found.influence],
        flags=flags,
    )


def not_finite(algebra: ModelShapes, params: dict[str, np.ndarray], batch: Batch,
               loss: float, gradients: dict[str, np.ndarray | None]) -> str | None:
    """Where the loss or a gradient of a pass is not finite, in words (None: all finite),
    with what a float64 pass of the same model computes (the NumPy reference): where that is
    finite, the spec's dtype cannot hold the model's numbers."""
    from gradscope.yaml.reference import reference_loss

    bad = [name for name, g in gradients.items() if g is not None and not np.all(np.isfinite(g))]
    if np.isfinite(loss) and not bad:
        return None
    dtype = algebra.spec.dtype
    said = [f"the loss is {loss:g}" if not np.isfinite(loss) else "the loss is finite"]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        said.append(f"{len(bad)} of {len(gradients)} gradients hold NaN or Inf ({shown})")
    with np.errstate(all="ignore"):
        wide = reference_loss(algebra, params, batch)
    if dtype != "float64" and np.isfinite(wide):
        said.append(f"a float64 pass of the same model computes a loss of {wide:.4g}: "
                    f"{dtype} (largest number {float(np.finfo(dtype).max):.3g}) cannot hold "
                    "this model's numbers")
    return "; ".join(said) + ("; the statistics count finite entries only" if bad else "")


def _finite_or_none(value: float) -> float | None:
    return value if np.isfinite(value) else None


