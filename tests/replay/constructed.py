"""CONSTRUCTED tool outputs, for the tools of which ../shared/fixtures holds no real capture.

No real `nvidia-smi --query-gpu ... --format=csv`, `nvidia-smi nvlink -s`, `ibstat` or kernel-log XID
sample is in the shared fixtures, so these builders write text in the documented formats (the
nvidia-smi man page's CSV header with units in brackets and `[N/A]`; `GPU n: NAME (UUID: ...)` /
`Link n: 26.562 GB/s | <inactive>`; ibstat's `CA '...'` / `Port N:` blocks; `NVRM: Xid (PCI:...): N,`).
Every test using them says so. Real captures (topo, nccl-tests) are never rebuilt here.
"""

from __future__ import annotations

from checks.parsers.gpu_query import QUERY_FIELDS

UNITS = {"memory.total": "MiB", "clocks.sm": "MHz", "clocks.max.sm": "MHz", "power.draw": "W", "power.limit": "W"}


def gpu_query_csv(n: int = 8, name: str = "NVIDIA H100 80GB HBM3", driver: str = "535.104.05",
                  overrides: dict[int, dict[str, str]] | None = None) -> str:
    """CONSTRUCTED `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv` for n healthy GPUs."""
    header = ", ".join(f"{f} [{UNITS[f]}]" if f in UNITS else f for f in QUERY_FIELDS)
    rows = []
    for i in range(n):
        v = {
            "index": str(i), "name": name, "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000",
            "pci.bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0", "driver_version": driver,
            "memory.total": "81559 MiB", "ecc.errors.uncorrected.volatile.total": "0",
            "ecc.errors.corrected.volatile.total": "0", "retired_pages.pending": "[N/A]",
            "remapped_rows.pending": "No", "remapped_rows.failure": "No", "clocks.sm": "1980 MHz",
            "clocks.max.sm": "1980 MHz", "clocks_event_reasons.active": "0x0000000000000000",
            "pcie.link.gen.current": "5", "pcie.link.gen.max": "5", "pcie.link.width.current": "16",
            "pcie.link.width.max": "16", "temperature.gpu": "35", "power.draw": "71.25 W", "power.limit": "700.00 W",
        }
        v.update((overrides or {}).get(i, {}))
        rows.append(", ".join(v[f] for f in QUERY_FIELDS))
    return header + "\n" + "\n".join(rows) + "\n"


def nvlink_status(n: int = 8, links: int = 18, name: str = "NVIDIA H100 80GB HBM3",
                  inactive: dict[int, list[int]] | None = None) -> str:
    """CONSTRUCTED `nvidia-smi nvlink -s`."""
    out = []
    for i in range(n):
        out.append(f"GPU {i}: {name} (UUID: GPU-{i:08x}-0000-0000-0000-000000000000)")
        for k in range(links):
            down = k in (inactive or {}).get(i, [])
            out.append(f"\t Link {k}: " + ("<inactive>" if down else "26.562 GB/s"))
    return "\n".join(out) + "\n"


def ibstat_text(ports: int = 8, rate: int = 400, down: list[int] | None = None,
                rates: dict[int, int] | None = None) -> str:
    """CONSTRUCTED `ibstat` for `ports` single-port mlx5 HCAs."""
    out = []
    for i in range(ports):
        is_down = i in (down or [])
        out += [f"CA 'mlx5_{i}'", "\tCA type: MT4129", "\tNumber of ports: 1", "\tFirmware version: 28.39.1002",
                "\tHardware version: 0", f"\tNode GUID: 0x{0xa088c20300000000 + i:016x}",
                f"\tSystem image GUID: 0x{0xa088c20300000000 + i:016x}", "\tPort 1:",
                "\t\tState: " + ("Down" if is_down else "Active"),
                "\t\tPhysical state: " + ("Polling" if is_down else "LinkUp"),
                f"\t\tRate: {(rates or {}).get(i, rate)}", f"\t\tBase lid: {i + 1}", "\t\tLMC: 0", "\t\tSM lid: 1",
                "\t\tCapability mask: 0xa751e848", f"\t\tPort GUID: 0x{0xa088c20300000000 + i:016x}",
                "\t\tLink layer: InfiniBand"]
    return "\n".join(out) + "\n"


def dmesg_xids(events: list[tuple[str, int, str]]) -> str:
    """CONSTRUCTED kernel log lines with NVIDIA XIDs, among unrelated lines."""
    out = ["[    0.000000] Linux version 6.1.0-18-amd64 (debian-kernel@lists.debian.org)"]
    for k, (pci, code, msg) in enumerate(events):
        out.append(f"[{1000 + k}.123456] NVRM: Xid (PCI:{pci}): {code}, pid=4242, name=python, {msg}")
    out.append("[ 2000.000000] mlx5_core 0000:18:00.0: mlx5_fw_tracer_handle_traces")
    return "\n".join(out) + "\n"
