"""The pure-Python shape algebra: the seed's numbers, block meanings, and no TensorFlow."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import load_spec

SEED_SHAPES = {
    "gru_1/w_ru": (264, 128), "gru_1/b_ru": (128,), "gru_1/w_c": (264, 64), "gru_1/b_c": (64,),
    "gru_2/w_ru": (96, 64), "gru_2/b_ru": (64,), "gru_2/w_c": (96, 32), "gru_2/b_c": (32,),
    "dense_1/kernel": (32, 3), "dense_1/bias": (3,),
}


def test_seed_model_has_the_ten_seed_shapes_in_tf1_order():
    algebra = model_shapes(load_spec())
    assert [(w.name, w.shape) for w in algebra.weights] == list(SEED_SHAPES.items())
    assert [(s.name, s.shape) for s in algebra.states] == [
        ("gru_1/h0", (34, 64)), ("gru_2/h0", (34, 32))]
    assert algebra.weight_count == 60291
    assert algebra.chain == "input 200 → gru_1(64) → gru_2(32) → dense_1(3)"


def test_seed_formulas_substitute_the_users_numbers():
    by_name = model_shapes(load_spec()).by_name()
    assert by_name["gru_1/w_ru"].formula == "(input 200 + units 64) × 2·units 64"
    assert by_name["gru_1/w_c"].formula == "(input 200 + units 64) × units 64"
    assert by_name["gru_2/w_ru"].formula == "(gru_1 units 64 + units 32) × 2·units 32"
    assert by_name["gru_1/h0"].formula == "batch 34 × units 64"
    assert "batch 34 × time 100 = 3400 positions" in by_name["dense_1/kernel"].meaning
    assert by_name["gru_1/w_ru"].alias == "rnn/multi_rnn_cell/cell_0/gru_cell/gates/kernel"
    assert by_name["gru_2/w_ru"].alias == "rnn/multi_rnn_cell/cell_1/gru_cell/gates/kernel"
    assert by_name["gru_1/w_c"].alias == "rnn/multi_rnn_cell/cell_0/gru_cell/candidate/kernel"
    assert by_name["dense_1/kernel"].alias == "dense/kernel"
    assert by_name["dense_1/bias"].alias == "dense/bias"
    assert {w.alias_source for w in model_shapes(load_spec()).weights} == {"tf1"}


def test_block_meanings_name_rows_and_gate_columns():
    w_ru = model_shapes(load_spec()).by_name()["gru_1/w_ru"]
    assert [(b.start, b.stop, b.label) for b in w_ru.rows] == [
        (0, 200, "x_t"), (200, 264, "h_{t−1}")]
    assert [(b.start, b.stop, b.label) for b in w_ru.columns] == [
        (0, 64, "reset gate r"), (64, 128, "update gate u")]
    assert "rows 0–199 x_t, 200–263 h_{t−1}" in w_ru.meaning
    assert "columns 0–63 reset gate r, 64–127 update gate u" in w_ru.meaning
    w_c = model_shapes(load_spec()).by_name()["gru_1/w_c"]
    assert "[x_t, r∘h_{t−1}]" in w_c.meaning and "candidate c" in w_c.meaning


def test_keras_layout_shapes_and_gate_order():
    spec = load_spec({"input_size": 200, "time_steps": 3, "batch_size": 2, "layout": "keras",
                      "layers": [{"gru": 64}, {"type": "gru", "units": 32, "reset_after": False},
                                 {"dense": 3}]})
    by_name = model_shapes(spec).by_name()
    assert by_name["gru_1/kernel"].shape == (200, 192)
    assert by_name["gru_1/recurrent_kernel"].shape == (64, 192)
    assert by_name["gru_1/bias"].shape == (2, 192)
    assert [b.label for b in by_name["gru_1/bias"].rows] == ["input bias", "recurrent bias"]
    assert by_name["gru_2/bias"].shape == (96,)
    assert [b.label for b in by_name["gru_1/kernel"].columns] == [
        "update gate z", "reset gate r", "candidate ĥ"]
    assert by_name["gru_1/kernel"].alias == "gru_1/gru_cell/kernel"
    assert by_name["gru_2/kernel"].alias == "gru_2/gru_cell/kernel"
    assert by_name["gru_1/kernel"].alias_source == "keras"


def test_last_step_head_sums_over_the_batch_only():
    algebra = model_shapes(load_spec(str(REPO / "sample_configs/last_step.yaml")))
    assert algebra.positions == 8
    assert "sum over batch 8 only" in algebra.by_name()["dense_1/kernel"].meaning
    assert algebra.output_shape == (8, 5)


recurrent = st.fixed_dictionaries({
    "type": st.just("gru"), "units": st.integers(1, 40),
    "layout": st.sampled_from(["block", "keras"]),
})


@settings(max_examples=200, deadline=None)
@given(input_size=st.integers(1, 300), layers=st.lists(recurrent, min_size=1, max_size=4),
       heads=st.lists(st.integers(1, 20), max_size=2), batch=st.integers(1, 64))
def test_parameter_counts_sum_and_stacked_inputs_chain(input_size, layers, heads, batch):
    spec = load_spec({"input_size": input_size, "time_steps": 2, "batch_size": batch,
                      "layers": [*layers, *({"dense": h} for h in heads)]})
    algebra = model_shapes(spec)
    assert algebra.weight_count == sum(w.size for w in algebra.weights)
    fan_in = input_size
    for cell in algebra.cells:
        assert cell.input_size == fan_in
        weights = {w.short: w for w in cell.weights()}
        u = cell.units
        if cell.layout == "block":
            assert weights["w_ru"].shape == (fan_in + u, 2 * u)
            assert weights["w_c"].shape == (fan_in + u, u)
        else:
            assert weights["kernel"].shape == (fan_in, 3 * u)
        for w in weights.values():  # row and column blocks tile their axes exactly
            if w.rows:
                assert w.rows[0].start == 0 and w.rows[-1].stop == w.shape[0]
            if w.columns:
                assert w.columns[0].start == 0 and w.columns[-1].stop == w.shape[-1]
        fan_in = u
    for state, cell in zip(algebra.states, algebra.cells, strict=True):
        assert state.shape == (batch, cell.units)


def test_shapes_command_never_imports_tensorflow_and_is_fast():
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from gradscope.cli import main\n"
        "try:\n    main(['shapes', '--json'])\nexcept SystemExit as e:\n    code = e.code\n"
        "assert code == 0, code\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
        "assert 'keras' not in sys.modules, 'keras was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert [t["shape"] for t in document["tensors"]] == [list(s) for s in SEED_SHAPES.values()]


def test_aliases_tell_layers_apart_as_the_canonical_tf1_program_names_them():
    # One block cell: dynamic_rnn's "rnn" scope alone; two dense layers: tf.layers.dense's
    # dense, dense_1; a keras-layout layer in the stack: its Keras 3 path.
    one = model_shapes(load_spec({"input_size": 3, "time_steps": 2, "batch_size": 2,
                                  "layers": [{"gru": 4}, {"dense": 3}, {"dense": 2}]}))
    assert [w.alias for w in one.weights] == [
        "rnn/gru_cell/gates/kernel", "rnn/gru_cell/gates/bias", "rnn/gru_cell/candidate/kernel",
        "rnn/gru_cell/candidate/bias", "dense/kernel", "dense/bias", "dense_1/kernel",
        "dense_1/bias"]
    mixed = model_shapes(load_spec({"input_size": 3, "time_steps": 2, "batch_size": 2,
                                    "layers": [{"lstm": 4}, {"gru": 3, "layout": "keras"},
                                               {"simple_rnn": 2}, {"dense": 2}]})).by_name()
    assert mixed["lstm_1/kernel"].alias == "rnn/multi_rnn_cell/cell_0/lstm_cell/kernel"
    assert mixed["gru_1/recurrent_kernel"].alias == "gru_1/gru_cell/recurrent_kernel"
    assert mixed["simple_rnn_1/bias"].alias == "rnn/multi_rnn_cell/cell_1/basic_rnn_cell/bias"
    aliases = [w.alias for w in model_shapes(load_spec()).weights]
    assert len(set(aliases)) == len(aliases)


def test_checkpoint_names_replace_the_derived_aliases():
    names = {"gru_1/w_ru": "GRU_Layer1/rnn/gru_cell/gates/kernel"}
    by_name = model_shapes(load_spec(), aliases=names).by_name()
    assert by_name["gru_1/w_ru"].alias == "GRU_Layer1/rnn/gru_cell/gates/kernel"
    assert by_name["gru_1/w_ru"].alias_source == "checkpoint"
    assert by_name["gru_1/w_c"].alias_source == "tf1"
