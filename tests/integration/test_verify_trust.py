"""Trust the tracer only where it is checked: `launch verify`'s traced peak per rank against what a
real gloo run of the same plan allocates on this CPU (fp32, same layout), within 10%.

Small shapes, but large enough that tensors dominate what malloc counts (a rank holds tens of MB).
The real run is measured with malloc (tests/verify_helpers.py), not with torch's tracker.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch.multiprocessing as mp

from launcher.verify import trace_plan
from tests.trainer_helpers import free_port, make_plan
from tests.verify_helpers import measure_rank

pytestmark = pytest.mark.integration

MODEL = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn_hidden": 512, "vocab": 4096}
LAYOUTS: dict[str, dict[str, Any]] = {
    # the 2-D mesh: FSDP (ZeRO 3) over dp, TP with sequence parallelism
    "tp2-dp2-zero3": dict(tp=2, dp=2, zero=3, micro_batch=2, global_batch=8),
    # pipeline (1F1B) with FSDP (ZeRO 2) on each stage
    "pp2-dp2-zero2-1f1b": dict(pp=2, dp=2, zero=2, micro_batch=1, global_batch=8, schedule="1f1b"),
    # context parallelism with ZeRO 1 (replicated parameters, sharded optimizer state)
    "cp2-dp2-zero1": dict(cp=2, dp=2, zero=1, micro_batch=2, global_batch=8, recompute="selective"),
    # mixture of experts (4, top 2) over ep=2: verify assumes balanced routing, the real run routes
    "ep2-dp4-zero2-moe": dict(dp=4, ep=2, zero=2, micro_batch=2, global_batch=16,
                              model={"experts": 4, "experts_per_token": 2}),
}


def plans():
    out = {}
    for name, kw in LAYOUTS.items():
        kw = dict(kw)
        over = {**MODEL, **kw.pop("model", {})}
        out[name] = make_plan(**kw, seq_len=512, model_over=over, loss_chunk=256)
    return out


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory):
    work = tmp_path_factory.mktemp("trust")
    ps = plans()
    jobs = [{"name": n, "plan": p.to_dict()} for n, p in ps.items()]
    mp.spawn(measure_rank, args=(4, jobs, str(work), free_port()), nprocs=4, join=True)
    out = {}
    for name in ps:
        for r in range(4):
            rec = json.loads((work / f"{name}.rank{r}.json").read_text())
            assert "error" not in rec, rec.get("trace")
            out[(name, r)] = rec["peak"]
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_traced_peak_within_10_percent_of_a_real_gloo_run(real_peaks, name):
    rep = trace_plan(plans()[name], build_last_rank=False)
    assert rep.roles, "no role traced"
    for role in rep.roles:
        assert role.status == "traced", role.error
        assert role.peak_gb is not None, role.role.name
        traced = role.peak_gb * 1e9
        real = real_peaks[(name, role.role.rank)]
        assert traced == pytest.approx(real, rel=0.10), (
            f"{name} {role.role.name}: traced {traced / 1e6:.1f} MB, real {real / 1e6:.1f} MB, "
            f"categories {role.categories_gb}")
