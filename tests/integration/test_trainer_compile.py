"""Compiled blocks (plan.layout.compile) in the real trainer on gloo: the same losses and gradient norms as the
single-process eager reference, and `launch verify` tracing compiled blocks against the ledger.

Two compiled layouts, to keep compile time small on 2 CPU cores: tp 2 through inductor (DTensor's
sequence-parallel norms and the custom sequence-parallel ops compiled into C++ kernels) and dp 2 under ZeRO 3
with selective recompute through aot_eager (the same dynamo graph and min-cut partition with eager kernels:
FSDP2's hooks beside the graph, SAC's policy inside it). Both compile with fullgraph=True, so a graph break fails
the run; dynamo is reset between layouts and its counters say a graph was compiled. Tolerance as
tests/integration/test_trainer_parity.py's: relative 1e-5 (observed ~3e-7).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from launcher.plan.ledger import rank_memory
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from tests.job_helpers import free_port
from tests.plan_helpers import chosen
from tests.trainer_helpers import job_losses, make_plan, run_layouts, spawn

pytestmark = pytest.mark.integration

RTOL = 1e-5
STEPS = 3
#: name -> (make_plan kwargs, compile backend or None for eager)
LAYOUTS: dict[str, tuple[dict[str, Any], str | None]] = {
    "ref": (dict(), None),
    "compiled_tp2_inductor": (dict(tp=2, micro_batch=2), "inductor"),
    "compiled_dp2_zero3_selective_aot_eager": (dict(dp=2, zero=3, recompute="selective", micro_batch=2), "aot_eager"),
}


def run_compiled(rank: int, nprocs: int, jobs: list[dict], workdir: str, ports: list[int]) -> None:
    """run_layouts one job at a time, dynamo reset before each (its caches would serve the next layout's blocks),
    and what dynamo compiled written beside each job's result: <name>.dynamo.json (rank 0)."""
    import resource

    import torch
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._inductor.config.compile_threads = 1       # no compile worker pool per rank on a 2-core machine
    for job, port in zip(jobs, ports):
        torch._dynamo.reset()
        counters.clear()
        before = resource.getrusage(resource.RUSAGE_SELF)
        run_layouts(rank, nprocs, [job], workdir, port)
        after = resource.getrusage(resource.RUSAGE_SELF)
        if rank == 0:
            stats = {"graphs": int(counters["stats"]["unique_graphs"]),
                     "graph_breaks": int(sum(counters["graph_break"].values())),
                     "cpu_seconds": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}
            (Path(workdir) / f"{job['name']}.dynamo.json").write_text(json.dumps(stats))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("compiled")
    jobs: list[dict[str, Any]] = []
    for name, (kw, backend) in LAYOUTS.items():
        p = make_plan(steps=STEPS, **kw)
        p = dataclasses.replace(p, layout=dataclasses.replace(p.layout, compile=backend is not None))
        jobs.append(dict(name=name, plan=p.to_dict(), env={"LAUNCH4D_COMPILE_BACKEND": backend or ""}))
    spawn(run_compiled, (2, jobs, str(work), [free_port() for _ in jobs]), 2)
    out: dict[str, dict] = {}
    for j in jobs:
        f = work / f"{j['name']}.json"
        out[j["name"]] = json.loads(f.read_text()) if f.exists() else {"error": "no result written"}
        out[j["name"]]["dynamo"] = json.loads((work / f"{j['name']}.dynamo.json").read_text())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, (_, backend) in LAYOUTS.items() if backend])
def test_compiled_blocks_match_the_eager_reference(results, name):
    ref = job_losses(results, "ref", STEPS)
    got = job_losses(results, name, STEPS)
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert a == pytest.approx(b, rel=RTOL), f"{name} step {step}: {a} vs reference {b}"
    assert ref[0] != ref[-1], "the reference did not train"
    assert results[name]["grad_norms"] == pytest.approx(results["ref"]["grad_norms"], rel=RTOL)
    dyn = results[name]["dynamo"]
    assert dyn["graphs"] >= 1 and dyn["graph_breaks"] == 0, dyn       # compiled, in one graph a block
    assert results["ref"]["dynamo"]["graphs"] == 0                     # the reference ran eager


@pytest.mark.integration
def test_verify_traces_compiled_blocks_as_the_ledger_prices_them():
    """Llama 3 8B at tp 8 without recompute, compiled (`launch verify`'s trace: inductor's partition, its graphs run
    op by op): the ledger within the bound of the trace, total and every category, and the trace above the eager
    ledger (the regathered inputs), so the blocks were traced compiled."""
    from benchmarks.ledger_vs_trace import misses
    from launcher.verify import trace_plan

    spec = spec_from_dict({"model": "llama3-8b", "train": {"seq_len": 8192, "global_batch": 8, "compile": True},
                           "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-sxm"},
                           "parallel": {"tp": 8, "cp": 1, "pp": 1, "zero": 1, "recompute": "none", "micro_batch": 1}})
    best = chosen(plan_job(spec, top=0))
    assert best.layout.compile
    (role,) = trace_plan(best, build_last_rank=False).to_dict()["roles"]
    assert role["status"] == "traced", role.get("error")
    row = {"traced_gb": role["peak_gb"], "ledger_gb": role["ledger_total_gb"], "traced": role["categories_gb"],
           "ledger": role["ledger_gb"]}
    assert misses(row) == []
    eager = rank_memory(spec.model, spec.train, spec.gpu, dataclasses.replace(best.layout, compile=False), 0)
    assert role["categories_gb"]["activations"] > eager.activations / 1e9 * 1.15
