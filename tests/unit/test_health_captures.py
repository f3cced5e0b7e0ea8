"""Every real capture in ../shared/fixtures for the deep health checks: what its parse says and what
the judges conclude, as a person reading the capture would (SOURCES.md and the notes there).

Read in place via shared_file (never copied); files marked DOC-EXAMPLE are vendor/tutorial output,
FRAGMENT / EXCERPT ones are partial pastes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from checks.judges.dcgm import judge_dcgm_diag
from checks.judges.finding import worst
from checks.judges.ibstat import judge_ibstat
from checks.judges.memory import judge_gpu_q
from checks.judges.nvbandwidth import judge_nvbandwidth
from checks.judges.nvlink import judge_nvlink_errors, judge_nvlink_status
from checks.judges.perftest import judge_perftest
from checks.judges.xid import classify_xid, judge_xid
from checks.parsers.base import ParseError
from checks.parsers.dcgm_diag import DcgmDiag, DcgmTest, parse_dcgm_diag
from checks.parsers.gpu_q import parse_gpu_q
from checks.parsers.gpu_query import parse_gpu_query
from checks.parsers.ibstat import parse_ibstat
from checks.parsers.nvbandwidth import parse_nvbandwidth
from checks.parsers.nvlink import parse_nvlink_status
from checks.parsers.nvlink_errors import parse_nvlink_errors
from checks.parsers.perftest import parse_perftest
from checks.parsers.xid import parse_xid
from tests.cli_helpers import launch
from tests.conftest import shared_file

pytestmark = pytest.mark.unit


def read(*parts: str) -> str:
    return shared_file(*parts).read_text()


def bad(findings):
    return sorted((f.status, f.component) for f in findings if f.status != "pass")


def ran(d: DcgmDiag, name: str) -> DcgmTest:
    """The test `name` in a dcgmi diag parse, which the capture holds."""
    t = d.test(name)
    assert t is not None, f"no {name!r} in the parse"
    return t


# ------------------------------------------------------------------ dcgmi diag

def test_dcgm_r3_targeted_power_fails_gpu1_only_from_the_second_line_of_its_cell():
    d = parse_dcgm_diag(read("dcgm-diag", "a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-targeted-power-FAIL-gpu1.txt"))
    assert (d.version, d.driver, d.gpu_count, d.layout) == ("3.3.9", "570.195.03", 4, "3.x")
    t = ran(d, "Targeted Power")
    assert t.result == "fail" and t.gpus == {0: "pass", 2: "pass", 3: "pass", 1: "fail"}
    warn = [m for m in t.messages if m.level == "warning"][0]
    assert warn.gpu == 1 and "did not reach desired power minimum target_power_min_ratio of 224.2" in warn.text
    assert [m.gpu for m in t.messages if m.level == "info"] == [0, 2, 3]
    assert ran(d, "EUD Test").all_gpus == "skip"
    f = judge_dcgm_diag(d, node="node0")
    assert bad(f) == [("fail", "GPU 1")] and f[0].node == "node0" and f[0].remediation
    assert "224.1" in f[0].message and f[0].check == "dcgm:Targeted Power"


@pytest.mark.parametrize("name", ["a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-all-pass.txt",
                                  "a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r1-deployment-pass.txt"])
def test_dcgm_passing_runs(name):
    d = parse_dcgm_diag(read("dcgm-diag", name))
    assert d.tests and all(t.result in ("pass", "skip") for t in d.tests)
    assert worst(judge_dcgm_diag(d)) == "pass"


def test_dcgm_h100_fail_early_every_gpu_cuinit():
    d = parse_dcgm_diag(read("dcgm-diag", "h100-8gpu-dcgm3.3.8-r3-fail-early-gpu-memory-FAIL-cuinit-system-not-"
                                          "yet-initialized.txt"))
    t = ran(d, "GPU Memory")
    assert t.all_gpus == "fail" and [m.gpu for m in t.messages] == list(range(8))
    assert "Unable to initialize CUDA library: 'system not yet initialized'" in t.messages[0].text
    assert ran(d, "Persistence Mode").result == "pass" and ran(d, "Persistence Mode").messages[0].level == "info"
    f = judge_dcgm_diag(d)
    assert bad(f) == [("fail", f"GPU {i}") for i in range(8)]
    assert "fabricmanager" in f[0].remediation


def test_dcgm_4x_layout_pcie_internal_error_fails_the_test_not_a_gpu():
    d = parse_dcgm_diag(read("dcgm-diag", "l40s-4gpu-dcgm4.2.3-r2-new-format-pcie-FAIL-internal-error-child-"
                                          "process-TRUNCATED-BY-AUTHOR.txt"))
    assert d.layout == "4.x" and d.device_ids == ["26b9"] * 4
    t = ran(d, "pcie")
    assert t.result == "fail" and t.gpus == {0: "pass", 1: "pass", 2: "pass", 3: "pass"}
    assert len(t.messages) == 4 and all(m.gpu is None for m in t.messages)
    assert ran(d, "memory").gpus == {i: "pass" for i in range(4)}
    f = judge_dcgm_diag(d)
    assert bad(f) == [("fail", "node")] and "internal error" in f[0].remediation.lower()


@pytest.mark.parametrize("name", ["rtxpro6000-blackwell-2gpu-aws-dcgm3.3.9-r3-all-tests-Skip-output-printed-twice.txt",
                                  "gb10-dgx-spark-1gpu-dcgm4.4.2-r3-k8s-pod-all-Skip-except-software-no-top-border.txt"])
def test_dcgm_everything_skipped_is_a_warning_not_a_pass(name):
    d = parse_dcgm_diag(read("dcgm-diag", name))
    f = judge_dcgm_diag(d)
    assert [(x.status, x.check) for x in f] == [("warn", "dcgm:coverage")]
    if "twice" in name:
        assert d.repeated and len(d.tests) == 15  # the second copy is not counted again


def test_dcgm_fragments():
    d = parse_dcgm_diag(read("dcgm-diag", "8gpu-node-dcgm-deployment-error-row-remap-pending-FRAGMENT.txt"))
    assert d.category_messages[0].gpu == 3 and "row remappings are pending" in d.category_messages[0].text
    f = judge_dcgm_diag(d)
    assert bad(f) == [("fail", "GPU 3")] and "row remap" in f[0].remediation
    d = parse_dcgm_diag(read("dcgm-diag", "8gpu-node-r2-gpu-memory-FAIL-gpu0-thermal-violations-FRAGMENT.txt"))
    assert d.truncated and ran(d, "GPU Memory").gpus[0] == "fail"
    assert ran(d, "GPU Memory").messages[0].text.endswith("and any other components.")
    f = judge_dcgm_diag(d)
    assert bad(f) == [("fail", "GPU 0")] and "cooling" in f[0].remediation
    d = parse_dcgm_diag(read("dcgm-diag", "a100-pcie-no-nvlink-dcgm2.4.6-r2-pcie-FAIL-all-nvlink-link-down-warnings-"
                                          "FRAGMENT.txt"))
    assert d.truncated and ran(d, "PCIe").all_gpus == "fail" and ran(d, "PCIe").messages[0].gpu == 0
    assert bad(judge_dcgm_diag(d)) == [("fail", "GPU 0")]


def test_dcgm_garbage_is_a_parse_error():
    with pytest.raises(ParseError):
        parse_dcgm_diag(read("nvlink", "a100-sxm4-80gb-8gpu-nvlink-s-12-links-25gbps-healthy.txt"))


# ------------------------------------------------------------------ nvbandwidth

def test_nvbandwidth_v04_h100_d2d_against_the_azure_figure():
    r = parse_nvbandwidth(read("nvbandwidth", "h100-80gb-8gpu-azure-ndv5-v0.4-d2d-memcpy-read-ce-371gbps.txt"))
    t = r.tests[0]
    assert (r.version, r.model, t.name, t.kind) == ("v0.4", "NVIDIA H100 80GB HBM3", "device_to_device_memcpy_read_ce",
                                                     "device_to_device")
    assert t.rows[0][0] is None and t.rows[2][4] == 372.96 and t.total == 20785.58
    assert min(t.values()) == 370.26
    f = judge_nvbandwidth(r)
    assert worst(f) == "pass" and f[0].threshold == 335.0
    # the same matrix on a GPU model held to a higher figure: every GPU fails, named
    low = judge_nvbandwidth(r, model="H100", peer_median=None)
    assert worst(low) == "pass"


def test_nvbandwidth_other_layouts():
    r = parse_nvbandwidth(read("nvbandwidth", "h100-80gb-8gpu-v0.10.0-d2d-memcpy-read-ce-395gbps-cov-line.txt"))
    assert r.tests[0].cov == 0.0 and r.devices == {} and len(r.tests[0].rows) == 8
    r = parse_nvbandwidth(read("nvbandwidth", "h20-3e-8gpu-v0.8-device-local-copy-1116gbps-hostname-line-EXCERPT.txt"))
    assert r.hostname == "sglang-host-cuda" and r.tests[0].kind == "local" and r.tests[0].per_gpu()[6] == 1117.17
    r = parse_nvbandwidth(read("nvbandwidth", "rtxa6000-6gpu-pcie-no-nvlink-v0.8-d2d-read-ce-22-26gbps-device-list-"
                                              "elided.txt"))
    assert r.tests[0].name == "device_to_device_memcpy_read_ce"  # from the SUM line: `Running` was elided
    assert worst(judge_nvbandwidth(r)) == "pass"  # ~22 vs 26 GB/s across vs within a PCIe switch is normal
    r = parse_nvbandwidth(read("nvbandwidth", "8gpu-nvlink-DOC-EXAMPLE-nvidia-readme-d2d-write-ce-276gbps-old-0.00-"
                                              "diagonal.txt"))
    assert r.tests[0].rows[3][3] is None and min(r.tests[0].values()) == 274.89  # 0.00 diagonal: not measured
    r = parse_nvbandwidth(read("nvbandwidth", "8gpu-DOC-EXAMPLE-nvidia-readme-h2d-memcpy-ce-26gbps-pcie4.txt"))
    assert r.tests[0].host_side == "row" and r.tests[0].per_gpu()[1] == 25.94
    r = parse_nvbandwidth(read("nvbandwidth", "a100-sxm4-40gb-1gpu-v0.8-h2d-memcpy-sm-25gbps.txt"))
    assert r.tests[0].per_gpu() == {0: 25.13}


def test_nvbandwidth_slow_gpu_is_named_against_the_node_median():
    text = read("nvbandwidth", "8gpu-DOC-EXAMPLE-nvidia-readme-h2d-memcpy-ce-26gbps-pcie4.txt")
    slow = text.replace("25.94", "12.10")  # GPU 1 at half the others' host->device figure
    f = judge_nvbandwidth(parse_nvbandwidth(slow), node="n3")
    assert bad(f) == [("fail", "GPU 1")] and f[0].figure == 12.1 and "median" in f[0].message
    f = judge_nvbandwidth(parse_nvbandwidth(text), node="n3", model="H100")  # 26 GB/s on an H100: below 48
    assert {x.status for x in f} == {"fail"} and len(f) == 8 and f[0].threshold == 48.0


# ------------------------------------------------------------------ perftest

def test_perftest_degraded_gpudirect_vs_host_memory_on_the_same_link():
    gdr = parse_perftest(read("perftest", "t4-roce-100g-ib_write_bw-use_cuda-client-10.5gbps-DEGRADED-vs-92.56-host-"
                                          "mem-pcie-ro-warning.txt"))
    host = parse_perftest(read("perftest", "t4-node-roce-100g-ib_write_bw-host-mem-client-rdma_cm-92.56gbps-"
                                           "baseline.txt"))
    assert (gdr.gpu, gdr.device, gdr.link_type, gdr.bw_avg_gbps) == ("Tesla T4", "mlx5_4", "Ethernet", 10.5)
    assert any("relaxed ordering" in w for w in gdr.warnings)
    assert (host.use_cuda, host.bw_avg_gbps) == (False, 92.56)
    assert worst(judge_perftest(host, link_rate_gbps=100)) == "pass"
    f = judge_perftest(gdr, node="t4", link_rate_gbps=100, host_baseline=host)
    assert [(x.status, x.check, x.component) for x in f] == [("fail", "rdma", "mlx5_4"),
                                                             ("fail", "rdma:gpudirect", "mlx5_4")]
    assert f[1].figure == 10.5 and f[1].threshold == 92.56 and "PCIe" in f[1].remediation


def test_perftest_sweep_server_and_healthy_links():
    a = parse_perftest(read("perftest", "a100-sxm4-80gb-ib-100g-ib_write_bw-use_cuda-2qp-a-sweep-client-81gbps.txt"))
    assert len(a.rows) == 23 and a.rows[0].avg_gbps == 0.060962 and a.bw_avg_gbps == 81.24 and a.qps == 2
    base = parse_perftest(read("perftest", "cx6-ib-100g-ib_write_bw-host-mem-a-sweep-client-98.38gbps.txt"))
    assert base.bw_avg_gbps == 98.38
    assert [x.status for x in judge_perftest(a, link_rate_gbps=100, host_baseline=base)] == ["warn", "pass"]
    srv = parse_perftest(read("perftest", "a40-openshift-roce-200g-ib_write_bw-use_cuda-dmabuf-16qp-D60-server-"
                                          "181gbps.txt"))
    cli = parse_perftest(read("perftest", "a40-openshift-roce-200g-ib_write_bw-use_cuda-dmabuf-16qp-D60-client-"
                                          "181gbps.txt"))
    assert srv.server and not cli.server and srv.bw_avg_gbps == cli.bw_avg_gbps == 181.46 and cli.qps == 16
    assert worst(judge_perftest(cli, link_rate_gbps=200)) == "pass"
    cx7 = parse_perftest(read("perftest", "cx7-ndr-b2b-dac-ib_write_bw-client-392gbps-cpu-freq-warning-"
                                          "interleaved.txt"))
    assert cx7.bw_avg_gbps == 392.34 and cx7.warnings[0].startswith("Conflicting CPU frequency")
    assert worst(judge_perftest(cx7, link_rate_gbps=400)) == "pass"
    oci = parse_perftest(read("perftest", "oci-roce-mlx5-100g-ib_write_bw-4qp-rdma_cm-tos41-98gbps.txt"))
    assert (oci.device, oci.qps, oci.settings["TOS"], oci.bw_avg_gbps) == ("mlx5_5", 4, "41", 98.01)
    # the link rate from the node's ibstat: CX-7 mlx5_0 at 400 Gb/s
    ib = parse_ibstat(read("ibstat", "h100-8x-cx7-ib-ndr400-plus-bluefield3-eth200-all-active.txt"))
    f = judge_perftest(cx7, node="n", ibstat=ib)
    assert [(x.status, x.threshold) for x in f] == [("pass", 400.0)]


# ------------------------------------------------------------------ NVLink

def test_nvlink_links_down_and_inactive():
    d = parse_nvlink_errors(read("nvlink", "h100-nvl-2gpu-dcgmi-nvlink-link-status-all-18-links-Down-FAULT.txt"))
    assert d.source == "dcgmi" and [len(g.down) for g in d.gpus] == [18, 18]
    assert bad(judge_nvlink_errors(d)) == [("fail", "GPU 0"), ("fail", "GPU 1")]
    text = read("nvlink", "a100-sxm4-80gb-gpu6-nvlink-s-all-links-inActive-FAULT.txt")
    assert parse_nvlink_errors(text).gpus[0].all_inactive
    s = parse_nvlink_status(text)
    assert s.gpus[0].index == 6 and s.gpus[0].all_inactive
    assert bad(judge_nvlink_status(s)) == [("fail", "GPU 6")]
    for name in ("a100-sxm4-80gb-8gpu-nvlink-s-12-links-25gbps-healthy.txt",
                 "a100-sxm4-80gb-gpu7-nvlink-s-12-links-25gbps-tab-indent.txt",
                 "gb200-nvlink-s-18-links-53.125gbps-FRAGMENT.txt"):
        s = parse_nvlink_status(read("nvlink", name))
        assert all(g.active == len(g.links) for g in s.gpus) and worst(judge_nvlink_status(s)) == "pass"


def test_nvlink_e_counters_doc_example_and_rising_between_reads():
    text = read("nvlink", "h100-nvlink-e-all-zero-DOC-EXAMPLE-anonymised-uuid-elided.txt")  # DOC-EXAMPLE
    e = parse_nvlink_errors(text)
    assert e.elided and sorted(e.gpus[0].counters) == [0, 1, 17]
    assert e.gpus[0].counters[17] == {"Replay Errors": 0, "Recovery Errors": 0, "CRC Errors": 0}
    assert worst(judge_nvlink_errors(e)) == "pass"
    # no real capture has non-zero counters: the later read is the same text with one counter raised
    later = parse_nvlink_errors(text.replace("Link 1: CRC Errors: 0", "Link 1: CRC Errors: 7"))
    f = judge_nvlink_errors(later, before=e, node="n2")
    assert bad(f) == [("fail", "GPU 0 link 1")] and f[0].figure == 7 and "rose from 0 to 7" in f[0].message
    assert bad(judge_nvlink_errors(later)) == [("warn", "GPU 0 link 1")]  # one read: since boot, not proven rising


# ------------------------------------------------------------------ nvidia-smi -q and --query-gpu

def test_gpu_q_healthy_h100_and_page_retirement():
    q = parse_gpu_q(read("nvidia-smi-query", "h100-80gb-hbm3-8gpu-q-full-drv535.161.08-healthy.txt"))
    s = q.gpus[0].summary()
    assert len(q.gpus) == 8 and q.driver == "535.161.08" and s["name"] == "NVIDIA H100 80GB HBM3"
    assert s["sram_uncorrectable_volatile"] == 0 and s["remapped_pending"] is False and s["retired_pending"] is None
    assert s["bank_histogram"]["Max"] == 2560 and worst(judge_gpu_q(q)) == "pass"
    q = parse_gpu_q(read("nvidia-smi-query", "azure-vm-8gpu-q-d-page-retirement-drv535.86.10-all-zero.txt"))
    assert len(q.gpus) == 8 and q.gpus[7].summary()["retired_double_bit"] == 0 and worst(judge_gpu_q(q)) == "pass"
    text = read("nvidia-smi-query", "azure-vm-8gpu-q-d-page-retirement-drv535.86.10-all-zero.txt")
    worse = text.replace("Double Bit ECC                    : 0", "Double Bit ECC                    : 11", 1)
    f = judge_gpu_q(parse_gpu_q(worse), node="vm")
    assert [(x.status, x.component, x.figure, x.threshold) for x in f] == [("fail", "GPU 00000001:00:00.0", 11, 10)]
    pending = text.replace("Pending Page Blacklist            : No", "Pending Page Blacklist            : Yes", 1)
    assert bad(judge_gpu_q(parse_gpu_q(pending))) == [("fail", "GPU 00000001:00:00.0")]


def test_gpu_q_faults():
    q = parse_gpu_q(read("nvidia-smi-query", "a10-1gpu-q-full-drv535.129.03-remapped-rows-uncorrectable4-pending-"
                                             "yes.txt"))
    s = q.gpus[0].summary()
    assert (s["remapped_uncorrectable"], s["remapped_pending"], s["bank_histogram"]["Max"]) == (4, True, 192)
    f = judge_gpu_q(q, node="a10")
    assert bad(f) == [("fail", "GPU 00000000:07:00.0")] and "reset the GPU" in f[0].remediation
    q = parse_gpu_q(read("nvidia-smi-query", "gpu-q-ecc-errors-sram-uncorrectable-volatile1-aggregate5-FRAGMENT.txt"))
    s = q.gpus[0].summary()
    assert (s["sram_uncorrectable_volatile"], s["sram_uncorrectable_aggregate"]) == (1, 5)
    assert [x.status for x in judge_gpu_q(q)] == ["fail"]
    q = parse_gpu_q(read("nvidia-smi-query", "nvidia-smi-plain-unable-to-determine-device-handle-unknown-error-after-"
                                             "xid79.txt"))
    assert q.inaccessible == {"0000:A1:00.0": "Unknown Error"}
    assert bad(judge_gpu_q(q)) == [("fail", "GPU 0000:A1:00.0")]


def test_gpu_query_csv_captures_and_idle_pcie_gen1_is_not_flagged():
    from checks.judges.config import JudgeConfig
    from checks.judges.hardware import gpu_health

    q = parse_gpu_query(read("nvidia-smi-query", "l40s-8gpu-query-gpu-csv-pcie-link-gen-width-idle-gen1-of-gen4-x16.txt"))
    assert [(g.pcie_gen, g.pcie_gen_max, g.pcie_width) for g in q.gpus] == [(1, 4, 16)] * 8
    assert {c.check: c.status for c in gpu_health("l40s", q, JudgeConfig())}["pcie"] == "pass"
    q = parse_gpu_query(read("nvidia-smi-query", "rtxpro6000-blackwell-2gpu-query-gpu-csv-clocks-event-reasons-sw-"
                                                 "power-cap-active.txt"))
    assert q.gpus[0].clock_event_reasons == "0x0000000000000004"
    assert q.gpus[0].raw["clocks_event_reasons.sw_power_cap"] == "Active"
    assert {c.check: c.status for c in gpu_health("b", q, JudgeConfig())}["clocks"] == "pass"
    q = parse_gpu_query(read("nvidia-smi-query", "rtxpro6000-blackwell-2gpu-query-gpu-csv-temp-power-ecc-volatile.txt"))
    assert (q.gpus[0].power_draw_w, q.gpus[1].power_limit_w, q.gpus[1].ecc_uncorrected) == (30.39, 600.0, 0)


# ------------------------------------------------------------------ ibstat / ibstatus / ibv_devinfo

def test_ibstat_unused_ethernet_ports_are_not_flagged():
    ib = parse_ibstat(read("ibstat", "8x-cx7-ib-ndr400-plus-cx6dx-eth-3-ports-down-disabled.txt"))
    assert [f"{p.ca}/{p.port}" for p in ib.unused_ethernet] == ["mlx5_2/1", "mlx5_7/1", "mlx5_8/1"]
    assert sum(p.active for p in ib.ports) == 9
    f = judge_ibstat(ib)
    assert worst(f) == "pass" and "3 unused Ethernet ports" in f[0].message
    from checks.judges.config import JudgeConfig
    from checks.judges.hardware import ib_check

    best: dict[str, float] = {}
    for p in ib.ports:
        if p.active:
            assert p.rate_gbps is not None, p
            best[p.ca] = p.rate_gbps
    assert ib_check("n", ib, JudgeConfig(), best, {(p.ca, p.port) for p in ib.ports if p.active}).status == "pass"


def test_ibstat_adapter_vanishing_mid_listing():
    ib = parse_ibstat(read("ibstat", "azure-a100-8x-cx6-vf-hdr200-ibpanic-mlx5_8-missing-exit255.txt"))
    assert len(ib.cas) == 8 and ib.missing == ["mlx5_8"] and ib.errors[0].startswith("ibpanic:")
    assert bad(judge_ibstat(ib)) == [("fail", "mlx5_8")]
    from checks.judges.config import JudgeConfig
    from checks.judges.hardware import ib_check

    c = ib_check("vm", ib, JudgeConfig(), {}, set())
    assert c.status == "fail" and "mlx5_8 vanished" in c.message



def test_ib_port_without_a_rate_is_not_held_to_another_nodes_rate():
    """ibv_devinfo (the probe's fallback where ibstat is missing) prints no rate: a node read that way beside one
    read by ibstat is judged on its port states, not crashed on (assemble raised TypeError formatting None)."""
    from checks.judges.config import JudgeConfig
    from checks.judges.hardware import ib_check

    ib = parse_ibstat(read("ibstat", "ibv_devinfo-h100-node-12x-cx7-roce-10-active-2-PORT_DOWN.txt"))
    active = {(p.ca, p.port) for p in ib.ports if p.active}
    assert all(p.rate_gbps is None for p in ib.ports if p.active)
    c = ib_check("n", ib, JudgeConfig(), {p.ca: 400.0 for p in ib.ports}, active)
    assert c.figure == len(active) and "runs at" not in c.message
    assert ib_check("n", ib, JudgeConfig(ib_rate_gbps=400.0), {}, active).status == c.status

@pytest.mark.parametrize("name,ports,rates", [
    ("h100-12ca-roce-cx7-400g-cx6dx-100g-all-active.txt", 12, {400.0, 100.0}),
    ("h100-8x-cx7-ib-ndr400-plus-bluefield3-eth200-all-active.txt", 9, {400.0, 200.0}),
    ("a100-vm-9x-mlx5-vf-hdr200-all-active.txt", 9, {200.0}),
    ("ibstatus-azure-a100-8x-hdr200-all-active.txt", 9, {200.0, 40.0}),
])
def test_ibstat_all_active(name, ports, rates):
    ib = parse_ibstat(read("ibstat", name))
    assert len(ib.ports) == ports and all(p.active for p in ib.ports)
    assert {p.rate_gbps for p in ib.ports} == rates and worst(judge_ibstat(ib)) == "pass"


def test_ibv_devinfo_two_ethernet_ports_down():
    ib = parse_ibstat(read("ibstat", "ibv_devinfo-h100-node-12x-cx7-roce-10-active-2-PORT_DOWN.txt"))
    assert len(ib.ports) == 12 and sum(p.active for p in ib.ports) == 10
    # the listing order is mlx5_0..mlx5_11: the down ones are mlx5_9 and mlx5_11
    assert [p.ca for p in ib.ports if not p.active] == ["mlx5_9", "mlx5_11"]
    assert bad(judge_ibstat(ib)) == [("warn", "mlx5_11/1"), ("warn", "mlx5_9/1")]


# ------------------------------------------------------------------ Xid

XID_EXPECT = {
    "akash-provider-gpu-xid79-fallen-off-bus-dmesg-T-crash-dump-multiline.txt": [("fail", "GPU 0000:a1:00")],
    "akash-provider-vm-xid43-xid31-mmu-fault-xid94-contained-dmesg-T-EXCERPT.txt":
        [("warn", "GPU 0000:00:05"), ("warn", "GPU 0000:00:07"), ("warn", "GPU 0000:00:08")],
    # Xid 109 (context switch timeout): NVIDIA's catalog says RESET_GPU; Xid 13 is the application's
    "gpu-dmesg-ctime-xid13-illegal-instruction-xid109-ctx-switch-timeout-peermem.txt":
        [("fail", "GPU 0000:cb:00"), ("warn", "GPU 0000:cb:00")],
    "gpu-xid48-dbe-then-xid63-row-remap-then-xid94-contained-iso-timestamps.txt":
        [("fail", "GPU 0000:19:00"), ("fail", "GPU 0000:19:00"), ("warn", "GPU 0000:19:00")],
    "hgx-dell-xe9680-gpu4-xid119-gsp-rpc-timeout-dmesg-T-with-stack.txt": [("fail", "GPU 0000:9b:00")],
    "journal-kernel-xid45-caused-by-previous-xid149-xid145-nvlink-EXCERPT.txt":
        [("fail", "GPU 0000:97:00"), ("fail", "GPU 0000:ba:00"), ("fail", "GPU 0000:dc:00"), ("fail", "GPU 0000:ed:00")],
    "k8s-worker-xid48-dbe-xid64-blacklisting-failed-plus-rminitadapter-failed-syslog-EXCERPT.txt":
        [("fail", "GPU 0000:07:00"), ("fail", "GPU 0000:07:00"), ("fail", "GPU 0000:0a:00")],
    "pci-10de-26b5-fallen-off-bus-multiline-NO-xid-drv570.158.01-dmesg.txt": [("fail", "GPU 0000:b3:00")],
    "xid13-sm-out-of-range-address-burst-629-lines-plus-xid43-dmesg-decode-iso.txt":
        [("warn", "GPU 0000:38:00"), ("warn", "GPU 0000:38:00")],
}


@pytest.mark.parametrize("name", sorted(XID_EXPECT))
def test_xid_captures_hardware_fails_application_warns(name):
    log = parse_xid(read("xid", name))
    assert bad(judge_xid(log, node="n")) == XID_EXPECT[name]


def test_xid_details():
    log = parse_xid(read("xid", "xid13-sm-out-of-range-address-burst-629-lines-plus-xid43-dmesg-decode-iso.txt"))
    assert [e.code for e in log.events].count(13) == 629 and [e.code for e in log.events].count(43) == 7
    log = parse_xid(read("xid", "pci-10de-26b5-fallen-off-bus-multiline-NO-xid-drv570.158.01-dmesg.txt"))
    assert log.events == [] and log.fallen_off_bus == ["0000:b3:00"]
    log = parse_xid(read("xid", "akash-provider-gpu-xid79-fallen-off-bus-dmesg-T-crash-dump-multiline.txt"))
    assert log.fallen_off_bus == ["0000:a1:00"] and len(judge_xid(log)) == 1  # the Xid 79 line, not twice
    assert classify_xid(45, "Ch 00000001 caused by previous Xid 149")[1] == "fail"
    assert classify_xid(45, "Ch 00000001")[1] == "warn"


# ------------------------------------------------------------------ the CLI

def test_preflight_parse_prints_the_parse_and_the_findings():
    gdr = shared_file("perftest", "t4-roce-100g-ib_write_bw-use_cuda-client-10.5gbps-DEGRADED-vs-92.56-host-mem-"
                                  "pcie-ro-warning.txt")
    host = shared_file("perftest", "t4-node-roce-100g-ib_write_bw-host-mem-client-rdma_cm-92.56gbps-baseline.txt")
    p = launch("preflight", "parse", "perftest", str(gdr), "--against", str(host), "--link-rate", "100",
                "--node", "t4node", "--json")
    assert p.returncode == 1, p.stderr
    out = json.loads(p.stdout)
    assert out["status"] == "fail" and out["parse"]["bw_avg_gbps"] == 10.5
    assert {(f["node"], f["component"], f["check"]) for f in out["findings"]} == {
        ("t4node", "mlx5_4", "rdma"), ("t4node", "mlx5_4", "rdma:gpudirect")}
    ok = launch("preflight", "parse", "dcgm-diag",
                 str(shared_file("dcgm-diag", "a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-all-pass.txt")))
    assert ok.returncode == 0 and ok.stdout.startswith("dcgm-diag ") and "PASS" in ok.stdout
    wrong = launch("preflight", "parse", "gpu-q", str(gdr))
    assert wrong.returncode == 2 and "gpu-q" in wrong.stderr and "Traceback" not in wrong.stderr


@pytest.mark.parametrize("name,status", [
    ("journal-kernel-xid45-caused-by-previous-xid149-xid145-nvlink-EXCERPT.txt", "fail"),  # NVLink Xids behind 45
    ("pci-10de-26b5-fallen-off-bus-multiline-NO-xid-drv570.158.01-dmesg.txt", "fail"),
    ("xid13-sm-out-of-range-address-burst-629-lines-plus-xid43-dmesg-decode-iso.txt", "warn"),  # the application's
])
def test_bandwidth_map_xid_check_follows_the_catalog(tmp_path, name, status):
    from checks.assemble import assemble
    from checks.folder import load_dir

    (tmp_path / "n1").mkdir()
    (tmp_path / "n1" / "xid.txt").write_text(read("xid", name))
    c = next(x for x in assemble(load_dir(tmp_path)).checks if x.check == "xid")
    assert (c.node, c.status) == ("n1", status) and "GPU 0000:" in c.message


FUZZ_SEEDS = {
    "dcgm-diag": ("dcgm-diag", "a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-targeted-power-FAIL-gpu1.txt"),
    "nvbandwidth": ("nvbandwidth", "h100-80gb-8gpu-azure-ndv5-v0.4-d2d-memcpy-read-ce-371gbps.txt"),
    "perftest": ("perftest", "a100-sxm4-80gb-ib-100g-ib_write_bw-use_cuda-2qp-a-sweep-client-81gbps.txt"),
    "nvlink-errors": ("nvlink", "h100-nvl-2gpu-dcgmi-nvlink-link-status-all-18-links-Down-FAULT.txt"),
    "gpu-q": ("nvidia-smi-query", "a10-1gpu-q-full-drv535.129.03-remapped-rows-uncorrectable4-pending-yes.txt"),
    "ibstat": ("ibstat", "azure-a100-8x-cx6-vf-hdr200-ibpanic-mlx5_8-missing-exit255.txt"),
    "xid": ("xid", "pci-10de-26b5-fallen-off-bus-multiline-NO-xid-drv570.158.01-dmesg.txt"),
}


def test_fuzz_real_captures_cut_or_garbled_never_traceback():
    """Cut or garbled real outputs: a parse (then the judges run) or a ParseError naming a line, nothing else."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from checks.judges.kinds import judge_parsed
    from checks.parsers import parser_for

    seeds = {k: read(*v) for k, v in FUZZ_SEEDS.items()}

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def run(data):
        kind = data.draw(st.sampled_from(sorted(seeds)))
        text = seeds[kind]
        if data.draw(st.booleans()):
            text = text[: data.draw(st.integers(0, len(text)))]
        else:
            i = data.draw(st.integers(0, len(text) - 1))
            text = text[:i] + data.draw(st.text(min_size=1, max_size=8)) + text[i + 1:]
        try:
            parsed = parser_for(kind)(text)
        except ParseError:
            return
        assert all(f.status in ("pass", "warn", "fail") for f in judge_parsed(kind, parsed, node="n"))

    run()


@pytest.mark.parametrize("how", ["stderr-line", "tabs", "crlf"])
def test_gpu_q_verdict_survives_stray_lines_tabs_and_crlf(how):
    """One stderr line interleaved inside "Remapped Rows", tab indentation or CRLF line ends do not turn
    a GPU with 4 uncorrectable, pending rows into a pass (issue 23)."""
    text = read("nvidia-smi-query", "a10-1gpu-q-full-drv535.129.03-remapped-rows-uncorrectable4-pending-yes.txt")
    if how == "stderr-line":
        text = text.replace("    Remapped Rows\n", "    Remapped Rows\nWARNING: infoROM is corrupted at gpu 0000:07:00.0\n")
    elif how == "tabs":
        text = "\n".join(ln.replace("    ", "\t") for ln in text.splitlines())
    else:
        text = text.replace("\n", "\r\n")
    s = parse_gpu_q(text).gpus[0].summary()
    assert (s["remapped_uncorrectable"], s["remapped_pending"]) == (4, True)
    assert bad(judge_gpu_q(parse_gpu_q(text), node="a10")) == [("fail", "GPU 00000000:07:00.0")]


@pytest.mark.parametrize("name", ["h100-80gb-8gpu-azure-ndv5-v0.4-d2d-memcpy-read-ce-371gbps.txt",
                                  "h100-80gb-8gpu-v0.10.0-d2d-memcpy-read-ce-395gbps-cov-line.txt",
                                  "8gpu-DOC-EXAMPLE-nvidia-readme-h2d-memcpy-ce-26gbps-pcie4.txt",
                                  "h20-3e-8gpu-v0.8-device-local-copy-1116gbps-hostname-line-EXCERPT.txt",
                                  "8gpu-nvlink-DOC-EXAMPLE-nvidia-readme-d2d-write-ce-276gbps-old-0.00-diagonal.txt"])
def test_nvbandwidth_cut_anywhere_reads_only_what_is_whole(name):
    """A capture cut at any byte gives the rows it holds whole, or a ParseError: never a figure the tool
    did not print (a last row cut mid-number, "370.9" read as 37: issue 23)."""
    from checks.parsers.nvbandwidth import parse_nvbandwidth

    text = read("nvbandwidth", name)
    full = {t.name: t for t in parse_nvbandwidth(text).tests}
    for cut in range(1, len(text)):
        try:
            part = parse_nvbandwidth(text[:cut])
        except ParseError:
            continue
        for t in part.tests:
            whole = full.get(t.name) or next(iter(full.values()))
            assert all(whole.rows.get(r) == row for r, row in t.rows.items()), (cut, t.name)
            assert t.total in (None, whole.total) and t.cov in (None, whole.cov), cut


@pytest.mark.parametrize("kind, folder, name", [
    ("dcgm-diag", "dcgm-diag", "a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-targeted-power-FAIL-gpu1.txt"),
    ("ibstat", "ibstat", "azure-a100-8x-cx6-vf-hdr200-ibpanic-mlx5_8-missing-exit255.txt"),
    ("nvlink-errors", "nvlink", "h100-nvl-2gpu-dcgmi-nvlink-link-status-all-18-links-Down-FAULT.txt"),
    ("nvbandwidth", "nvbandwidth", "h100-80gb-8gpu-v0.10.0-d2d-memcpy-read-ce-395gbps-cov-line.txt"),
    ("gpu-q", "nvidia-smi-query", "a10-1gpu-q-full-drv535.129.03-remapped-rows-uncorrectable4-pending-yes.txt"),
])
@pytest.mark.parametrize("mark", ["....", "…", "[...]", "  <snip>", "... (12 lines omitted)"])
def test_a_pasted_capture_with_an_elided_line_is_judged_on_the_rest(kind, folder, name, mark):
    """A person's "...." in a pasted capture is not the tool's: the rest reads the same as the whole
    capture (it refused the whole capture, issue 23), and parsers that note an elision note it."""
    from checks.parsers import NOTES_ELISIONS, parser_for
    from checks.parsers.base import to_jsonable

    text = read(folder, name)
    lines = text.splitlines()
    mid = len(lines) // 2
    elided = "\n".join(lines[:mid] + [mark] + lines[mid:]) + "\n"
    got, whole = to_jsonable(parser_for(kind)(elided)), to_jsonable(parser_for(kind)(text))
    flags = {"truncated", "elided"}
    assert {k: v for k, v in got.items() if k not in flags} == {k: v for k, v in whole.items() if k not in flags}
    if kind in NOTES_ELISIONS:
        assert any(got.get(f) for f in flags), got


CAPTURE_KINDS = {"perftest": "perftest", "nccl-tests": "nccl-tests", "nvbandwidth": "nvbandwidth",
                 "dcgm-diag": "dcgm-diag", "gpu-q": "nvidia-smi-query", "nvlink-errors": "nvlink", "ibstat": "ibstat"}


def _figures(obj, out: set) -> set:
    if isinstance(obj, dict):
        for v in obj.values():
            _figures(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _figures(v, out)
    elif isinstance(obj, float):
        out.add(obj)
    return out


@pytest.mark.parametrize("kind", sorted(CAPTURE_KINDS))
def test_captures_cut_at_every_hundredth_invent_no_figure(kind):
    """Every real capture of a kind, cut at every 1 % of its bytes: the parse holds only figures the whole
    capture holds, or is a ParseError (a last line cut mid-number was a measurement, issue 23)."""
    from checks.parsers import parser_for
    from checks.parsers.base import to_jsonable

    names = sorted(p.name for p in shared_file(CAPTURE_KINDS[kind]).iterdir())
    parse = parser_for(kind)
    for name in names:
        text = read(CAPTURE_KINDS[kind], name)
        try:
            whole = _figures(to_jsonable(parse(text)), set())
        except ParseError:
            continue
        for cut in sorted({len(text) * i // 100 for i in range(1, 100)}):
            try:
                part = _figures(to_jsonable(parse(text[:cut])), set())
            except ParseError:
                continue
            assert part <= whole, (name, cut, sorted(part - whole)[:3])


@pytest.mark.parametrize("kind, folder, name", [
    ("dcgm-diag", "dcgm-diag", "a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-targeted-power-FAIL-gpu1.txt"),
    ("nvlink-errors", "nvlink", "h100-nvl-2gpu-dcgmi-nvlink-link-status-all-18-links-Down-FAULT.txt"),
    ("nvlink-errors", "nvlink", "h100-nvlink-e-all-zero-DOC-EXAMPLE-anonymised-uuid-elided.txt"),
    ("perftest", "perftest", "a100-sxm4-80gb-ib-100g-ib_write_bw-use_cuda-2qp-a-sweep-client-81gbps.txt"),
    ("gpu-q", "nvidia-smi-query", "a10-1gpu-q-full-drv535.129.03-remapped-rows-uncorrectable4-pending-yes.txt"),
    ("xid", "xid", "pci-10de-26b5-fallen-off-bus-multiline-NO-xid-drv570.158.01-dmesg.txt"),
    ("xid", "xid", "journal-kernel-xid45-caused-by-previous-xid149-xid145-nvlink-EXCERPT.txt"),
])
def test_a_stderr_line_anywhere_leaves_the_verdict_as_it_was(kind, folder, name):
    """A line from another stream (a CPU-frequency warning, a locale warning) put between any two lines
    of a capture, with CRLF line ends too: the same findings as the clean capture (it changed the
    verdict or refused the capture, issue 23)."""
    from checks.judges.kinds import judge_parsed
    from checks.parsers import parser_for

    def verdict(text: str) -> list[tuple[str, str]]:
        return [(f.status, f.component) for f in judge_parsed(kind, parser_for(kind)(text), node="n")]

    text = read(folder, name)
    want = verdict(text)
    lines = text.splitlines()
    for pos in range(1, len(lines)):
        for junk in ("Conflicting CPU frequency values detected: 1500.000000 != 3400.000000",
                     "bash: warning: setlocale: LC_ALL: cannot change locale (en_US.UTF-8)"):
            mixed = "\n".join(lines[:pos] + [junk] + lines[pos:]) + "\n"
            assert verdict(mixed) == want, (pos, junk)
            assert verdict(mixed.replace("\n", "\r\n")) == want, (pos, "crlf")


def _line_span(text: str, at: int) -> tuple[int, int]:
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    return start, (len(text) if end < 0 else end + 1)


#: what a capture suffers on its way to a parser, applied at a position: cut there (a full disk, a killed
#: tool), the cut with CRLF line ends, one character changed, a stray coloured stderr line inserted, the
#: line there lost, the line there repeated
MUTATIONS: dict[str, Callable[[str, int], str]] = {
    "cut": lambda t, at: t[:at],
    "cut-crlf": lambda t, at: t[:at].replace("\n", "\r\n"),
    "char-changed": lambda t, at: t[:at] + ("#" if t[at:at + 1] != "#" else "%") + t[at + 1:],
    "stray-line": lambda t, at: t[:at] + "\n\x1b[31mWARNING: stray \x00 line\x1b[0m\n" + t[at:],
    "line-lost": lambda t, at: t[:_line_span(t, at)[0]] + t[_line_span(t, at)[1]:],
    "line-doubled": lambda t, at: t[:_line_span(t, at)[1]] + t[slice(*_line_span(t, at))] + t[_line_span(t, at)[1]:],
}
MUTATED_KINDS = {**CAPTURE_KINDS, "xid": "xid", "topo": "topo"}


@pytest.mark.parametrize("kind", sorted(MUTATED_KINDS))
def test_mutated_captures_at_every_tenth_give_a_verdict_or_a_parse_error(kind):
    """Every real capture of a kind, mutated (MUTATIONS) at every 10 % of its length: the parser returns a
    parse the judges give pass / warn / fail on, or a ParseError; never another exception (issue 23)."""
    from checks.judges.kinds import judge_parsed
    from checks.parsers import JUDGED_KINDS, parser_for
    from checks.parsers.base import to_jsonable

    parse = parser_for(kind)
    names = sorted(p.name for p in shared_file(MUTATED_KINDS[kind]).iterdir())
    for name in names:
        text = read(MUTATED_KINDS[kind], name)
        for at in sorted({len(text) * i // 10 for i in range(11)}):
            for how, mutate in MUTATIONS.items():
                try:
                    parsed = parse(mutate(text, at))
                except ParseError:
                    continue
                except Exception as exc:  # noqa: BLE001 - the failure this test is for
                    raise AssertionError(f"{name} {how} at {at}: {type(exc).__name__}: {exc}") from exc
                to_jsonable(parsed)
                if kind in JUDGED_KINDS:
                    assert {f.status for f in judge_parsed(kind, parsed, node="n")} <= {"pass", "warn", "fail"}
