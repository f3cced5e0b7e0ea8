"""`launch run JOB.yaml`: plan the job and run it on this machine under torchrun, following it.

The embedded default of the project: the same job file that goes to Slurm or Kubernetes runs here
(CPU/gloo without a GPU). Rank 0's lines stream to the terminal; everything is in
<run_dir>/logs/node0.log. Ctrl-C (or SIGTERM) asks the trainer to checkpoint and stop; a second one
kills it. The exit status is the job's: 0 done, 75 preempted (resume with --resume auto), else failed.
"""

from __future__ import annotations

import collections
import re
import signal
import sys
import time
from pathlib import Path

import click

from launcher.commands import emit, json_option, progress, warn
from launcher.commands.options import dry_run_option, plan_option
from launcher.errors import UserError
from launcher.formats.rundir import LATEST, RunDir, read_metrics
from launcher.plan.entrypoint import NOT_VERIFIED

LOG_LEVEL_LINE = re.compile(r"^[EW]\d{4} ")


def checkpoint_source(path: str) -> Path:
    """--resume PATH: a run dir, its checkpoints/ dir, or one complete step-N dir (what the trainer takes)."""
    from launcher.formats.rundir import latest_checkpoint, resume_target

    p = Path(path).resolve()
    target = resume_target(p)
    if target is None or (target[1] is None and latest_checkpoint(target[0]) is None):
        raise UserError(f"--resume: {path} holds no complete checkpoint (give auto, never, a run dir, "
                        "its checkpoints/ dir or a checkpoints/step-N dir)")
    return p


def check_devices(plan, as_json: bool, cpu: bool = False) -> str:
    """'cuda' or 'cpu'. A GPU plan needs its GPUs here: without them one line says what the plan needs,
    what this machine has and how to run it on CPU anyway (`cpu`: --cpu, gloo processes)."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if plan.gpu.name != "cpu" and not cpu:
        if have == 0:
            raise UserError(f"cluster.gpu: the plan needs {plan.world_size} × {plan.gpu.name} GPUs but this machine "
                            f"has no GPU; pass --cpu to run its {plan.world_size} ranks as CPU processes (gloo), "
                            "or set cluster.gpu: cpu")
        if plan.world_size > have:
            raise UserError(f"cluster.gpus_per_node: the plan needs {plan.world_size} GPUs but this machine has "
                            f"{have}; set cluster.gpus_per_node or pass --nproc {have} (or --cpu)")
        return "cuda"
    if plan.gpu.name != "cpu":
        progress(f"launch: --cpu: running {plan.world_size} CPU processes with gloo "
                 f"(MFU is reported against {plan.gpu.name}'s peak)")
    return "cpu"


#: What one CPU rank needs beyond the ledger's tensors: the Python interpreter, torch and gloo.
CPU_RANK_OVERHEAD_GB = 0.5


def host_memory_gb() -> float | None:
    """MemAvailable of this machine (GB), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(plan, device: str, available_gb: float | None = None) -> float:
    """On CPU every rank's tensors live in this machine's memory: the plan's per-rank need (its ledger,
    less the GPU runtime allowance, plus the process itself) times the ranks must fit in what is
    available, else one line instead of ranks killed by the kernel's OOM killer. The need, GB."""
    if device != "cpu":
        return 0.0
    m = plan.memory
    per_rank = max(0.0, float(m.get("per_gpu_gb", 0.0)) - float(m.get("runtime_gb", 0.0))) + CPU_RANK_OVERHEAD_GB
    need = per_rank * plan.world_size
    have = host_memory_gb() if available_gb is None else available_gb
    if have is not None and need > have:
        raise UserError(f"host memory: {plan.world_size} CPU ranks of {plan.model.preset} need about {need:.1f} GB "
                        f"({per_rank:.1f} GB each: the plan's {m.get('per_gpu_gb', 0.0):.1f} GB per GPU less the GPU "
                        f"runtime, plus {CPU_RANK_OVERHEAD_GB} GB a process) but this machine has {have:.1f} GB "
                        "available; run it where its GPUs are (launch submit), or a smaller model here")
    return need


def _beats(run_dir: Path):
    from launcher.diagnose.heartbeat import Heartbeats, parse_beat

    hb = Heartbeats()
    for path in RunDir(run_dir).heartbeat_files():
        try:
            beat = parse_beat(path.read_text(), str(path))
        except (OSError, UnicodeDecodeError):
            continue
        if beat is not None:
            hb.add(beat)
    return hb


def stall_report(run_dir: Path, world: int | None) -> str:
    """Where each rank is: from stack dumps when there are live ones (the frame each rank is in), else from
    the heartbeat files (launcher.diagnose's reading of both)."""
    from launcher.diagnose.findings import ERROR

    hb = _beats(run_dir)
    stuck = stack_report(run_dir, world, hb)
    if stuck:
        return stuck
    role = _pp_stage_of_ranks(run_dir)
    findings = hb.findings(world, {}, role)
    if not findings:
        return "no heartbeat files yet (the ranks have not started their first phase)"
    errors = [f for f in findings if f.severity == ERROR]
    if errors:
        return errors[0].message
    # Everyone is waiting (no file is stale next to another): the suspect is the rank that issued
    # fewer collectives than the others of its pipeline stage.
    beats = hb.beats
    top: dict = {}
    for r, b in beats.items():
        top[role.get(r)] = max(top.get(role.get(r), (0, 0)), (b.step, b.collectives))
    behind = sorted(r for r, b in beats.items() if b.phase != "done" and (b.step, b.collectives) < top[role.get(r)])
    lead = "; ".join(f"rank {r} is behind its peers at step {beats[r].step} after {beats[r].collectives} "
                     f"collectives (last {beats[r].last_collective})" for r in behind)
    return (lead + "; " if lead else "") + findings[-1].message


def stack_report(run_dir: Path, world: int | None, hb=None) -> str | None:
    """The stack dumps' verdict ("rank R on host H stuck in FRAME ..."), or None without live dumps."""
    from launcher.diagnose.stacks import Stacks

    stacks = Stacks()
    for path in RunDir(run_dir).stack_files():
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    stacks.feed(line.rstrip("\n"), f"{path.name}:{n}", path.name)
        except OSError:
            continue
    hb = hb if hb is not None else _beats(run_dir)
    found = stacks.findings(world, {}, hb.beats)
    top = next((f for f in found if f.kind == "stalled_rank"), None) or next(
        (f for f in found if f.severity != "info"), None)
    return top.message.removesuffix(" (stack dumps)") if top else None


def straggler_report(run_dir: Path) -> tuple[tuple[int, ...], str]:
    """(the straggling ranks, one line naming them with their hosts); ((), "") when there are none."""
    from launcher.diagnose.stragglers import describe, stragglers

    beats = _beats(run_dir).beats
    found = stragglers(beats)
    return tuple(r for r, _, _ in found), (describe(found, beats, {}) if found else "")


def _pp_stage_of_ranks(run_dir: Path) -> dict[int, int]:
    from launcher.plan.model import Plan

    try:
        plan = Plan.load(RunDir(run_dir).plan)
    except UserError:
        return {}
    return {r.rank: r.coords.get("pp", 0) for r in plan.ranks}


class StallWatch:
    """While the job runs: when rank 0 has printed nothing for `quiet_s`, ask every rank for its stacks
    (`dump`, the backend's py-spy/SIGQUIT) and say where every rank is."""

    def __init__(self, run_dir: Path, world: int | None, quiet_s: float, dump=None, startup_s: float = 0.0):
        import threading

        self.run_dir, self.world, self.quiet_s, self.dump = run_dir, world, quiet_s, dump
        self.startup_s = max(quiet_s, startup_s)  # before the first step: start-up is slow, not hung
        self.stepping = False
        self.last = time.time()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(min(5.0, self.quiet_s / 4)):
            quiet = time.time() - self.last
            if quiet >= (self.quiet_s if self.stepping else self.startup_s):
                where = ""
                if self.dump is not None:
                    asked = self.dump(f"no output from rank 0 for {quiet:.0f} s (launch run)")
                    if asked:
                        self.stop.wait(3.0)  # faulthandler/py-spy write within milliseconds; allow a loaded box
                        where = f"; stacks in {RunDir(self.run_dir).stacks}"
                warn(f"launch: no output from rank 0 for {quiet:.0f} s; "
                         f"{stall_report(self.run_dir, self.world)}{where}; more: launch diagnose {self.run_dir}")
                self.last = time.time()


def follow(backend, handle, as_json: bool, quiet_s: float = 120.0,
           startup_s: float = 0.0) -> dict[int, collections.deque]:
    """Stream rank 0 (and torchrun's warnings) until the job ends; keep each rank's last lines;
    report where the ranks are when rank 0 goes quiet for `quiet_s`."""
    from launcher.backends.local import rank_of

    watch = StallWatch(Path(handle.run_dir), int(handle.extra.get("world", 0)) or None, quiet_s,
                       dump=lambda reason: backend.dump_stacks(handle, reason), startup_s=startup_s)
    watch.thread.start()
    slow: dict = {"said": None}

    tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=30))
    out = sys.stderr if as_json else sys.stdout
    stops = {"n": 0}

    def on_signal(signum, frame):
        stops["n"] += 1
        if stops["n"] == 1:
            progress("launch: stopping the job (the trainer checkpoints, then exits); again to kill it")
            backend.cancel(handle)
        else:
            progress("launch: killing the job")
            backend.cancel(handle, force=True)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for line in backend.log_iter(handle, follow=True):
            rank, text = rank_of(line)
            if rank is not None:
                tails[rank].append(text)
                if rank == 0:
                    watch.last = time.time()
                    print(text, file=out, flush=True)
                    if text.startswith("step "):
                        watch.stepping = True
                        ranks, said = straggler_report(Path(handle.run_dir))
                        if ranks and ranks != slow["said"]:  # said once per new set of slow ranks
                            warn(f"launch: straggler: {said}")
                        slow["said"] = ranks
            elif LOG_LEVEL_LINE.match(line):
                tails[-1].append(line)
                print(line, file=sys.stderr, flush=True)
    finally:
        watch.stop.set()
        for s, h in old.items():
            signal.signal(s, h)
    return tails


@click.command("run")
@click.argument("job", type=click.Path(dir_okay=False))
@plan_option("run", "JOB", " JOB itself may be a plan.json.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory (default <log_dir>/<name>-<time>).")
@click.option("--nproc", type=int, help="Processes on this machine (overrides cluster.gpus_per_node).")
@click.option("--cpu", is_flag=True, help="Run a GPU plan here on CPU processes (gloo), where it has no GPUs.")
@click.option("--resume", default="never", show_default=True, metavar="auto|never|PATH",
              help="auto: continue from the run dir's latest complete checkpoint; PATH: start from another "
                   "run's checkpoint (a run dir or checkpoints/step-N; the layout may differ, DCP reshards).")
@dry_run_option("Print the plan and the command; start nothing, write nothing.")
@json_option
def run(job: str, plan_path: str | None, run_dir: str | None, nproc: int | None, cpu: bool, resume: str,
        dry_run: bool, as_json: bool) -> int:
    """Plan JOB (a job file; or run a plan.json as it is) and run it here with torchrun; exit with the
    job's status."""
    from launcher.backends import get_backend
    from launcher.commands.sources import load_launch

    if resume not in ("auto", "never"):
        resume = str(checkpoint_source(resume))
    launch = load_launch(job, plan_path, None, nproc, local=True)
    spec, plan, text = launch.spec, launch.plan, launch.text
    if spec.cluster.nodes != 1:
        raise UserError(f"cluster.nodes: `launch run` uses this machine only, but the job asks for "
                        f"{spec.cluster.nodes} nodes; use `launch submit` (slurm or k8s), or set cluster.nodes: 1")
    if launch.from_plan:
        progress(f"launch: the plan in {launch.from_plan}, as it is (tp={plan.tp} cp={plan.cp} pp={plan.pp} "
                 f"dp={plan.dp}, zero {plan.zero_stage}); not re-planned")
    entry = plan.train.entrypoint
    if entry is not None and entry.script is not None and not Path(entry.script).is_file():
        raise UserError(f"train.entrypoint.script: {entry.script}: no such file")
    if spec.train.data != "synthetic":  # a bad token file fails here, before anything is written
        from launcher.formats.tokens import check_token_file

        check_token_file(spec.train.data, spec.model.vocab, spec.train.seq_len)
    from launcher.backends import default_run_dir

    rd = Path(run_dir) if run_dir else default_run_dir(spec)
    backend = get_backend("local")  # `launch run` is this machine by definition
    if dry_run:
        req = backend.dryrun(spec, plan, rd, resume=resume, job_text=text)
        emit({"run_dir": req.run_dir, "plan": plan.to_dict(), "command": req.command, "request": req.to_dict()},
             as_json, lambda: _dry_run_yaml(plan, req))
        return 0
    from launcher.backends.jobstate import check_state

    device = check_devices(plan, as_json, cpu)
    if entry is None:  # the ledger is the bundled trainer's: own code's memory is its own
        check_host_memory(plan, device)
    check_state()  # a broken state file is found before anything starts
    handle = _start(backend, spec, plan, rd, resume, text, cpu=device == "cpu" and plan.gpu.name != "cpu")
    progress(f"launch: {spec.name}: {plan.world_size} processes on {device} "
             f"(tp={plan.tp} cp={plan.cp} pp={plan.pp} dp={plan.dp}, zero {plan.zero_stage}, "
             f"micro_batch {plan.micro_batch} × grad_accum {plan.grad_accum}); run dir {handle.run_dir}"
             + (f"; running your own code: {entry.label} (the plan in LAUNCH4D_*; memory {NOT_VERIFIED})"
                if entry is not None else ""))
    t0 = time.time()
    quiet_s = float(spec.diagnostics.stall_dump_s or max(30.0, min(120.0, spec.diagnostics.collective_timeout_s / 2)))
    tails = follow(backend, handle, as_json, quiet_s, startup_s=spec.diagnostics.init_timeout_s / 2)
    status = backend.wait(handle)
    left = backend.sweep(handle)
    if left:
        warn(f"launch: {len(left)} process(es) of the job outlived torchrun; killed them "
                 f"(pid {', '.join(map(str, left))})")
    steps = read_metrics(handle.run_dir)
    code = status.exit_code if status.exit_code is not None else 1
    payload = {"run_dir": handle.run_dir, "exit_code": code, "state": status.state, "job_id": handle.id,
               "steps": steps[-1]["step"] if steps else 0, "final_loss": steps[-1]["loss"] if steps else None}
    if code != 0:
        _explain(handle, status, tails)
    progress(f"launch: {status.state} (exit {code}) after {time.time() - t0:.1f} s"
             + (f", {payload['steps']} steps" if steps or entry is None else "")
             + (f", final loss {payload['final_loss']:.4f}" if steps else "")
             + (f"; {status.detail}" if status.detail else ""))
    if as_json:
        emit(payload, True)
    return code


def _dry_run_yaml(plan, req) -> str:
    """What --dry-run shows a person: the layout, the run dir and the command, as YAML."""
    import dataclasses

    import yaml

    return yaml.safe_dump({"layout": dataclasses.asdict(plan.layout), "world_size": plan.world_size,
                           "run_dir": req.run_dir, "env": dict(sorted(req.env.items())),
                           "argv": list(req.extra["argv"])}, sort_keys=False, width=1 << 16).rstrip()


def _start(backend, spec, plan, rd: Path, resume: str, text: str | None, cpu: bool = False):
    """Create and lock the run dir, then start the job. The lock is passed to the job's processes,
    so a second `launch run` on this dir is refused for as long as any of them lives; a failure
    before the job starts removes the run dir this call created."""
    import shutil

    from launcher.backends import check_run_dir
    from launcher.formats.files import make_dirs
    from launcher.formats.rundir import RunDirLock

    check_run_dir(rd, plan)
    created = make_dirs(rd, "run directory")
    lock_existed = RunDir(rd).lock.exists()
    try:
        lock = RunDirLock(rd)
        try:
            if (RunDir(rd).checkpoints / LATEST).exists() and resume == "never":
                raise UserError(f"--run-dir: {rd} already has checkpoints; pass --resume auto to continue it, "
                                "or give a new run directory")
            for w in plan.warnings:
                warn(f"launch: plan warning: {w}")
            req = backend.dryrun(spec, plan, rd, resume=resume, job_text=text, keep_fds=(lock.fd,))
            if cpu:  # --cpu: a GPU plan on CPU processes even where GPUs are
                req.env.update(LAUNCH4D_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
            handle = backend.submit(req)
        except BaseException:
            if not lock_existed:
                RunDir(rd).lock.unlink(missing_ok=True)
            raise
        finally:
            lock.release()  # the job's processes hold it from here
    except BaseException:
        if created:
            shutil.rmtree(created[0], ignore_errors=True)
        raise
    _record(handle)
    return handle


def _record(handle) -> None:
    from launcher.backends.jobstate import record

    try:
        record(handle)
    except UserError as exc:  # started all the same: say so, and go on following it
        warn(f"launch: warning: job {handle.id} is running but was not recorded ({exc})")


def _explain(handle, status, tails) -> None:
    """On failure, the last lines of the rank that failed first (torchrun's root cause)."""
    from launcher.backends.local import ROOT_CAUSE_RANK

    try:
        text = Path(handle.log_path).read_text(errors="replace")
    except OSError:
        text = ""
    m = ROOT_CAUSE_RANK.findall(text)
    rank = int(m[-1]) if m else None
    if rank is not None and rank != 0 and tails.get(rank):
        warn(f"launch: last lines of rank {rank} (first to fail):")
        for line in tails[rank]:
            warn(f"  {line}")
    warn(f"launch: full log: {handle.log_path}")
