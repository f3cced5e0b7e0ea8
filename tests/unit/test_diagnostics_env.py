"""One source of the diagnostics environment: a local run, the sbatch script and the Kubernetes pods
carry the same NCCL debug / flight recorder / watchdog variables with the same values (the local
run once lacked the flight recorder's buffer size and the heartbeat timeout)."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from launcher.backends.local import LocalBackend
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from launcher.render.k8s import render_k8s
from launcher.render.sbatch import render_slurm
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.unit

RUN = "/runs/diag-job"
#: what every backend must set for these diagnostics settings (written out, not derived from the code)
EXPECTED = {
    "NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "INIT,COLL", "NCCL_DEBUG_FILE": f"{RUN}/logs/nccl/%h.%p.log",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_FR_BUFFER_SIZE": "4000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{RUN}/logs/flight/rank_", "TORCH_FR_DUMP_TEMP_FILE": f"{RUN}/logs/flight/rank_",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900",
    "NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0",
}


def spec_plan(**diag):
    d = yaml.safe_load((EXAMPLES / "tiny-slurm.yaml").read_text())
    d["backend"]["env"] = {"OMP_NUM_THREADS": "1"}
    d["backend"]["k8s"] = {"image": "registry.example/launch4d:0.1.0"}
    d["diagnostics"] = {"nccl_debug": "TRACE", "nccl_debug_subsys": "INIT,COLL", "flight_recorder_entries": 4000,
                        "collective_timeout_s": 900, "socket_ifname": "eth1", "ib_hca": "mlx5_0", **diag}
    spec = spec_from_dict(d, source="job.yaml")
    return spec, plan_job(spec).best


def local_env(spec, plan) -> dict[str, str]:
    return LocalBackend().env(spec, plan, Path(RUN))


def sbatch_env(spec, plan) -> dict[str, str]:
    script = render_slurm(spec, plan, RUN).files["train.sbatch"]
    out = {}
    for line in script.splitlines():
        if line.startswith("export ") and "=" in line and " " not in line[7:].split("=", 1)[0]:
            for word in shlex.split(line[7:]):
                key, _, value = word.partition("=")
                out[key] = value
    return out


def k8s_env(spec, plan) -> dict[str, str]:
    """The trainer's env: a TrainJob's spec.trainer.env, or every PyTorchJob pytorch container's."""
    docs = list(yaml.safe_load_all(render_k8s(spec, plan, RUN).files["manifest.yaml"]))
    envs = [e for d in docs for e in _envs(d)]
    assert envs and all(e == envs[0] for e in envs)
    names = [e["name"] for e in envs[0]]
    assert len(names) == len(set(names)), names                  # no variable set twice in a pod
    return {e["name"]: e["value"] for e in envs[0] if "value" in e}


def _envs(node):
    if isinstance(node, dict):
        if node.get("env") and ("image" in node or "numNodes" in node):  # a container, or a TrainJob's trainer
            yield node["env"]
        for v in node.values():
            yield from _envs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _envs(v)


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_every_backend_sets_the_same_diagnostics(api):
    spec, plan = spec_plan()
    spec = replace(spec, backend=replace(spec.backend, k8s=replace(spec.backend.k8s, api=api)))
    renderings = {"local": local_env(spec, plan), "sbatch": sbatch_env(spec, plan), "k8s": k8s_env(spec, plan)}
    for name, env in renderings.items():
        assert {k: env.get(k) for k in EXPECTED} == EXPECTED, name


def test_switched_off_diagnostics_are_off_everywhere():
    spec, plan = spec_plan(nccl_debug="off", flight_recorder=False, socket_ifname=None, ib_hca=None)
    off = ("NCCL_DEBUG", "NCCL_DEBUG_FILE", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
           "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    for env in (local_env(spec, plan), sbatch_env(spec, plan), k8s_env(spec, plan)):
        assert [k for k in off if k in env] == []
        assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "900" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_the_job_env_has_the_last_word_everywhere():
    spec, plan = spec_plan()
    spec = replace(spec, backend=replace(spec.backend, env={"NCCL_DEBUG": "WARN"}))
    for env in (local_env(spec, plan), sbatch_env(spec, plan), k8s_env(spec, plan)):
        assert env["NCCL_DEBUG"] == "WARN"


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_every_backend_puts_the_plan_in_the_environment(api):
    """The LAUNCH4D_* layout variables (what a train.entrypoint script reads) are the same in every backend,
    and the deprecated TORCH_NCCL_TRACE_BUFFER_SIZE (torch >= 2.13 warns on every rank) is set nowhere."""
    spec, plan = spec_plan()
    spec = replace(spec, backend=replace(spec.backend, k8s=replace(spec.backend.k8s, api=api)))
    lay = plan.layout
    expected = {"LAUNCH4D_TP": str(lay.tp), "LAUNCH4D_CP": str(lay.cp), "LAUNCH4D_PP": str(lay.pp),
                "LAUNCH4D_DP": str(lay.dp), "LAUNCH4D_EP": str(lay.ep), "LAUNCH4D_ZERO": str(lay.zero),
                "LAUNCH4D_MICRO_BATCH": str(lay.micro_batch), "LAUNCH4D_GRAD_ACCUM": str(lay.grad_accum),
                "LAUNCH4D_MESH_ORDER": ",".join(plan.mesh_order), "LAUNCH4D_SEQ_LEN": str(plan.train.seq_len),
                "LAUNCH4D_STEP_TIMEOUT_S": "900"}
    for name, env in {"local": local_env(spec, plan), "sbatch": sbatch_env(spec, plan),
                      "k8s": k8s_env(spec, plan)}.items():
        assert {k: env.get(k) for k in expected} == expected, name
        assert env["LAUNCH4D_PLAN"].endswith("/plan.json") and "LAUNCH4D_RESUME" not in env, name  # bundled trainer
        assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env, name
