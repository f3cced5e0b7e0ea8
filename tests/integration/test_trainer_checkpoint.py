"""Checkpointer: DCP round trips (one process, 2-rank gloo FSDP2, 2-stage pipeline with global
names), atomic publication (a crash before the rename leaves `latest` on the previous complete
checkpoint), and the preemption flag agreed across ranks."""

from __future__ import annotations

import copy
import os
import signal
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launcher.trainer.checkpoint import PREEMPT_EXIT_CODE, Checkpointer, is_complete

# DCP says so when it saves/loads without a process group, which the one-process tests mean to do.
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")]


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d)
        self.w2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    """Layers in a ModuleDict keyed by global index, so a pipeline stage keeps the full model's names."""

    def __init__(self, d: int = 8, layers: int = 4):
        super().__init__()
        self.emb: nn.Linear | None = nn.Linear(d, d)        # None on a pipeline stage without it
        self.layers = nn.ModuleDict({str(i): Block(d) for i in range(layers)})
        self.out: nn.Linear | None = nn.Linear(d, 1)

    def forward(self, x):
        x = self.emb(x) if self.emb is not None else x
        for blk in self.layers.values():
            x = blk(x)
        return self.out(x) if self.out is not None else x


def make_training(seed: int = 0, model: nn.Module | None = None):
    torch.manual_seed(seed)
    model = model or Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train_steps(model, opt, sched, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert sd
    return {k: v.detach().clone() for k, v in sd.items()}  # type: ignore[union-attr]  # a model's: tensors


def test_round_trip_single_process(tmp_path):
    model, opt, sched = make_training()
    train_steps(model, opt, sched, 3)
    ck = Checkpointer(tmp_path, every=3)
    assert not ck.maybe_save(2, model, opt, sched, {"step": 2})
    assert ck.maybe_save(3, model, opt, sched, {"step": 3, "kind": "synthetic"})
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-3"
    saved = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    lr = sched.get_last_lr()
    train_steps(model, opt, sched, 2, seed=5)  # move away

    m2, o2, s2 = make_training(seed=9)
    loaded = Checkpointer(tmp_path, every=3).load_latest(m2, o2, s2)
    assert loaded == (3, {"step": 3, "kind": "synthetic"})
    for k, v in saved.items():
        assert torch.equal(m2.state_dict()[k], v), k
    assert s2.get_last_lr() == lr and s2.last_epoch == 3
    for pid, st in saved_opt["state"].items():
        assert torch.equal(o2.state_dict()["state"][pid]["exp_avg"], st["exp_avg"])
    # and training continues identically from there
    m3, o3, s3 = make_training(seed=9)
    Checkpointer(tmp_path, every=3).load_latest(m3, o3, s3)
    train_steps(m2, o2, s2, 2, seed=5)
    train_steps(m3, o3, s3, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), m3.parameters()))


def test_nothing_to_resume(tmp_path):
    model, opt, sched = make_training()
    assert Checkpointer(tmp_path, every=1).load_latest(model, opt, sched) is None


def test_crash_before_rename_keeps_previous_latest(tmp_path, monkeypatch):
    model, opt, sched = make_training()
    ck = Checkpointer(tmp_path, every=2)
    train_steps(model, opt, sched, 2)
    ck.maybe_save(2, model, opt, sched, {"step": 2})
    at_two = copy.deepcopy(model.state_dict())
    train_steps(model, opt, sched, 2)

    def crash(self, tmp, final):  # the process dies here (an error that is caught removes the .tmp instead)
        raise KeyboardInterrupt("node lost power")

    monkeypatch.setattr(Checkpointer, "_publish", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.maybe_save(4, model, opt, sched, {"step": 4})
    monkeypatch.undo()
    cdir = tmp_path / "checkpoints"
    assert (cdir / "step-4.tmp" / ".metadata").exists()  # fully written, never published
    assert (cdir / "latest").read_text().strip() == "step-2"
    m2, o2, s2 = make_training(seed=3)
    assert Checkpointer(tmp_path, every=2).load_latest(m2, o2, s2) == (2, {"step": 2})
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in at_two.items())
    # the next save of that step clears the leftover and publishes
    Checkpointer(tmp_path, every=2).maybe_save(4, model, opt, sched, {"step": 4})
    assert not (cdir / "step-4.tmp").exists() and is_complete(cdir / "step-4")
    assert (cdir / "latest").read_text().strip() == "step-4"


def test_crash_mid_dcp_write_and_stale_latest(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    model, opt, sched = make_training()
    ck = Checkpointer(tmp_path, every=1)
    ck.maybe_save(1, model, opt, sched, {"step": 1})

    def dying_save(state, checkpoint_id):
        os.makedirs(checkpoint_id, exist_ok=True)
        open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ck.maybe_save(2, model, opt, sched, {"step": 2})
    monkeypatch.undo()
    latest = Checkpointer(tmp_path, 1).latest_dir()
    assert latest is not None and latest.name == "step-1"
    # `latest` pointing at something incomplete (hand-edited, or a torn copy): newest complete wins
    (tmp_path / "checkpoints" / "step-7").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-7\n")
    latest = Checkpointer(tmp_path, 1).latest_dir()
    assert latest is not None and latest.name == "step-1"


def test_keep_prunes_old_and_resave_same_step_is_noop(tmp_path):
    model, opt, sched = make_training()
    ck = Checkpointer(tmp_path, every=1, keep=2)
    for s in range(1, 5):
        ck.maybe_save(s, model, opt, sched, {"step": s})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-3", "step-4"]
    mtime = (tmp_path / "checkpoints" / "step-4" / ".metadata").stat().st_mtime_ns
    Checkpointer(tmp_path, every=1).maybe_save(4, model, opt, sched, {"step": 4}, force=True)
    assert (tmp_path / "checkpoints" / "step-4" / ".metadata").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("env,sig", [(None, signal.SIGUSR2), ("URG", signal.SIGURG), ("SIGUSR1", signal.SIGUSR1)])
def test_signal_handlers_set_flag(tmp_path, monkeypatch, env, sig):
    """The checkpoint signal is USR2 unless LAUNCH4D_CHECKPOINT_SIGNAL says otherwise; SIGTERM too."""
    if env is None:
        monkeypatch.delenv("LAUNCH4D_CHECKPOINT_SIGNAL", raising=False)
    else:
        monkeypatch.setenv("LAUNCH4D_CHECKPOINT_SIGNAL", env)
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, sig)}
    try:
        ck = Checkpointer(tmp_path, every=0)
        ck.install_signal_handlers()
        assert not ck.stop_requested()
        os.kill(os.getpid(), sig)
        assert ck.preempt_requested and ck.preempt_signal == sig and ck.stop_requested()
        ck2 = Checkpointer(tmp_path, every=0)
        ck2.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        assert ck2.preempt_requested and ck2.preempt_signal == signal.SIGTERM
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert PREEMPT_EXIT_CODE not in (0, 1, 2)


# --- real multi-process (gloo) ----------------------------------------------------------------

def _init(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _fsdp_worker(rank: int, world: int, store: str, run_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = Net()
        for blk in model.layers.values():
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model, opt, sched = make_training(model=model)
        train_steps(model, opt, sched, 2, seed=rank + 1)
        ck = Checkpointer(run_dir, every=2)
        # only rank 1 is signalled; both must agree to stop
        if rank == 1:
            ck.preempt_requested = True
        assert ck.stop_requested()
        ck.maybe_save(2, model, opt, sched, {"step": 2}, force=True)
        ref = full_state(model)
        ref_opt = copy.deepcopy(opt.state_dict())
        train_steps(model, opt, sched, 3, seed=7)
        assert not all(torch.equal(a, b) for a, b in zip(full_state(model).values(), ref.values()))
        assert ck.load_latest(model, opt, sched) == (2, {"step": 2})
        got = full_state(model)
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
        for pid, st in ref_opt["state"].items():
            assert torch.equal(opt.state_dict()["state"][pid]["exp_avg"].to_local(), st["exp_avg"].to_local())
        assert sched.last_epoch == 2
        if rank == 0:
            torch.save(ref, os.path.join(run_dir, "ref.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, run_dir: str) -> None:
    from tests.trainer_helpers import spawn

    with tempfile.TemporaryDirectory() as d:
        spawn(fn, (world, os.path.join(d, "store"), run_dir), world)


@pytest.mark.slow
def test_fsdp_two_ranks_round_trip_and_reshard_to_one_process(tmp_path):
    _spawn(_fsdp_worker, 2, str(tmp_path))
    ref = torch.load(tmp_path / "ref.pt")
    # the sharded checkpoint loads into a plain single-process model (DCP reshards)
    model, opt, sched = make_training(seed=5)
    loaded = Checkpointer(tmp_path, every=2).load_latest(model, opt, sched)
    assert loaded is not None and loaded[0] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def _pp_worker(rank: int, world: int, store: str, run_dir: str) -> None:
    """Rank r owns stage r of a 2-stage split; with virtual stages it owns two chunks (looped)."""
    _init(rank, world, store)
    try:
        torch.manual_seed(0)
        full = Net(layers=4)
        # chunks: [emb, L0], [L1], [L2], [L3, out]; rank 0 gets chunks 0 and 2, rank 1 chunks 1 and 3
        owned = {0: [("emb", 0), (2,)], 1: [(1,), (3, "out")]}[rank]
        parts = []
        for chunk in owned:
            part = copy.deepcopy(full)
            keep = {str(i) for i in chunk if isinstance(i, int)}
            for name in list(part.layers.keys()):
                if name not in keep:
                    del part.layers[name]
            part.emb = part.emb if "emb" in chunk else None
            part.out = part.out if "out" in chunk else None
            parts.append(part)
        params = [p for part in parts for p in part.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for _ in range(2):
            sum((p.sum() for p in params), torch.zeros(())).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        ref = {i: copy.deepcopy(p.state_dict()) for i, p in enumerate(parts)}
        ck = Checkpointer(run_dir, every=1)
        ck.maybe_save(2, parts, opt, sched, {"step": 2})
        with torch.no_grad():
            for p in params:
                p.add_(1.0)
        assert ck.load_latest(parts, opt, sched) == (2, {"step": 2})
        for i, part in enumerate(parts):
            for k, v in part.state_dict().items():
                assert torch.equal(v, ref[i][k]), (rank, i, k)
        # each stage got its own optimizer groups back (hyperparameters too) and can step on
        assert opt.param_groups[0]["betas"] == (0.9, 0.999) and len(opt.state) == len(params)
        sum((p.sum() for p in params), torch.zeros(())).backward()
        opt.step()
        if rank == 0:
            from torch.distributed.checkpoint import FileSystemReader

            meta = FileSystemReader(os.path.join(run_dir, "checkpoints", "step-2")).read_metadata()
            keys = {k for k in meta.state_dict_metadata if k.startswith("model.")}
            assert keys == {f"model.{k}" for k in full.state_dict()}, sorted(keys)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_pipeline_stages_save_their_own_keys(tmp_path):
    _spawn(_pp_worker, 2, str(tmp_path))
    # the per-stage checkpoint is one whole model: it loads into an unsplit single-process Net
    model, opt, sched = make_training(seed=4)
    loaded = Checkpointer(tmp_path, every=1).load_latest(model, opt, sched)
    assert loaded is not None and loaded[0] == 2
