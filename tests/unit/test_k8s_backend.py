"""Kubernetes backend against recorded API responses (no API server can run on this machine).

The real kubernetes client is used end to end: only its urllib3 pool manager is replaced by a
table of (method, path) -> (HTTP status, JSON body). The bodies are shaped like the API server's
and the training operator's: `Status` objects (kind/status/message/reason/details/code) for
errors, the created object echoed back with metadata.uid for POSTs, the PyTorchJob's `status`
with the conditions and replicaStatuses the operator writes (JobCondition: type, status, reason,
message, lastUpdateTime, lastTransitionTime), and PodList items with the operator's
`training.kubeflow.org/*` labels. Every request the client makes is recorded and checked.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import urllib3
import yaml
from click.testing import CliRunner

from launcher.cli import cli
from tests.conftest import EXAMPLES, spec_file

pytestmark = pytest.mark.unit

NS, NAME = "training", "tiny-k8s"
JOBS = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
PODS = f"/api/v1/namespaces/{NS}/pods"


def status_obj(code: int, reason: str, message: str, kind: str, name: str, group: str | None = None) -> dict:
    details = {"name": name, "kind": kind}
    if group:
        details["group"] = group
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details, "code": code}


def condition(type_: str, status: str, reason: str, message: str) -> dict:
    t = "2026-11-29T10:00:00Z"
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastUpdateTime": t, "lastTransitionTime": t}


def pod(name: str, rtype: str, index: int, phase: str, restarts: int = 0) -> dict:
    return {"metadata": {"name": name, "namespace": NS,
                         "labels": {"training.kubeflow.org/job-name": NAME, "training.kubeflow.org/replica-type": rtype,
                                    "training.kubeflow.org/replica-index": str(index), "launch4d/job": NAME}},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "pytorch", "ready": phase == "Running", "restartCount": restarts,
                 "image": "ghcr.io/example/launch4d:0.1.0", "imageID": "ghcr.io/example/launch4d@sha256:" + "0" * 64,
                 "state": {"running": {"startedAt": "2026-11-29T10:00:05Z"}}}]}}


class FakeApi:
    """Stands in for urllib3's PoolManager under the real kubernetes ApiClient."""

    def __init__(self, routes: list[tuple[str, str, int, object]]):
        self.routes = routes
        self.calls: list[tuple[str, str, dict, object]] = []

    def request(self, method, url, body=None, fields=None, timeout=None, headers=None, preload_content=True, **_):
        u = urlparse(url)
        sent = json.loads(body) if isinstance(body, str) and body else body
        self.calls.append((method, u.path, parse_qs(u.query), sent))
        for m, rx, code, payload in self.routes:
            if m == method and re.fullmatch(rx, u.path):
                if isinstance(payload, Exception):
                    raise payload
                data = payload if isinstance(payload, bytes) else json.dumps(
                    payload(sent) if callable(payload) else payload).encode()
                ctype = "text/plain" if isinstance(payload, bytes) else "application/json"
                return urllib3.HTTPResponse(body=io.BytesIO(data), status=code, headers={"Content-Type": ctype},
                                            preload_content=False, reason="")
        return urllib3.HTTPResponse(body=io.BytesIO(json.dumps(status_obj(404, "NotFound", "the server could not "
                                    "find the requested resource", "", "")).encode()), status=404,
                                    headers={"Content-Type": "application/json"}, preload_content=False)

    def clear(self):
        pass

    def methods(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p, _, _ in self.calls]


def echo_created(body: dict) -> dict:
    out = json.loads(json.dumps(body))
    out["metadata"].update(uid="9b2f3c1e-0d5a-4c61-9b7e-2f7d5d1c0a11", resourceVersion="1234", generation=1,
                           creationTimestamp="2026-11-29T10:00:00Z")
    return out


@pytest.fixture
def k8s(monkeypatch, tmp_path):
    return install_fake(monkeypatch, tmp_path)


def install_fake(monkeypatch, tmp_path):
    """Install a FakeApi behind the client the backend builds; returns a function to set routes."""
    from kubernetes import client

    import launcher.backends.kubernetes as kb

    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    holder = {}

    def install(routes):
        api = FakeApi(routes)
        cfg = client.Configuration(host="https://k8s.test:6443")
        ac = client.ApiClient(cfg)
        ac.rest_client.pool_manager = api  # type: ignore[assignment]  # answers as urllib3's pool would
        monkeypatch.setattr(kb, "load_api_client", lambda *a, **k: ac)
        holder["api"] = api
        return api

    return install


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_error_line(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


SUBMIT_OK = [("POST", CMS, 201, echo_created), ("POST", JOBS, 201, echo_created),
             ("PATCH", f"{CMS}/{NAME}-plan", 200, {"kind": "ConfigMap", "apiVersion": "v1",
                                                   "metadata": {"name": f"{NAME}-plan", "namespace": NS}})]


def test_submit_creates_configmap_then_pytorchjob_then_owner_reference(k8s):
    api = k8s(SUBMIT_OK)
    res = run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert (out["id"], out["namespace"], out["backend"]) == (NAME, NS, "k8s")
    assert api.methods() == [("POST", CMS), ("POST", JOBS), ("PATCH", f"{CMS}/{NAME}-plan")]
    cm, job, patch = (c[3] for c in api.calls)
    assert cm["kind"] == "ConfigMap" and json.loads(cm["data"]["plan.json"])["world_size"] == 4
    assert job["kind"] == "PyTorchJob" and job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    owner = patch["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("PyTorchJob", NAME, "9b2f3c1e-0d5a-4c61-9b7e-2f7d5d1c0a11")
    # what went over the wire is what `launch render` prints, and it satisfies the CRD schema
    import jsonschema

    crd = yaml.safe_load(spec_file("kubeflow.org_pytorchjobs.yaml").read_text())
    jsonschema.validate(job, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    rendered = list(yaml.safe_load_all(run("render", EXAMPLES / "tiny-k8s-pytorchjob.yaml").output))
    assert rendered == [cm, job]


def test_dry_run_sends_nothing(k8s):
    api = k8s(SUBMIT_OK)
    res = run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml", "--dry-run")
    assert res.exit_code == 0 and "kind: PyTorchJob" in res.output and api.calls == []


def test_job_409_is_already_exists_and_the_configmap_is_removed_again(k8s):
    api = k8s([("POST", CMS, 201, echo_created),
               ("POST", JOBS, 409, status_obj(409, "AlreadyExists", f'pytorchjobs.kubeflow.org "{NAME}" already exists',
                                              "pytorchjobs", NAME, "kubeflow.org")),
               ("DELETE", f"{CMS}/{NAME}-plan", 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})])
    msg = one_error_line(run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml"))
    assert f"PyTorchJob {NS}/{NAME} already exists" in msg
    assert api.methods() == [("POST", CMS), ("POST", JOBS), ("DELETE", f"{CMS}/{NAME}-plan")]
    assert "not known" in run("status", NAME).output          # nothing recorded


def test_configmap_409_creates_nothing(k8s):
    api = k8s([("POST", CMS, 409, status_obj(409, "AlreadyExists", f'configmaps "{NAME}-plan" already exists',
                                             "configmaps", f"{NAME}-plan"))])
    msg = one_error_line(run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml"))
    assert f"ConfigMap {NS}/{NAME}-plan already exists" in msg
    assert api.methods() == [("POST", CMS)]


def test_missing_crd_and_forbidden(k8s):
    k8s([("POST", CMS, 201, echo_created), ("DELETE", f"{CMS}/{NAME}-plan", 200, {})])   # POST pytorchjobs -> 404
    assert "CRD (kubeflow.org/v1) is not installed" in one_error_line(run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml"))
    k8s([("POST", CMS, 403, status_obj(403, "Forbidden", 'configmaps is forbidden: User "dev" cannot create '
                                       'resource "configmaps" in API group "" in the namespace "training"',
                                       "configmaps", ""))])
    assert "not allowed" in one_error_line(run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml"))


def test_unreachable_api_server(k8s):
    api = k8s([("POST", CMS, 0, urllib3.exceptions.MaxRetryError(None, CMS, "Connection refused"))])  # type: ignore[arg-type]
    msg = one_error_line(run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml"))
    assert "cannot reach the Kubernetes API" in msg and api.methods() == [("POST", CMS)]


def test_no_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    msg = one_error_line(run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml"))
    assert "no Kubernetes credentials" in msg


def _submitted(k8s):
    k8s(SUBMIT_OK)
    assert run("submit", EXAMPLES / "tiny-k8s-pytorchjob.yaml").exit_code == 0


def job_with(conditions: list[dict], replicas: dict) -> dict:
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": NAME, "namespace": NS},
            "spec": {}, "status": {"conditions": conditions, "replicaStatuses": replicas,
                                   "startTime": "2026-11-29T10:00:01Z"}}


def test_status_running_then_succeeded(k8s):
    _submitted(k8s)
    created = condition("Created", "True", "PyTorchJobCreated", f"PyTorchJob {NAME} is created.")
    running = condition("Running", "True", "PyTorchJobRunning", f"PyTorchJob {NS}/{NAME} is running.")
    pods: dict[str, Any] = {"kind": "PodList", "apiVersion": "v1", "metadata": {},
                            "items": [pod(f"{NAME}-master-0", "master", 0, "Running"), pod(f"{NAME}-worker-0", "worker", 0, "Running", 1)]}
    api = k8s([("GET", f"{JOBS}/{NAME}", 200, job_with([created, running], {"Master": {"active": 1},
                                                                            "Worker": {"active": 1}})),
               ("GET", PODS, 200, pods)])
    st = json.loads(run("status", NAME, "--json").output)
    assert (st["state"], st["condition"], st["done"], st["restarts"]) == ("RUNNING", "Running", False, 1)
    assert st["pods"] == {f"{NAME}-master-0": "Running", f"{NAME}-worker-0": "Running"}
    assert parse_qs(urlparse("?" + "&".join(f"{k}={v[0]}" for k, v in api.calls[1][2].items())).query)[
        "labelSelector"] == [f"training.kubeflow.org/job-name={NAME}"]

    done = dict(running, status="False")
    ok = condition("Succeeded", "True", "PyTorchJobSucceeded", f"PyTorchJob {NS}/{NAME} successfully completed.")
    for p in pods["items"]:
        p["status"]["phase"] = "Succeeded"
    k8s([("GET", f"{JOBS}/{NAME}", 200, job_with([created, done, ok], {"Master": {"succeeded": 1},
                                                                       "Worker": {"succeeded": 1}})),
         ("GET", PODS, 200, pods)])
    res = run("status", NAME, "--wait", "--json")
    st = json.loads(res.output)
    assert res.exit_code == 0 and (st["state"], st["done"]) == ("SUCCEEDED", True)
    assert "successfully completed" in st["detail"]


def test_logs_of_one_rank_come_from_its_pod(k8s):
    _submitted(k8s)
    log = b"[rank2]: hello from rank 2\n[rank3]: step 1/6 | loss 5.5\n[rank3]: step 2/6 | loss 5.4\ntorchrun line\n"
    api = k8s([("GET", f"{PODS}/{NAME}-worker-0/log", 200, log)])
    res = run("logs", NAME, "--rank", "3", "--json")
    assert json.loads(res.output)["lines"] == ["step 1/6 | loss 5.5", "step 2/6 | loss 5.4"]
    assert api.calls[0][2]["container"] == ["pytorch"]
    assert "--rank 9" in one_error_line(run("logs", NAME, "--rank", "9"))


def test_cancel_deletes_job_and_configmap(k8s):
    _submitted(k8s)
    api = k8s([("DELETE", f"{JOBS}/{NAME}", 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}),
               ("DELETE", f"{CMS}/{NAME}-plan", 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})])
    res = run("cancel", NAME, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["cancelled"]
    assert api.methods() == [("DELETE", f"{JOBS}/{NAME}"), ("DELETE", f"{CMS}/{NAME}-plan")]
    _, _, query, body = api.calls[0]
    assert query.get("propagationPolicy") == ["Foreground"] or (body or {}).get("propagationPolicy") == "Foreground"
    api = k8s([])   # everything 404 now: cancelling again is not an error (idempotent)
    res = run("cancel", NAME, "--json")
    assert res.exit_code == 0, res.output
    assert api.methods() == [("DELETE", f"{JOBS}/{NAME}"), ("DELETE", f"{CMS}/{NAME}-plan")]


def test_kubeconfig_and_context_are_honoured(tmp_path):
    from launcher.backends.kubernetes import load_api_client
    from launcher.errors import UserError

    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "a",
           "clusters": [{"name": "ca", "cluster": {"server": "https://a.example:6443"}},
                        {"name": "cb", "cluster": {"server": "https://b.example:6443"}}],
           "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
           "contexts": [{"name": "a", "context": {"cluster": "ca", "user": "u"}},
                        {"name": "b", "context": {"cluster": "cb", "user": "u", "namespace": "training"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    assert load_api_client(str(path)).configuration.host == "https://a.example:6443"
    assert load_api_client(str(path), "b").configuration.host == "https://b.example:6443"
    with pytest.raises(UserError, match="context nope"):
        load_api_client(str(path), "nope")


def pod_done(body: object = None, exit_code: int = 0) -> dict:
    """A lone pod as the API reads it back once its container has exited."""
    return {"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p", "namespace": NS},
            "status": {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [
                {"name": "check", "ready": False, "restartCount": 0, "image": "i", "imageID": "i",
                 "state": {"terminated": {"exitCode": exit_code, "reason": "Completed"}}}]}}


def test_preflight_pods_are_submissions_through_the_backend(k8s):
    """`preflight --backend k8s`: each node-check pod is created, read and deleted through the
    Kubernetes backend and recorded, so `launch status|logs|cancel <pod>` reach it."""
    api = k8s([("POST", PODS, 201, echo_created), ("GET", f"{PODS}/[^/]+", 200, pod_done),
               ("GET", f"{PODS}/[^/]+/log", 200, b"no tools here\n"),
               ("DELETE", f"{PODS}/[^/]+", 200, pod_done)])
    res = run("preflight", "--hosts", "gpu01", "--backend", "k8s", "--namespace", NS, "--json")
    created = [c[3] for c in api.calls if c[0] == "POST"]
    assert created and all(p["kind"] == "Pod" and p["spec"]["nodeName"] == "gpu01" for p in created), res.output
    names = [p["metadata"]["name"] for p in created]
    assert [c[1] for c in api.calls if c[0] == "DELETE"] == [f"{PODS}/{n}" for n in names]   # each read, then deleted
    listed = json.loads(run("jobs", "--json").output)
    rows = listed if isinstance(listed, list) else listed["jobs"]
    assert {r["id"] for r in rows if r["backend"] == "k8s"} == set(names)
    pod_name = names[0]
    res = run("status", pod_name, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["state"] == "SUCCEEDED", res.output
    res = run("logs", pod_name)
    assert res.exit_code == 0 and "no tools here" in res.output, res.output
    api = k8s([])   # gone: cancel is no error, status says so
    res = run("cancel", pod_name, "--json")
    assert res.exit_code == 0 and not json.loads(res.output)["cancelled"], res.output
    assert api.methods() == [("DELETE", f"{PODS}/{pod_name}")]
