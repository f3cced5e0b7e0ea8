"""Preflight fan-out: 32 SSH hosts against 1 host; prints both times and the ratio (must be < 3x).

Every "host" is a private sshd on loopback (tests/services/sshd.py) whose PATH holds the replay
tools (tests/replay): nvidia-smi topo and nccl-tests print real captures from ../shared/fixtures
(read at run time), gpu-query / nvlink / ibstat print CONSTRUCTED text (no real capture exists).
The timed part is one full `run_preflight` + `assemble` (probes, per-node nccl-tests, pair rounds,
all-node run) from a fresh SSHRunner, so SSH handshakes are included; starting sshd is not.
The replays can take time like the real tools: --smi-delay per nvidia-smi call (real ones take
0.1-1 s: NVML initialises every GPU) and --nccl-delay per nccl-tests run (real ones take seconds:
NCCL init alone is 1-5 s). The limit is checked with those delays (default 0.3 s and 1 s); the
zero-delay row shows what is left when only SSH and process start-up count, on this machine's
cores, where 32 simulated nodes, their sshd and this client share the same CPUs.

    .venv/bin/python benchmarks/preflight_fanout.py [--hosts 32] [--smi-delay 0.3] [--nccl-delay 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checks.assemble import assemble  # noqa: E402
from checks.orchestrate import PreflightOptions, run_preflight  # noqa: E402
from checks.runners.ssh import SSHRunner  # noqa: E402
from tests.conftest import fixtures_dir  # noqa: E402
from tests.replay import install  # noqa: E402
from tests.replay.constructed import gpu_query_csv, ibstat_text, nvlink_status  # noqa: E402
from tests.services.sshd import SshCluster, sshd_available  # noqa: E402


def timed(cluster: SshCluster, hosts: list[str], repeat: int) -> tuple[float, object]:
    times, bw = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        with SSHRunner(ssh_config=str(cluster.ssh_config), known_hosts=str(cluster.known_hosts)) as r:
            res = run_preflight(r, hosts, PreflightOptions(probe_timeout=30, nccl_timeout=60))
        bw = assemble(res)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), bw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--smi-delay", type=float, default=0.3, help="seconds each nvidia-smi replay takes")
    ap.add_argument("--nccl-delay", type=float, default=1.0, help="seconds each nccl-tests replay takes")
    ap.add_argument("--no-zero-row", action="store_true", help="skip the zero-delay row")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    why = sshd_available()
    if why:
        print(f"skipped: {why}")
        return 0
    fx = fixtures_dir()
    if not (fx / "topo").is_dir():
        print(f"skipped: third-party fixtures absent at {fx}")
        return 0
    names = [f"node{i:02d}" for i in range(1, args.hosts + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = root / "constructed"
        files.mkdir()
        (files / "gq.csv").write_text(gpu_query_csv())
        (files / "nv.txt").write_text(nvlink_status())
        (files / "ib.txt").write_text(ibstat_text())
        rows = [(args.smi_delay, args.nccl_delay)] + ([] if args.no_zero_row else [(0.0, 0.0)])
        results = []
        with SshCluster(root, names) as c:
            c.write_known_hosts()
            for smi, nccl in rows:
                for n in names:
                    install(c.nodes[n].dir, root / "nodes", fx, TOPO="topo/h100-sxm-8gpu-12nic-mlx5-1numa.txt",
                            GPU_QUERY=files / "gq.csv", NVLINK=files / "nv.txt", IBSTAT=files / "ib.txt",
                            NCCL_NODE="nccl-tests/h100-1node-8gpu-5colls-v2.17.8.txt",
                            NCCL_PAIR="nccl-tests/h100-a3mega-2node-16gpu-all_reduce_perf.txt",
                            NCCL_ALL="nccl-tests/h100-10node-80gpu-5colls-v2.17.8.txt",
                            REPLAY_DELAY=str(nccl), SMI_DELAY=str(smi))
                t1, bw1 = timed(c, names[:1], args.repeat)
                tn, bwn = timed(c, names, args.repeat)
                results.append((smi, nccl, t1, tn, bw1, bwn))
    print(f"cores: {os.cpu_count()}; median of {args.repeat} runs; times include SSH connect, probes, "
          "nccl-tests phases and judging")
    for smi, nccl, t1, tn, bw1, bwn in results:
        print(f"[nvidia-smi {smi:g} s, nccl-tests {nccl:g} s per call]")
        print(f"  preflight of 1 host:   {t1:6.2f} s  (probes + node nccl-tests; {len(bw1.checks)} checks)")
        print(f"  preflight of {args.hosts} hosts: {tn:6.2f} s  (probes + node nccl-tests + {len(bwn.pairs)} pair runs "
              f"+ all-node run; {len(bwn.checks)} checks, {len(bwn.exclude)} excluded)")
        print(f"  ratio: {tn / t1:.2f}x" + ("  (limit 3x)" if (smi, nccl) == rows[0] else "  (CPU-bound floor here)"))
    ratio = results[0][3] / results[0][2]
    return 0 if ratio < 3 else 1


if __name__ == "__main__":
    sys.exit(main())
