"""How a gradient is checked, whichever wing the model comes from.

Both checks probe a loss along unit directions, take central differences, compare them with
autodiff's directional derivative, and turn each witness's verdict into a report row. What
they share is here, with the one tolerance table and the one table of steps. This module
imports neither wing and no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from gradscope.report.models import CheckedTensor, WitnessEntry


class Tolerance(NamedTuple):
    """``|a − b| ≤ atol + rtol·|b|``; a witness that normalises its error uses ``rtol``."""

    rtol: float
    atol: float = 0.0


#: Tolerances by witness and by the dtype it computes in. Finite differences use JAX's
#: ``check_grads`` values (1e-5 in float64, 2e-3 in float32); witnesses in exact arithmetic
#: are held much tighter. GRUBlockCellGrad has no float64 kernel. ``replay`` holds the Keras
#: engine's layer-by-layer run to Keras' own call (the same operations, so only rounding), and
#: the sum of per-example gradients to the tape's (in a mixed policy's half precision);
#: ``cross_check`` holds Keras' recurrent calls to gradscope's NumPy cells, about ten
#: epsilons of float16 and bfloat16 under a mixed policy.
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "finite_differences": {"float64": Tolerance(1e-5), "float32": Tolerance(2e-3)},
    "numpy_reference": {"float64": Tolerance(1e-9), "float32": Tolerance(1e-4)},
    "gru_block_kernel": {"float64": Tolerance(1e-9), "float32": Tolerance(2e-3)},
    "tbptt_carry": {"float64": Tolerance(1e-9), "float32": Tolerance(1e-4)},
    "against": {"float64": Tolerance(1e-6), "float32": Tolerance(1e-4)},
    "replay": {"float64": Tolerance(1e-9, 1e-12), "float32": Tolerance(1e-4, 1e-6),
               "float16": Tolerance(1e-2, 1e-4), "bfloat16": Tolerance(6e-2, 1e-4)},
    "cross_check": {"float64": Tolerance(1e-9, 1e-10), "float32": Tolerance(1e-4, 1e-5),
                    "float16": Tolerance(1e-2, 1e-2), "bfloat16": Tolerance(6e-2, 6e-2)},
}


def tolerance(witness: str, dtype: str = "float64") -> Tolerance:
    """``witness``'s tolerance in ``dtype``; a dtype it has none for takes float32's."""
    row = TOLERANCES[witness]
    return row.get(dtype, row["float32"])


#: The step of a central difference along a unit direction, by the code probed and its dtype.
#: The truncation error grows as step², the loss's rounding, amplified, as 1/step.
#: ``smooth``: gradscope's own cells (tanh, sigmoid), where 1e-3 keeps the truncation ~1e-7.
#: ``any``: the user's code, which may hold kinks (relu, clips, max): 1e-5 in float64; in
#: float32, 1e-2, as 1e-3 let a 1.5× wrong gradient pass under the rounding.
STEP: dict[str, dict[str, float]] = {
    "smooth": {"float64": 1e-3},
    "any": {"float64": 1e-5, "float32": 1e-2},
}


def step_for(dtype: str, code: str = "any") -> float:
    """The step of the central differences on ``code`` that computes in ``dtype``."""
    row = STEP[code]
    return row.get(dtype, row.get("float32", row["float64"]))


def retakes_for(dtype: str, code: str = "any") -> tuple[float, ...]:
    """The smaller steps a disagreeing probe is taken again at, in turn (a kink, a loss that
    curves within the step, or a wrong gradient?): in float64 a hundredth of the step, then a
    ten-thousandth (a chaotic trajectory's loss curves within 1e-6 of the weights; its
    rounding, 1e-16 of the loss over 1e-9, is still far below a gradient), in float32 a
    tenth, whose rounding would drown a hundredth; of the step for ``code``
    (:func:`step_for`). On ``smooth`` code in float64 a tenth comes first: its difference's
    error falls a hundredfold while its rounding grows only tenfold, so it sees a curve out
    where a hundredth's rounding would hide it (found tried as a new user would: a softmax
    LSTM over 300 steps, a bias's derivative 1.608647e-06 at 1e-3 against autodiff's
    1.608813e-06, whose disagreement was below the rounding at 1e-5, and check failed it;
    at 1e-4 it reads 1.608811e-06). A wrong gradient disagrees at every step; a kink's
    one-sided slopes stay apart at every step."""
    step = step_for(dtype, code)
    if dtype != "float64":
        return (step / 10,)
    return (step / 10, step / 100, step / 10_000) if code == "smooth" else (step / 100,
                                                                            step / 10_000)


#: A float64 number within this power of a dtype's largest finite number (float32: about
#: 4.8e34 of 3.4e38; float16: 2.2e4 of 65504) is near enough to its range that the model, as
#: the user runs it in that dtype, may overflow where a float64 copy does not (a square
#: inside the loss, say): a check in float64 then runs the model in its own dtype to see.
NEAR_RANGE_POWER = 0.9


def near_range(values: Any, dtype: str) -> bool:
    """Whether any of ``values`` (numbers or arrays of a float64 pass, None left out: a loss
    and its gradients, say) comes near ``dtype``'s range (never for float64 itself)."""
    kind = np.dtype(dtype) if dtype != "bfloat16" else np.dtype("float32")
    if kind.kind != "f" or kind.itemsize >= 8:
        return False
    limit = float(np.finfo(kind).max) ** NEAR_RANGE_POWER
    for value in values:
        array = np.asarray(value)
        if (value is not None and array.dtype.kind == "f" and array.size
                and float(np.max(np.abs(array))) > limit):
            return True
    return False


#: Random directions per tensor, unless the user asks for another number (``--directions``).
PER_TENSOR_DIRECTIONS = 3
#: Random single elements probed per tensor, beside the element of largest |g|.
RANDOM_ELEMENTS = 2


def rounding_of(dtype: str) -> float:
    """The rounding of a loss computed in ``dtype``, relative to max(|loss|, 1): 64 of its
    epsilons, the bound of a long computation (bfloat16's epsilon is 2⁻⁷: NumPy has no
    such dtype)."""
    return 64 * (2.0 ** -7 if dtype == "bfloat16" else float(np.finfo(dtype).eps))


#: :func:`rounding_of` float64.
ROUNDING = rounding_of("float64")


def underflow_scale(dtype: str) -> float:
    """The magnitude below which a gradient computed in ``dtype`` is no longer held to a
    relative tolerance: its smallest normal number over its epsilon (float32: 9.9e-32).
    Below the smallest normal number a CPU's arithmetic flushes to 0, so each operation of
    a long backward pass may lose up to that much; below this scale that loss exceeds the
    value's own rounding, and a float64 reference of a gradient that fades through many
    steps (an LSTM's shut forget gate) sits there while the tape reads 0. Found tried as a
    new user would: a correct float32 check failed ∂L/∂h0 with a relative error of
    5.6e+261 (reference 5.6e-39, tape 0). bfloat16 shares float32's exponent range."""
    name = "float32" if dtype == "bfloat16" else dtype
    info = np.finfo(name)
    return float(info.tiny) / float(info.eps)


def rounding_noise(loss: Any, step: float, rounding: float = ROUNDING) -> Any:
    """The loss's rounding (``rounding`` of max(|loss|, 1)), amplified by 1/(2·step): below it
    no disagreement of a central difference is real. ``loss``: a number or an array."""
    return rounding * np.maximum(np.abs(loss), 1.0) / (2 * step)


#: A disagreement within this many times what one rounding of the inputs moves a computation
#: is rounding, grown along it (a trajectory that amplifies, a loss's residual that cancels):
#: a cell held to Keras' output, the YAML wing's NumPy reference held to autodiff.
AMPLIFIED = 10.0


def one_rounding_off(value: Any, rounding: float, rng: np.random.Generator) -> np.ndarray:
    """``value`` with every number moved by one ``rounding`` (relative), its sign drawn from
    ``rng``: what rounding the inputs of a computation is worth, to see how far the
    computation grows it (:data:`AMPLIFIED`)."""
    return value * (1 + rounding * rng.choice([-1.0, 1.0], size=np.shape(value)))


#: In float64 a loss below this has its rounding measured (:func:`small_loss_rounding`):
#: 64 epsilons of 1 are then more than a hundred of the loss. Five forward passes; on the
#: LSTM 256 × 2 at 1000 steps (a loss of 0.95, where it would gain nothing) they took 13 s.
SMALL_LOSS = 1e-2
#: Where :func:`small_loss_rounding` takes the loss, along one unit direction of the weights.
ROUNDING_STEPS = (-2e-8, -1e-8, 0.0, 1e-8, 2e-8)


def small_loss_rounding(losses: Any) -> float:
    """In float64, the rounding of a loss below :data:`SMALL_LOSS`, relative to 1
    (max(|loss|, 1), as :func:`rounding_noise` takes it): measured, where 64 epsilons of 1
    would allow a loss of 8.5e-7 (a loss weight of 1e-6) a difference a hundred times its
    gradient's tolerance (found tried as a new user would: a weight's gradient 5% wrong
    passed), and would stop a retake at a smaller step from seeing that a right gradient
    agrees there (a model near its targets, a loss of 6e-9: a false alarm). ``losses``: the
    loss at each of :data:`ROUNDING_STEPS` along one direction of the weights. Less the
    parabola that fits them best (the loss's curvature over 2e-8, about 1e-16 where the
    model's outputs are near their targets, is far above a loss of 6e-9's rounding, and a
    line would take it for rounding), four times the largest residue, at least 64 epsilons
    of the loss itself and at most 64 of 1. No gradient enters."""
    steps = np.array(ROUNDING_STEPS) / 1e-8
    values = np.asarray(losses, np.float64)
    middle = values[ROUNDING_STEPS.index(0.0)]
    fitted = np.polyval(np.polyfit(steps, values - middle, 2), steps)
    residues = np.abs(values - middle - fitted)
    return min(ROUNDING, max(4 * float(np.max(residues)), ROUNDING * abs(float(middle))))


def relative_error(value: np.ndarray, expected: np.ndarray) -> float:
    """‖value − expected‖₂ / ‖expected‖₂ (or the absolute norm when ``expected`` is zero)."""
    value = np.asarray(value, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = float(np.linalg.norm(expected))
    difference = float(np.linalg.norm(value - expected))
    return difference / scale if scale > 0 else difference


@dataclass(frozen=True)
class Probe:
    """One direction a loss is moved along: unit norm, the tensor's shape."""

    tensor: str
    label: str  # "direction 1", "element (3, 7) (largest |g|)"
    direction: np.ndarray
    #: For a single-element probe, the element's index.
    element: tuple[int, ...] | None = None

    @property
    def key(self) -> tuple[str, Any]:
        """What the probe perturbs: two probes with one key have the same losses."""
        return (self.tensor, self.label if self.element is None else self.element)


def random_probes(name: str, shape: tuple[int, ...], directions: int,
                  rng: np.random.Generator) -> tuple[list[Probe], list[int]]:
    """The probes that need no gradient: ``directions`` random unit directions, and the
    candidates for the random elements (flat indices: the first ``RANDOM_ELEMENTS`` of them
    that are not the element of largest |g|)."""
    out = []
    for k in range(directions):
        v = rng.standard_normal(shape)
        out.append(Probe(name, f"direction {k + 1}", v / np.linalg.norm(v)))
    size = int(np.prod(shape, dtype=np.int64))
    candidates = rng.choice(size, size=min(size, RANDOM_ELEMENTS + 1), replace=False)
    return out, [int(i) for i in candidates]


def element_probe(name: str, shape: tuple[int, ...], index: int, why: str) -> Probe:
    v = np.zeros(shape)
    where = tuple(int(w) for w in np.unravel_index(index, shape))
    v[where] = 1.0
    return Probe(name, f"element {where} ({why})", v, where)


def elements_for(name: str, gradient: np.ndarray, candidates: list[int]) -> list[Probe]:
    """The element of largest |g|, then the random candidates that are not it."""
    largest = int(np.argmax(np.abs(gradient)))
    chosen = [i for i in candidates if i != largest][:RANDOM_ELEMENTS]
    # Where every element is 0 there is no largest: the first, said as what it is.
    why = "largest |g|" if np.any(gradient) else "the first; every |g| is 0"
    return [element_probe(name, gradient.shape, largest, why),
            *(element_probe(name, gradient.shape, i, "random") for i in chosen)]


def probes_for(name: str, gradient: np.ndarray, directions: int,
               rng: np.random.Generator) -> list[Probe]:
    """Random unit directions, the element of largest |g|, and random single elements."""
    drawn, candidates = random_probes(name, gradient.shape, directions, rng)
    return drawn + elements_for(name, gradient, candidates)


def factor_text(value: float) -> str:
    """A ratio in three significant digits, or as many more (up to seven) as tell it from 1:
    "1.02", "1.001", "0.9995" (found tried as a new user would: a gradient 0.1% wrong, "the
    tape's is 1 times the differences'")."""
    shown = f"{value:.3g}"
    for digits in range(4, 8):
        if value == 1.0 or float(shown) != 1.0:
            break
        shown = f"{value:.{digits}g}"
    return shown


def allowance(gradient: np.ndarray, probes: list[Probe], loss: float, rtol: float,
              atol: float | None, step: float, rounding: float = ROUNDING) -> np.ndarray:
    """Per probe, how far a central difference at ``step`` may be from autodiff's ⟨g, v⟩ and
    agree (:func:`directional_error`): ``rtol`` of its scale (:func:`probe_scales`), the
    loss's rounding amplified at that step (:func:`rounding_noise`), and ``atol``."""
    analytic = np.array([float(np.sum(gradient * p.direction)) for p in probes])
    return (rtol * probe_scales(gradient, probes, analytic)
            + rounding_noise(loss, step, rounding) + (atol or 0.0))


def probe_scales(gradient: np.ndarray, probes: list[Probe], analytic: np.ndarray
                 ) -> np.ndarray:
    """Per probe, the size its error is measured against: its own derivative ``analytic``,
    or, where that is near zero by chance, the typical size of one: for a random direction
    ‖g‖/√n; for a single element, the median |g| of the elements that have one, where that
    is smaller. A gradient whose few elements are far larger than the rest (an input's early
    steps on a near-chaotic RNN, 244 beside 0.045) makes ‖g‖/√n no element's size: found
    tried as a new user would, an input's gradient 2% wrong passed on two such elements,
    its other probes left out as not resolved."""
    typical = float(np.linalg.norm(gradient)) / np.sqrt(max(gradient.size, 1))
    sizes = np.abs(np.asarray(gradient, np.float64))
    sizes = sizes[sizes > 0]
    element = min(typical, float(np.median(sizes))) if sizes.size else typical
    floors = np.array([element if p.element is not None else typical for p in probes])
    return np.maximum(np.maximum(np.abs(analytic), floors), 1e-300)


def directional_error(gradient: np.ndarray, probes: list[Probe], plus: np.ndarray,
                      minus: np.ndarray, loss: float, rtol: float, atol: float | None,
                      step: float, rounding: float = ROUNDING) -> tuple[float, bool, str]:
    """Central differences along ``probes`` (loss at ±``step``) against ⟨g, v⟩: the worst
    normalised error, whether it is within ``rtol``, and a line naming the worst probe and both
    values. Only ``plus − minus`` counts: for a probe that moves one example, both may be that
    example's share of the loss."""
    numerical = (plus - minus) / (2 * step)
    analytic = np.array([float(np.sum(gradient * p.direction)) for p in probes])
    # Passing means |fd − ad| within the allowance: the error is normalised so that it
    # passes exactly when it is ≤ rtol.
    errors = rtol * np.abs(numerical - analytic) / allowance(gradient, probes, loss, rtol,
                                                             atol, step, rounding)
    worst = int(np.argmax(errors))
    detail = (f"{len(probes)} probes; worst: {probes[worst].label}, finite difference "
              f"{numerical[worst]:.6e} vs autodiff {analytic[worst]:.6e}")
    return float(errors[worst]), bool(errors[worst] <= rtol), detail


def extrapolated_error(gradient: np.ndarray, probes: list[Probe], plus: np.ndarray,
                       minus: np.ndarray, half_plus: np.ndarray, half_minus: np.ndarray,
                       loss: float, rtol: float, atol: float | None, step: float,
                       rounding: float = ROUNDING) -> tuple[float, bool, str]:
    """:func:`directional_error` of Richardson's extrapolation from central differences at
    ``step`` (``plus``, ``minus``) and at half of it (``half_plus``, ``half_minus``):
    (4·D(step/2) − D(step))/3, whose error falls as the step's fourth power where a central
    difference's falls as its square, and whose rounding is three times the step's. Where
    the loss curves within the step and every smaller step's rounding is wider than the
    disagreement (:func:`can_tell`), it still resolves the derivative (found tried as a new
    user would: a softmax LSTM's kernel 1.6e-5 off at 1e-3, below 1e-4's rounding; a right
    gradient failed)."""
    analytic = np.array([float(np.sum(gradient * p.direction)) for p in probes])
    whole = (plus - minus) / (2 * step)
    half = (half_plus - half_minus) / step
    numerical = (4 * half - whole) / 3
    errors = rtol * np.abs(numerical - analytic) / allowance(gradient, probes, loss, rtol,
                                                             atol, step / 3, rounding)
    worst = int(np.argmax(errors))
    detail = (f"{len(probes)} probes; worst: {probes[worst].label}, extrapolated from the "
              f"steps {step:g} and {step / 2:g} (Richardson) {numerical[worst]:.6e} vs "
              f"autodiff {analytic[worst]:.6e}")
    return float(errors[worst]), bool(errors[worst] <= rtol), detail


def can_tell(gradient: np.ndarray, probes: list[Probe], plus: np.ndarray, minus: np.ndarray,
             loss: float, rtol: float, atol: float | None, step: float, smaller: float,
             rounding: float = ROUNDING) -> bool:
    """Whether central differences at the ``smaller`` step could see the disagreement those
    at ``step`` found (``plus``, ``minus``): for every probe that disagreed there, the
    allowance at ``smaller`` (:func:`allowance`: the loss's rounding grows as 1/step) is
    narrower than that disagreement. Where it is not, a retake there agrees whatever the
    gradient: found tried as a new user would, an initial state's gradient of 4.1e-05, 3%
    wrong (a custom gradient's ×1.03 below it), passed at 1e-9, whose rounding (about 1e-05)
    was larger than the gradient itself."""
    numerical = (plus - minus) / (2 * step)
    analytic = np.array([float(np.sum(gradient * p.direction)) for p in probes])
    off = np.abs(numerical - analytic)
    disagreeing = off > allowance(gradient, probes, loss, rtol, atol, step, rounding)
    there = allowance(gradient, probes, loss, rtol, atol, smaller, rounding)
    return bool(np.all(there[disagreeing] < off[disagreeing]))


def not_settling(first: float, at_larger: float, at_smaller: float, scale: float,
                 loss: float, rtol: float, larger: float, smaller: float,
                 rounding: float = ROUNDING) -> bool:
    """Whether central differences at a step and at two smaller ones (``larger``,
    ``smaller``) do not converge: the last two apart by more than ``rtol`` of ``scale`` and
    their rounding (twice the smaller step's, once the larger's), and by more than a
    hundredth of the first two. On a smooth loss, even one that curves within the step, the
    error falls as the step squared; along a trajectory that amplifies every perturbation
    the differences witness nothing."""
    allowed = (rtol * scale + 2 * float(rounding_noise(loss, smaller, rounding))
               + float(rounding_noise(loss, larger, rounding)))
    apart = abs(at_larger - at_smaller)
    return bool(apart > allowed and apart > 0.01 * abs(first - at_larger))


@dataclass
class Settled:
    """Probes after :func:`settle_kinks`: groups of (probes, plus, minus, step) to compare,
    the probes left out at a kink (label, right slope, left slope), and those left out
    unresolved (label, the two smallest steps, the central difference at each)."""

    groups: list[tuple[list[Probe], np.ndarray, np.ndarray, float]] = field(
        default_factory=list)
    kinks: list[tuple[str, float, float]] = field(default_factory=list)
    unresolved: list[tuple[str, float, float, float, float]] = field(default_factory=list)
    #: Left out too, not resolved: probes across which the loss curves within the step, whose
    #: differences come, step by step, to within :data:`APPROACH` of autodiff, and no closer
    #: (label, the step, the difference there, autodiff's).
    approaching: list[tuple[str, float, float, float]] = field(default_factory=list)
    #: Left out too, not resolved: probes whose disagreement at the step no smaller step's
    #: rounding is narrow enough to see (:func:`can_tell`): (label, the step, the difference
    #: there, autodiff's, the first smaller step, its allowance).
    drowned: list[tuple[str, float, float, float, float, float]] = field(
        default_factory=list)

    def kink_detail(self, total: int) -> str:
        label, right, left = self.kinks[0]
        return (f"{len(self.kinks)} of {total} probes at a kink (relu or a clip at its corner, "
                f"a tie in a max): the loss has no derivative there, its one-sided slopes "
                f"differ ({label}: {right:.6e} on one side, {left:.6e} on the other), so "
                "those probes are left out")

    def unresolved_detail(self, total: int) -> str:
        label, larger, smaller, at_larger, at_smaller = self.unresolved[0]
        return (f"{len(self.unresolved)} of {total} probes not resolved: their central "
                f"differences do not settle as the step shrinks ({label}: {at_larger:.6e} at "
                f"{larger:g}, {at_smaller:.6e} at {smaller:g}), as along a trajectory that "
                "amplifies every perturbation (a chaotic or exploding recurrence), so those "
                "probes are left out")

    def approaching_detail(self, total: int) -> str:
        label, step, difference, analytic = self.approaching[0]
        return (f"{len(self.approaching)} of {total} probes not resolved: the loss curves "
                f"within the step, and their central differences come to autodiff as the step "
                f"shrinks, as near as the steps resolve ({label}: {difference:.6e} at {step:g} "
                f"against {analytic:.6e}), as along a trajectory that amplifies every "
                "perturbation, so those probes are left out")

    def drowned_detail(self, total: int) -> str:
        label, step, difference, analytic, smaller, allowed = self.drowned[0]
        return (f"{len(self.drowned)} of {total} probes not resolved: they disagree at the "
                f"step {step:g} ({label}: {difference:.6e} against autodiff {analytic:.6e}), "
                f"by less than a smaller step's rounding lets a difference see ({allowed:.1e} "
                f"at {smaller:g}), so that no smaller step tells a loss that curves within "
                "the step from a wrong gradient; those probes are left out")

    def left_out_detail(self, total: int) -> str:
        """What was left out, in words ("" where nothing was)."""
        said = [self.kink_detail(total)] if self.kinks else []
        said += [self.unresolved_detail(total)] if self.unresolved else []
        said += [self.drowned_detail(total)] if self.drowned else []
        return "; ".join(said + ([self.approaching_detail(total)] if self.approaching else []))

    @property
    def not_resolved(self) -> bool:
        """Some probe was left out not resolved, either way."""
        return bool(self.unresolved or self.approaching or self.drowned)


#: A probe's central difference at the first step and at the smallest retake part by more
#: than this share of the gradient's scale: the loss curves within the step.
CURVES = 1e-2
#: A probe's disagreement no smaller step can see is taken again at this many times the step.
LARGER = 10
#: How near autodiff the differences of a probe across which the loss curves must come to be
#: left out, not resolved, rather than failed: a hundred times the float64 tolerance.
APPROACH = 1e-3


def settle_kinks(gradient: np.ndarray, probes: list[Probe], plus: np.ndarray,
                 minus: np.ndarray, evaluate_at: Callable[[np.ndarray], float],
                 base: np.ndarray, loss: float, rtol: float,
                 atol: float | None, dtype: str = "float64",
                 rounding: float = ROUNDING) -> Settled:
    """A probe whose central difference disagrees with autodiff is taken again at smaller
    steps, in turn (:func:`retakes_for`). Where the loss is smooth, or curves within the step
    but not within a smaller one, the difference there agrees (it keeps that step). Where the
    probe straddles a kink, the one-sided slopes stay apart at every step: the probe is left
    out, and said to be at a kink, never a failure. Where the differences do not converge
    as the step shrinks (a trajectory that amplifies every perturbation), the probe is left
    out too, said not resolved. A probe that fails at every step on a smooth loss stays as
    it failed."""
    settled = Settled()
    kept: list[int] = []
    retaken: dict[float, list[tuple[Probe, float, float]]] = {}
    centre: float | None = None
    step, retakes = step_for(dtype), retakes_for(dtype)
    small = retakes[0]

    def seen_again_larger(k: int, first: float, analytic: float
                          ) -> tuple[bool, tuple[float, float] | None]:
        """Probe ``k``, whose disagreement at the step no smaller step can see, taken again
        at ten times it, whose rounding is a tenth: whether the disagreement is seen again
        there (beyond the allowance, and its difference nearer the step's than half their
        disagreement with autodiff: two differences that agree with each other and not with
        autodiff, over a loss smooth across both: a wrong gradient. Found tried as a new user
        would: an initial state's gradient 0.05% wrong, its disagreement at 1e-5 measured to
        four digits, left out and passed); and the losses there where the difference agrees
        with autodiff (the step's disagreement was its rounding), else None."""
        probe, larger = probes[k], LARGER * step
        a = evaluate_at((base + larger * probe.direction).astype(base.dtype))
        b = evaluate_at((base - larger * probe.direction).astype(base.dtype))
        off = abs(first - analytic)
        agrees = directional_error(gradient, [probe], np.array([a]), np.array([b]), loss,
                                   rtol, atol, larger, rounding)[1]
        return (not agrees and abs((a - b) / (2 * larger) - first) <= 0.5 * off,
                (a, b) if agrees else None)

    for k, probe in enumerate(probes):
        if directional_error(gradient, [probe], plus[k:k + 1], minus[k:k + 1], loss, rtol,
                             atol, step, rounding)[1]:
            kept.append(k)
            continue
        first = float((plus[k] - minus[k]) / (2 * step))
        analytic = float(np.sum(gradient * probe.direction))
        scale = float(probe_scales(gradient, [probe], np.array([analytic]))[0])
        # Only the smaller steps whose rounding leaves the disagreement visible: at the
        # others a difference agrees whatever the gradient (they are the last of them).
        telling = [at for at in retakes if can_tell(
            gradient, [probe], plus[k:k + 1], minus[k:k + 1], loss, rtol, atol, step, at,
            rounding)]
        if not telling:
            seen, agreed = seen_again_larger(k, first, analytic)
            if seen:
                kept.append(k)  # a wrong gradient: it fails at the step
                continue
            if agreed is not None:  # the step's rounding, which the larger step's is not
                retaken.setdefault(LARGER * step, []).append((probe, *agreed))
                continue
            settled.drowned.append((
                probe.label, step, first, analytic, small,
                float(allowance(gradient, [probe], loss, rtol, atol, small, rounding)[0])))
            continue
        taken = [(at, evaluate_at((base + at * probe.direction).astype(base.dtype)),
                  evaluate_at((base - at * probe.direction).astype(base.dtype)))
                 for at in telling]
        agreeing = next(((at, a, b) for at, a, b in taken if directional_error(
            gradient, [probe], np.array([a]), np.array([b]), loss, rtol, atol, at,
            rounding)[1]), None)
        if agreeing is not None:
            retaken.setdefault(agreeing[0], []).append((probe, agreeing[1], agreeing[2]))
            continue
        if len(taken) < len(retakes):
            # The smaller steps that would tell a curving loss from a wrong gradient are lost
            # to rounding: where the loss curves between the step and the last retake taken
            # (their differences apart by CURVES of the scale), nothing tells which it is.
            at, a, b = taken[-1]
            if abs(first - (a - b) / (2 * at)) > CURVES * scale:
                settled.drowned.append((
                    probe.label, at, float((a - b) / (2 * at)), analytic, retakes[len(taken)],
                    float(allowance(gradient, [probe], loss, rtol, atol, retakes[len(taken)],
                                    rounding)[0])))
                continue
        if len(taken) > 1:
            # The central differences do not converge: the two smallest steps disagree with
            # each other beyond rounding, and by more than a hundredth of what the two
            # largest did (on a smooth loss, even one that curves within the step, the
            # error falls as the step squared: 10⁴-fold from one retake to the next). Then
            # they witness nothing. A wrong gradient converges, to another value than
            # autodiff's, and fails.
            fds = [(step, first), *((at, (a - b) / (2 * at)) for at, a, b in taken)]
            (larger, at_larger), (smaller, at_smaller) = fds[-2:]
            if not_settling(first, at_larger, at_smaller, scale, loss, rtol, larger, smaller,
                            rounding):
                settled.unresolved.append((probe.label, larger, smaller, at_larger,
                                           at_smaller))
                continue
            # The loss curves within the step (its difference there is far from the smallest
            # step's), and the differences come to autodiff as the step shrinks, within
            # APPROACH, as near as rounding on such a trajectory lets them (on a chaotic RNN
            # at 3× an orthogonal kernel: ×0.36 at 1e-5, 1e-3 off at 1e-7, 1.1e-5 at 1e-8,
            # 1.4e-5 at 1e-9, where forward mode agrees with autodiff to 1e-15). A gradient
            # off by more than APPROACH still fails; on a smooth loss the differences do not
            # curve so, and a wrong gradient fails there whatever its size.
            off = [abs(d - analytic) for _, d in fds]
            nearest = int(np.argmin(off))
            if (abs(first - at_smaller) > CURVES * scale and off[nearest] <= APPROACH * scale
                    and off[nearest] < 0.01 * off[0]):
                settled.approaching.append((probe.label, fds[nearest][0], fds[nearest][1],
                                            analytic))
                continue
        _, near_plus, near_minus = taken[0]
        centre = evaluate_at(base) if centre is None else centre
        far = (plus[k] - centre) / step - (centre - minus[k]) / step
        near = (near_plus - centre) / small - (centre - near_minus) / small
        noise = 16 * rounding * max(abs(centre), 1.0) / small
        if abs(far) > noise and abs(near) > 0.5 * abs(far):
            settled.kinks.append((probe.label, (near_plus - centre) / small,
                                  (centre - near_minus) / small))
        else:
            kept.append(k)
    if kept:
        settled.groups.append(([probes[k] for k in kept], plus[kept], minus[kept], step))
    for at, group in retaken.items():
        settled.groups.append(([p for p, _, _ in group], np.array([a for _, a, _ in group]),
                               np.array([b for _, _, b in group]), at))
    return settled


@dataclass(frozen=True)
class WitnessResult:
    """One witness's verdict on one tensor.

    ``error`` is a relative error (the witness says how it normalises); ``passed`` is
    ``error <= tolerance`` unless the witness found something worse (a wrong shape, a missing
    tensor), in which case ``error`` may be ``None`` and ``detail`` says what.
    """

    witness: str
    tensor: str
    error: float | None
    tolerance: float
    passed: bool
    detail: str = ""
    #: For time-indexed tensors: the first step, counting back from the end, that diverges.
    first_bad_step: int | None = None
    #: Every probe sat where the loss has no derivative: the witness says nothing here.
    at_kink: bool = False
    #: Every probe left out, some not resolved (:meth:`Settled.unresolved_detail`): the
    #: witness says nothing here.
    unresolved: bool = False
    #: The probes left out, in words (:meth:`Settled.left_out_detail`; "" where none was):
    #: at a kink, or not resolved. Where every probe was, it is also the ``detail``.
    left_out: str = ""


def checked_tensors(results: list[WitnessResult], order: list[str] | None = None,
                    shapes: dict[str, list[int]] | None = None,
                    prefix: str = "") -> list[CheckedTensor]:
    """One report row per tensor: those named in ``order`` first, in that order, then the
    others as they came, each with its witnesses. A witness whose error is not a number
    (NaN in a difference, an overflow) has failed, and says so: JSON has no NaN, and a report
    never passes it. ``prefix`` goes before each name (a layer's, for ``check --layer``)."""
    order, shapes = order or [], shapes or {}
    by_name: dict[str, list[WitnessResult]] = {}
    for result in results:
        by_name.setdefault(result.tensor, []).append(result)
    names = [n for n in order if n in by_name] + [n for n in by_name if n not in order]
    rows = []
    for name in names:
        entries = [_entry(r) for r in by_name[name]]
        rows.append(CheckedTensor(name=f"{prefix}{name}", shape=shapes.get(name),
                                  passed=all(e.passed for e in entries), witnesses=entries))
    return rows


def unwitnessed(results: list[WitnessResult]) -> set[str]:
    """The tensors every result of which left its probes out (at a kink, or not resolved):
    nothing contradicts them, and nothing confirms them."""
    left_out: dict[str, bool] = {}
    for result in results:
        out = bool(result.at_kink or result.unresolved)
        left_out[result.tensor] = left_out.get(result.tensor, True) and out
    return {tensor for tensor, out in left_out.items() if out}


def _entry(result: WitnessResult) -> WitnessEntry:
    error, passed, detail = result.error, result.passed, result.detail
    if error is not None and not np.isfinite(error):
        error, passed, detail = None, False, f"{detail}; its error is {result.error}"
    return WitnessEntry(witness=result.witness, error=error, tolerance=result.tolerance,
                        passed=passed, detail=detail, first_bad_step=result.first_bad_step,
                        at_kink=result.at_kink, unresolved=result.unresolved,
                        left_out=result.left_out)
