"""`launch verify` on the example job files, end to end through the CLI as a user runs it.

CI verifies the tiny examples, the 8B, hybrid-sharding and ZB-V ones here (the tiny one through
`launch verify --json`, the other tiny ones — the same model and layout on other backends — through the same two calls the
command makes, in this process: the CLI's own start-up is tested once, the traces all run).
Every other example is verified by benchmarks/verify_examples.py, which prints a table (exit code,
verdict, roles traced, peak vs ledger, time): they take minutes each on 2 CPUs (interleaved
pipelines trace every pipeline rank; the 405B example ~110 s CPU). test_every_example_is_verified_somewhere keeps the two lists
complete: a new example must land in one of them, with the reason when it is not verified in CI.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.ledger_vs_trace import CATEGORIES, misses
from tests.conftest import EXAMPLES, REPO

pytestmark = pytest.mark.integration

TINY = ["tiny-cpu.yaml", "tiny-k8s.yaml", "tiny-k8s-pytorchjob.yaml", "tiny-slurm.yaml"]
LARGE = "llama3-8b-8xh100.yaml"
HSDP = "llama3-1b-hsdp-1024xh100.yaml"
ZBV = "llama3-8b-zbv-32xh100.yaml"
#: verified by benchmarks/verify_examples.py only, and why not in CI
BENCHMARK_ONLY = {
    "gpt3-175b-a100.yaml": "a pipeline plan: every pipeline rank of 512 traced, ~25 s CPU (interleaved: ~85 s)",
    "llama3-70b-64xh100.yaml": "a larger dense Llama at pp 1, what the 8B example checks: ~20 s CPU",
    "llama3-405b-1024xh100.yaml": "the same at 1,024 ranks and 126 layers: ~115 s CPU",
    "mixtral-8x7b.yaml": "tests/integration/test_verify.py verifies it through the CLI (MoE, every pipeline rank)",
    "llama3-8b-compile-8xh100.yaml": "compiled blocks, torchtitan's Table 1 layout, ~10 s CPU; the planner compiles "
                                     "llama3-8b-8xh100.yaml's blocks too, which CI verifies. Fits, but its ledger "
                                     "misses the bound: activations 2.6 GB (11 %) above the trace (compiled, "
                                     "selective)",
    "llama2-7b-128k-ulysses.yaml": "all-to-all CP at 128k, ~20 s CPU; tests/integration/test_ledger_vs_trace.py traces "
                                   "all-to-all layouts at full width in CI",
    "llama3-70b-fp8-64xh100.yaml": "the 70B example in fp8, ~100 s CPU; tests/integration/test_ledger_vs_trace.py traces fp8 "
                                   "layouts at full width in CI. Its plan (tp 4, selective, compiled, since the "
                                   "compiled casts are priced fused) fits, the ledger 70.75 GB over a traced 67.23",
}


def launch_verify(example: str) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "verify", str(EXAMPLES / example), "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def check_report(rep: dict, code: int) -> None:
    """What every verify report must say: the exit code is the verdict, every role traced with each
    category beside the ledger's, and the traced categories add up to the peak."""
    assert code == (0 if rep["fits"] else 1) and rep["builds"]
    assert all(b["ok"] for b in rep["build_checks"]), rep["build_checks"]
    for role in rep["roles"]:
        assert role["status"] == "traced", role.get("error")
        assert set(role["categories_gb"]) == set(CATEGORIES) == set(role["ledger_gb"])
        assert role["peak_gb"] == pytest.approx(sum(role["categories_gb"].values()), rel=1e-3)
        assert role["needed_gb"] == pytest.approx(role["peak_gb"] + role["allowance_gb"], rel=1e-3)
        assert role["fits"] == (role["needed_gb"] <= role["limit_gb"])
        assert role["difference_gb"] == pytest.approx(role["peak_gb"] - role["ledger_total_gb"], abs=1e-3)


def ledger_row(role: dict) -> dict:
    """A verify role as benchmarks/ledger_vs_trace.py's row, for its bound (`misses`)."""
    return {"traced_gb": role["peak_gb"], "ledger_gb": role["ledger_total_gb"], "traced": role["categories_gb"],
            "ledger": role["ledger_gb"]}


def test_tiny_example_verifies_through_the_cli():
    """tp 2 x dp 2, ZeRO 3, fp32 on 4 CPU ranks: exit 0, one role ("every rank") traced, and the ledger
    within the matrix's bound of the trace, total and every category."""
    code, rep = launch_verify("tiny-cpu.yaml")
    check_report(rep, code)
    assert code == 0 and rep["world_size"] == 4 and rep["plan"] == "tiny-cpu"
    (role,) = rep["roles"]
    assert role["role"]["name"] == "every rank" and set(role["sources"].values()) == {"traced"}
    # the total: its categories are the matrix's ("tiny-cpu example" in benchmarks/ledger_vs_trace.py)
    assert role["ledger_total_gb"] == pytest.approx(role["peak_gb"], rel=0.10)


@pytest.mark.parametrize("example", TINY[1:])
def test_tiny_backend_examples_verify(example):
    """The k8s and Slurm tiny examples: the same model and layout as tiny-cpu on 2 nodes x 2, traced
    as `launch verify` traces them (its own two calls); each rank role fits, as tiny-cpu's does."""
    pytest.importorskip("torch")
    from launcher.commands.verify_cmd import load_plan_or_job
    from launcher.verify import trace_plan

    plan = load_plan_or_job(str(EXAMPLES / example))
    rep = trace_plan(plan).to_dict()
    check_report(rep, 0 if rep["fits"] else 1)
    assert rep["fits"] and rep["world_size"] == 4 and plan.nodes == 2
    (role,) = rep["roles"]
    assert role["ledger_total_gb"] == pytest.approx(role["peak_gb"], rel=0.10)


def test_large_example_verifies_through_the_cli():
    """Llama 3 8B on 8 H100 as the planner lays it out (ZeRO 2, selective recompute, bf16): built at
    its full size, its step traced at 3 and 4 layers and extended to all 32 (said per figure), the
    state exact, the ledger within the matrix's bound of the trace; the last rank of the world built too."""
    code, rep = launch_verify(LARGE)
    check_report(rep, code)
    assert rep["world_size"] == 8 and [b["rank"] for b in rep["build_checks"]] == [7]
    (role,) = rep["roles"]
    assert all("layers extended from 3 and 4 to 32" in s for s in role["sources"].values()), role["sources"]
    # 8.03e9 parameters, ZeRO 2 over dp=8: fp32 master shards 4 B/param/8, Adam moments 8 B/param/8
    n = 8_030_261_248
    assert role["state_gb"]["params"] == pytest.approx(4 * n / 8 / 1e9, rel=0.01)
    assert role["categories_gb"]["optimizer"] == pytest.approx(8 * n / 8 / 1e9, rel=0.01)
    assert misses(ledger_row(role)) == []


def test_hsdp_example_verifies_sharded_inside_each_node():
    """Llama 3.2 1B over 1,024 H100 as the planner lays it out: ZeRO 2 sharded over each node's 8 GPUs with
    128 replicas (hybrid sharding), traced at its full world size: the fp32 masters and Adam moments are
    1/8 of the model per GPU (not 1/1,024), and the ledger within the matrix's bound of the trace."""
    code, rep = launch_verify(HSDP)
    check_report(rep, code)
    assert code == 0 and rep["world_size"] == 1024
    (role,) = rep["roles"]
    n = 1_235_814_400                         # llama3-1b's parameters (tied embedding)
    assert role["state_gb"]["params"] == pytest.approx(4 * n / 8 / 1e9, rel=0.01)
    assert role["categories_gb"]["optimizer"] == pytest.approx(8 * n / 8 / 1e9, rel=0.01)
    assert misses(ledger_row(role)) == []


def test_zbv_example_verifies_every_pipeline_rank():
    """Llama 3 8B in a 16-stage ZB-V pipeline over 32 H100 as the planner lays it out (the split backward, two
    stages of a V on each rank): all 16 pipeline ranks verified at the full world size, two traced per action and
    the rest replayed from an identical shard, each through zero-bubble-v's own order at the plan's 16
    micro-batches, and every rank's ledger within the matrix's bound of its trace (~3 s CPU)."""
    code, rep = launch_verify(ZBV)
    check_report(rep, code)
    assert code == 0 and rep["world_size"] == 32
    roles = rep["roles"]
    assert [r["role"]["name"] for r in roles[:2]] == ["pp 0 stages 0,31 (embedding + head)", "pp 1 stages 1,30"]
    assert len(roles) == 16 and sum(not r.get("trace_of") for r in roles) == 2
    for role in roles:
        assert all("zero-bubble-v order at 16 micro-batches" in s for s in role["sources"].values()), role["sources"]
        assert misses(ledger_row(role)) == [], role["role"]["name"]


def test_every_example_is_verified_somewhere():
    examples = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert sorted([*TINY, LARGE, HSDP, ZBV, *BENCHMARK_ONLY]) == examples
