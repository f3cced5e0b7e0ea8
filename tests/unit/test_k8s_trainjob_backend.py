"""TrainJob submit/status/logs/cancel against recorded API responses (no API server can run here).

The real kubernetes client runs end to end over tests/unit/test_k8s_backend.py's FakeApi (its urllib3
pool manager replaced by a table of (method, path) -> (HTTP status, JSON body)). The bodies are
shaped like the real API's: the created object echoed with metadata.uid; the TrainJob `status` as
Trainer v2 writes it (metav1.Condition: type, status, reason, message, lastTransitionTime; types
Suspended/Created/Complete/Failed with Trainer's reasons Suspended/Resumed/JobsCreationSucceeded
and JobSet's AllJobsCompleted/ReachedMaxRestarts; `jobsStatus` per replicatedJob); the child
JobSet's `status.restarts`; Pods of an Indexed Job with the labels JobSet and the Job controller
set (jobset.sigs.k8s.io/jobset-name, batch.kubernetes.io/job-completion-index) and the random
name suffix; API `Status` objects for errors.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import EXAMPLES
from tests.unit.test_k8s_backend import (
    CMS,
    NAME,
    NS,
    PODS,
    echo_created,
    install_fake,
    one_error_line,
    run,
    status_obj,
)

pytestmark = pytest.mark.unit

TRAINER = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}"
TJ, RT = f"{TRAINER}/trainjobs", f"{TRAINER}/trainingruntimes"
JOBSET = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/{NAME}"
OK = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
SUBMIT_OK = [("POST", CMS, 201, echo_created), ("POST", RT, 201, echo_created), ("POST", TJ, 201, echo_created),
             ("PATCH", f"{CMS}/{NAME}-plan", 200, echo_created),
             ("PATCH", f"{RT}/{NAME}-runtime", 200, echo_created)]


@pytest.fixture
def k8s(monkeypatch, tmp_path):
    return install_fake(monkeypatch, tmp_path)


def cond(type_: str, status: str, reason: str, message: str) -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-11-29T10:00:00Z"}


def trainjob(conditions: list[dict], jobs: list[dict] | None = None) -> dict:
    st: dict = {"conditions": conditions}
    if jobs is not None:
        st["jobsStatus"] = jobs
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": NAME, "namespace": NS, "uid": "9b2f3c1e-0d5a-4c61-9b7e-2f7d5d1c0a11"},
            "spec": {}, "status": st}


def jobset(restarts: int) -> dict:
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": NAME, "namespace": NS},
            "status": {"restarts": restarts, "replicatedJobsStatus": [
                {"name": "node", "ready": 1, "succeeded": 0, "failed": 0, "active": 1, "suspended": 0}]}}


def pod(index: int, suffix: str, phase: str, created: str, restarts: int = 0) -> dict:
    return {"metadata": {"name": f"{NAME}-node-0-{index}-{suffix}", "namespace": NS,
                         "creationTimestamp": created,
                         "labels": {"jobset.sigs.k8s.io/jobset-name": NAME,
                                    "jobset.sigs.k8s.io/replicatedjob-name": "node",
                                    "jobset.sigs.k8s.io/job-index": "0",
                                    "batch.kubernetes.io/job-completion-index": str(index),
                                    "job-name": f"{NAME}-node-0", "launch4d/job": NAME}},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "node", "ready": phase == "Running", "restartCount": restarts,
                 "image": "ghcr.io/example/launch4d:0.1.0", "imageID": "ghcr.io/example/launch4d@sha256:" + "0" * 64,
                 "state": {"running": {"startedAt": "2026-11-29T10:00:05Z"}}}]}}


def podlist(*items: dict) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(items)}


def submitted(k8s):
    api = k8s(SUBMIT_OK)
    res = run("submit", EXAMPLES / "tiny-k8s.yaml", "--json")
    assert res.exit_code == 0, res.output
    return api, json.loads(res.output)


def test_submit_creates_configmap_runtime_trainjob_then_owner_references(k8s):
    api, out = submitted(k8s)
    assert (out["id"], out["namespace"]) == (NAME, NS)
    assert api.methods() == [("POST", CMS), ("POST", RT), ("POST", TJ), ("PATCH", f"{CMS}/{NAME}-plan"),
                             ("PATCH", f"{RT}/{NAME}-runtime")]
    sent = {path: body for m, path, _, body in api.calls if m == "POST"}
    assert sent[TJ]["kind"] == "TrainJob" and sent[TJ]["spec"]["suspend"] is True
    assert sent[RT]["kind"] == "TrainingRuntime"
    owner = api.calls[3][3]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["apiVersion"]) == ("TrainJob", NAME, "trainer.kubeflow.org/v1alpha1")
    assert api.calls[4][3] == api.calls[3][3]
    assert sent[TJ] == [d for d in yaml.safe_load_all(run("render", EXAMPLES / "tiny-k8s.yaml").output) if d][-1]


def test_trainjob_rejected_undoes_runtime_and_configmap(k8s):
    api = k8s([("POST", CMS, 201, echo_created), ("POST", RT, 201, echo_created),
               ("POST", TJ, 422, status_obj(422, "Invalid", 'TrainJob.trainer.kubeflow.org "tiny-k8s" is invalid: '
                                                             "spec.trainer.numNodes: Invalid value", "TrainJob", NAME,
                                             "trainer.kubeflow.org")),
               ("DELETE", f"{RT}/{NAME}-runtime", 200, OK), ("DELETE", f"{CMS}/{NAME}-plan", 200, OK)])
    msg = one_error_line(run("submit", EXAMPLES / "tiny-k8s.yaml"))
    assert "TrainJob training/tiny-k8s: API answered 422" in msg
    assert api.methods()[-2:] == [("DELETE", f"{RT}/{NAME}-runtime"), ("DELETE", f"{CMS}/{NAME}-plan")]


def test_trainer_not_installed(k8s):
    k8s([("POST", CMS, 201, echo_created), ("DELETE", f"{CMS}/{NAME}-plan", 200, OK)])  # the rest: 404
    assert "the TrainingRuntime CRD (trainer.kubeflow.org/v1alpha1) is not installed" in one_error_line(
        run("submit", EXAMPLES / "tiny-k8s.yaml"))


def test_status_suspended_running_restarted_complete(k8s):
    submitted(k8s)
    suspended = cond("Suspended", "True", "Suspended", "TrainJob is suspended")
    k8s([("GET", f"{TJ}/{NAME}", 200, trainjob([suspended])), ("GET", PODS, 200, podlist()),
         ("GET", JOBSET, 404, status_obj(404, "NotFound", f'jobsets.jobset.x-k8s.io "{NAME}" not found', "jobsets",
                                         NAME, "jobset.x-k8s.io"))])
    st = json.loads(run("status", NAME, "--json").output)
    assert (st["state"], st["condition"], st["done"], st["detail"]) == ("PENDING", "Suspended", False,
                                                                        "TrainJob is suspended")
    resumed = cond("Suspended", "False", "Resumed", "TrainJob is resumed")
    created = cond("Created", "True", "JobsCreationSucceeded", "Succeeded to create Jobs")
    jobs = [{"name": "node", "ready": 1, "succeeded": 0, "failed": 0, "active": 1, "suspended": 0}]
    api = k8s([("GET", f"{TJ}/{NAME}", 200, trainjob([resumed, created], jobs)),
               ("GET", PODS, 200, podlist(pod(0, "x7k2p", "Running", "2026-11-29T10:05:00Z", 1),
                                          pod(1, "q9v4m", "Running", "2026-11-29T10:05:00Z"))),
               ("GET", JOBSET, 200, jobset(2))])
    st = json.loads(run("status", NAME, "--json").output)
    assert (st["state"], st["condition"], st["restarts"]) == ("RUNNING", "Running", 3)   # 2 gang + 1 container
    assert st["replica_statuses"]["node"]["active"] == 1
    assert set(st["pods"]) == {f"{NAME}-node-0-0-x7k2p", f"{NAME}-node-0-1-q9v4m"}
    assert api.calls[1][2]["labelSelector"] == [f"jobset.sigs.k8s.io/jobset-name={NAME}"]
    done = cond("Complete", "True", "AllJobsCompleted", "jobset completed successfully")
    k8s([("GET", f"{TJ}/{NAME}", 200, trainjob([resumed, created, done])), ("GET", PODS, 200, podlist()),
         ("GET", JOBSET, 200, jobset(2))])
    res = run("status", NAME, "--wait", "--json")
    st = json.loads(res.output)
    assert res.exit_code == 0 and (st["state"], st["done"]) == ("SUCCEEDED", True)


def test_status_failed_after_max_restarts(k8s):
    submitted(k8s)
    failed = cond("Failed", "True", "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
    k8s([("GET", f"{TJ}/{NAME}", 200, trainjob([failed])), ("GET", PODS, 200, podlist()),
         ("GET", JOBSET, 200, jobset(3))])
    st = json.loads(run("status", NAME, "--json").output)
    assert (st["state"], st["restarts"], st["done"]) == ("FAILED", 3, True)
    assert "max number of restarts" in st["detail"]


def test_logs_come_from_the_newest_pod_of_the_node_rank(k8s):
    submitted(k8s)
    log = b"[rank2]: hello from rank 2\n[rank3]: step 1/6 | loss 5.5\ntorchrun line\n"
    api = k8s([("GET", PODS, 200, podlist(pod(0, "a1b2c", "Running", "2026-11-29T10:05:00Z"),
                                          pod(1, "old00", "Failed", "2026-11-29T10:00:00Z"),
                                          pod(1, "q9v4m", "Running", "2026-11-29T10:05:00Z"))),
               ("GET", f"{PODS}/{NAME}-node-0-1-q9v4m/log", 200, log)])
    res = run("logs", NAME, "--rank", "3", "--json")
    assert json.loads(res.output)["lines"] == ["step 1/6 | loss 5.5"]
    assert api.calls[-1][2]["container"] == ["node"]
    k8s([("GET", PODS, 200, podlist())])
    assert "no pod yet for node 1" in one_error_line(run("logs", NAME, "--rank", "2"))


def test_cancel_deletes_trainjob_runtime_configmap_and_is_idempotent(k8s):
    submitted(k8s)
    api = k8s([("DELETE", f"{TJ}/{NAME}", 200, OK), ("DELETE", f"{RT}/{NAME}-runtime", 200, OK),
               ("DELETE", f"{CMS}/{NAME}-plan", 200, OK)])
    res = run("cancel", NAME, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["cancelled"]
    assert api.methods() == [("DELETE", f"{TJ}/{NAME}"), ("DELETE", f"{RT}/{NAME}-runtime"),
                             ("DELETE", f"{CMS}/{NAME}-plan")]
    _, _, query, body = api.calls[0]
    assert query.get("propagationPolicy") == ["Foreground"] or (body or {}).get("propagationPolicy") == "Foreground"
    api = k8s([])   # all gone: 404 everywhere
    assert run("cancel", NAME).exit_code == 0
    assert api.methods()[0] == ("DELETE", f"{TJ}/{NAME}")
