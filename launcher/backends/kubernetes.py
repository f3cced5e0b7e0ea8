"""Kubernetes backend: a TrainJob (trainer.kubeflow.org/v1alpha1, with its TrainingRuntime when
one is rendered) or a PyTorchJob (kubeflow.org/v1), and the plan's ConfigMap, through the API.

Submission creates the ConfigMap, then the objects in order, then points the others'
ownerReference at the job so deleting the job collects them. If any step fails, what this call
created is deleted again: nothing is left half-created. 409 Conflict is reported as "already
exists". Status reads the job's conditions (PyTorchJob: Created/Running/Restarting/Succeeded/
Failed/Suspended; TrainJob: Created/Suspended/Complete/Failed, Running when its pods run, and the
JobSet's whole-gang restarts) and its pods' phases; logs read the trainer container of the pod
that holds the rank asked for (PyTorchJob: node 0 = master-0, node i = worker-(i-1); TrainJob:
the pod whose Indexed-Job completion index is the node rank).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.backends import (
    FAILED,
    PENDING,
    RUNNING,
    SUCCEEDED,
    Backend,
    BackendOptions,
    JobStatus,
    Request,
    filter_rank,
    skip_lines,
)
from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.jobs import JobRecord
from launcher.transport.lines import iter_lines

if TYPE_CHECKING:
    from launcher.plan.model import Plan
    from launcher.plan.spec import JobSpec

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
#: kind -> (group, version, plural) of every custom object we create.
KINDS = {"PyTorchJob": (GROUP, VERSION, PLURAL),
         "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
         "TrainingRuntime": ("trainer.kubeflow.org", "v1alpha1", "trainingruntimes")}
JOB_LABEL = "training.kubeflow.org/job-name"     # set by the training operator on every pod
OUR_LABEL = "launch4d/job"                       # set by our pod template
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"  # set by JobSet on a TrainJob's pods
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # an Indexed Job pod's index = node rank
JOBSET = ("jobset.x-k8s.io", "v1alpha2")
CONDITION_STATE = {"Created": PENDING, "Running": RUNNING, "Restarting": RUNNING,
                   "Suspended": PENDING, "Succeeded": SUCCEEDED, "Failed": FAILED}
POD_STATE = {"Pending": PENDING, "Running": RUNNING, "Succeeded": SUCCEEDED, "Failed": FAILED}
TRAINJOB_STATE = {"Created": PENDING, "Running": RUNNING, "Suspended": PENDING, "Complete": SUCCEEDED,
                  "Failed": FAILED}


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
        kind = what.split()[0]
        if kind in KINDS:
            group, version, _ = KINDS[kind]
            return UserError(f"{what}: the {kind} CRD ({group}/{version}) is not installed in this cluster")
        return UserError(f"{what}: not found ({message})")
    if status in (401, 403):
        return UserError(f"{what}: not allowed ({message})")
    if status is None:
        return UserError(f"{what}: cannot reach the Kubernetes API ({exc})")
    return UserError(f"{what}: API answered {status} ({message})")


@dataclass(frozen=True)
class K8sOptions(BackendOptions):
    templates: str | None = None          # a directory whose templates override ours
    preflight_plan: float | None = None   # the in-job gate's tolerance (None: no gate)


class KubernetesBackend(Backend):
    name = "k8s"
    Options = K8sOptions

    def __init__(self, api_client=None, kubeconfig: str | None = None, context: str | None = None,
                 core_api: Any = None):
        """`core_api`: a CoreV1Api to use as it is (a preflight test's recorded stand-in)."""
        self._api = api_client
        self._kubeconfig, self._context = kubeconfig, context
        self._core_api = core_api

    def _use(self, extra: dict) -> None:
        """Later commands reach the cluster the job was submitted to (its kubeconfig/context)."""
        if self._api is None and (extra.get("kubeconfig") or extra.get("context")):
            self._kubeconfig, self._context = extra.get("kubeconfig"), extra.get("context")

    @property
    def api(self):
        self.check_access()
        return self._api

    def check_access(self) -> None:
        """The kubeconfig (or in-cluster credentials) loaded now, once."""
        if self._api is None:
            self._api = load_api_client(self._kubeconfig, self._context)

    def _core(self):
        if self._core_api is not None:
            return self._core_api
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def _custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api)

    # submit -----------------------------------------------------------------------------------
    def dryrun(self, job: JobSpec, plan: Plan, run_dir: str | Path | None = None, *, job_text: str | None = None,
               exclude: list[str] | None = None, node_order: list[str] | None = None, **options: Any) -> Request:
        """The manifest (ConfigMap with plan.json, then the job's objects), nothing sent: no client is
        even built. `run_dir` is where the job is recorded here; the pods' run dir is the manifest's.
        The scheduler places the pods, so `node_order` does not apply; the job file's text is not sent."""
        from launcher.render.k8s import parse_manifests, render_k8s

        opts = self.options(options)
        rendered = render_k8s(job, plan, None, opts.templates, exclude, opts.preflight_plan)
        configmap, *objects = parse_manifests(rendered.files["manifest.yaml"])
        head = objects[-1]
        ns = head["metadata"]["namespace"]
        k = job.backend.k8s
        extra = {"namespace": ns, "configmap": configmap["metadata"]["name"], "gpus_per_node": plan.gpus_per_node,
                 "nodes": plan.nodes, "pod_run_dir": rendered.run_dir, "kubeconfig": k.kubeconfig,
                 "context": k.context, "kind": head["kind"],
                 "owned": [[o["kind"], o["metadata"]["name"]] for o in objects[:-1]]}
        if opts.preflight_plan is not None:   # `launch logs` shows the gate's init container first
            from launcher.render.groupprobe import PROBE_CONTAINER

            extra["probe_container"] = PROBE_CONTAINER
        made = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in [configmap, *objects])
        command = f"create in namespace {ns}{' (context ' + k.context + ')' if k.context else ''}: {made}"
        return Request(self.name, job.name, str(run_dir or rendered.run_dir), command,
                       dict(rendered.files), main="manifest.yaml", warnings=rendered.warnings, extra=extra)

    def request(self, what: Any) -> Request:
        """Objects made elsewhere (launcher.formats.requests.Manifests): one Pod, or a Service and its pods."""
        from launcher.formats.requests import Manifests

        if isinstance(what, Manifests):
            if len(what.docs) == 1 and what.docs[0].get("kind") == "Pod":
                return self._pod_request(what.docs[0], what.run_dir)
            if what.docs and what.docs[0].get("kind") == "Service":
                return self._gang_request(what.docs, what.run_dir, what.gpus_per_node)
            raise UserError("Manifests: one Pod, or a Service then its Pods")
        return super().request(what)

    def _pod_request(self, pod: dict[str, Any], run_dir: str = "") -> Request:
        """A pod manifest made elsewhere (preflight's node checks) as a request: submitted, followed
        and cancelled like any job (status: the pod's phase and exit code; logs: its log)."""
        import yaml

        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        ctx = f" (context {self._context})" if self._context else ""
        return Request(self.name, name, run_dir, f"create in namespace {ns}{ctx}: Pod {name}",
                       {"pod.yaml": yaml.safe_dump(pod, sort_keys=False)}, main="pod.yaml",
                       extra={"namespace": ns, "kind": "Pod", "kubeconfig": self._kubeconfig,
                              "context": self._context})

    def _gang_request(self, docs: list[dict[str, Any]], run_dir: str = "", gpus_per_node: int = 1) -> Request:
        """A headless Service and its pods made elsewhere (`launch preflight --plan --backend k8s`: one pod
        per node of the plan) as one request: submitted, followed (status: every pod's phase, a failed
        one's exit code; logs: the pod of the node asked for, node 0's by default) and cancelled (pods
        and Service deleted) like any job."""
        import yaml

        service, *pods = docs
        ns, name = service["metadata"]["namespace"], service["metadata"]["name"]
        ctx = f" (context {self._context})" if self._context else ""
        made = ", ".join([f"Service {name}", *(f"Pod {p['metadata']['name']}" for p in pods)])
        return Request(self.name, name, run_dir, f"create in namespace {ns}{ctx}: {made}",
                       {"gang.yaml": "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)}, main="gang.yaml",
                       extra={"namespace": ns, "kind": "PodGang", "pods": [p["metadata"]["name"] for p in pods],
                              "gpus_per_node": gpus_per_node, "nodes": len(pods), "kubeconfig": self._kubeconfig,
                              "context": self._context})

    def _submit_gang(self, request: Request) -> JobRecord:
        from launcher.render.k8s import parse_manifests

        service, *pods = parse_manifests(request.files["gang.yaml"])
        ns, name = service["metadata"]["namespace"], service["metadata"]["name"]
        self._use(request.extra)
        core = self._core()
        try:
            core.create_namespaced_service(ns, service)
        except Exception as exc:
            raise _api_error(exc, f"Service {ns}/{name}") from None
        made: list[str] = []
        for pod in pods:
            try:
                core.create_namespaced_pod(namespace=ns, body=pod)
            except Exception as exc:
                for done in made:
                    self._delete_pod(done, ns, quiet=True)
                self._delete_object("Service", ns, name)
                raise _api_error(exc, f"Pod {ns}/{pod['metadata']['name']}") from None
            made.append(pod["metadata"]["name"])
        return JobRecord(self.name, name, request.name, request.run_dir, request=request.text(),
                         extra=dict(request.extra))

    def submit(self, request: Request) -> JobRecord:
        """Create the manifest's objects in order (undone on any failure)."""
        from launcher.render.k8s import parse_manifests

        if request.extra.get("kind") == "Pod":
            return self._submit_pod(request)
        if request.extra.get("kind") == "PodGang":
            return self._submit_gang(request)
        configmap, *objects = parse_manifests(request.files["manifest.yaml"])
        extra = dict(request.extra)
        self._use(extra)
        extra["uid"] = self.create(configmap, *objects)
        return JobRecord(self.name, objects[-1]["metadata"]["name"], request.name, request.run_dir,
                         request=request.text(), log_dir=rundir.remote(request.run_dir, rundir.LOGS), extra=extra)

    def _submit_pod(self, request: Request) -> JobRecord:
        import yaml

        pod = yaml.safe_load(request.files["pod.yaml"])
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self._use(request.extra)
        try:
            self._core().create_namespaced_pod(namespace=ns, body=pod)
        except Exception as exc:
            raise _api_error(exc, f"Pod {ns}/{name}") from None
        return JobRecord(self.name, name, request.name, request.run_dir, request=request.text(),
                         extra=dict(request.extra))

    def create(self, configmap: dict, *objects: dict) -> str | None:
        """The ConfigMap, then each custom object in order (a TrainingRuntime before the TrainJob
        that refers to it), then ownerReferences from the job onto the others; undo on failure."""
        job = objects[-1]
        ns = job["metadata"]["namespace"]
        cm_name = configmap["metadata"]["name"]
        core, custom = self._core(), self._custom()
        try:
            core.create_namespaced_config_map(ns, configmap)
        except Exception as exc:  # ApiException, or urllib3 connection errors
            raise _api_error(exc, f"ConfigMap {ns}/{cm_name}") from None
        made: list[dict] = []
        created: dict = {}
        for obj in objects:
            try:
                if obj["kind"] == "Service":        # the gate's headless Service (a PyTorchJob's gang)
                    core.create_namespaced_service(ns, obj)
                    made.append(obj)
                    continue
                group, version, plural = KINDS[obj["kind"]]
                created = custom.create_namespaced_custom_object(group, version, ns, plural, obj)
            except Exception as exc:
                for done in reversed(made):
                    self._delete_object(done["kind"], ns, done["metadata"]["name"])
                self._delete_configmap(ns, cm_name)
                raise _api_error(exc, f"{obj['kind']} {ns}/{obj['metadata']['name']}") from None
            made.append(obj)
        uid = (created or {}).get("metadata", {}).get("uid")
        if uid:
            owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": job["metadata"]["name"],
                     "uid": uid, "controller": False, "blockOwnerDeletion": False}
            patch = {"metadata": {"ownerReferences": [owner]}}
            try:
                core.patch_namespaced_config_map(cm_name, ns, patch)
                for obj in objects[:-1]:
                    if obj["kind"] == "Service":
                        core.patch_namespaced_service(obj["metadata"]["name"], ns, patch)
                        continue
                    group, version, plural = KINDS[obj["kind"]]
                    custom.patch_namespaced_custom_object(group, version, ns, plural, obj["metadata"]["name"], patch)
            except Exception:
                pass  # not fatal: cancel deletes them by name as well
        return uid

    def _delete_object(self, kind: str, ns: str, name: str) -> None:
        try:
            if kind == "Service":
                self._core().delete_namespaced_service(name, ns)
                return
            group, version, plural = KINDS[kind]
            self._custom().delete_namespaced_custom_object(group, version, ns, plural, name)
        except Exception:
            pass

    def _delete_configmap(self, ns: str, name: str) -> None:
        try:
            self._core().delete_namespaced_config_map(name, ns)
        except Exception:
            pass

    # status -----------------------------------------------------------------------------------
    def get_job(self, name: str, ns: str, kind: str = "PyTorchJob") -> dict | None:
        """The job object, or None where the API says 404 (deleted, or collected after its TTL)."""
        group, version, plural = KINDS[kind]
        try:
            return self._custom().get_namespaced_custom_object(group, version, ns, plural, name)
        except Exception as exc:
            if getattr(exc, "status", None) == 404 and "could not find the requested resource" not in str(
                    getattr(exc, "body", "")).lower():
                return None
            raise _api_error(exc, f"{kind} {ns}/{name}") from None

    def pods(self, name: str, ns: str, kind: str = "PyTorchJob") -> list[Any]:
        core = self._core()
        selector = f"{JOBSET_LABEL}={name}" if kind == "TrainJob" else f"{JOB_LABEL}={name}"
        try:
            pods = core.list_namespaced_pod(ns, label_selector=selector).items
            if not pods:
                pods = core.list_namespaced_pod(ns, label_selector=f"{OUR_LABEL}={name}").items
        except Exception as exc:
            raise _api_error(exc, f"pods of {ns}/{name}") from None
        return sorted(pods, key=lambda p: p.metadata.name)

    def jobset_restarts(self, name: str, ns: str) -> int | None:
        """Whole-gang restarts: the status.restarts of the JobSet Trainer made for the TrainJob
        (same name). None when it cannot be read (not yet created, or not allowed)."""
        try:
            js = self._custom().get_namespaced_custom_object(*JOBSET, ns, "jobsets", name)
        except Exception:
            return None
        return int((js.get("status") or {}).get("restarts") or 0)

    def describe(self, handle: JobRecord) -> K8sJobStatus | None:
        """The job's conditions and its pods' phases; None when the job is not there (404)."""
        self._use(handle.extra)
        ns = handle.extra.get("namespace") or "default"
        kind = handle.extra.get("kind") or "PyTorchJob"
        if kind == "Pod":
            return self._describe_pod(handle.id, ns)
        if kind == "PodGang":
            return self._describe_gang(handle.extra.get("pods") or [], ns)
        job = self.get_job(handle.id, ns, kind)
        if job is None:
            return None
        st = job.get("status") or {}
        conds = [c for c in st.get("conditions") or [] if c.get("status") == "True"]
        last = conds[-1] if conds else None
        cond = last["type"] if last else "Pending"
        pod_list = self.pods(handle.id, ns, kind)
        pods = {p.metadata.name: (p.status.phase if p.status else None) for p in pod_list}
        restarts = sum((cs.restart_count or 0) for p in pod_list if p.status
                       for cs in (p.status.container_statuses or [])) if pod_list else None
        if kind != "TrainJob":
            return K8sJobStatus(CONDITION_STATE.get(cond, PENDING), None, (last or {}).get("message") or "",
                                condition=cond, pods=pods, restarts=restarts,
                                replica_statuses=st.get("replicaStatuses") or {})
        if cond in ("Created", "Pending") and any(phase == "Running" for phase in pods.values()):
            cond = "Running"            # TrainJob has no Running condition; its pods say so
        gang = self.jobset_restarts(handle.id, ns)
        if gang is not None:
            restarts = gang + (restarts or 0)
        return K8sJobStatus(TRAINJOB_STATE.get(cond, PENDING), None, (last or {}).get("message") or "",
                            condition=cond, pods=pods, restarts=restarts,
                            replica_statuses={j["name"]: j for j in st.get("jobsStatus") or [] if "name" in j})

    def _describe_pod(self, name: str, ns: str) -> K8sJobStatus | None:
        """A lone pod's phase, and its container's exit code once it has ended; None when it is gone."""
        try:
            st = self._core().read_namespaced_pod(name=name, namespace=ns).status
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise _api_error(exc, f"Pod {ns}/{name}") from None
        rc = None
        for cs in st.container_statuses or []:
            term = cs.state.terminated if cs.state else None
            if term is not None:
                rc = term.exit_code
        state = POD_STATE.get(st.phase or "Pending", PENDING)
        if rc is None and state in (SUCCEEDED, FAILED):
            rc = 0 if state == SUCCEEDED else 1
        return K8sJobStatus(state, rc, f"pod {st.phase}", condition=st.phase or "Pending", pods={name: st.phase})

    def _describe_gang(self, names: list[str], ns: str) -> K8sJobStatus | None:
        """A gang of pods as one job: failed when one failed (its exit code), succeeded when all did,
        running while one runs; None when every pod is gone."""
        seen = {n: self._describe_pod(n, ns) for n in names}
        here = {n: st for n, st in seen.items() if st is not None}
        if not here:
            return None
        pods: dict[str, str | None] = {n: (st.condition if st is not None else "Gone") for n, st in seen.items()}
        failed = [(n, st) for n, st in here.items() if st.state == FAILED]
        gone = [n for n, st in seen.items() if st is None]
        if failed or gone:
            n, st = failed[0] if failed else (gone[0], None)
            rc = st.exit_code if st is not None else 1
            return K8sJobStatus(FAILED, rc, f"pod {n} {'failed' if st is not None else 'is gone'}",
                                condition="Failed", pods=pods)
        if all(st.state == SUCCEEDED for st in here.values()):
            return K8sJobStatus(SUCCEEDED, 0, "every pod succeeded", condition="Succeeded", pods=pods)
        state = RUNNING if any(st.state == RUNNING for st in here.values()) else PENDING
        return K8sJobStatus(state, None, f"{sum(st.state == RUNNING for st in here.values())} of {len(names)} "
                            "pod(s) running", condition="Running" if state == RUNNING else "Pending", pods=pods)

    # logs -------------------------------------------------------------------------------------
    def _targets(self, handle: JobRecord, ns: str, nodes: int, node: int | None) -> list[str]:
        """Pod names of node `node` (all nodes when None), in node-rank order. A PyTorchJob's are
        fixed; a TrainJob's pods are Indexed-Job pods with a random suffix, found by their
        completion index (= node rank), the newest one after a gang restart."""
        if handle.extra.get("kind") != "TrainJob":
            names = [f"{handle.id}-master-0"] + [f"{handle.id}-worker-{i}" for i in range(nodes - 1)]
            return names if node is None else [names[node]]
        by_index: dict[int, Any] = {}
        for p in self.pods(handle.id, ns, "TrainJob"):
            index = (p.metadata.labels or {}).get(INDEX_LABEL)
            if index is None or not index.isdigit():
                continue
            old = by_index.get(int(index))
            if old is None or str(p.metadata.creation_timestamp or "") >= str(old.metadata.creation_timestamp or ""):
                by_index[int(index)] = p
        wanted = range(nodes) if node is None else [node]
        missing = [i for i in wanted if i not in by_index]
        if missing:
            raise UserError(f"TrainJob {ns}/{handle.id}: no pod yet for node {missing[0]} (pending or not admitted)")
        return [by_index[i].metadata.name for i in wanted]

    def log_iter(self, handle: JobRecord, rank: int | None = None, follow: bool = False, since: int | None = None,
                 stream: str = "out") -> Iterator[str]:
        """The trainer container's log (stdout and stderr together) of the pod holding `rank`; without
        a rank, every node's pod (node 0's alone when following)."""
        return skip_lines(self._logs(handle, follow, rank), since)

    def _logs(self, handle: JobRecord, follow: bool, rank: int | None) -> Iterator[str]:
        self._use(handle.extra)
        ns = handle.extra.get("namespace") or "default"
        if handle.extra.get("kind") == "Pod":
            yield from self._pod_log(handle.id, ns, follow)
            return
        gpus = int(handle.extra.get("gpus_per_node", 1))
        if handle.extra.get("kind") == "PodGang":
            names = handle.extra.get("pods") or []
            node = 0 if rank is None else rank // gpus
            if node >= len(names):
                raise UserError(f"--rank {rank}: the gang has {len(names) * gpus} ranks")
            yield from self._pod_log(names[node], ns, follow)
            return
        nodes = int(handle.extra.get("nodes", 1))
        container = "node" if handle.extra.get("kind") == "TrainJob" else "pytorch"
        if rank is None:
            targets = self._targets(handle, ns, nodes, 0 if follow else None)
        else:
            node = rank // gpus
            if node >= nodes:
                raise UserError(f"--rank {rank}: the job has {nodes * gpus} ranks")
            targets = self._targets(handle, ns, nodes, node)
        core = self._core()
        probe = handle.extra.get("probe_container")
        for pod in targets:
            shown = False
            if probe:   # `--preflight-plan`: the gate's init container ran first; its lines come first
                try:
                    resp = core.read_namespaced_pod_log(pod, ns, container=probe, follow=follow,
                                                        _preload_content=False)
                    for raw in _stream_lines(resp):
                        shown = True
                        if rank is None:
                            yield raw if len(targets) == 1 else f"{pod}: {raw}"
                except Exception:  # noqa: BLE001 - not started yet: the trainer's log says the rest
                    pass
            try:
                resp = core.read_namespaced_pod_log(pod, ns, container=container, follow=follow,
                                                    _preload_content=False)
            except Exception as exc:
                if shown and getattr(exc, "status", None) == 400:   # the gate failed: no trainer started
                    yield f"{pod}: the {container} container did not start (plan preflight above)"
                    continue
                raise _api_error(exc, f"logs of pod {ns}/{pod}") from None
            for raw in _stream_lines(resp):
                if rank is None:
                    yield raw if len(targets) == 1 else f"{pod}: {raw}"
                else:
                    text = filter_rank(raw, rank)
                    if text is not None:
                        yield text

    def _pod_log(self, name: str, ns: str, follow: bool) -> Iterator[str]:
        """A lone pod's log (stdout and stderr together), whole or followed until the pod ends."""
        core = self._core()
        try:
            if not follow:
                yield from core.read_namespaced_pod_log(name=name, namespace=ns).splitlines()
                return
            resp = core.read_namespaced_pod_log(name=name, namespace=ns, follow=True, _preload_content=False)
        except Exception as exc:
            raise _api_error(exc, f"logs of pod {ns}/{name}") from None
        yield from _stream_lines(resp)

    # cancel -----------------------------------------------------------------------------------
    def cancel(self, handle: JobRecord, force: bool = False) -> bool:
        """Delete the job (its pods go with it; `force` changes nothing), then what was created with it. Idempotent: a job
        already gone (404) or already finished is not an error (False: nothing was stopped), and its
        ConfigMap and runtime are still removed."""
        self._use(handle.extra)
        ns = handle.extra.get("namespace") or "default"
        kind = handle.extra.get("kind") or "PyTorchJob"
        if kind == "Pod":
            return self._delete_pod(handle.id, ns)
        if kind == "PodGang":
            ended = [self._delete_pod(n, ns, quiet=True) for n in handle.extra.get("pods") or []]
            self._delete_object("Service", ns, handle.id)
            return any(ended)
        group, version, plural = KINDS[kind]
        stopped = True
        try:
            gone = self._custom().delete_namespaced_custom_object(group, version, ns, plural, handle.id,
                                                                  propagation_policy="Foreground")
            # Foreground deletion answers with the object as it was: a finished job was not stopped.
            stopped = not finished(gone)
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise _api_error(exc, f"{kind} {ns}/{handle.id}") from None
            stopped = False
        for owned_kind, owned_name in handle.extra.get("owned") or []:
            self._delete_object(owned_kind, ns, owned_name)
        self._delete_configmap(ns, handle.extra.get("configmap", f"{handle.id}-plan"))
        return stopped


    def _delete_pod(self, name: str, ns: str, quiet: bool = False) -> bool:
        """Delete a lone pod; False when it had already ended or is gone (404). `quiet`: any error is
        False too (cleaning up after another failure)."""
        try:
            gone = self._core().delete_namespaced_pod(name=name, namespace=ns)
        except Exception as exc:
            if getattr(exc, "status", None) == 404 or quiet:
                return False
            raise _api_error(exc, f"Pod {ns}/{name}") from None
        phase = getattr(getattr(gone, "status", None), "phase", None)
        return phase not in ("Succeeded", "Failed")


def finished(obj: Any) -> bool:
    """A job object whose conditions say it has ended (Succeeded/Failed; a TrainJob's Complete)."""
    status = obj.get("status") if isinstance(obj, dict) else None
    if not isinstance(status, dict):  # a Status answer ("status": "Success") says nothing of the job
        return False
    conds = status.get("conditions") or []
    return any(c.get("type") in ("Succeeded", "Failed", "Complete") and c.get("status") == "True" for c in conds)


def _stream_lines(resp) -> Iterator[str]:
    try:
        yield from iter_lines(resp.stream(4096))
    finally:
        resp.release_conn()
