"""Parsers for nvidia-smi --query-gpu CSV, nvidia-smi nvlink -s, ibstat / ibv_devinfo and kernel-log XIDs.

CONSTRUCTED INPUTS: these tests use text built from the documented formats (tests/replay/constructed.py
and the literals below, each marked CONSTRUCTED) to vary one field at a time and to fuzz. The real
captures now in ../shared/fixtures (nvidia-smi-query/, nvlink/, ibstat/, xid/) are tested in
tests/unit/test_health_captures.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks.parsers import parser_for
from checks.parsers.base import ParseError
from checks.parsers.gpu_query import parse_gpu_query
from checks.parsers.ibstat import parse_ibstat
from checks.parsers.nvlink import parse_nvlink_status
from checks.parsers.xid import parse_xid
from tests.replay.constructed import dmesg_xids, gpu_query_csv, ibstat_text, nvlink_status

pytestmark = pytest.mark.unit


def test_gpu_query_fields_units_and_na():
    q = parse_gpu_query(gpu_query_csv(n=8, overrides={2: {"ecc.errors.uncorrected.volatile.total": "3",
                                                          "pcie.link.width.current": "8",
                                                          "clocks_event_reasons.active": "0x0000000000000008"}}))
    assert q.count == 8
    g = q.gpus[2]
    assert g.name == "NVIDIA H100 80GB HBM3" and g.driver == "535.104.05" and g.memory_total_mib == 81559
    assert g.ecc_uncorrected == 3 and g.pcie_width == 8 and g.pcie_width_max == 16
    assert g.clock_event_reasons == "0x0000000000000008" and g.power_limit_w == 700.0
    assert g.retired_pending is None and g.remapped_pending is False  # "[N/A]" and "No"


def test_gpu_query_header_subset_in_any_order():
    # CONSTRUCTED, in the shape of the man page's example (`--query-gpu=index,name,... --format=csv`)
    q = parse_gpu_query("name, index, pcie.link.gen.current, pcie.link.gen.max\nNVIDIA A100-SXM4-80GB, 0, 4, 4\n")
    assert q.gpus[0].index == 0 and q.gpus[0].pcie_gen == 4 and q.gpus[0].ecc_uncorrected is None


def test_gpu_query_driver_failure_text_is_a_parse_error():
    # CONSTRUCTED: the message nvidia-smi prints when the driver is not loaded
    with pytest.raises(ParseError) as e:
        parse_gpu_query("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    assert e.value.line_no == 1


def test_gpu_query_short_row_names_the_line():
    text = gpu_query_csv(n=4)
    lines = text.splitlines()
    with pytest.raises(ParseError) as e:
        parse_gpu_query("\n".join(lines[:3] + [lines[3][:30]]))
    assert e.value.line_no == 4


def test_nvlink_status_inactive_links():
    s = parse_nvlink_status(nvlink_status(n=2, links=18, inactive={1: [4, 5]}))
    assert [g.active for g in s.gpus] == [18, 16] and s.gpus[1].inactive == [4, 5]
    assert s.gpus[0].links[0] == pytest.approx(26.562) and str(s.gpus[0].uuid).startswith("GPU-")


def test_nvlink_without_links_and_garbage():
    s = parse_nvlink_status("GPU 0: NVIDIA RTX 6000 Ada Generation (UUID: GPU-1)\n")  # CONSTRUCTED: no NVLink
    assert s.gpus[0].links == {}
    with pytest.raises(ParseError) as e:
        parse_nvlink_status("GPU 0: X (UUID: GPU-1)\n\t Link 0: fast\n")
    assert e.value.line_no == 2


def test_ibstat_ports_state_rate():
    st_ = parse_ibstat(ibstat_text(ports=4, rate=400, down=[2], rates={3: 200}))
    assert [p.ca for p in st_.ports] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert [p.active for p in st_.ports] == [True, True, False, True]
    assert st_.ports[3].rate_gbps == 200 and st_.ports[0].link_layer == "InfiniBand"
    assert st_.cas[0].firmware == "28.39.1002"


def test_ibstat_truncated_port_is_a_parse_error():
    lines = ibstat_text(ports=2).splitlines()
    cut = lines[: lines.index("\t\tRate: 400", 10)]  # second HCA cut before its Rate
    with pytest.raises(ParseError) as e:
        parse_ibstat("\n".join(cut))
    assert "missing" in str(e.value)


def test_ibv_devinfo_format():
    # CONSTRUCTED from rdma-core's ibv_devinfo field names (no real capture in the shared fixtures)
    text = ("hca_id:\tmlx5_0\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t28.39.1002\n"
            "\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tmax_mtu:\t\t4096 (5)\n"
            "\t\t\tactive_width:\t\t4X (2)\n\t\t\tactive_speed:\t\t100.0 Gbps (64)\n"
            "\t\t\tphys_state:\t\tLINK_UP (5)\n\t\t\tlink_layer:\t\tInfiniBand\n")
    p = parse_ibstat(text).ports[0]
    assert p.active and p.rate_gbps == 400.0 and p.state == "Active"


def test_xid_events_and_critical_codes():
    log = parse_xid(dmesg_xids([("0000:3b:00", 79, "GPU has fallen off the bus."), ("0000:1b:00", 13, "Graphics")]))
    assert [e.code for e in log.events] == [79, 13]
    assert [e.code for e in log.critical] == [79] and log.events[0].pci == "0000:3b:00"
    assert parse_xid("[ 1.0] usb 1-1: new device\n").events == []
    with pytest.raises(ParseError) as e:
        parse_xid("ok\n[ 5.0] NVRM: Xid (PCI:0000:01:00): abc, pid=1\n")
    assert e.value.line_no == 2


SAMPLES = {
    "gpu-query": gpu_query_csv(n=3),
    "nvlink": nvlink_status(n=2, links=4),
    "ibstat": ibstat_text(ports=2),
    "xid": dmesg_xids([("0000:3b:00", 79, "GPU has fallen off the bus.")]),
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_constructed_outputs_never_traceback(data):
    kind = data.draw(st.sampled_from(sorted(SAMPLES)))
    text = SAMPLES[kind]
    if data.draw(st.booleans()):
        text = text[: data.draw(st.integers(0, len(text)))]
    else:
        i = data.draw(st.integers(0, len(text) - 1))
        text = text[:i] + data.draw(st.text(min_size=1, max_size=6)) + text[i + 1:]
    try:
        parser_for(kind)(text)
    except ParseError as exc:
        assert exc.line_no is not None
