"""DCGM diag judged per GPU: DCGM's own verdict on every test, with what to do about a failure."""

from __future__ import annotations

from checks.judges.finding import Finding
from checks.parsers.dcgm_diag import DcgmDiag, DcgmTest

DCGM_SOURCE = "DCGM's own verdict (dcgmi diag), per GPU"
SKIP_ONLY = {"denylist", "nvml library", "cuda main library", "permissions and os blocks", "persistence mode",
             "environment variables", "page retirement/row remap", "graphics processes", "inforom", "software"}


def _dcgm_remedy(test: DcgmTest, text: str) -> str:
    low, name = text.lower(), test.name.lower()
    if "cuinit" in low or "not yet initialized" in low:
        return ("CUDA could not initialise: on NVSwitch systems start nvidia-fabricmanager, check `nvidia-smi -q` "
                "Fabric state, then rerun dcgmi diag")
    if "row remapping" in low or "row remap" in name:
        return "reset the GPU (nvidia-smi -r -i N) or reboot to apply the pending row remaps, then rerun"
    if "thermal" in low:
        return "check the node's cooling (fans, airflow, thermal interface), then rerun dcgmi diag -r 3"
    if "internal error" in low:
        return "DCGM internal error, not attributed to a GPU: restart nv-hostengine / the DCGM pod and rerun"
    if "power" in name:
        return "check power delivery and clocks (nvidia-smi -q -d POWER,CLOCK); if it fails again, drain for RMA"
    if "pcie" in name:
        return "check the PCIe link (nvidia-smi -q -d PCIE, lspci -vv), reseat if degraded, rerun"
    return "reset the GPU and rerun dcgmi diag -r 3; if it fails again, drain the node and RMA the GPU"


def judge_dcgm_diag(diag: DcgmDiag, node: str = "") -> list[Finding]:
    out: list[Finding] = []
    n = diag.gpu_count
    for m in diag.category_messages:
        if m.level == "error":
            comp = f"GPU {m.gpu}" if m.gpu is not None else "node"
            fake = DcgmTest(category="Deployment", name="deployment")
            out.append(Finding(node, comp, "dcgm:deployment", "fail", m.text, "no Error rows", m.text,
                               _dcgm_remedy(fake, m.text), DCGM_SOURCE))
    for t in diag.tests:
        if t.result != "fail" and t.result != "warn":
            continue
        failing = sorted(g for g, s in t.gpus.items() if s in ("fail", "warn"))
        notes = {m.gpu: m.text for m in t.messages if m.level in ("warning", "error") and m.gpu is not None}
        if not failing and t.all_gpus in ("fail", "warn"):
            failing = list(range(n)) if n else sorted(notes)  # a fragment without the device list
        general = [m.text for m in t.messages if m.level in ("warning", "error") and m.gpu is None]
        status = "fail" if t.result == "fail" else "warn"
        if failing:
            for g in failing:
                text = notes.get(g) or "; ".join(general) or f"{t.name}: {t.gpus.get(g, t.all_gpus)}"
                out.append(Finding(node, f"GPU {g}", f"dcgm:{t.name}", t.gpus.get(g, status) or status,
                                   t.gpus.get(g, t.all_gpus), "Pass", text, _dcgm_remedy(t, text), DCGM_SOURCE))
        else:
            per = f" (every GPU's own row says {', '.join(sorted(set(t.gpus.values())))})" if t.gpus else ""
            text = "; ".join(general) or f"{t.name} failed"
            out.append(Finding(node, "node" if not t.all_gpus else "all GPUs", f"dcgm:{t.name}", status, t.result,
                               "Pass", f"{t.name} {t.result}{per}: {text}", _dcgm_remedy(t, text), DCGM_SOURCE))
    plugins = [t for t in diag.tests if t.name.lower() not in SKIP_ONLY]
    if plugins and all(t.result == "skip" for t in plugins) and not out:
        out.append(Finding(node, "node", "dcgm:coverage", "warn", "all skipped", "at least one test run",
                           f"every diagnostic test was skipped ({', '.join(t.name for t in plugins)}): nothing "
                           "was tested", "check that this DCGM version supports the GPU (a newer DCGM for new "
                           "GPU models) and that the diag runs with the GPUs idle and as root", DCGM_SOURCE))
    if not out:
        ran = [t.name for t in diag.tests if t.result == "pass"]
        out.append(Finding(node, "node", "dcgm", "pass", f"{len(ran)} passed", "Pass",
                           f"{len(ran)} tests passed" + (" (fragment)" if diag.truncated else ""), "", DCGM_SOURCE))
    return out


