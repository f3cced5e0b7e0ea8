"""Kubernetes: each command runs in a pod pinned to the node (`nodeName`), read back from its log.

The pod manifest comes from templates/k8s/preflight-pod.yaml.j2; the kubernetes client is
imported only here, when this backend is used. Pod logs merge stdout and stderr, so the command is
wrapped to print stderr after a marker line and the two are split again. Multi-node nccl-tests need
an MPI job (MPIJob/PyTorchJob), which this runner does not start: `launcher` is None and the
orchestrator skips the pair and all-node phases, saying so.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Sequence
from typing import Any

from checks.results import CommandResult
from checks.runners import Runner
from launcher.render import RFC1123_SUBDOMAIN

TEMPLATE = "k8s/preflight-pod.yaml.j2"  # rendered by launcher.render's one environment


def render_pod(*, name: str, namespace: str, node: str, image: str, command: str, run_id: str,
               gpus: int | None = None, deadline: int = 900, service_account: str | None = None) -> dict[str, Any]:
    import yaml

    from launcher.render import render_template

    for what, v in (("pod name", name), ("namespace", namespace), ("node name", node)):
        if not RFC1123_SUBDOMAIN.fullmatch(v) or len(v) > 253:
            raise ValueError(f"{what} {v!r} is not a valid Kubernetes name (lowercase letters, digits, '-', '.')")
    text = render_template(TEMPLATE, dict(name=name, namespace=namespace, node=node, image=image, command=command,
                                          run_id=run_id, gpus=gpus, deadline=deadline,
                                          service_account=service_account))
    return yaml.safe_load(text)


class K8sRunner(Runner):
    name = "k8s"
    launcher = None  # pods have no multi-host launcher

    def __init__(self, *, namespace: str = "default", image: str = "nvcr.io/nvidia/pytorch:24.05-py3",
                 gpus: int | None = None, kubeconfig: str | None = None, context: str | None = None,
                 api: Any = None, poll_s: float = 1.0, service_account: str | None = None):
        self.namespace = namespace
        self.image = image
        self.gpus = gpus
        self.poll_s = poll_s
        self.service_account = service_account
        self.run_id = secrets.token_hex(4)
        self._n = 0
        if api is None:
            from kubernetes import client, config  # lazy: only this backend needs it

            config.load_kube_config(config_file=kubeconfig, context=context)
            api = client.CoreV1Api()
        self.api = api

    def run(self, host: str, command: str, timeout: float) -> CommandResult:
        start = time.monotonic()
        self._n += 1
        marker = f"__launch4d_stderr_{secrets.token_hex(4)}__"
        err = f"/tmp/{marker}.err"
        wrapped = f"( {command}\n) 2>{err}; rc=$?; echo; echo {marker}; cat {err}; rm -f {err}; exit $rc"
        safe = re.sub(r"[^a-z0-9-]", "-", host.lower()).strip("-")[:40]
        name = f"launch4d-preflight-{self.run_id}-{self._n}-{safe}"
        try:
            pod = render_pod(name=name, namespace=self.namespace, node=host, image=self.image, command=wrapped,
                             run_id=self.run_id, gpus=self.gpus, deadline=int(timeout) + 60,
                             service_account=self.service_account)
            self.api.create_namespaced_pod(namespace=self.namespace, body=pod)
        except Exception as exc:  # noqa: BLE001 - API errors become the host's reason
            return CommandResult(host, command, error=f"cannot create pod on {host}: {_api_reason(exc)}",
                                 seconds=time.monotonic() - start)
        try:
            phase, rc = None, None
            while time.monotonic() - start < timeout:
                st = self.api.read_namespaced_pod(name=name, namespace=self.namespace).status
                phase = st.phase
                if phase in ("Succeeded", "Failed"):
                    for cs in st.container_statuses or []:
                        term = cs.state.terminated if cs.state else None
                        if term is not None:
                            rc = term.exit_code
                    break
                time.sleep(self.poll_s)
            if phase not in ("Succeeded", "Failed"):
                return CommandResult(host, command, rc=None, timed_out=True, seconds=time.monotonic() - start,
                                     stderr=f"pod {name} still {phase} after {timeout:.0f}s")
            log = self.api.read_namespaced_pod_log(name=name, namespace=self.namespace)
            out, _, err = log.partition(f"\n{marker}\n")
            return CommandResult(host, command, out, err.strip("\n"), rc if rc is not None else (0 if phase ==
                                 "Succeeded" else 1), seconds=time.monotonic() - start)
        except Exception as exc:  # noqa: BLE001
            return CommandResult(host, command, error=f"pod {name}: {_api_reason(exc)}",
                                 seconds=time.monotonic() - start)
        finally:
            try:
                self.api.delete_namespaced_pod(name=name, namespace=self.namespace)
            except Exception:  # noqa: BLE001 - best effort; pods carry a deadline anyway
                pass

    def run_multi(self, hosts: Sequence[str], command: str, timeout: float) -> CommandResult:
        return CommandResult(hosts[0], command, error="multi-node nccl-tests need an MPI job on Kubernetes; "
                                                      "not run by the k8s backend")


def _api_reason(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
