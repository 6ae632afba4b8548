"""BatchNormalization: each feature normalised with statistics over the batch (and every other
axis) in training mode, and with the moving statistics in inference mode."""

from __future__ import annotations

from gradscope.cells.base import Block
from gradscope.keras.layers.base import (
    LayerExplainer,
    LayerFacts,
    WeightNote,
    batch_positions,
    register,
)


def feature_axis(facts: LayerFacts) -> int:
    return int(facts.config.get("axis", -1))


def features(facts: LayerFacts) -> int:
    shape = facts.input_shape
    axis = feature_axis(facts)
    size = shape[axis] if -len(shape) <= axis < len(shape) else None
    if size is None:
        raise ValueError(f"layer {facts.name}: the size of axis {axis} of its input {shape} "
                         "is unknown")
    return int(size)


def reduced(facts: LayerFacts) -> str:
    """What the batch statistics (and gamma's and beta's gradients) run over."""
    return batch_positions(facts, {feature_axis(facts) % len(facts.input_shape)})


@register
class BatchNormalizationExplainer(LayerExplainer):
    class_names = ("BatchNormalization",)

    def summary(self, facts: LayerFacts) -> str:
        c = features(facts)
        scale = "γ∘" if facts.option("scale", True) else ""
        shift = " + β" if facts.option("center", True) else ""
        epsilon = facts.option("epsilon", 1e-3)
        momentum = facts.option("momentum", 0.99)
        text = (f"BatchNormalization of {c} features (axis {feature_axis(facts)}), each "
                f"normalised over {reduced(facts)}: training mode y = {scale}(x − μ_B) / "
                f"√(σ²_B + ε){shift} with the batch's mean and variance, and moving_mean, "
                f"moving_variance ← {momentum}·old + {1 - float(momentum):.3g}·batch; "
                f"inference mode y = {scale}(x − moving_mean) / √(moving_variance + ε){shift}, "
                f"an affine map per feature; ε = {epsilon}")
        if facts.option("trainable", True) is False:
            text += "; trainable=False: it always uses the moving statistics"
        if facts.option("renorm"):
            text += ("; renorm: training mode corrects the batch statistics towards "
                     "renorm_mean and renorm_stddev, y = γ∘(x̂·r + d) + β, with r and d held "
                     "constant for the gradient")
        return text

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        c = features(facts)
        over = reduced(facts)

        def vector(key: str, role: str, note: str, trainable: bool = False) -> WeightNote:
            """One weight of c values, one per feature."""
            return WeightNote(key=key, shape=(c,), formula=f"features {c}", role=role,
                              columns=(Block(0, c, "features"),), note=note,
                              trainable=trainable)

        frozen = ("non-trainable: not among the trainable weights, it gets no gradient; "
                  f"training mode updates it by momentum {facts.option('momentum', 0.99)} "
                  "from the batch statistics")
        notes = []
        if facts.option("scale", True):
            notes.append(vector("gamma", "scale of each normalised feature (starts at 1)",
                                f"its gradient sums ∂L/∂y∘x̂ over {over}", trainable=True))
        if facts.option("center", True):
            notes.append(vector("beta", "shift of each normalised feature (starts at 0)",
                                f"its gradient sums ∂L/∂y over {over}", trainable=True))
        notes += [vector("moving_mean", "running mean of each feature, used in inference mode",
                         frozen),
                  vector("moving_variance", "running variance of each feature, used in "
                         "inference mode", frozen)]
        if facts.option("renorm"):
            renorm = ("non-trainable: not among the trainable weights, it gets no gradient; "
                      "training mode updates it by renorm_momentum "
                      f"{facts.option('renorm_momentum', 0.99)}")
            notes += [vector("moving_stddev", "running standard deviation (renorm derives "
                             "moving_variance from it)", frozen),
                      vector("renorm_mean", "renorm's running mean (the r, d correction)",
                             renorm),
                      vector("renorm_stddev", "renorm's running standard deviation (the r, d "
                             "correction)", renorm)]
        return notes

    def gradient_note(self, facts: LayerFacts) -> str:
        c = features(facts)
        over = reduced(facts)
        scale = facts.option("scale", True)
        gamma = "γ∘" if scale else ""
        text = (f"inference mode: an affine map per feature, ∂L/∂x = {gamma}∂L/∂y / "
                f"√(moving_variance + ε) for each of the {c} features, every example "
                "independent; training mode: μ_B and σ²_B depend on every example, so the "
                f"gradient couples the examples of the batch: with g = {gamma}∂L/∂y and x̂ "
                f"the normalised input, ∂L/∂x = (g − mean(g) − x̂·mean(g∘x̂)) / σ_B, the means "
                f"over {over}, per feature; moving_mean and moving_variance are "
                "non-trainable and get no gradient")
        if facts.option("renorm"):
            text += ("; renorm: training mode multiplies g by r (r = σ_B / renorm_stddev, "
                     "clipped; r and d are held constant for the gradient)")
        return text
