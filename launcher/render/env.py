"""The environment every trainer process runs under, from one place for every backend (local,
Slurm, Kubernetes): NCCL debug files, the flight recorder, the watchdog's timeouts, interface
hints (the job file's, else preflight's), then the user's backend.env."""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.secrets import looks_secret
from launcher.formats.shell import quote as shell_quote
from launcher.plan.spec_backend import ENV_TRAINER_ONLY, env_problem, split_env

if TYPE_CHECKING:
    from launcher.plan.entrypoint import EntrypointSpec
    from launcher.plan.model import Plan
    from launcher.plan.spec import JobSpec

def measured_nccl_env(plan: Plan) -> dict[str, str]:
    """From preflight, through the plan: NCCL_IB_HCA restricted (exact match) to the NICs nearest
    the job's GPUs, so a storage or management port is never picked."""
    nics = sorted({r.nic for r in plan.ranks if r.nic})
    return {"NCCL_IB_HCA": "=" + ",".join(nics)} if nics else {}


def diagnostics_env(spec: JobSpec, run_dir: str, extra: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """NCCL / PyTorch observability variables from the job's `diagnostics` section, the same for every
    backend (the local run's environment, the sbatch script's exports, the pods' env); interface
    hints given in the job file win over measured ones (`extra`)."""
    d = spec.diagnostics
    env: list[tuple[str, str]] = []
    if d.nccl_debug != "off":
        env.append(("NCCL_DEBUG", d.nccl_debug))
        if d.nccl_debug_subsys:
            env.append(("NCCL_DEBUG_SUBSYS", d.nccl_debug_subsys))
        env.append(("NCCL_DEBUG_FILE", f"{run_dir}/{rundir.NCCL_LOGS}/%h.%p.log"))
    env.append(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"))
    if d.flight_recorder:
        # TORCH_FR_BUFFER_SIZE only: torch >= 2.13 (the trainer's floor) warns on every rank that the old
        # TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated. The dump path keeps both names (no warning).
        env += [("TORCH_FR_BUFFER_SIZE", str(d.flight_recorder_entries)),
                ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{run_dir}/{rundir.FLIGHT}/rank_"),
                ("TORCH_FR_DUMP_TEMP_FILE", f"{run_dir}/{rundir.FLIGHT}/rank_")]
    # The init and collective timeouts go to the trainer's flags (trainer_args); the NCCL watchdog's
    # heartbeat monitor must not fire before the collective timeout does.
    env.append(("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(max(d.collective_timeout_s, 60))))
    measured = extra or {}
    ifname = d.socket_ifname or measured.get("NCCL_SOCKET_IFNAME")
    hca = d.ib_hca or measured.get("NCCL_IB_HCA")
    if ifname:  # gloo (CPU collectives, the trainer's control-plane barriers) on the same interface
        env += [("NCCL_SOCKET_IFNAME", ifname), ("GLOO_SOCKET_IFNAME", ifname)]
    if hca:
        env.append(("NCCL_IB_HCA", hca))
    return env


def trainer_args(spec: JobSpec, plan_path: str, run_dir: str) -> str:
    """The trainer's command-line arguments, shell-quoted."""
    d = spec.diagnostics
    return (f"--plan {shell_quote(plan_path)} --run-dir {shell_quote(run_dir)} --resume auto "
            f"--init-timeout-s {d.init_timeout_s} --step-timeout-s {d.collective_timeout_s}")


def plan_env(plan: Plan, plan_path: str, run_dir: str, resume: str = "auto") -> list[tuple[str, str]]:
    """The plan as environment variables, the same in every backend: what a train.entrypoint script reads
    instead of parsing plan.json (the bundled trainer reads plan.json itself). Ranks come from torchrun
    (RANK, LOCAL_RANK, WORLD_SIZE), in the plan's order; the mesh coordinates of rank r follow from
    LAUNCH4D_MESH_ORDER and the degrees (r = Σ coordinate · stride, the last dimension innermost)."""
    lay, t = plan.layout, plan.train
    env = [("LAUNCH4D_PLAN", plan_path), ("LAUNCH4D_RUN_DIR", run_dir),
           ("LAUNCH4D_TP", lay.tp), ("LAUNCH4D_CP", lay.cp), ("LAUNCH4D_PP", lay.pp), ("LAUNCH4D_DP", lay.dp),
           ("LAUNCH4D_EP", lay.ep), ("LAUNCH4D_MESH_ORDER", ",".join(plan.mesh_order)),
           ("LAUNCH4D_ZERO", lay.zero), ("LAUNCH4D_RECOMPUTE", lay.recompute),
           ("LAUNCH4D_MICRO_BATCH", lay.micro_batch), ("LAUNCH4D_GRAD_ACCUM", lay.grad_accum),
           ("LAUNCH4D_GLOBAL_BATCH", t.global_batch), ("LAUNCH4D_SEQ_LEN", t.seq_len), ("LAUNCH4D_STEPS", t.steps),
           ("LAUNCH4D_SCHEDULE", lay.schedule), ("LAUNCH4D_VIRTUAL_STAGES", lay.virtual_stages),
           ("LAUNCH4D_STAGE_LAYERS", ",".join(map(str, plan.stage_layers))),
           ("LAUNCH4D_INIT_TIMEOUT_S", plan.diagnostics.init_timeout_s),
           ("LAUNCH4D_STEP_TIMEOUT_S", plan.diagnostics.collective_timeout_s)]
    if t.entrypoint is not None:        # the bundled trainer takes --resume; own code reads it here
        env.append(("LAUNCH4D_RESUME", resume))
    return [(k, str(v)) for k, v in env]


def entry_command(entry: EntrypointSpec | None, trainer: str) -> str:
    """What torchrun starts, shell-quoted: the bundled trainer with `trainer` (its arguments, quoted
    already: trainer_args), or train.entrypoint's script or module with its own arguments."""
    if entry is None:
        return f"-m launcher.trainer {trainer}"
    return " ".join(shell_quote(a) for a in entry.argv)


def user_env(spec: JobSpec) -> list[tuple[str, str]]:
    """backend.env as exported to every process of the job (the names that run code were refused when
    the job file was read; LD_LIBRARY_PATH, PATH and PYTHONPATH go to trainer_env_prefix instead)."""
    out = []
    for key, value in sorted(spec.backend.env.items()):
        why = env_problem(key)
        if why:
            raise UserError(f"backend.env.{key}: {why}")
        if looks_secret(key):  # refused: reference a Secret instead
            raise UserError(f"backend.env.{key}: looks like a secret and would be written into the rendered "
                            "file; pass it from the submitting shell (Slurm exports it) or name a Kubernetes "
                            "Secret in backend.k8s.env_from_secrets")
        if "\x00" in str(value):
            raise UserError(f"backend.env.{key}: a NUL byte cannot be in an environment variable")
        if key not in ENV_TRAINER_ONLY:
            out.append((key, value))
    return out


def trainer_env_prefix(spec: JobSpec) -> str:
    """The backend.env names passed to the trainer's command only, as shell assignments in front of
    it ("LD_LIBRARY_PATH=... PYTHONPATH=... "; empty when there are none): launch4d's own shells
    never run with them."""
    return "".join(f"{k}={shell_quote(v)} " for k, v in sorted(split_env(spec.backend.env)[1].items()))
