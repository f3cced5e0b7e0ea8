"""Kubernetes backend: a PyTorchJob (kubeflow.org/v1) and its plan ConfigMap, through the API.

Submission creates the ConfigMap, then the PyTorchJob, then points the ConfigMap's
ownerReference at the job so deleting the job collects it. If any step fails, what this call
created is deleted again: nothing is left half-created. 409 Conflict is reported as "already
exists". Status reads the job's conditions (Created/Running/Restarting/Succeeded/Failed/
Suspended) and its pods' phases; logs read the `pytorch` container of the pod that holds the
rank asked for (node 0 = master-0, node i = worker-(i-1)).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.backends import FAILED, PENDING, RUNNING, SUCCEEDED, JobHandle, JobStatus
from launcher.backends.slurm import filter_rank
from launcher.errors import UserError

if TYPE_CHECKING:
    from launcher.plan import Plan
    from launcher.spec import JobSpec

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
JOB_LABEL = "training.kubeflow.org/job-name"     # set by the training operator on every pod
OUR_LABEL = "launch4d/job"                       # set by our pod template
CONDITION_STATE = {"Created": PENDING, "Running": RUNNING, "Restarting": RUNNING,
                   "Suspended": PENDING, "Succeeded": SUCCEEDED, "Failed": FAILED}


@dataclass
class K8sJobStatus(JobStatus):
    """The shared JobStatus plus the PyTorchJob's condition and its pods' phases."""

    condition: str = "Pending"
    pods: dict[str, str | None] = field(default_factory=dict)
    restarts: int | None = None
    replica_statuses: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "done": self.done}


def load_api_client(kubeconfig: str | None = None, context: str | None = None):
    """An ApiClient from a kubeconfig (explicit, $KUBECONFIG or ~/.kube/config), else in-cluster."""
    from kubernetes import client, config

    try:
        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
        return client.ApiClient(cfg)
    except Exception as kube_exc:  # the loader raises ConfigException, TypeError, OSError...
        if kubeconfig or context:
            raise UserError(f"kubeconfig {kubeconfig or '(default)'} context {context or '(current)'}: "
                            f"{kube_exc}") from None
        try:
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except Exception:
            raise UserError("no Kubernetes credentials: no kubeconfig ($KUBECONFIG or ~/.kube/config) and not "
                            "running in a pod (set backend.k8s.kubeconfig / context)") from None


def _api_error(exc: Exception, what: str) -> UserError:
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    message = getattr(exc, "reason", None) or str(exc)
    try:
        message = json.loads(body).get("message", message) if body else message
    except (ValueError, AttributeError):
        pass
    if status == 409:
        return UserError(f"{what} already exists ({message}); cancel it first or rename the job")
    if status == 404 and "could not find the requested resource" in str(message).lower():
        return UserError(f"{what}: the PyTorchJob CRD (kubeflow.org/v1) is not installed in this cluster")
    if status in (401, 403):
        return UserError(f"{what}: not allowed ({message})")
    if status is None:
        return UserError(f"{what}: cannot reach the Kubernetes API ({exc})")
    return UserError(f"{what}: API answered {status} ({message})")


class KubernetesBackend:
    name = "k8s"

    def __init__(self, api_client=None, kubeconfig: str | None = None, context: str | None = None):
        self._api = api_client
        self._kubeconfig, self._context = kubeconfig, context

    def _use(self, extra: dict) -> None:
        """Later commands reach the cluster the job was submitted to (its kubeconfig/context)."""
        if self._api is None and (extra.get("kubeconfig") or extra.get("context")):
            self._kubeconfig, self._context = extra.get("kubeconfig"), extra.get("context")

    @property
    def api(self):
        if self._api is None:
            self._api = load_api_client(self._kubeconfig, self._context)
        return self._api

    def _core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def _custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api)

    # submit -----------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, plan: Plan, run_dir: str | Path | None = None, dry_run: bool = False,
               templates: str | None = None, **options: Any) -> JobHandle:
        """Render the ConfigMap + PyTorchJob and create both (or, for a dry run, only render)."""
        from launcher.render import parse_manifests, render_k8s

        rendered = render_k8s(spec, plan, None, templates)
        configmap, job = parse_manifests(rendered.files["manifest.yaml"])
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        k = spec.backend.k8s
        extra = {"namespace": ns, "configmap": configmap["metadata"]["name"], "gpus_per_node": plan.gpus_per_node,
                 "nodes": plan.nodes, "pod_run_dir": rendered.run_dir, "kubeconfig": k.kubeconfig,
                 "context": k.context}
        if dry_run:
            return JobHandle(self.name, "dry-run", spec.name, str(run_dir or rendered.run_dir), dry_run=True,
                             request=rendered.files["manifest.yaml"], extra=extra)
        self._use(extra)
        uid = self.create(configmap, job)
        extra["uid"] = uid
        return JobHandle(self.name, name, spec.name, str(run_dir or rendered.run_dir),
                         request=rendered.files["manifest.yaml"], extra=extra)

    def create(self, configmap: dict, job: dict) -> str | None:
        """ConfigMap, then PyTorchJob, then the ConfigMap's ownerReference; undo on failure."""
        ns = job["metadata"]["namespace"]
        name = job["metadata"]["name"]
        cm_name = configmap["metadata"]["name"]
        core, custom = self._core(), self._custom()
        try:
            core.create_namespaced_config_map(ns, configmap)
        except Exception as exc:  # ApiException, or urllib3 connection errors
            raise _api_error(exc, f"ConfigMap {ns}/{cm_name}") from None
        try:
            created = custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
        except Exception as exc:
            self._delete_configmap(ns, cm_name)
            raise _api_error(exc, f"PyTorchJob {ns}/{name}") from None
        uid = (created or {}).get("metadata", {}).get("uid")
        if uid:
            owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob", "name": name, "uid": uid,
                     "controller": False, "blockOwnerDeletion": False}
            try:
                core.patch_namespaced_config_map(cm_name, ns, {"metadata": {"ownerReferences": [owner]}})
            except Exception:
                pass  # not fatal: cancel deletes the ConfigMap by name as well
        return uid

    def _delete_configmap(self, ns: str, name: str) -> None:
        try:
            self._core().delete_namespaced_config_map(name, ns)
        except Exception:
            pass

    # status -----------------------------------------------------------------------------------
    def get_job(self, name: str, ns: str) -> dict:
        try:
            return self._custom().get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                raise UserError(f"PyTorchJob {ns}/{name} not found (deleted, or collected after its TTL)") from None
            raise _api_error(exc, f"PyTorchJob {ns}/{name}") from None

    def pods(self, name: str, ns: str) -> list[Any]:
        core = self._core()
        try:
            pods = core.list_namespaced_pod(ns, label_selector=f"{JOB_LABEL}={name}").items
            if not pods:
                pods = core.list_namespaced_pod(ns, label_selector=f"{OUR_LABEL}={name}").items
        except Exception as exc:
            raise _api_error(exc, f"pods of {ns}/{name}") from None
        return sorted(pods, key=lambda p: p.metadata.name)

    def status(self, handle: JobHandle) -> K8sJobStatus:
        self._use(handle.extra)
        ns = handle.extra.get("namespace") or "default"
        job = self.get_job(handle.id, ns)
        st = job.get("status") or {}
        conds = [c for c in st.get("conditions") or [] if c.get("status") == "True"]
        last = conds[-1] if conds else None
        cond = last["type"] if last else "Pending"
        pod_list = self.pods(handle.id, ns)
        pods = {p.metadata.name: (p.status.phase if p.status else None) for p in pod_list}
        restarts = sum((cs.restart_count or 0) for p in pod_list if p.status
                       for cs in (p.status.container_statuses or [])) if pod_list else None
        return K8sJobStatus(CONDITION_STATE.get(cond, PENDING), None, (last or {}).get("message") or "",
                            condition=cond, pods=pods, restarts=restarts,
                            replica_statuses=st.get("replicaStatuses") or {})

    # logs -------------------------------------------------------------------------------------
    def logs(self, handle: JobHandle, follow: bool = False, rank: int | None = None, **_: Any) -> Iterator[str]:
        self._use(handle.extra)
        ns = handle.extra.get("namespace") or "default"
        gpus = int(handle.extra.get("gpus_per_node", 1))
        nodes = int(handle.extra.get("nodes", 1))
        record = handle
        if rank is None:
            pod_names = [f"{record.id}-master-0"] + [f"{record.id}-worker-{i}" for i in range(nodes - 1)]
            targets = pod_names if not follow else pod_names[:1]
        else:
            node = rank // gpus
            if node >= nodes:
                raise UserError(f"--rank {rank}: the job has {nodes * gpus} ranks")
            targets = [f"{record.id}-master-0" if node == 0 else f"{record.id}-worker-{node - 1}"]
        core = self._core()
        for pod in targets:
            try:
                resp = core.read_namespaced_pod_log(pod, ns, container="pytorch", follow=follow,
                                                    _preload_content=False)
            except Exception as exc:
                raise _api_error(exc, f"logs of pod {ns}/{pod}") from None
            for raw in _stream_lines(resp):
                if rank is None:
                    yield raw if len(targets) == 1 else f"{pod}: {raw}"
                else:
                    text = filter_rank(raw, rank)
                    if text is not None:
                        yield text

    # cancel -----------------------------------------------------------------------------------
    def cancel(self, handle: JobHandle) -> None:
        self._use(handle.extra)
        ns = handle.extra.get("namespace") or "default"
        try:
            self._custom().delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, handle.id,
                                                           propagation_policy="Foreground")
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                raise UserError(f"PyTorchJob {ns}/{handle.id} not found (already deleted?)") from None
            raise _api_error(exc, f"PyTorchJob {ns}/{handle.id}") from None
        self._delete_configmap(ns, handle.extra.get("configmap", f"{handle.id}-plan"))


def _stream_lines(resp) -> Iterator[str]:
    pending = b""
    try:
        for chunk in resp.stream(4096):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace")
        if pending:
            yield pending.decode(errors="replace")
    finally:
        resp.release_conn()
