"""Conv1D: one kernel window slid along the steps; every output step sees ``kernel_size``
input steps, ``dilation_rate`` apart, and every filter the input channels of its group."""

from __future__ import annotations

from typing import Any

from gradscope.cells.base import Block
from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    WeightNote,
    activation_note,
    register,
)


def _one(value: Any, default: int = 1) -> int:
    """A Conv1D size saved as ``[3]``, ``(3,)`` or ``3``."""
    if value is None:
        return default
    if isinstance(value, list | tuple):
        return int(value[0])
    return int(value)


class Geometry:
    """The numbers of one Conv1D call, read from its config and input shape."""

    def __init__(self, facts: LayerFacts) -> None:
        self.filters = int(facts.config["filters"])
        self.kernel_size = _one(facts.config.get("kernel_size"))
        self.stride = _one(facts.config.get("strides"))
        self.dilation = _one(facts.config.get("dilation_rate"))
        self.groups = int(facts.config.get("groups", 1) or 1)
        self.padding = str(facts.config.get("padding", "valid")).lower()
        self.channels_first = facts.config.get("data_format") == "channels_first"
        shape = facts.input_shape
        channels = shape[1] if self.channels_first else shape[-1]
        if channels is None:
            raise ValueError(f"layer {facts.name}: the channel axis of its input is unknown")
        self.channels = int(channels)
        steps = shape[-1] if self.channels_first else (shape[1] if len(shape) > 2 else None)
        self.steps = int(steps) if steps is not None else None
        self.label = facts.input_label

    @property
    def span(self) -> int:
        """How many input steps one window covers, first tap to last."""
        return self.dilation * (self.kernel_size - 1) + 1

    @property
    def per_group(self) -> int:
        return self.channels // self.groups

    @property
    def filters_per_group(self) -> int:
        return self.filters // self.groups

    def output_steps(self) -> int | None:
        """The output length, as ``compute_conv_output_shape`` gives it ("causal" pads
        dilation·(kernel_size−1) steps on the left, then works as "valid")."""
        if self.steps is None:
            return None
        if self.padding == "valid":
            return max((self.steps - self.span) // self.stride + 1, 0)
        if self.padding == "causal":
            return (self.steps - 1) // self.stride + 1
        return -(-self.steps // self.stride)

    def left_pad(self) -> int | None:
        """Zeros before step 0: none for "valid", dilation·(k−1) for "causal", and for "same"
        half of the total padding, rounded down (TensorFlow's SAME)."""
        if self.padding == "valid":
            return 0
        if self.padding == "causal":
            return self.span - 1
        out = self.output_steps()
        if out is None or self.steps is None:
            return None
        return max((out - 1) * self.stride + self.span - self.steps, 0) // 2

    def tap(self) -> str:
        """The input step tap j of output step t reads, e.g. "2·t + j − 1"."""
        pad = self.left_pad()
        stride = f"{self.stride}·t" if self.stride != 1 else "t"
        tap = f"{self.dilation}·j" if self.dilation != 1 else "j"
        shift = f" − {pad}" if pad else ("" if pad == 0 else " − pad")
        return f"{stride} + {tap}{shift}"

    def uncovered_steps(self) -> int | None:
        """How many input steps no window reads (they get no gradient): the tail "valid"
        leaves over, or the gaps of a stride longer than a window."""
        out, pad = self.output_steps(), self.left_pad()
        if out is None or pad is None or self.steps is None:
            return None
        read = {self.stride * t + self.dilation * j - pad
                for t in range(out) for j in range(self.kernel_size)}
        return sum(1 for step in range(self.steps) if step not in read)


@register
class Conv1DExplainer(LayerExplainer):
    class_names = ("Conv1D",)

    def summary(self, facts: LayerFacts) -> str:
        g = Geometry(facts)
        activation = facts.option("activation") or "linear"
        bias = " + b[f]" if facts.option("use_bias", True) else ""
        channel = (f"the {g.per_group} channels of f's group" if g.groups > 1
                   else f"c < {g.channels}")
        formula = (f"y[t, f] = {'' if activation == 'linear' else activation}"
                   f"{'(' if activation != 'linear' else ''}Σ_j Σ_c x[{g.tap()}, c]"
                   f"·W[j, c, f]{bias}{')' if activation != 'linear' else ''} "
                   f"(j < kernel_size {g.kernel_size}, {channel})")
        steps = g.output_steps()
        length = (f"; {g.steps} steps → {steps} steps" if g.steps is not None and steps
                  is not None else "")
        options = [f"padding {g.padding}", f"strides {g.stride}", f"dilation_rate {g.dilation}"]
        if g.groups > 1:
            options.append(f"groups {g.groups}: filters {g.filters_per_group} per group, "
                           f"each sees {g.per_group} of the {g.channels} channels")
        if g.channels_first:
            options.append("channels_first: the input is (batch, channels, steps)")
        return (f"Conv1D {g.channels} channels → {g.filters} filters, kernel_size "
                f"{g.kernel_size} (each window spans {g.span} steps): {formula}; "
                f"{', '.join(options)}{length}")

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        g = Geometry(facts)
        taps = (Block(0, g.kernel_size,
                      f"taps j: tap j of output step t reads input step {g.tap()}"),)
        columns = tuple(
            Block(group * g.filters_per_group, (group + 1) * g.filters_per_group,
                  f"filters of group {group} (channels {group * g.per_group}–"
                  f"{(group + 1) * g.per_group - 1})")
            for group in range(g.groups)) if g.groups > 1 else (
            Block(0, g.filters, "filters"),)
        steps = g.output_steps()
        sums = (f"its gradient sums over the batch × {steps} output steps" if steps is not None
                else "its gradient sums over the batch and every output step")
        channels = (f"axis 1: the {g.per_group} input channels of the filter's group "
                    f"({g.channels} / groups {g.groups})" if g.groups > 1
                    else f"axis 1: the {g.channels} input channels of {g.label}")
        kernel_formula = (f"kernel_size {g.kernel_size} × ({g.label} channels {g.channels} / "
                          f"groups {g.groups}) × filters {g.filters}" if g.groups > 1 else
                          f"kernel_size {g.kernel_size} × {g.label} channels {g.channels} × "
                          f"filters {g.filters}")
        notes = [WeightNote(
            key="kernel", shape=(g.kernel_size, g.per_group, g.filters),
            formula=kernel_formula,
            role="W[j, c, f]: how much tap j of channel c adds to filter f",
            rows=taps, columns=columns, note=f"{channels}; {sums}")]
        rank = facts.option("lora_rank")
        if rank:
            rank = int(rank)
            notes[0] = WeightNote(
                key="kernel", shape=notes[0].shape, formula=notes[0].formula,
                role=notes[0].role, rows=taps, columns=columns,
                note=f"{channels}; frozen by LoRA: non-trainable, it gets no gradient")
            notes += [
                WeightNote(key="lora_kernel_a", shape=(g.kernel_size, g.per_group, rank),
                           formula=f"kernel_size {g.kernel_size} × channels per group "
                                   f"{g.per_group} × lora_rank {rank}",
                           role="LoRA factor A: the kernel used is kernel + "
                                "(lora_alpha / rank)·A·B", rows=taps, note=sums),
                WeightNote(key="lora_kernel_b", shape=(rank, g.filters),
                           formula=f"lora_rank {rank} × filters {g.filters}",
                           role="LoRA factor B", columns=columns, note=sums)]
        if facts.option("use_bias", True):
            notes.append(WeightNote(
                key="bias", shape=(g.filters,), formula=f"filters {g.filters}",
                role="one bias per filter, the same at every output step", columns=columns,
                note=sums))
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        g = Geometry(facts)
        activation = facts.option("activation") or "linear"
        parts = [f"the activation {activation} {activation_note(activation)}",
                 f"∂L/∂x at input step s gathers ∂L/∂z[t, f]·W[j, c, f] of the {g.filters} "
                 "filters f from every output step t whose window has a tap j on s "
                 f"({g.tap()} = s): a transposed convolution over the {g.kernel_size} taps"]
        if g.groups > 1:
            parts.append(f"groups {g.groups}: channel c receives gradient only from the "
                         f"{g.filters_per_group} filters of its group")
        uncovered = g.uncovered_steps()
        if uncovered:
            parts.append(f"{uncovered} of the {g.steps} input steps are read by no window and "
                         "get no gradient")
        elif uncovered is None and (g.padding == "valid" or g.stride > 1):
            parts.append("an input step that no window reads gets no gradient")
        if g.padding == "causal":
            last = "t" if g.stride == 1 else f"{g.stride}·t"
            parts.append(f"causal: output step t reads only input steps ≤ {last}, so ∂L/∂x[s] "
                         f"comes only from output steps with {last} ≥ s")
        return "; ".join(parts)
