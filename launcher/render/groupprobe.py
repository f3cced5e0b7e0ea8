"""The job gate's part of a rendering (`launch submit --preflight-plan`): the plan's communication
groups to measure (preflight-plan.spec.json, beside plan.json in the run dir) and what the batch
script or the gang's init container needs to run them (templates/slurm/groupprobe.sh.j2)."""

from __future__ import annotations

from typing import Any

from launcher.formats import rundir
from launcher.plan.commgroups import probe_spec
from launcher.plan.model import Plan


def probe_files(plan: Plan, tolerance: float, timeout_s: int) -> tuple[dict[str, Any], dict[str, str]]:
    """(template context `probe`, files for the run dir)."""
    import json

    spec = probe_spec(plan, tolerance=tolerance)
    ctx = {"spec": rundir.PREFLIGHT_PLAN_SPEC, "result": rundir.PREFLIGHT_PLAN, "log": rundir.PREFLIGHT_PLAN_LOG,
           "timeout_s": int(timeout_s), "tolerance": tolerance, "groups": len(spec.groups)}
    return ctx, {rundir.PREFLIGHT_PLAN_SPEC: json.dumps(spec.to_dict(), indent=1) + "\n"}


# --- Kubernetes: the gang's init container ----------------------------------------------------------
PROBE_CONTAINER = "groupprobe"        # the init container's name (the job's pod failure policy names it)
SLOW_EXIT = 1                         # verdict: a group slower than the plan assumed (the job fails)
MISSING_EXIT = 3                      # verdict: nothing measured (a failure like any other: restarts apply)


def k8s_probe_script(*, nodes: int, nproc: int, node_rank: str, master_addr: str, master_port: str, spec_path: str,
                     run_dir: str, shared_run_dir: bool, timeout_s: int, groups: int, python_prefix: str = "") -> str:
    """The init container's command: this pod's torchrun of the probe over the gang (the trainer's static
    rendezvous, node rank = the pod's index, the port after the trainer's), then the gang's verdict from
    this pod's own copy of the result (`--every-node`): its `launch4d-check` lines and the result on the
    log, the failing lines as the pod's termination message, the result into the run dir (node 0's only
    when the run dir is one volume shared by every pod), and the verdict's exit status."""
    from launcher.formats.shell import quote as q

    result, log = f"{run_dir}/{rundir.PREFLIGHT_PLAN}", f"{run_dir}/{rundir.PREFLIGHT_PLAN_LOG}"
    copy = '[ "$node_rank" = 0 ]' if shared_run_dir else "true"
    return "\n".join([
        "set -uo pipefail",
        f"node_rank={node_rank}",
        f"master_addr={master_addr}",
        f"port={master_port}",
        'case "$node_rank" in ""|*[!0-9]*) echo "launch4d: plan preflight: this pod has no node rank '
        f'(${{node_rank:-empty}})" >&2; exit {MISSING_EXIT} ;; esac',
        "if [ -n \"${LAUNCH4D_GPU_LISTS:-}\" ]; then lists=( $LAUNCH4D_GPU_LISTS ); "
        "export CUDA_VISIBLE_DEVICES=${lists[$node_rank]}; fi",
        'd=$(mktemp -d)',
        f'echo "launch4d: plan preflight: measuring {groups} communication group(s); node $node_rank of {nodes} '
        '(${LAUNCH4D_NODE_NAME:-?}), rendezvous $master_addr:$port"',
        f"timeout {timeout_s + 60} {python_prefix}python -m torch.distributed.run --nnodes={nodes} "
        f"--nproc-per-node={nproc} --node-rank=\"$node_rank\" --rdzv-backend=static --master-addr=\"$master_addr\" "
        f"--master-port=\"$port\" --max-restarts=0 -m checks.groupprobe.worker {q(spec_path)} -o \"$d/result.json\" "
        f"--every-node --timeout {timeout_s} 2>&1 | tee \"$d/log\"",
        f'{python_prefix}python -m checks.groupprobe.verdict "$d/result.json" --log "$d/log" --print-result '
        '> "$d/verdict" 2>&1',
        "rc=$?",
        'cat "$d/verdict"',
        "grep '^launch4d-check .* FAIL ' \"$d/verdict\" | head -c 4096 > /dev/termination-log 2>/dev/null || true",
        # nothing is written through a symbolic link planted in the run dir (the trainer refuses to start then)
        f"if {copy} && [ -f \"$d/result.json\" ] && [ -z \"$(find {q(run_dir)} -type l -print -quit 2>/dev/null)\" ]; "
        f"then mkdir -p {q(run_dir + '/' + rundir.LOGS)} && cp \"$d/result.json\" {q(result)}.tmp.$node_rank && "
        f"mv -f {q(result)}.tmp.$node_rank {q(result)} && cp \"$d/log\" {q(log)}; fi",
        f'case $rc in 0) ;; {SLOW_EXIT}) echo "launch4d: plan preflight: a group is slower than the plan assumed; '
        'the job fails: keep the node(s) named above out (launch preflight --drain --scheduler k8s, or '
        'backend.k8s.exclude_nodes) and submit again" >&2 ;; esac',
        "rm -rf \"$d\"",
        "exit $rc",
    ])


# --- Kubernetes: `launch preflight --plan --backend k8s`, a one-off gang of pods ---------------------
def gang_documents(*, name: str, namespace: str, image: str, commands: list[str], gpus: int | None,
                   nodes: list[str] | None = None, node_selector: dict[str, str] | None = None,
                   tolerations: list[dict[str, Any]] | None = None, pull_secrets: list[str] | None = None,
                   service_account: str | None = None, deadline_s: int = 900) -> list[dict[str, Any]]:
    """A headless Service and one pod per node of the plan, pod i running `commands[i]` (its torchrun of
    the probe). Pod i's DNS name `<name>-i.<name>` is its hostname under the Service, published before
    the pods are Ready, so the static rendezvous on pod 0 resolves while every pod runs. Pinned to
    `nodes` (node i of the plan is nodes[i]) when given, else placed by the scheduler one per node."""
    from launcher.render import check_k8s_name

    check_k8s_name(name, "plan preflight gang name", 55)
    labels = {"app.kubernetes.io/managed-by": "launch4d", "app.kubernetes.io/name": "launch4d-preflight-plan",
              "launch4d/probe": name}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": namespace, "labels": labels},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"launch4d/probe": name}}}
    pods = []
    for i, command in enumerate(commands):
        container: dict[str, Any] = {
            "name": PROBE_CONTAINER, "image": image, "command": ["bash", "-c", command],
            "env": [{"name": "LAUNCH4D_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
        spec: dict[str, Any] = {
            "hostname": f"{name}-{i}", "subdomain": name, "restartPolicy": "Never",
            "activeDeadlineSeconds": deadline_s, "containers": [container],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
        if nodes:
            spec["nodeName"] = nodes[i]
        else:
            spec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"launch4d/probe": name}}, "topologyKey": "kubernetes.io/hostname"}]}}
        if node_selector:
            spec["nodeSelector"] = dict(node_selector)
        if tolerations:
            spec["tolerations"] = [dict(t) for t in tolerations]
        if pull_secrets:
            spec["imagePullSecrets"] = [{"name": s} for s in pull_secrets]
        if service_account:
            spec["serviceAccountName"] = service_account
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"{name}-{i}", "namespace": namespace,
                                  "labels": {**labels, "launch4d/node-rank": str(i)}},
                     "spec": spec})
    return [service, *pods]
