"""NVIDIA's whole Xid catalog behind `preflight parse xid` and the BandwidthMap's xid check: every code it
lists has a verdict and an action, a code it does not list is flagged as unknown (it went unflagged,
issue 23), and the real kernel logs under shared fixtures hold only known codes.

The synthetic lines are CONSTRUCTED (tests/replay/constructed.py's dmesg_xids); the captures are the
shared fixtures' xid/ files (SOURCES.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from checks.judges.xid import judge_xid
from checks.parsers.xid import parse_xid
from checks.parsers.xid_catalog import AZURE_CRITICAL, BUCKETS, CATALOG, OUT_OF_SERVICE, verdict
from tests.conftest import fixtures_dir, shared_file
from tests.replay.constructed import dmesg_xids

pytestmark = pytest.mark.unit


def test_the_catalog_is_whole_and_every_bucket_is_explained():
    assert sorted(CATALOG) == list(range(1, 173))  # Table 1 of NVIDIA's catalog: codes 1-172, none skipped
    for e in CATALOG.values():
        assert e.mnemonic and e.description, e
        assert e.immediate in BUCKETS and (e.investigatory in BUCKETS or not e.investigatory), e
    assert AZURE_CRITICAL <= set(CATALOG)


@pytest.mark.parametrize("code, mnemonic, immediate", [
    (13, "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY", "RESTART_APP"),
    (31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP"), (43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE"),
    (48, "ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48"), (63, "INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE"),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU"), (74, "NVLINK_ERROR", "WORKFLOW_NVLINK_ERR"),
    (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM"), (94, "ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP"),
    (95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU"), (119, "GSP_RPC_TIMEOUT", "RESET_GPU"),
    (149, "NVLINK_NETIR_ERROR", "WORKFLOW_NVLINK5_ERR"), (154, "GPU_RECOVERY_ACTION_CHANGED", "XID_154"),
    (158, "GPU_FATAL_TIMEOUT", "RESET_GPU"), (172, "UNCORRECTABLE_SRAM_ERROR", ""),
])
def test_rows_as_nvidia_publishes_them(code, mnemonic, immediate):
    e = CATALOG[code]
    assert (e.mnemonic, e.immediate) == (mnemonic, immediate)


@pytest.mark.parametrize("code", sorted(CATALOG))
def test_every_catalog_code_is_judged_with_its_action(code):
    """One synthetic line per code: one finding, fail exactly where NVIDIA's immediate action takes the GPU
    out of service (or Azure drains on it), warn otherwise, never a pass; the action names the bucket."""
    log = parse_xid(dmesg_xids([("0000:3b:00", code, "Ch 00000001")]))
    [f] = judge_xid(log, node="n")
    e = CATALOG[code]
    out_of_service = e.immediate in OUT_OF_SERVICE or code in AZURE_CRITICAL or code == 154
    assert f.status == ("fail" if out_of_service else "warn"), (code, f)
    assert (e.immediate or e.note or "no action") in f.remediation and f.figure == code
    assert log.to_dict()["unknown_codes"] == []


@pytest.mark.parametrize("code", [0, 173, 200, 31337])
def test_a_code_outside_the_catalog_is_flagged_unknown(code):
    log = parse_xid(dmesg_xids([("0000:3b:00", code, "something new")]))
    [f] = judge_xid(log, node="n")
    assert f.status == "warn" and "unknown Xid" in f.message and "not in NVIDIA's catalog" in f.message
    assert log.to_dict()["unknown_codes"] == [code] and log.to_dict()["events"][0]["known"] is False


@pytest.mark.parametrize("code, message, status", [
    (45, "Ch 00000001 caused by previous Xid 13", "warn"),     # the application's fault behind the cleanup
    (45, "Ch 00000001 caused by previous Xid 79", "fail"),
    (45, "Ch 00000001", "warn"),
    (154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", "fail"),
    (154, "GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)", "warn"),
    (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 04 (0x004505c6 0x00000000 0x00000000)", "fail"),
    (149, "NETIR_BER_EVENT Nonfatal XC0 i0 Link 04 (0x00000113 0x00000001 0x00000000)", "warn"),
    (74, "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", "fail"),
])
def test_the_message_refines_the_codes_the_catalog_says_to_read(code, message, status):
    assert verdict(code, message).status == status


XID_CAPTURES = sorted(p.name for p in (fixtures_dir() / "xid").glob("*.txt")) or ["(absent)"]


@pytest.mark.parametrize("name", XID_CAPTURES)
def test_real_kernel_logs_hold_only_catalog_codes(name):
    log = parse_xid(shared_file("xid", name).read_text(errors="replace"))
    assert all(e.known for e in log.events)
    assert all(f.source.startswith("NVIDIA Xid catalog (https://docs.nvidia.com/deploy/xid-errors/")
               for f in judge_xid(log, node="n") if f.check == "xid" and isinstance(f.figure, int))


def test_preflight_parse_xid_reports_an_unknown_code(tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_text(dmesg_xids([("0000:3b:00", 999, "new in a future driver"), ("0000:3b:00", 13, "Graphics")]))
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "preflight", "parse", "xid", str(log), "--json"],
                       capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout)
    assert out["status"] == "warn" and out["parse"]["unknown_codes"] == [999], r.stdout
    assert any("unknown Xid 999" in f["message"] for f in out["findings"])
