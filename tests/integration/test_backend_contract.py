"""One contract, three backends: the same tests run against local (real processes on this machine),
Slurm (the real 2-node Slurm of tests/services/slurm.py) and Kubernetes (the real kubernetes client
against recorded API-shaped responses: no API server runs here, see tests/unit/test_k8s_backend.py).

What every backend promises (launcher.backends.Backend):
- dryrun() is inspectable (command, files, text, JSON) and has no side effect: nothing written,
  started or sent;
- submit -> describe -> log_iter (rank filter, since, follow) -> wait, and cancel of an ended job
  says so (False) without an error;
- cancel of a running job stops it, and cancelling again is fine;
- describe of a job the backend never had is None (and wait on it returns at once).

The jobs are small stand-ins for the trainer, put into the request a dryrun made (a request is
data: torchx's dry-run info works the same way): two "ranks" printing one line each. The trainer
itself runs through these same backends in test_run_cmd.py and test_slurm_e2e.py.
"""

from __future__ import annotations

import io
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import urllib3
import yaml

from launcher.backends import CANCELLED, PENDING, RUNNING, SUCCEEDED, Backend, Request, procs
from launcher.formats.jobs import JobRecord
from tests.conftest import EXAMPLES
from tests.plan_helpers import chosen
from tests.services.slurm import slurm_cluster  # noqa: F401  (session fixture)

pytestmark = pytest.mark.integration

QUICK = "echo '[rank0]: hello from rank 0'; echo '[rank1]: hello from rank 1'; echo 'a line of no rank'"


# --- harnesses: how each backend gets a job and what "a side effect" means there ----------------
class LocalHarness:
    """Real processes: the request's torchrun command becomes a shell standing in for it."""

    kind = "local"

    def __init__(self, tmp_path: Path):
        from launcher.backends.local import LocalBackend
        from launcher.plan.planner import plan_job
        from launcher.plan.spec import load_spec

        self.tmp = tmp_path
        self.backend: Backend = LocalBackend()
        self.spec = load_spec(EXAMPLES / "tiny-cpu.yaml")
        self.plan = chosen(plan_job(self.spec))

    def run_dir(self, name: str) -> Path:
        return self.tmp / name

    def job(self, req: Request, body: str) -> Request:
        req.extra["argv"] = ["bash", "-c", body]
        return req

    def quick(self, req: Request) -> Request:
        return self.job(req, QUICK + "; sleep 1")

    def long(self, req: Request) -> Request:
        return self.job(req, "echo '[rank0]: started'; sleep 600")

    def traces(self, req: Request) -> Any:
        return Path(req.run_dir).exists(), procs.marked(("LAUNCH4D_RUN_DIR", req.run_dir))

    def unknown(self) -> JobRecord:
        return JobRecord("local", "local-4194304", "nope", str(self.tmp / "never"),
                         extra={"pid": 4194304, "marker": "never-submitted"})

    def running(self, st) -> bool:
        return st is not None and st.state == RUNNING

    def close(self) -> None:
        pass


class SlurmHarness:
    """The real test Slurm: the rendered script's #SBATCH header, with a small srun step as its body."""

    kind = "slurm"

    def __init__(self, tmp_path: Path, cluster):
        from launcher.backends.slurm import SlurmBackend
        from launcher.plan.planner import plan_job
        from launcher.plan.spec import spec_from_dict

        self.tmp, self.cluster = tmp_path, cluster
        d = yaml.safe_load((EXAMPLES / "tiny-slurm.yaml").read_text())
        d["backend"]["log_dir"] = str(tmp_path / "runs")
        d["backend"]["slurm"]["python"] = sys.executable
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            d["backend"]["slurm"]["master_port"] = s.getsockname()[1]
        self.spec = spec_from_dict(d)
        self.plan = chosen(plan_job(self.spec))
        self.backend = SlurmBackend()
        self.submitted: list[str] = []

    def run_dir(self, name: str) -> Path:
        return self.tmp / "runs" / name

    def job(self, req: Request, body: str) -> Request:
        head = [ln for ln in req.files["train.sbatch"].splitlines() if ln.startswith(("#!", "#SBATCH"))]
        req.files["train.sbatch"] = "\n".join([*head, body, ""])
        return req

    def quick(self, req: Request) -> Request:
        return self.job(req, "srun --label --nodes=2 --ntasks-per-node=1 bash -c "
                             "'echo \"[rank$SLURM_PROCID]: hello from rank $SLURM_PROCID\"'\necho 'a line of no rank'")

    def long(self, req: Request) -> Request:
        return self.job(req, "srun --label --nodes=2 --ntasks-per-node=1 bash -c "
                             "'echo \"[rank$SLURM_PROCID]: started\"; sleep 600'")

    def traces(self, req: Request) -> Any:
        jobs = self.cluster.run("squeue", "-h", "-t", "all", "-o", "%i").stdout.split()
        return Path(req.run_dir).exists(), sorted(jobs)

    def unknown(self) -> JobRecord:
        return JobRecord("slurm", "999999", "nope", str(self.tmp / "never"), extra={})

    def running(self, st) -> bool:
        return st is not None and st.state == RUNNING

    def close(self) -> None:
        for jid in self.submitted:
            self.cluster.run("scancel", jid, check=False)


NS, NAME = "training", "tiny-k8s"
JOBS = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
PODS = f"/api/v1/namespaces/{NS}/pods"


class RecordedCluster:
    """Stands in for urllib3's PoolManager under the real kubernetes ApiClient, answering as the API
    server and the training operator do (objects echoed with a uid, Status objects for errors,
    PyTorchJob conditions, PodLists with the operator's labels, plain-text pod logs). Keeps the
    objects it was sent, so a deleted job is a 404 afterwards. `script` says what the job does:
    "quick" runs then succeeds (one look at it RUNNING first), "long" runs until deleted."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.script = "quick"
        self.looks = 0

    @staticmethod
    def _reply(code: int, payload: Any) -> urllib3.HTTPResponse:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        ctype = "text/plain" if isinstance(payload, bytes) else "application/json"
        return urllib3.HTTPResponse(body=io.BytesIO(data), status=code, headers={"Content-Type": ctype},
                                    preload_content=False, reason="")

    @staticmethod
    def not_found(kind: str, name: str) -> urllib3.HTTPResponse:
        return RecordedCluster._reply(404, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                            "status": "Failure", "message": f'{kind} "{name}" not found',
                                            "reason": "NotFound", "details": {"name": name, "kind": kind},
                                            "code": 404})

    def _job(self, name: str) -> dict:
        from tests.unit.test_k8s_backend import condition

        job = dict(self.objects[f"{JOBS}/{name}"])
        self.looks += 1
        conds = [condition("Created", "True", "PyTorchJobCreated", f"PyTorchJob {name} is created."),
                 condition("Running", "True", "PyTorchJobRunning", f"PyTorchJob {NS}/{name} is running.")]
        if self.script == "quick" and self.looks > 1:
            conds[-1]["status"] = "False"
            conds.append(condition("Succeeded", "True", "PyTorchJobSucceeded",
                                   f"PyTorchJob {NS}/{name} successfully completed."))
        job["status"] = {"conditions": conds, "replicaStatuses": {}, "startTime": "2026-11-29T10:00:01Z"}
        return job

    def _pods(self, name: str) -> dict:
        from tests.unit.test_k8s_backend import pod

        phase = "Running" if self.script == "long" or self.looks <= 1 else "Succeeded"
        return {"kind": "PodList", "apiVersion": "v1", "metadata": {},
                "items": [pod(f"{name}-master-0", "master", 0, phase), pod(f"{name}-worker-0", "worker", 0, phase)]
                if f"{JOBS}/{name}" in self.objects else []}

    def _log(self, pod_name: str) -> bytes:
        node = 0 if pod_name.endswith("master-0") else 1
        if self.script == "long":
            return f"[rank{2 * node}]: started\n".encode()
        return "".join(f"[rank{r}]: hello from rank {r}\n" for r in (2 * node, 2 * node + 1)).encode() + \
            (b"a line of no rank\n" if node == 0 else b"")

    def request(self, method, url, body=None, fields=None, timeout=None, headers=None, preload_content=True, **_):
        path = urlparse(url).path
        self.calls.append((method, path))
        sent = json.loads(body) if isinstance(body, str) and body else body
        if method == "POST" and path in (CMS, JOBS):
            sent["metadata"].update(uid="9b2f3c1e-0d5a-4c61-9b7e-2f7d5d1c0a11", resourceVersion="1")
            self.objects[f"{path}/{sent['metadata']['name']}"] = sent
            return self._reply(201, sent)
        if method == "PATCH" and path in self.objects:
            return self._reply(200, self.objects[path])
        if method == "DELETE":
            if path not in self.objects:
                return self.not_found(path.split("/")[-2], path.split("/")[-1])
            # foreground deletion: the API server answers with the object, deletionTimestamp set
            gone = self._job(path.split("/")[-1]) if path.startswith(JOBS) else self.objects[path]
            del self.objects[path]
            gone["metadata"] = {**gone["metadata"], "deletionTimestamp": "2026-11-29T10:05:00Z",
                                "finalizers": ["foregroundDeletion"]}
            return self._reply(200, gone)
        if method == "GET" and path.startswith(JOBS + "/"):
            name = path.split("/")[-1]
            return self._reply(200, self._job(name)) if path in self.objects else self.not_found("pytorchjobs", name)
        if method == "GET" and path == PODS:
            return self._reply(200, self._pods(NAME))
        m = re.fullmatch(PODS + r"/([^/]+)/log", path)
        if method == "GET" and m and f"{JOBS}/{NAME}" in self.objects:
            return self._reply(200, self._log(m.group(1)))
        return self.not_found("", path)

    def clear(self) -> None:
        pass


class K8sHarness:
    kind = "k8s"

    def __init__(self, tmp_path: Path, monkeypatch):
        from kubernetes import client

        import launcher.backends.kubernetes as kb
        from launcher.plan.planner import plan_job
        from launcher.plan.spec import load_spec

        self.tmp = tmp_path
        self.api = RecordedCluster()
        built: list[int] = []

        def load(*a, **k):
            built.append(1)
            ac = client.ApiClient(client.Configuration(host="https://k8s.test:6443"))
            ac.rest_client.pool_manager = self.api  # type: ignore[assignment]  # recorded responses in urllib3's place
            return ac

        monkeypatch.setattr(kb, "load_api_client", load)
        self.built = built
        self.backend = kb.KubernetesBackend()
        self.spec = load_spec(EXAMPLES / "tiny-k8s-pytorchjob.yaml")
        self.plan = chosen(plan_job(self.spec))

    def run_dir(self, name: str) -> Path:
        return self.tmp / name

    def quick(self, req: Request) -> Request:
        self.api.script, self.api.looks = "quick", 0
        return req

    def long(self, req: Request) -> Request:
        self.api.script, self.api.looks = "long", 0
        return req

    def traces(self, req: Request) -> Any:
        return Path(req.run_dir).exists(), list(self.api.calls), len(self.built)

    def unknown(self) -> JobRecord:
        return JobRecord("k8s", "never-submitted", "nope", str(self.tmp / "never"),
                         extra={"namespace": NS, "kind": "PyTorchJob"})

    def running(self, st) -> bool:
        return st is not None and st.state == RUNNING

    def close(self) -> None:
        pass


@pytest.fixture(params=["local", pytest.param("slurm", marks=pytest.mark.slow), "k8s"])
def harness(request, tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    if request.param == "local":
        h: Any = LocalHarness(tmp_path)
    elif request.param == "slurm":
        h = SlurmHarness(tmp_path, request.getfixturevalue("slurm_cluster"))
    else:
        h = K8sHarness(tmp_path, monkeypatch)
    yield h
    h.close()


def submit(h, req: Request) -> JobRecord:
    handle = h.backend.submit(req)
    if h.kind == "slurm":
        h.submitted.append(handle.id)
    return handle


# --- the contract -------------------------------------------------------------------------------
def test_dryrun_is_inspectable_and_side_effect_free(harness):
    rd = harness.run_dir("dry")
    before = harness.traces(Request(harness.kind, "", str(rd), ""))
    req = harness.backend.dryrun(harness.spec, harness.plan, rd, job_text="name: x\n")
    assert req.backend == harness.backend.name and req.name == harness.spec.name and req.command
    assert req.text().startswith(req.command)
    assert req.main is None or req.files[req.main].strip() in req.text()
    assert json.loads(json.dumps(req.to_dict()))["command"] == req.command
    assert harness.traces(req) == before                               # nothing written, started or sent


def test_dryrun_refuses_an_option_the_backend_does_not_take(harness):
    """Options are typed per backend (Backend.Options): one it does not take, or a value of the wrong
    type, is one line naming it (a UserError: exit 2), never silently ignored; None is not given."""
    from launcher.errors import UserError

    be, rd = harness.backend, harness.run_dir("opts")
    with pytest.raises(UserError, match=rf"^no_such_option: not an option of the {be.name} backend \(its options: "):
        be.dryrun(harness.spec, harness.plan, rd, no_such_option=1)
    assert be.dryrun(harness.spec, harness.plan, rd, no_such_option=None).command
    taken = [f.name for f in __import__("dataclasses").fields(be.Options)]
    with pytest.raises(UserError, match=rf"^{taken[0]}: the {be.name} backend takes "):
        be.dryrun(harness.spec, harness.plan, rd, **{taken[0]: object()})
    other = {"local": "templates", "slurm": "keep_fds", "k8s": "resume"}[harness.kind]
    with pytest.raises(UserError, match=rf"^{other}: not an option of the {be.name} backend"):
        be.dryrun(harness.spec, harness.plan, rd, **{other: "x"})


def test_other_kinds_of_request_go_through_the_interface(harness):
    """What is not a planned job (a preflight's batch script, its pods) is a kind of request the backend
    builds (Backend.request) or refuses in one line; every backend answers tasks() and dump_stacks()."""
    from launcher.errors import UserError
    from launcher.formats.requests import BatchScript, Manifests

    be = harness.backend
    script = BatchScript("pf", str(harness.run_dir("pf")), "preflight.sbatch", "#!/bin/bash\ntrue\n", 1)
    pod = Manifests([{"kind": "Pod", "metadata": {"name": "p", "namespace": "ml"}, "spec": {}}])
    for what, runs in ((script, "slurm"), (pod, "k8s")):
        if harness.kind == runs:
            req = be.request(what)
            assert req.backend == be.name and req.main in req.files and req.command
        else:
            with pytest.raises(UserError, match=rf"^the {be.name} backend cannot run a {type(what).__name__}$"):
                be.request(what)
    h = harness.unknown()
    assert be.tasks(h) == [h]


def test_submit_describe_logs_wait_then_cancel_is_a_no_op(harness):
    be = harness.backend
    req = harness.quick(be.dryrun(harness.spec, harness.plan, harness.run_dir("quick")))
    h = submit(harness, req)
    first = be.describe(h)
    assert first is not None and first.state in (PENDING, RUNNING, SUCCEEDED)
    followed = list(be.log_iter(h, follow=True))                       # until the job ends
    assert any(ln.endswith("hello from rank 0") for ln in followed)
    st = be.wait(h, timeout=300)
    assert (st.state, st.done) == (SUCCEEDED, True)
    lines = list(be.log_iter(h))
    assert any(ln.endswith("hello from rank 1") for ln in lines) and any("a line of no rank" in ln for ln in lines)
    assert list(be.log_iter(h, rank=1)) == ["hello from rank 1"]
    assert list(be.log_iter(h, since=1)) == lines[1:]
    assert be.cancel(h) is False and be.cancel(h) is False             # ended: said so, no error


def test_cancel_a_running_job_then_again(harness):
    be = harness.backend
    h = submit(harness, harness.long(be.dryrun(harness.spec, harness.plan, harness.run_dir("long"))))
    deadline = time.monotonic() + 300
    while not harness.running(be.describe(h)):                         # a generous guard, not a timing
        assert time.monotonic() < deadline, be.describe(h)
        time.sleep(0.5)
    assert be.cancel(h) is True
    st = be.wait(h, timeout=300)
    assert st.state == CANCELLED or be.describe(h) is None            # cancelled, or deleted (Kubernetes)
    assert be.cancel(h) is False


def test_describe_of_an_unknown_job_is_none(harness):
    h = harness.unknown()
    assert harness.backend.describe(h) is None
    st = harness.backend.wait(h, timeout=60)
    assert st.state == "UNKNOWN" and not st.done


def test_no_backend_is_named_in_the_commands_that_drive_them():
    """The CLI talks to the interface: no command module picks code by the backend's kind."""
    for path in sorted((Path(__file__).resolve().parents[2] / "launcher" / "commands").glob("launch_cmds.py")):
        text = path.read_text()
        assert not re.search(r"""(kind|backend)\s*==\s*["'](local|slurm|k8s)["']""", text), path
        assert "from launcher.backends.slurm" not in text and "from launcher.backends.kubernetes" not in text


def test_logs_follow_json_streams_one_object_per_line(tmp_path, monkeypatch):
    """`launch logs -f --json`: NDJSON as the job writes it (here a local job), numbered for --since."""
    from click.testing import CliRunner

    from launcher.cli import cli
    from launcher.commands.local_job import record_job

    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    h = LocalHarness(tmp_path)
    handle = h.backend.submit(h.quick(h.backend.dryrun(h.spec, h.plan, tmp_path / "run")))
    record_job(handle)
    res = CliRunner().invoke(cli, ["logs", handle.id, "-f", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    assert [r["n"] for r in rows] == list(range(len(rows))) and len(rows) == 3
    assert rows[1]["line"] == "[rank1]: hello from rank 1" and rows[0]["id"] == handle.id
    res = CliRunner().invoke(cli, ["logs", handle.id, "-f", "--json", "--since", "2", "--rank", "0"])
    assert res.output == ""                                            # rank 0 has one line, skipped
    res = CliRunner().invoke(cli, ["logs", handle.id, "--json", "--rank", "1"])
    assert json.loads(res.output)["lines"] == ["hello from rank 1"]
