"""Every number the seed prints, and the Korthikanti figures in ../shared/notes/planner.md, exactly."""

from __future__ import annotations

import pytest

from launcher.plan.ledger import (
    GIB,
    act_gb,
    bubble_ratio,
    bytes_per_param,
    in_flight_microbatches,
    layer_activation_bytes,
    per_gpu_state_gb,
    tp_bytes_per_step,
)
from tests.cli_helpers import invoke

pytestmark = pytest.mark.unit


def test_sixteen_bytes_per_param():
    assert bytes_per_param().total == 16
    assert bytes_per_param(grad_dtype="fp32").total == 18          # Megatron's figure
    assert bytes_per_param("sgd").total == 12                       # the seed's SGD-with-momentum figure


@pytest.mark.parametrize("params_b, gb", [(7, 112), (13, 208), (70, 1120)])
def test_state_memory_whole_model(params_b, gb):
    assert per_gpu_state_gb(params_b, 1, 0) == pytest.approx(gb)


@pytest.mark.parametrize("stage, row", [
    (0, [112.0, 208.0, 1120.0]),
    (1, [38.5, 71.5, 385.0]),
    (2, [26.2, 48.8, 262.5]),
    (3, [14.0, 26.0, 140.0]),
])
def test_zero_table(stage, row):
    assert [round(per_gpu_state_gb(n, 8, stage), 1) for n in (7, 13, 70)] == row


def test_zero1_floor_for_7b():
    # "no matter how many GPUs you add, a 7B model never drops below 28GB" under stage 1
    assert per_gpu_state_gb(7, 10**6, 1) == pytest.approx(28.0, abs=1e-3)


@pytest.mark.parametrize("mode, gb", [("none", "104.15"), ("selective", "18.25"), ("full", "1.07")])
def test_activation_modes(mode, gb):
    assert f"{act_gb(4096, 1, 4096, 32, 32, mode):.2f}" == gb


def test_micro_batch_four_is_416_gb():
    assert int(act_gb(4096, 4, 4096, 32, 32, "none")) == 416


def test_tp_bytes_per_step():
    assert tp_bytes_per_step(4096, 1, 4096, 32, tp=8) / 1e9 == 7.516192768


def test_tp_time_nvlink_vs_ib():
    b = tp_bytes_per_step(4096, 1, 4096, 32, tp=8)
    assert round(b / 50e9 * 1e3) == 150          # "it becomes 150 milliseconds"
    assert 8 <= b / 900e9 * 1e3 <= 10             # "around 10 milliseconds"


@pytest.mark.parametrize("m, text", [(4, "175.0%"), (8, "87.5%"), (16, "43.8%"), (32, "21.9%"), (64, "10.9%")])
def test_bubble(m, text):
    assert f"{bubble_ratio(8, m):.1%}" == text


# --- Korthikanti et al. Fig. 1 / Table 2 as in ../shared/notes/planner.md -------------------------------------

def test_korthikanti_22b_tp_only_and_sp_selective():
    s, b, h, a, L, t = 2048, 4, 6144, 64, 48, 8
    tp_only = layer_activation_bytes(s, b, h, a, "none", tp=t, sequence_parallel=False) * L / GIB
    sp_sel = layer_activation_bytes(s, b, h, a, "selective", tp=t) * L / GIB
    assert tp_only == pytest.approx(59.25, abs=0.005)
    assert sp_sel == pytest.approx(9.5625, abs=1e-4)


def test_korthikanti_175b_interleaved():
    s, b, h, a, L, t, p, v = 2048, 1, 12288, 96, 96, 8, 8, 3
    held = in_flight_microbatches("interleaved-1f1b", p, 64, v)
    sp_sel = layer_activation_bytes(s, b, h, a, "selective", tp=t) * L / p * held / GIB
    tp_only = layer_activation_bytes(s, b, h, a, "none", tp=t, sequence_parallel=False) * L / p * held / GIB
    assert round(sp_sel, 2) == 12.35
    assert round(tp_only, 2) == 66.84


def test_korthikanti_params_and_optimizer_18_bytes():
    # Fig. 1 "params + optimizer" for 22B at t=8 (and 175B at t8/p8): 12·L·h² at 18 B/param
    per_gpu = 12 * 48 * 6144**2 / 8 * bytes_per_param(grad_dtype="fp32").total / GIB
    assert round(per_gpu, 2) == 45.56


def test_memory_command_prints_seed_tables():
    out = invoke("memory").output
    for text in ["16 B", "112 GB", "208 GB", "1120 GB", "[38.5, 71.5, 385.0]", "[26.2, 48.8, 262.5]",
                 "[14.0, 26.0, 140.0]", "104.15 GB", "18.25 GB", "1.07 GB", "7.516192768 GB/step",
                 "175.0%", "87.5%", "43.8%", "21.9%", "10.9%", "150 ms", "416 GB"]:
        assert text in out, text


def test_memory_command_json_and_adhoc():
    import json

    d = json.loads(invoke("memory", "--json").output)
    assert d["zero_table"][3]["gb"] == [14.0, 26.0, 140.0]
    r = invoke("memory", "--params", "7e9", "--world", "8", "--zero", "3", "--json")
    assert json.loads(r.output)["state_gb"] == [{"stage": 3, "gb": 14.0}]


@pytest.mark.parametrize("model, row", [
    ("22B", (45.56, 59.25, 9.56)), ("175B", (45.56, 66.84, 12.35)),
    ("530B", (31.64, 114.02, 23.08)), ("1T", (32.96, 131.25, 26.56))])
def test_korthikanti_fig1_all_four_models(model, row):
    from launcher.commands.memory_cmd import korthikanti_fig1

    got = {r["model"]: r for r in korthikanti_fig1()}[model]
    assert (got["params_optimizer_gib"], got["activations_tp_gib"], got["activations_sp_selective_gib"]) == row
