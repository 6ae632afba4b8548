"""``explain --chunks K``: the carry in numbers, held to an independent TensorFlow program.

The truth is a two-layer block GRU written here with ``tf.scan`` (not gradscope's cells or
engine), run in two chunks: once straight through (full BPTT) and once with
``tf.stop_gradient`` on both layers' states at the chunk boundary (truncated BPTT). The seed's
``tf.gradients(ys=final states, xs=initial states, grad_ys=next chunk's ∂L/∂h0)`` is a tape
over the first chunk with ``output_gradients``. gradscope's numbers come from the CLI's JSON.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_gradscope

from gradscope.chunks import CARRIED_SHARE_THRESHOLD
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import Batch, initial_params
from gradscope.yaml.truncation import CarryPasses

#: 7 steps in 2 chunks: np.array_split cuts them 4 + 3, so the boundary is at t = 4.
CONFIG = {"input_size": 3, "time_steps": 7, "batch_size": 2, "dtype": "float64", "seed": 5,
          "layers": [{"gru": 4}, {"gru": 3}, {"dense": 2}]}
BOUNDARY = 4
CONFIG_YAML = ("input_size: 3\ntime_steps: 7\nbatch_size: 2\ndtype: float64\nseed: 5\n"
               "layers: [{gru: 4}, {gru: 3}, {dense: 2}]\n")
RTOL = 1e-9


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The config, a batch of our own (non-zero initial states), and the weights gradscope
    draws from the config's seed (the weights are data here, not computation)."""
    folder = tmp_path_factory.mktemp("carry")
    (folder / "model.yaml").write_text(CONFIG_YAML)
    rng = np.random.default_rng(11)
    arrays = {"x": rng.standard_normal((2, 7, 3)),
              "y": np.eye(2)[rng.integers(0, 2, size=(2, 7))],
              "gru_1/h0": 0.5 * rng.standard_normal((2, 4)),
              "gru_2/h0": 0.5 * rng.standard_normal((2, 3))}
    np.savez(folder / "batch.npz", **arrays)
    shapes = model_shapes(load_spec(CONFIG))
    return folder, arrays, shapes, initial_params(shapes)


@pytest.fixture(scope="module")
def truth(case, tf):
    _, arrays, _, params = case
    return independent_carry(tf, params, arrays)


@pytest.fixture(scope="module")
def report(case):
    folder, *_ = case
    result = run_gradscope("explain", str(folder / "model.yaml"), "--data",
                           str(folder / "batch.npz"), "--chunks", "2", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["carry"]


def independent_carry(tf, params: dict[str, np.ndarray], arrays: dict[str, np.ndarray]
                      ) -> dict[str, dict[str, float]]:
    """Norms of full, truncated and carried weight gradients, and of the seed's product."""
    p = {name: tf.constant(value, tf.float64) for name, value in params.items()}
    x = tf.constant(arrays["x"])
    y = tf.constant(arrays["y"])
    h0 = [tf.constant(arrays["gru_1/h0"]), tf.constant(arrays["gru_2/h0"])]

    def gru(layer: str, inputs, h_start):
        """Block GRU over (B, T, F): r, u = σ([x, h]·w_ru + b_ru); c = tanh([x, r∘h]·w_c + b_c);
        h = u∘h + (1 − u)∘c. Returns (B, T, units)."""
        w_ru, b_ru, w_c, b_c = (p[f"{layer}/{n}"] for n in ("w_ru", "b_ru", "w_c", "b_c"))
        units = b_c.shape[0]

        def step(h, x_t):
            ru = tf.sigmoid(tf.concat([x_t, h], 1) @ w_ru + b_ru)
            r, u = ru[:, :units], ru[:, units:]
            c = tf.tanh(tf.concat([x_t, r * h], 1) @ w_c + b_c)
            return u * h + (1 - u) * c

        return tf.transpose(tf.scan(step, tf.transpose(inputs, [1, 0, 2]), initializer=h_start),
                            [1, 0, 2])

    def loss_of(outputs):
        logits = tf.einsum("btu,uk->btk", outputs, p["dense_1/kernel"]) + p["dense_1/bias"]
        return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))

    def run(cut: bool):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([*p.values(), *h0])
            a1 = gru("gru_1", x[:, :BOUNDARY], h0[0])
            a2 = gru("gru_2", a1, h0[1])
            finals = [a1[:, -1], a2[:, -1]]
            starts = [tf.stop_gradient(s) for s in finals] if cut else finals
            tape.watch(starts)
            b1 = gru("gru_1", x[:, BOUNDARY:], starts[0])
            b2 = gru("gru_2", b1, starts[1])
            loss = loss_of(tf.concat([a2, b2], axis=1))
        weights = tape.gradient(loss, p)
        return weights, tape, finals, starts, loss

    full, *_ = run(cut=False)
    truncated, tape, finals, starts, loss = run(cut=True)
    # The next chunk's ∂L/∂(initial states): what chunk 1 alone sends back to its start.
    grad_ys = tape.gradient(loss, starts)
    products = tape.gradient(finals, h0, output_gradients=grad_ys)
    weights = {}
    for name in params:
        g_full, g_truncated = full[name].numpy(), truncated[name].numpy()
        weights[name] = {"l2_full": float(np.linalg.norm(g_full)),
                         "l2_truncated": float(np.linalg.norm(g_truncated)),
                         "l2_carried": float(np.linalg.norm(g_full - g_truncated))}
    states = {name: {"l2_grad_y": float(np.linalg.norm(g.numpy())),
                     "l2_product": float(np.linalg.norm(v.numpy()))}
              for name, g, v in zip(["gru_1/h0", "gru_2/h0"], grad_ys, products, strict=True)}
    return {"weights": weights, "states": states}


def worst_error(carry: dict, truth: dict) -> float:
    """The largest relative error of any weight norm or product norm against the truth."""
    errors = []
    for entry in carry["weights"]:
        for key, expected in truth["weights"][entry["name"]].items():
            errors.append(abs(entry[key] - expected) / max(expected, 1e-300))
    for entry in carry["products"]:
        for key, expected in truth["states"][entry["x"]].items():
            errors.append(abs(entry[key] - expected) / max(expected, 1e-300))
    return max(errors)


def test_explain_chunks_json_equals_an_independent_stop_gradient_program(report, truth):
    assert report["chunks"] == 2 and report["chunk_lengths"] == [4, 3]
    assert [entry["name"] for entry in report["weights"]] == list(truth["weights"])
    for entry in report["weights"]:
        assert set(entry) == {"name", "l2_full", "l2_truncated", "l2_carried", "carried_share"}
        expected = truth["weights"][entry["name"]]
        assert entry["l2_carried"] == pytest.approx(expected["l2_carried"], rel=RTOL, abs=1e-15)
        assert entry["l2_full"] == pytest.approx(expected["l2_full"], rel=RTOL)
        assert entry["l2_truncated"] == pytest.approx(expected["l2_truncated"], rel=RTOL)
        share = entry["l2_carried"] / entry["l2_full"]
        assert entry["carried_share"] == pytest.approx(share, rel=1e-12)
    # The recurrent weights get a carry; the dense layer, applied at every step, none.
    carried = {entry["name"]: entry["l2_carried"] for entry in report["weights"]}
    assert carried["gru_1/w_ru"] > 0 and carried["dense_1/kernel"] == 0
    assert [(e["chunk"], e["x"], e["y"]) for e in report["products"]] == [
        (0, "gru_1/h0", "gru_1/h[t=3]"), (0, "gru_2/h0", "gru_2/h[t=3]")]
    for entry in report["products"]:
        expected = truth["states"][entry["x"]]
        assert entry["l2_grad_y"] == pytest.approx(expected["l2_grad_y"], rel=RTOL)
        assert entry["l2_product"] == pytest.approx(expected["l2_product"], rel=RTOL)
    assert worst_error(report, truth) < RTOL
    largest = max(e["carried_share"] for e in report["weights"])
    assert report["threshold"] == CARRIED_SHARE_THRESHOLD
    assert report["matters"] == (largest >= CARRIED_SHARE_THRESHOLD)
    assert report["verdict"].startswith("carrying matters" if report["matters"]
                                        else "carrying hardly matters")


@pytest.fixture(scope="module")
def passes(case):
    _, arrays, shapes, params = case
    batch = Batch(x=arrays["x"], y=arrays["y"],
                  initial_states={k: v for k, v in arrays.items() if k.endswith("/h0")})
    return CarryPasses(shapes), params, batch


def as_report(numbers) -> dict:
    return {
        "weights": [{"name": name,
                     "l2_full": float(np.linalg.norm(numbers.full[name])),
                     "l2_truncated": float(np.linalg.norm(numbers.truncated[name])),
                     "l2_carried": float(np.linalg.norm(numbers.carried(name)))}
                    for name in numbers.full],
        "products": [{"x": name, "l2_grad_y": float(np.linalg.norm(product.grad_ys[name])),
                      "l2_product": float(np.linalg.norm(product.products[name]))}
                     for product in numbers.products for name in product.products],
    }


@pytest.mark.parametrize("mutant,cut_steps", [
    ("no cut: truncated equals full, nothing carried", []),
    ("cut one step early", [BOUNDARY - 1]),
    ("cut one step late", [BOUNDARY + 1]),
    ("an extra cut inside the second chunk", [BOUNDARY, BOUNDARY + 2]),
])
def test_a_wrong_carry_is_caught(passes, truth, mutant, cut_steps):
    """The comparison above fails for carry numbers computed with the cut in the wrong place;
    the same library call with the right cut passes it (the mutant is the cut alone)."""
    carry, params, batch = passes
    wrong = carry.numbers(params, batch, [BOUNDARY, 3], cut_steps=cut_steps)
    assert worst_error(as_report(wrong), truth) > 1e-3, mutant
    right = carry.numbers(params, batch, [BOUNDARY, 3])
    assert worst_error(as_report(right), truth) < RTOL


def test_python_api_and_the_verdict_threshold(case):
    import gradscope

    folder, *_ = case
    carry = gradscope.explain(str(folder / "model.yaml"), data=str(folder / "batch.npz"),
                              chunks=3).carry
    assert carry.chunk_lengths == [3, 2, 2]
    assert [(p.chunk, p.x) for p in carry.products] == [
        (0, "gru_1/h0"), (0, "gru_2/h0"), (1, "gru_1/h[t=2]"), (1, "gru_2/h[t=2]")]
    assert carry.weights is not None
    assert carry.matters == any(w.carried_share >= 0.01 for w in carry.weights)


def test_the_verdict_says_hardly_below_the_threshold_and_matters_above_it():
    from gradscope.yaml.explain import carried_entry, carry_entry
    from gradscope.yaml.truncation import CarryNumbers

    shapes = model_shapes(load_spec(CONFIG))
    full = {info.name: np.ones(info.shape) for info in shapes.weights}

    def verdict(share: float):
        truncated = {name: value * (1 - share) for name, value in full.items()}
        numbers = CarryNumbers(chunk_lengths=[4, 3], full=full, truncated=truncated,
                               products=[])
        return carried_entry(carry_entry(shapes), shapes, numbers)

    below = verdict(0.5 * CARRIED_SHARE_THRESHOLD)
    assert below.matters is False
    assert below.verdict == ("carrying hardly matters: it changes every gradient by < 1% "
                             "(at most 0.500%, gru_1/w_ru)")
    above = verdict(2 * CARRIED_SHARE_THRESHOLD)
    assert above.matters is True
    assert above.verdict == ("carrying matters: it changes 10 of 10 gradients by ≥ 1% "
                             "(gru_1/w_ru by 2.00%)")


def test_non_finite_gradients_are_refused_not_reported():
    from gradscope.errors import ConfigError
    from gradscope.yaml.explain import carried_entry, carry_entry
    from gradscope.yaml.truncation import CarryNumbers

    shapes = model_shapes(load_spec(CONFIG))
    full = {info.name: np.ones(info.shape) for info in shapes.weights}
    truncated = {**full, "gru_2/w_c": np.full(full["gru_2/w_c"].shape, np.nan)}
    numbers = CarryNumbers(chunk_lengths=[4, 3], full=full, truncated=truncated, products=[])
    with pytest.raises(ConfigError, match="truncated BPTT gradient of gru_2/w_c has NaN"):
        carried_entry(carry_entry(shapes), shapes, numbers)
