"""Pooling over time: MaxPooling1D, AveragePooling1D, GlobalMaxPooling1D and
GlobalAveragePooling1D (``keras/src/layers/pooling/``). Max routes the gradient to the arg-max
(TensorFlow's max-pool gradient picks the first of tied steps, its reduce_max gradient shares it
among them); average divides it evenly."""

from __future__ import annotations

from gradscope.keras.layers.base import LayerExplainer, LayerFacts, register
from gradscope.keras.layers.shapes import first, shape_text, size, steps_axis, steps_of


def _steps(facts: LayerFacts) -> int | None:
    return steps_of(facts, steps_axis(facts))


def _features(facts: LayerFacts) -> int | None:
    shape = facts.input_shape
    if len(shape) < 3:
        return None
    return shape[1] if facts.option("data_format") == "channels_first" else shape[-1]


def _pooled(facts: LayerFacts) -> str:
    """The output shape of a global pooling: (batch, F), or (batch, 1, F) with keepdims."""
    features = size(_features(facts))
    if not facts.option("keepdims"):
        return f"(batch, {features})"
    if facts.option("data_format") == "channels_first":
        return f"(batch, {features}, 1)"
    return f"(batch, 1, {features})"


class WindowPooling(LayerExplainer):
    """MaxPooling1D and AveragePooling1D: windows of ``pool_size`` steps every ``strides``; a
    subclass says how a window's gradient reaches its steps (``routed``)."""

    verb = ""

    def window(self, facts: LayerFacts) -> tuple[int, int, str, int | None, int | None]:
        pool = first(facts.option("pool_size"), 2)
        stride = first(facts.option("strides"), pool)
        padding = str(facts.option("padding", "valid"))
        steps = _steps(facts)
        if steps is None:
            out = None
        elif padding == "same":
            out = (steps - 1) // stride + 1
        else:
            out = (steps - pool) // stride + 1
        return pool, stride, padding, steps, out

    def summary(self, facts: LayerFacts) -> str:
        pool, stride, padding, steps, out = self.window(facts)
        return (f"{facts.class_name} pool_size {pool}, strides {stride}, padding '{padding}': "
                f"the {self.verb} of each window of {pool} steps, per feature, "
                f"{size(steps)} → {size(out)} steps on {shape_text(facts.input_shape)}")

    def routed(self, facts: LayerFacts, pool: int) -> list[str]:
        """How each window's gradient goes to its ``pool`` steps."""
        raise NotImplementedError

    def gradient_note(self, facts: LayerFacts) -> str:
        pool = first(facts.option("pool_size"), 2)
        return "; ".join(self.routed(facts, pool) + self.coverage(facts))

    def coverage(self, facts: LayerFacts) -> list[str]:
        """Which steps collect from several windows or from none."""
        pool, stride, padding, steps, out = self.window(facts)
        parts = []
        if stride < pool:
            parts.append(f"windows overlap (stride {stride} < pool {pool}): a step adds up what "
                         "it gets from every window it is in")
        if stride > pool:
            parts.append(f"stride {stride} > pool {pool}: the {stride - pool} step(s) between "
                         "two windows receive zero")
        if padding == "valid" and steps is not None and out is not None and out > 0:
            left = steps - ((out - 1) * stride + pool)
            if left > 0:
                parts.append(f"the last {left} step(s) fall in no window and receive zero")
        return parts


@register
class MaxPooling1DExplainer(WindowPooling):
    class_names = ("MaxPooling1D",)
    verb = "maximum"

    def routed(self, facts: LayerFacts, pool: int) -> list[str]:
        return [f"each window's gradient goes only to the step holding the maximum of its {pool} "
                "steps (per feature; the first one if tied); the others in the window get zero"]


@register
class AveragePooling1DExplainer(WindowPooling):
    class_names = ("AveragePooling1D",)
    verb = "mean"

    def routed(self, facts: LayerFacts, pool: int) -> list[str]:
        parts = [f"each window's gradient is divided by {pool} and given to each of its {pool} "
                 "steps"]
        if facts.option("padding", "valid") == "same":
            parts.append("with padding 'same' a window at the edge divides by the number of "
                         "real steps in it, not by the padding")
        return parts


@register
class GlobalMaxPooling1DExplainer(LayerExplainer):
    class_names = ("GlobalMaxPooling1D",)

    def summary(self, facts: LayerFacts) -> str:
        return (f"GlobalMaxPooling1D: the maximum over the {size(_steps(facts))} steps of each "
                f"of the {size(_features(facts))} features, {shape_text(facts.input_shape)} → "
                f"{_pooled(facts)}")

    def gradient_note(self, facts: LayerFacts) -> str:
        return (f"each feature's gradient goes to the step (of {size(_steps(facts))}) holding its "
                "maximum, shared evenly if several steps tie; every other step gets zero; the "
                "layer does not support masking: masked steps compete too")


@register
class GlobalAveragePooling1DExplainer(LayerExplainer):
    class_names = ("GlobalAveragePooling1D",)

    @staticmethod
    def masked(facts: LayerFacts) -> bool:
        """A second tensor in the call is its ``mask`` (the only tensor it takes besides x)."""
        return len(facts.input_shapes) > 1

    def summary(self, facts: LayerFacts) -> str:
        steps = size(_steps(facts))
        head = f"GlobalAveragePooling1D: {shape_text(facts.input_shape)} → {_pooled(facts)}"
        if self.masked(facts):
            return (f"{head}, the mean over the unmasked steps of the {steps} (the call "
                    "receives a mask): Σ of the unmasked steps / their number")
        return f"{head}, the mean over the {steps} steps of each feature"

    def gradient_note(self, facts: LayerFacts) -> str:
        steps = size(_steps(facts))
        masked = ("each unmasked step receives ∂L/∂y divided by the number of unmasked steps of "
                  "its sequence, and masked steps receive zero")
        if self.masked(facts):
            return masked
        return (f"each of the {steps} steps receives ∂L/∂y / {steps}; if a mask reaches the "
                f"layer (after Masking or an Embedding with mask_zero) {masked}")
