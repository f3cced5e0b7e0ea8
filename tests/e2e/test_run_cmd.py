"""`launch run` and the local backend, with real torchrun processes (gloo on CPU).

End to end: examples/tiny-cpu.yaml completes and writes the run directory (COMMON.md layout).
Resume parity: a run stopped with SIGTERM (the trainer checkpoints and exits 75) and resumed with
--resume auto logs the same loss at every step as an uninterrupted run. Same layout, same seed,
fp32 on CPU with one thread per process: the losses are expected bit-identical; the test allows
a relative 1e-6.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from launcher.backends import PREEMPT_EXIT_CODE, PREEMPTED, SUCCEEDED, rank_of, state_for_exit
from launcher.backends.local import LocalBackend, job_exit_code
from tests.cli_helpers import LAUNCH, launch, state_env
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.e2e

TINY = EXAMPLES / "tiny-cpu.yaml"


@pytest.fixture
def env(tmp_path):
    return state_env(tmp_path)


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


# --- fast: no training processes -------------------------------------------------------------

def test_dry_run_writes_nothing_and_shows_command(tmp_path, env):
    rd = tmp_path / "rd"
    r = launch("run", TINY, "--nproc", 2, "--run-dir", rd, "--dry-run", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "torch.distributed.run" in out["command"] and "--nproc-per-node=2" in out["command"]
    assert "-m launcher.trainer --plan" in out["command"] and out["plan"]["world_size"] == 2
    assert not rd.exists()


def test_dry_run_for_a_person_is_yaml(tmp_path, env):
    import yaml

    r = launch("run", TINY, "--nproc", 2, "--run-dir", tmp_path / "rd", "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    out = yaml.safe_load(r.stdout)
    assert out["layout"]["tp"] == 2 and out["world_size"] == 2 and out["env"]["LAUNCH4D_DEVICE"] == "cpu"
    assert out["argv"][1:3] == ["-m", "torch.distributed.run"] and not (tmp_path / "rd").exists()


def test_multi_node_job_is_refused(tmp_path, env):
    job = tmp_path / "two.yaml"
    job.write_text(TINY.read_text().replace("nodes: 1", "nodes: 2"))
    r = launch("run", job, "--run-dir", tmp_path / "rd", env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: cluster.nodes:") and "launch submit" in r.stderr
    assert not (tmp_path / "rd").exists()


def test_bad_nproc_and_missing_data_file(tmp_path, env):
    r = launch("run", TINY, "--nproc", 3, "--run-dir", tmp_path / "rd", env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: parallel.tp: 2 does not divide")
    job = tmp_path / "data.yaml"
    job.write_text(TINY.read_text().replace("data: synthetic", "data: corpus.bin"))
    r = launch("run", job, "--nproc", 2, "--run-dir", tmp_path / "rd2", "--dry-run", "--json", env=env, cwd=tmp_path)
    assert r.returncode == 2 and "corpus.bin does not exist" in r.stderr and not (tmp_path / "rd2").exists()
    # relative data paths are resolved against the working directory before they go into plan.json
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "corpus.bin")
    (tmp_path / "corpus.bin.json").write_text('{"dtype": "uint16", "vocab": 256, "tokens": 500}')
    r = launch("run", job, "--nproc", 2, "--run-dir", tmp_path / "rd2", "--dry-run", "--json", env=env, cwd=tmp_path)
    assert json.loads(r.stdout)["plan"]["train"]["data"] == str(tmp_path / "corpus.bin")
    (tmp_path / "corpus.bin.json").write_text('{"dtype": "uint16", "vocab": 512, "tokens": 500}')
    r = launch("run", job, "--nproc", 2, "--run-dir", tmp_path / "rd2", env=env, cwd=tmp_path)
    assert r.returncode == 2 and "vocab 512 but model.vocab is 256" in r.stderr and not (tmp_path / "rd2").exists()


def test_resume_path_must_hold_a_complete_checkpoint(tmp_path, env):
    (tmp_path / "run" / "checkpoints" / "step-3.tmp").mkdir(parents=True)  # an unfinished save only
    for bad in (tmp_path / "nope", tmp_path / "run"):
        r = launch("run", TINY, "--nproc", 2, "--run-dir", tmp_path / "x", "--resume", bad, env=env)
        assert r.returncode == 2 and r.stderr.startswith("error: --resume:") and "no complete checkpoint" in r.stderr
    assert not (tmp_path / "x").exists()


def test_exit_code_from_real_torchrun_failure_summary(tmp_path):
    """torchrun exits 1 for any worker failure; the worker's own code is in its root-cause summary."""
    script = tmp_path / "w.py"
    # rank 1 checkpoints and exits 75; rank 0 is still busy and torchrun SIGTERMs it (exitcode -15)
    script.write_text("import os, sys, time\nprint('hi', flush=True)\n"
                      "sys.exit(75) if os.environ['RANK'] == '1' else time.sleep(60)\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1
    code = job_exit_code(r.returncode, r.stdout + r.stderr)
    assert "exitcode  : -15" in r.stderr  # the real summary holds both ranks
    assert code == PREEMPT_EXIT_CODE and state_for_exit(code) == PREEMPTED
    assert job_exit_code(0, "") == 0 and state_for_exit(0) == SUCCEEDED
    assert rank_of("[rank3]: step 1/8 | loss 5.0") == (3, "step 1/8 | loss 5.0")
    assert rank_of("W1129 09:04:49 torchrun says") == (None, "W1129 09:04:49 torchrun says")


# --- slow: the tiny model under torchrun ------------------------------------------------------

@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted 2-process run of the tiny job (shared by the end-to-end and parity tests)."""
    base = tmp_path_factory.mktemp("full")
    env = state_env(base)
    r = launch("run", TINY, "--nproc", 2, "--run-dir", base / "run", "--json", env=env)
    return base / "run", r


@pytest.mark.slow
def test_launch_run_tiny_cpu_end_to_end(full_run):
    rd, r = full_run
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["exit_code"] == 0 and out["steps"] == 8 and out["run_dir"] == str(rd.resolve())
    ls = losses(rd)
    assert sorted(ls) == list(range(1, 9)) and out["final_loss"] == ls[8]
    assert "step 8/8 | loss" in r.stderr  # rank 0's lines streamed (to stderr under --json)
    for name in ("plan.json", "job.yaml", "logs/node0.log", "checkpoints/latest"):
        assert (rd / name).exists(), name
    assert (rd / "checkpoints" / "latest").read_text().strip() == "step-8"
    log = (rd / "logs" / "node0.log").read_text()
    assert "[rank0]: step 1/8" in log
    beats = [json.loads((rd / "heartbeat" / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [b["phase"] for b in beats] == ["done", "done"] and all(b["step"] == 8 for b in beats)
    rec = json.loads((rd / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["tokens_per_s"] > 0 and rec["tflops_per_gpu"] > 0 and rec["mfu"] > 0


@pytest.mark.slow
def test_resume_parity_after_sigterm(full_run, tmp_path, env):
    ref_dir, ref = full_run
    assert ref.returncode == 0, ref.stderr[-3000:]
    rd = tmp_path / "run"
    proc = subprocess.Popen([LAUNCH, "run", str(TINY), "--nproc", "2", "--run-dir", str(rd), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 180
    while time.time() < deadline:  # wait for step 2, then stop it as Slurm's preemption would
        metrics = rd / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == PREEMPT_EXIT_CODE, err[-3000:]
    first = json.loads(out)
    assert first["state"] == PREEMPTED and 2 <= first["steps"] <= 8
    stopped_at = first["steps"]
    assert (rd / "checkpoints" / "latest").read_text().strip() == f"step-{stopped_at}"
    assert "got SIGTERM" in (rd / "logs" / "node0.log").read_text()

    again = launch("run", TINY, "--nproc", 2, "--run-dir", rd, env=env)  # no --resume: refused
    assert again.returncode == 2 and "--resume auto" in again.stderr

    r = launch("run", TINY, "--nproc", 2, "--run-dir", rd, "--resume", "auto", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in (rd / "logs" / "node0.log").read_text()
    got, want = losses(rd), losses(ref_dir)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])


def test_run_dir_layout_and_refusal_of_another_jobs_dir(tmp_path):
    from launcher.backends import prepare_run_dir
    from launcher.errors import UserError
    from tests.unit.test_trainer_data import data_plan

    rd = prepare_run_dir(tmp_path / "rd", data_plan(dp=2), "name: t\n")
    for sub in ("logs/nccl", "logs/flight", "heartbeat", "checkpoints"):
        assert (rd / sub).is_dir()
    assert (rd / "job.yaml").read_text() == "name: t\n" and (rd / "plan.json").exists()
    prepare_run_dir(rd, data_plan(dp=2), None)  # the same job again (a resume) is fine
    with pytest.raises(UserError, match="holds a different job"):
        prepare_run_dir(rd, data_plan(dp=4), None)


def tiny_job(tmp_path: Path, name: str, replace: dict[str, str]) -> Path:
    text = TINY.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_token_file_job_and_pipeline_resume_from_checkpoint(tmp_path, env):
    """A byte-tokenised corpus through the real trainer, on a 2-stage interleaved pipeline (each rank
    two model chunks); then a fresh run dir seeded with step-2's checkpoint resumes and matches."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    tok = subprocess.run([sys.executable, "-m", "launcher.trainer.tokenize", str(corpus), "-o",
                          str(tmp_path / "corpus.bin")], capture_output=True, text=True)
    assert tok.returncode == 0, tok.stderr
    job = tiny_job(tmp_path, "pp", {"data: synthetic": f"data: {tmp_path / 'corpus.bin'}",
                                    "steps: 8": "steps: 4", "checkpoint_every: 4": "checkpoint_every: 2",
                                    "tp: 2": "tp: 1", "pp: 1": "pp: 2\n  schedule: interleaved-1f1b\n"
                                                               "  virtual_stages: 2"})
    a = launch("run", job, "--nproc", 2, "--run-dir", tmp_path / "a", "--json", env=env)
    assert a.returncode == 0, a.stderr[-3000:]
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["layout"]["pp"] == 2 and plan["layout"]["virtual_stages"] == 2
    ref = losses(tmp_path / "a")
    assert ref[4] < ref[1]  # real text is learnable
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(tmp_path / "a" / "checkpoints" / "step-2"), str(b / "checkpoints")], check=True)
    (b / "checkpoints" / "latest").write_text("step-2\n")
    r = launch("run", job, "--nproc", 2, "--run-dir", b, "--resume", "auto", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(b)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(ref[step], rel=1e-6)


def test_local_env_pins_cpu_jobs_and_follows_the_plans_gpu_order(tmp_path, monkeypatch):
    from launcher.plan.layout import placements
    from launcher.plan.spec import load_spec, resolve_gpu
    from tests.unit.test_trainer_data import data_plan

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = load_spec(TINY)
    be = LocalBackend()
    cpu = be.env(spec, data_plan(dp=2), tmp_path)
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]: "
    assert cpu["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "logs" / "flight" / "rank_")
    gpu_plan = data_plan(dp=4)
    gpu_plan.gpu = resolve_gpu("h100-pcie")
    gpu_plan.ranks = placements(gpu_plan.degrees, gpu_plan.mesh_order, 4, [0, 2, 1, 3])
    assert be.env(spec, gpu_plan, tmp_path)["CUDA_VISIBLE_DEVICES"] == "0,2,1,3"
    gpu_plan.ranks = placements(gpu_plan.degrees, gpu_plan.mesh_order, 4)
    assert "CUDA_VISIBLE_DEVICES" not in be.env(spec, gpu_plan, tmp_path)


@pytest.mark.slow
def test_resume_into_another_layout(full_run, tmp_path, env):
    """The 2-rank (tp=2) run's step-4 checkpoint continues on 4 ranks (tp=2 × dp=2, ZeRO 3): DCP
    reshards, the data position is layout-free, and the losses follow the original run's (fp32, a
    different reduction order: relative 1e-5)."""
    ref_dir, ref = full_run
    assert ref.returncode == 0
    r = launch("run", TINY, "--nproc", 4, "--run-dir", tmp_path / "wide", "--resume",
               ref_dir / "checkpoints" / "step-4", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "wide" / "plan.json").read_text())
    assert plan["layout"]["dp"] == 2 and plan["layout"]["tp"] == 2
    got, want = losses(tmp_path / "wide"), losses(ref_dir)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5)


def test_stall_watch_names_the_rank_that_stopped(tmp_path, capsys):
    from launcher.commands.follow import StallWatch, stall_report
    from launcher.trainer.metrics import Heartbeat

    assert "no heartbeat files yet" in stall_report(tmp_path, 2)
    stuck, ok = Heartbeat(tmp_path, 1, "h"), Heartbeat(tmp_path, 0, "h")
    stuck.beat(2, "forward", last_collective="all_gather")
    data = json.loads(stuck.path.read_text())
    data["updated"] -= 60  # rank 1 stopped a minute ago ...
    stuck.path.write_text(json.dumps(data))
    ok.beat(3, "backward", last_collective="reduce_scatter")  # ... while rank 0 went on
    report = stall_report(tmp_path, 2)
    assert report.startswith("rank 1") and "step 2" in report and "all_gather" in report
    # both waiting (no stale file): the one with fewer collectives is named
    ok.beat(3, "forward", last_collective="all_gather")
    ok.beat(3, "forward", last_collective="all_reduce")  # rank 0: 3 collectives, waiting in the 3rd
    stuck.beat(3, "forward", last_collective="all_gather")  # rank 1: 2, never issued the 3rd
    assert stall_report(tmp_path, 2).startswith("rank 1 is behind its peers at step 3 after 2 collectives")
    watch = StallWatch(tmp_path, 2, quiet_s=0.2)
    watch.thread.start()
    time.sleep(0.6)
    watch.stop.set()
    watch.thread.join()
    err = capsys.readouterr().err
    assert "launch: no output from rank 0 for" in err and "rank 1" in err and f"launch diagnose {tmp_path}" in err


# --- one artefact from plan to launch: run takes a plan.json; a GPU plan needs GPUs or --cpu ---------

def _planned(tmp_path, env, job: Path, *extra) -> Path:
    out = tmp_path / "plan.json"
    r = launch("plan", job, "-o", out, *extra, env=env)
    assert r.returncode == 0, r.stderr
    return out


def test_run_takes_a_plan_json_as_it_is(tmp_path, env):
    job = tiny_job(tmp_path, "auto", {"parallel:\n  tp: 2\n  cp: 1\n  pp: 1\n  zero: 3\n  recompute: none\n"
                                      "  micro_batch: 2\n": "parallel:\n  tp: 2\n  zero: 1\n"})
    plan_file = _planned(tmp_path, env, job)
    plan = json.loads(plan_file.read_text())
    for args in ([plan_file], [job, "--plan", plan_file]):
        r = launch("run", *args, "--run-dir", tmp_path / "rd", "--dry-run", "--json", env=env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["plan"]["layout"] == plan["layout"] and out["plan"]["ranks"] == plan["ranks"]
        assert "not re-planned" in r.stderr and f"--nproc-per-node={plan['world_size']}" in out["command"]
    r = launch("run", plan_file, "--nproc", 2, "--run-dir", tmp_path / "rd", "--dry-run", env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: --nproc: ") and "a plan is launched as it is" in r.stderr
    other = tiny_job(tmp_path, "other", {"steps: 8": "steps: 9"})
    r = launch("run", other, "--plan", plan_file, "--run-dir", tmp_path / "rd", "--json", env=env)
    assert r.returncode == 2 and "train.steps: the job file has 9, the plan 8" in r.stderr
    assert json.loads(r.stdout)["field"] == "--plan"
    assert not (tmp_path / "rd").exists()


@pytest.mark.skipif(bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or Path("/dev/nvidia0").exists(),
                    reason="a machine with GPUs runs GPU plans")
def test_a_gpu_plan_on_a_machine_without_gpus(tmp_path, env):
    """`launch run examples/llama3-8b-8xh100.yaml` here: one line saying what the plan needs, what is here
    and how to run it on CPU; with --cpu the host memory is checked before any rank starts (8 CPU
    ranks of an 8B model would be killed by the OOM killer), and nothing is created."""
    rd = tmp_path / "rd"
    r = launch("run", EXAMPLES / "llama3-8b-8xh100.yaml", "--run-dir", rd, env=env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("error: cluster.gpu: the plan needs 8 × h100-sxm GPUs but this machine has no GPU; "
                               "pass --cpu")
    r = launch("run", EXAMPLES / "llama3-8b-8xh100.yaml", "--run-dir", rd, "--cpu", env=env)
    assert r.returncode == 2 and "error: host memory: 8 CPU ranks of llama3-8b need about" in r.stderr
    assert "GB available" in r.stderr and not rd.exists() and not (tmp_path / "state").exists()


def test_host_memory_check_counts_every_rank():
    from launcher.commands.local_job import CPU_RANK_OVERHEAD_GB, check_host_memory
    from launcher.errors import UserError
    from tests.unit.test_trainer_data import data_plan

    plan = data_plan(dp=4)
    plan.memory = {**plan.memory, "per_gpu_gb": 3.0, "runtime_gb": 1.0}
    need = 4 * (2.0 + CPU_RANK_OVERHEAD_GB)
    assert check_host_memory(plan, "cpu", available_gb=need + 0.1) == pytest.approx(need)
    assert check_host_memory(plan, "cuda", available_gb=0.0) == 0.0         # on GPUs the ranks' tensors are not here
    with pytest.raises(UserError, match=r"host memory: 4 CPU ranks .* need about 10.0 GB .* 9.9 GB available"):
        check_host_memory(plan, "cpu", available_gb=need - 0.1)


@pytest.mark.slow
def test_plan_o_then_run_that_plan_on_cpu(tmp_path, env):
    """A newcomer's path: `launch plan job.yaml -o plan.json`, then `launch run plan.json` runs exactly that
    plan (here a GPU plan, on this machine's CPUs with --cpu)."""
    job = tiny_job(tmp_path, "gpu", {"gpu: cpu": "gpu: h100-sxm", "gpus_per_node: 4": "gpus_per_node: 2",
                                     "steps: 8": "steps: 2", "checkpoint_every: 4": "checkpoint_every: 0"})
    plan_file = _planned(tmp_path, env, job)
    r = launch("run", plan_file, "--cpu", "--run-dir", tmp_path / "rd", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["steps"] == 2 and "--cpu: running 2 CPU processes" in r.stderr
    ran = json.loads((tmp_path / "rd" / "plan.json").read_text())
    assert ran["layout"] == json.loads(plan_file.read_text())["layout"]
    assert "from " in (tmp_path / "rd" / "job.yaml").read_text().splitlines()[0]
