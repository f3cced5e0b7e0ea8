"""The bundled trainer's correctness: loss parity across layouts (real gloo processes), plus the
pieces that can be checked in one process (config errors, CP split, chunked loss, seeded init,
mesh-wide clipping, the TP-across-hosts check).

Tolerance: every layout's per-step loss and pre-clip global gradient norm must equal the
single-process reference's within relative 1e-5 (fp32 on CPU; observed differences are ~1e-7,
summation order only).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, cast

import pytest
import torch

from launcher.errors import UserError
from launcher.trainer.config import config_from_plan
from tests.trainer_helpers import job_losses, make_plan, spawn_layouts

pytestmark = pytest.mark.integration

RTOL = 1e-5
STEPS = 3   # two optimizer updates between the first and the last compared loss

# name -> make_plan kwargs; all compared with "ref" (one process, whole batch, grad_accum 8).
# The TP/CP layouts take micro_batch 2 (4): their CPU cost is per micro-batch (DTensor dispatch), not
# per token, and two or more micro-batches still accumulate (pipelines: at least pp of them).
LAYOUTS: dict[str, dict[str, Any]] = {
    "ref": dict(),
    "dp8_zero3": dict(dp=8, zero=3),
    "tp2_dp4_zero2": dict(tp=2, dp=4, zero=2),
    "pp2_1f1b_tp2_dp2_uneven_zero1": dict(pp=2, tp=2, dp=2, schedule="1f1b", stage_layers=[1, 3], zero=1),
    "cp2_tp2_dp2": dict(cp=2, tp=2, dp=2, micro_batch=2),
    "pp2_interleaved_v2_cp2_tp2": dict(pp=2, cp=2, tp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                       micro_batch=2),
    "dp2_ga2_zero0": dict(dp=2, micro_batch=2, grad_accum=2, zero=0),
    "dp4_ga1": dict(dp=4, micro_batch=2, grad_accum=1),
    "recompute_selective_cp2_tp2_dp2": dict(cp=2, tp=2, dp=2, recompute="selective", micro_batch=2),
    "recompute_full_pp2_gpipe_tp2_dp2": dict(pp=2, tp=2, dp=2, schedule="gpipe", recompute="full", micro_batch=2),
    # a non-default mesh order: cp and dp (flattened for FSDP) are not adjacent
    "order_cp_pp_dp_tp_pp2_cp2_tp2": dict(pp=2, cp=2, tp=2, mesh_order=("cp", "pp", "dp", "tp"), micro_batch=4),
}
# GELU MLP with tied embeddings (the output projection is the vocab-sharded embedding under TP)
# mixture of experts (4 experts, top-2, dropless); expert parallelism splits dp·cp (moe.py)
MOE = dict(model_over={"experts": 4, "experts_per_token": 2})
MOE_LAYOUTS: dict[str, dict[str, Any]] = {
    "moe_ref": dict(MOE),
    "moe_dp4_ep2_zero3": dict(MOE, dp=4, ep=2, zero=3),          # experts: fully_shard over dp·cp/ep = 2
    "moe_dp4_ep4_zero0": dict(MOE, dp=4, ep=4, zero=0),          # one expert per rank, no replicas
    "moe_pp2_1f1b_dp2_ep2_zero1": dict(MOE, pp=2, dp=2, ep=2, zero=1),
    "moe_cp2_dp2_ep2_zero2_recompute_full": dict(MOE, cp=2, dp=2, ep=2, zero=2, recompute="full", micro_batch=2),
    "moe_dp2_zero3_ep1": dict(MOE, dp=2, zero=3),
    # attention TP with the router and experts whole per TP rank (expert TP 1), experts over ep: ZeRO 0/1
    "moe_tp2_dp2_ep2_zero1": dict(MOE, tp=2, dp=2, ep=2, zero=1, micro_batch=2),
    "moe_tp2_pp2_dp2_zero0": dict(MOE, tp=2, pp=2, dp=2, zero=0, micro_batch=2, schedule="1f1b"),
}
GELU_TIED = dict(model_over={"mlp": "gelu", "tied_embeddings": True})
OTHER_MODEL: dict[str, dict[str, Any]] = {
    "gelu_tied_ref": dict(GELU_TIED, checkpoint_every=2),       # (its step-2 checkpoint: a pp=1 tied one)
    "gelu_tied_tp2_dp2": dict(GELU_TIED, tp=2, dp=2, zero=2, micro_batch=2),
    # tied over pipeline stages (Megatron): stage 0's embedding, the last stage's identical head copy,
    # gradients summed over the embedding group; FSDP (zero 3) under 1F1B, replicate under interleaved.
    # The 1F1B run also checkpoints at step 2 for the resume jobs below.
    "gelu_tied_pp2_1f1b_tp2_dp2": dict(GELU_TIED, pp=2, tp=2, dp=2, schedule="1f1b", zero=3, micro_batch=2,
                                       checkpoint_every=2),
    "gelu_tied_pp2_interleaved_v2_dp2": dict(GELU_TIED, pp=2, dp=2, schedule="interleaved-1f1b",
                                             virtual_stages=2, zero=1),
}
# a vocabulary no TP degree divides (GPT-2's 50257 in small): padded to a multiple of vocab_multiple·tp, the
# padding's logits masked; each run against the same model unpadded (vocab_multiple 1, tp 1)
ODD = dict(vocab=250)
ODD_VOCAB: dict[str, tuple[dict[str, Any], str | None]] = {
    "odd_vocab_unpadded": (dict(model_over=dict(ODD, vocab_multiple=1)), None),
    "odd_vocab_tp2_dp4_zero1": (dict(model_over=ODD, tp=2, dp=4, zero=1, micro_batch=2), "odd_vocab_unpadded"),
    "odd_tied_unpadded": (dict(model_over=dict(ODD, vocab_multiple=1, mlp="gelu", tied_embeddings=True)), None),
    "odd_tied_pp2_tp2_dp2_zero3": (dict(model_over=dict(ODD, mlp="gelu", tied_embeddings=True), pp=2, tp=2, dp=2,
                                        schedule="1f1b", zero=3, micro_batch=2), "odd_tied_unpadded"),
}
TIED_PP = ("gelu_tied_pp2_1f1b_tp2_dp2", "gelu_tied_pp2_interleaved_v2_dp2")
TIED_CKPT_PP2 = "gelu_tied_pp2_1f1b_tp2_dp2/checkpoints/step-2"
TIED_CKPT_PP1 = "gelu_tied_ref/checkpoints/step-2"
# resume at step 2 from a tied pp=2 checkpoint (the same layout, and pp=1: the head copy is saved as the
# embedding) and from a tied pp=1 checkpoint into pp=2 (the copy is loaded from the embedding)
TIED_RESUME: dict[str, tuple[dict[str, Any], str]] = {
    "gelu_tied_pp2_resumed": (dict(GELU_TIED, pp=2, tp=2, dp=2, schedule="1f1b", zero=3, micro_batch=2),
                              TIED_CKPT_PP2),
    "gelu_tied_pp1_resumed_from_pp2": (dict(GELU_TIED), TIED_CKPT_PP2),
    "gelu_tied_pp2_interleaved_resumed_from_pp1": (dict(GELU_TIED, pp=2, dp=2, schedule="interleaved-1f1b",
                                                        virtual_stages=2, zero=1), TIED_CKPT_PP1),
}


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("parity")
    jobs = [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict(), tied_check=n in TIED_PP)
            for n, kw in {**LAYOUTS, **OTHER_MODEL}.items()]
    jobs += [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict(), resume=ckpt)
             for n, (kw, ckpt) in TIED_RESUME.items()]
    jobs += [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict()) for n, kw in MOE_LAYOUTS.items()]
    jobs += [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict()) for n, (kw, _) in ODD_VOCAB.items()]
    # the TP-host check, in the same processes: TP pairs (0,1) and (2,3) split over two fake hosts
    bad_hosts = {"LAUNCH4D_FAKE_HOSTS": "a,b,a,b"}
    jobs.append(dict(name="tp_across_hosts", plan=make_plan(tp=2, dp=2, steps=1).to_dict(), env=bad_hosts))
    jobs.append(dict(name="tp_across_hosts_forced", plan=make_plan(tp=2, dp=2, steps=1, forced=True).to_dict(),
                     env=bad_hosts))
    jobs.append(dict(name="tp_on_one_host", plan=make_plan(tp=2, dp=2, steps=1).to_dict(),
                     env={"LAUNCH4D_FAKE_HOSTS": "a,a,b,b"}))
    return spawn_layouts(jobs, work)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "ref"])
def test_loss_parity_with_single_process(parity_results, name):
    ref = job_losses(parity_results, "ref", STEPS)
    got = job_losses(parity_results, name, STEPS)
    assert all(math.isfinite(x) for x in got)
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert a == pytest.approx(b, rel=RTOL), f"{name} step {step}: {a} vs reference {b}"
    assert ref[0] != ref[-1], "the reference did not train (loss never moved)"
    # Adam hides a constant gradient scale (e.g. averaging instead of summing over dp); the
    # pre-clip global grad norm does not.
    norms, ref_norms = parity_results[name]["grad_norms"], parity_results["ref"]["grad_norms"]
    assert norms == pytest.approx(ref_norms, rel=RTOL), f"{name} grad norms {norms} vs reference {ref_norms}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, (_, ref) in ODD_VOCAB.items() if ref])
def test_padded_vocabulary_gives_the_unpadded_losses(parity_results, name):
    """tp 2 of a 250-token vocabulary (padded to 256 rows: 6 of TP rank 1's 128 are padding), ZeRO 1 and
    a tied pipeline under ZeRO 3: the losses and grad norms of the same model unpadded in one process."""
    ref = ODD_VOCAB[name][1]
    assert ref is not None
    assert job_losses(parity_results, name, STEPS) == pytest.approx(job_losses(parity_results, ref, STEPS), rel=RTOL)
    assert parity_results[name]["grad_norms"] == pytest.approx(parity_results[ref]["grad_norms"], rel=RTOL)


@pytest.mark.slow
def test_gelu_tied_embeddings_parity(parity_results):
    ref = parity_results["gelu_tied_ref"]
    got = parity_results["gelu_tied_tp2_dp2"]
    assert job_losses(parity_results, "gelu_tied_tp2_dp2", STEPS) == pytest.approx(
        job_losses(parity_results, "gelu_tied_ref", STEPS), rel=RTOL)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=RTOL)
    assert ref["losses"] != parity_results["ref"]["losses"]     # really a different model


@pytest.mark.slow
@pytest.mark.parametrize("name", TIED_PP)
def test_tied_embeddings_over_pipeline_stages_parity(parity_results, name):
    """Tied embedding split over pp stages: same losses and grad norms as one process, and the
    embedding and its head copy still bit-identical after the last step."""
    ref = parity_results["gelu_tied_ref"]
    assert job_losses(parity_results, name, STEPS) == pytest.approx(job_losses(parity_results, "gelu_tied_ref", STEPS), rel=RTOL)
    assert parity_results[name]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=RTOL)
    assert parity_results[name]["tied_max_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TIED_RESUME))
def test_tied_pipeline_checkpoint_resumes(parity_results, name):
    """Resumed at step 2 from a tied checkpoint (pp=2 -> pp=2, pp=2 -> pp=1, pp=1 -> pp=2): step 3 as
    the uninterrupted run."""
    ref = job_losses(parity_results, "gelu_tied_ref", STEPS)
    assert job_losses(parity_results, name, STEPS - 2) == pytest.approx(ref[2:], rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in MOE_LAYOUTS if n != "moe_ref"])
def test_moe_expert_parallel_parity(parity_results, name):
    ref = job_losses(parity_results, "moe_ref", STEPS)
    got = job_losses(parity_results, name, STEPS)
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert a == pytest.approx(b, rel=RTOL), f"{name} step {step}: {a} vs MoE reference {b}"
    assert ref != parity_results["ref"]["losses"]           # really a different (MoE) model
    assert parity_results[name]["grad_norms"] == pytest.approx(parity_results["moe_ref"]["grad_norms"], rel=RTOL)


@pytest.mark.slow
def test_grad_accum_split_matches_dp_split(parity_results):
    a = job_losses(parity_results, "dp2_ga2_zero0", STEPS)
    b = job_losses(parity_results, "dp4_ga1", STEPS)
    assert a == pytest.approx(b, rel=RTOL)


@pytest.mark.slow
def test_tp_group_across_hosts_is_an_error(parity_results):
    r = parity_results["tp_across_hosts"]
    assert "losses" not in r
    assert r["error"].startswith("UserError")
    assert "spans hosts a, b" in r["error"] and "inside one node" in r["error"]


@pytest.mark.slow
def test_tp_group_across_hosts_forced_runs(parity_results):
    ref = job_losses(parity_results, "ref", STEPS)
    assert job_losses(parity_results, "tp_across_hosts_forced", 1)[0] == pytest.approx(ref[0], rel=RTOL)
    assert job_losses(parity_results, "tp_on_one_host", 1)[0] == pytest.approx(ref[0], rel=RTOL)


# --- single-process checks ---------------------------------------------------------------------

def test_config_rejects_too_few_microbatches_for_1f1b():
    plan = make_plan(pp=2, dp=4, micro_batch=2, grad_accum=1, schedule="1f1b")
    with pytest.raises(UserError, match=r"plan.layout.grad_accum=1: schedule 1f1b needs at least pp=2 micro-batches"):
        config_from_plan(plan)
    config_from_plan(make_plan(pp=2, dp=4, micro_batch=2, grad_accum=1, schedule="gpipe"))


def test_config_names_the_bad_field():
    with pytest.raises(UserError, match=r"plan.stage_layers sums to 5"):
        config_from_plan(make_plan(pp=2, stage_layers=[2, 3]))
    with pytest.raises(UserError, match=r"plan.layout.tp=4 does not divide model.kv_heads=2"):
        config_from_plan(make_plan(tp=4, dp=2))
    with pytest.raises(UserError, match=r"plan.layout.cp=2 needs train.seq_len=36 divisible by 2·cp·tp=8"):
        config_from_plan(make_plan(cp=2, tp=2, dp=2, seq_len=36))


def test_config_accepts_tied_embeddings_with_pp():
    cfg = config_from_plan(make_plan(pp=2, dp=4, model_over={"tied_embeddings": True}))
    assert cfg.model.tied_embeddings and cfg.plan.pp == 2


def test_tied_head_copy_starts_identical_to_the_embedding():
    from launcher.trainer.model import Transformer

    args = make_plan(model_over={"tied_embeddings": True}).model
    first, last = Transformer(args, seq_len=8), Transformer(args, seq_len=8)
    first.keep_only(0, 2, has_embedding=True, has_head=False)
    last.keep_only(2, 4, has_embedding=False, has_head=True)
    first.init_weights(7)
    last.init_weights(7)
    assert not first.tied_head_copy and last.tied_head_copy
    assert first.tok_embeddings is not None and torch.equal(last.output_weight(), first.tok_embeddings.weight)
    whole = Transformer(args, seq_len=8)
    assert whole.output is None and not whole.tied_head_copy     # pp=1: one tensor, unchanged keys


def test_cp_head_tail_split_covers_sequence_once():
    from launcher.trainer.context_parallel import positions, shard_sequence

    seq, cp = 32, 4
    allpos = torch.cat([positions(seq, r, cp) for r in range(cp)])
    assert sorted(allpos.tolist()) == list(range(seq))
    assert positions(seq, 0, cp).tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    x = torch.arange(seq)[None, :]
    assert shard_sequence(x, 1, cp).tolist() == [[4, 5, 6, 7, 24, 25, 26, 27]]
    # every rank gets the same causal work: sum over its queries of visible keys
    work = [int(sum(p + 1 for p in positions(seq, r, cp).tolist())) for r in range(cp)]
    assert len(set(work)) == 1


def test_chunked_loss_equals_full_cross_entropy():
    from launcher.trainer.loss import ChunkedLoss

    torch.manual_seed(0)
    h = torch.randn(2, 12, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (2, 12))
    full = torch.nn.functional.cross_entropy((h @ w.t()).reshape(-1, 40), y.reshape(-1), reduction="sum") / 96
    full.backward()
    assert h.grad is not None and w.grad is not None
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss = ChunkedLoss(lambda: w, global_tokens=96, chunk=5)(h, y)   # 24 tokens in chunks of 5
    loss.backward()
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)
    assert h.grad is not None and w.grad is not None
    assert torch.allclose(h.grad, gh, atol=1e-6) and torch.allclose(w.grad, gw, atol=1e-6)


def test_seeded_init_is_layout_independent():
    from launcher.trainer.model import Transformer

    args = make_plan().model
    full = Transformer(args, seq_len=8)
    full.init_weights(7)
    stage = Transformer(args, seq_len=8)
    stage.keep_only(2, 4, has_embedding=False, has_head=True)
    stage.init_weights(7)
    ref = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, ref[name]), name
    other = Transformer(args, seq_len=8)
    other.init_weights(8)
    assert not torch.equal(cast(Any, other.layers["0"]).attention.wq.weight, cast(Any, full.layers["0"]).attention.wq.weight)


def test_grad_norm_and_clip_matches_torch_in_one_process():
    from launcher.trainer.loss import grad_norm_and_clip

    torch.manual_seed(1)
    a: list[torch.Tensor] = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b: list[torch.Tensor] = [torch.nn.Parameter(t.detach().clone()) for t in a]
    for x, y in zip(a, b):
        g = torch.randn_like(x) * 3
        x.grad, y.grad = g.clone(), g.clone()
    ours = grad_norm_and_clip(a, 1.0, ranks_per_stage=1)
    theirs = float(torch.nn.utils.clip_grad_norm_(b, 1.0))
    assert ours == pytest.approx(theirs, rel=1e-6)
    for x, y in zip(a, b):
        assert x.grad is not None and y.grad is not None and torch.allclose(x.grad, y.grad, atol=1e-6)


def test_tp_host_problems_names_groups():
    from launcher.trainer.mesh import tp_host_problems

    cfg = config_from_plan(make_plan(tp=2, dp=4))
    assert tp_host_problems(cfg, ["a"] * 4 + ["b"] * 4) == []
    probs = tp_host_problems(cfg, ["a", "a", "a", "b", "b", "b", "b", "b"])
    assert probs == ["TP group ranks [2, 3] spans hosts a, b"]


def test_cli_bad_plan_is_one_line_exit_2(tmp_path):
    plan = make_plan(pp=2, dp=4, micro_batch=2, grad_accum=1, schedule="1f1b")
    plan.save(tmp_path / "plan.json")
    env = dict(os.environ, RANK="0", WORLD_SIZE="8")
    r = subprocess.run([sys.executable, "-m", "launcher.trainer", "--plan", str(tmp_path / "plan.json"),
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: plan.layout.grad_accum=1: schedule 1f1b")
    assert "Traceback" not in r.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["layout"]["pp"] == 2


def _torchrun(plan, tmp_path, *extra: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    from tests.trainer_helpers import free_port

    plan.save(tmp_path / "plan.json")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "launcher.trainer",
           "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_cli_under_torchrun_writes_metrics_and_heartbeats(tmp_path):
    from launcher.formats.rundir import read_heartbeats, read_metrics

    r = _torchrun(make_plan(dp=2, steps=2), tmp_path, "--resume", "never")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_metrics(tmp_path / "run")
    assert [m["step"] for m in recs] == [1, 2]
    assert all(math.isfinite(m["loss"]) for m in recs)
    beats = read_heartbeats(tmp_path / "run")
    assert [(b["rank"], b["phase"], b["step"]) for b in beats] == [(0, "done", 2), (1, "done", 2)]
    assert "ZeRO 3: fully_shard per block, embedding, norm+head and root" in r.stderr       # the log says how ZeRO mapped
    assert "TP group" not in r.stderr


@pytest.mark.slow
def test_cli_inject_stall_times_out_and_heartbeats_name_the_rank(tmp_path):
    from launcher.formats.rundir import read_heartbeats

    r = _torchrun(make_plan(dp=2, steps=3), tmp_path, "--resume", "never", "--inject-stall", "1:2",
                  "--step-timeout-s", "5")
    assert r.returncode != 0
    beats = {b["rank"]: b for b in read_heartbeats(tmp_path / "run")}
    assert beats[1]["step"] == 2 and beats[1]["phase"] == "forward"     # the stalled rank
    assert beats[0]["step"] == 2 and beats[0]["phase"] == "error"       # its peer timed out waiting


def test_chunked_loss_never_saves_full_logits():
    from launcher.trainer.loss import ChunkedLoss

    n, hidden, vocab, chunk = 24, 16, 40, 5
    h = torch.randn(1, n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (1, n))
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ChunkedLoss(lambda: w, global_tokens=n, chunk=chunk)(h, y)
    loss.backward()
    assert saved and all(math.prod(s) < n * vocab for s in saved), saved


def test_recompute_modes_recompute_what_they_say():
    """Forward ops that backward runs again: none nothing; selective the norms and the activation but
    no matmul or attention (recompute.SAVED_OPS); full the whole block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from launcher.trainer.model import Transformer
    from launcher.trainer.recompute import apply_recompute

    aten = torch.ops.aten
    watched = {aten.rsqrt.default: "norm", aten.silu.default: "silu",
               aten._scaled_dot_product_flash_attention_for_cpu.default: "sdpa"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = dict.fromkeys(watched.values(), 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in watched:
                self.seen[watched[func]] += 1
            return func(*args, **(kwargs or {}))

    args = make_plan().model
    x = torch.randint(0, args.vocab, (2, 8))
    # 4 layers: 2 norms, 1 SwiGLU, 1 attention each
    want = {"none": dict(norm=0, silu=0, sdpa=0), "selective": dict(norm=8, silu=4, sdpa=0),
            "full": dict(norm=8, silu=4, sdpa=4)}
    for mode, expected in want.items():
        m = Transformer(args, seq_len=8)
        m.init_weights(1)
        apply_recompute(m, mode)
        loss = m(x).sum()
        with Count() as c:
            loss.backward()
        assert c.seen == expected, mode


def test_fsdp_wraps_every_block_then_root(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from launcher.trainer.fsdp import apply_fsdp, describe
    from launcher.trainer.model import Transformer

    def unit_of(module: object) -> Any:
        """The FSDP unit (parameter group) `module` was wrapped as."""
        group = cast(FSDPModule, module)._get_fsdp_state()._fsdp_param_group
        assert group is not None, module
        return group

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_cp",))
        for zero, tied in ((3, False), (2, False), (3, True)):
            m = Transformer(make_plan(model_over={"tied_embeddings": tied}).model, seq_len=8)
            m.init_weights(1)
            apply_fsdp(m, mesh, zero=zero, bf16=False)
            assert isinstance(m, FSDPModule)
            assert all(isinstance(b, FSDPModule) for b in m.layers.values())
            for b in m.layers.values():
                info = unit_of(b).post_forward_mesh_info
                assert (info is not None) == (zero == 3)      # ZeRO 3 reshards after forward, 2 keeps
            # the embedding a unit of its own (as a block) unless it is also the head; norm and head one unit,
            # kept gathered to their backward, which follows at once
            assert isinstance(m.tok_embeddings, FSDPModule) != tied
            if not tied:
                assert (unit_of(m.tok_embeddings).post_forward_mesh_info is not None) == (zero == 3)
                assert cast(FSDPModule, m.output)._get_fsdp_state() is cast(FSDPModule, m.norm)._get_fsdp_state()
                assert unit_of(m.output).post_forward_mesh_info is None
            root = cast(FSDPModule, m)._get_fsdp_state()._fsdp_param_group
            assert (root is not None) == tied                 # the root holds only a tied embedding-and-head
    finally:
        dist.destroy_process_group()
    assert "reshard_after_forward=True" in describe(3, 8) and "reshard_after_forward=False" in describe(2, 8)
    assert "optimizer state sharded" in describe(1, 8) and "ZeRO 0" in describe(0, 8)
