"""Kubernetes: each command runs in a pod pinned to the node (`nodeName`), read back from its log.

The pod manifest comes from templates/k8s/preflight-pod.yaml.j2, rendered by launcher.render's one
environment; each pod is submitted through launcher's KubernetesBackend. Both are handed in by the
command layer (checks imports neither render nor the backends). Pod logs merge stdout and stderr,
so the command is wrapped to print stderr after a marker line and the two are split again.
Multi-node nccl-tests need an MPI job (MPIJob/PyTorchJob), which this runner does not start:
`launcher` is None and the orchestrator skips the pair and all-node phases, saying so.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from checks.runners.base import Renderer, Runner
from launcher.formats.k8snames import RFC1123_SUBDOMAIN
from launcher.formats.requests import Manifests
from launcher.transport import Completed, Transport, TransportError

TEMPLATE = "k8s/preflight-pod.yaml.j2"  # rendered by launcher.render's one environment


def render_pod(render: Renderer, *, name: str, namespace: str, node: str, image: str, command: str, run_id: str,
               gpus: int | None = None, deadline: int = 900, service_account: str | None = None) -> dict[str, Any]:
    """The pod manifest, through `render` (launcher.render.render_template), as a dict."""
    import yaml

    for what, v in (("pod name", name), ("namespace", namespace), ("node name", node)):
        if not RFC1123_SUBDOMAIN.fullmatch(v) or len(v) > 253:
            raise ValueError(f"{what} {v!r} is not a valid Kubernetes name (lowercase letters, digits, '-', '.')")
    text = render(TEMPLATE, dict(name=name, namespace=namespace, node=node, image=image, command=command,
                                 run_id=run_id, gpus=gpus, deadline=deadline, service_account=service_account))
    return yaml.safe_load(text)


class K8sRunner(Runner):
    """Each command is a pod rendered through `render` (launcher.render.render_template) and submitted
    through `kube`, launcher's KubernetesBackend (both passed in by the command layer, which checks may
    not import): request(Manifests([pod])) -> submit, describe until it ends, log_iter, then cancel (the pod is
    deleted). `on_submit(handle)` is told of each pod (the CLI records it, so `launch
    status|logs|cancel <pod>` follow it while it runs)."""

    name = "k8s"
    launcher = None  # pods have no multi-host launcher

    def __init__(self, kube: Any, *, render: Renderer, namespace: str = "default",
                 image: str = "nvcr.io/nvidia/pytorch:24.05-py3",
                 gpus: int | None = None, poll_s: float = 1.0, service_account: str | None = None,
                 on_submit: Callable[[Any], None] | None = None):
        self.kube = kube
        self.render = render
        self.namespace = namespace
        self.image = image
        self.gpus = gpus
        self.poll_s = poll_s
        self.service_account = service_account
        self.on_submit = on_submit
        self.run_id = secrets.token_hex(4)
        self._n = 0

    def transport(self, host: str) -> Transport:
        """A pod is not a machine one logs in to: `run` goes through the Kubernetes backend instead."""
        raise TransportError(f"{host}: the k8s backend reaches nodes through pods, not a transport")

    def run(self, host: str, command: str, timeout: float) -> Completed:
        start = time.monotonic()
        self._n += 1
        marker = f"__launch4d_stderr_{secrets.token_hex(4)}__"
        err = f"/tmp/{marker}.err"
        wrapped = f"( {command}\n) 2>{err}; rc=$?; echo; echo {marker}; cat {err}; rm -f {err}; exit $rc"
        safe = re.sub(r"[^a-z0-9-]", "-", host.lower()).strip("-")[:40]
        name = f"launch4d-preflight-{self.run_id}-{self._n}-{safe}"
        try:
            pod = render_pod(self.render, name=name, namespace=self.namespace, node=host, image=self.image,
                             command=wrapped, run_id=self.run_id, gpus=self.gpus, deadline=int(timeout) + 60,
                             service_account=self.service_account)
            handle = self.kube.submit(self.kube.request(Manifests([pod])))
        except Exception as exc:  # noqa: BLE001 - API errors become the host's reason
            return Completed(host=host, command=command, error=f"cannot create pod on {host}: {exc}",
                             seconds=time.monotonic() - start)
        try:
            if self.on_submit is not None:
                self.on_submit(handle)
            st = None
            while time.monotonic() - start < timeout:
                st = self.kube.describe(handle)
                if st is None or st.done:
                    break
                time.sleep(self.poll_s)
            if st is None:
                return Completed(host=host, command=command, error=f"pod {name} disappeared before it ended",
                                 seconds=time.monotonic() - start)
            if not st.done:
                return Completed(None, "", f"pod {name} still {st.state} after {timeout:.0f}s", timed_out=True,
                                 seconds=time.monotonic() - start, host=host, command=command)
            log = "".join(f"{line}\n" for line in self.kube.log_iter(handle))
            out, _, err = log.partition(f"\n{marker}\n")
            return Completed(st.exit_code, out, err.strip("\n"), seconds=time.monotonic() - start, host=host,
                             command=command)
        except Exception as exc:  # noqa: BLE001
            return Completed(host=host, command=command, error=f"pod {name}: {exc}", seconds=time.monotonic() - start)
        finally:
            try:
                self.kube.cancel(handle)
            except Exception:  # noqa: BLE001 - best effort; pods carry a deadline anyway
                pass

    def run_multi(self, hosts: Sequence[str], command: str, timeout: float) -> Completed:
        return Completed(host=hosts[0], command=command, error="multi-node nccl-tests need an MPI job on Kubernetes; "
                                                                  "not run by the k8s backend")
