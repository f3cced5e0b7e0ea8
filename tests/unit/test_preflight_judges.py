"""Judging and BandwidthMap assembly from outputs laid out for `launch preflight import`.

topo and nccl-tests outputs are the real captures from ../shared/fixtures; gpu-query, nvlink, ibstat
and kernel-log files are CONSTRUCTED (tests/replay/constructed.py: no real capture exists there).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checks.assemble import assemble
from checks.folder import load_dir
from checks.judges.config import JudgeConfig, JudgeConfigError
from checks.judges.figures import at_least, outliers
from launcher.formats.bwmap import BandwidthMap
from tests.cli_helpers import launch as cli
from tests.conftest import REPO, shared_file
from tests.replay.constructed import dmesg_xids, gpu_query_csv, ibstat_text, nvlink_status

pytestmark = pytest.mark.unit

H100_TOPO = "h100-sxm-8gpu-12nic-mlx5-1numa.txt"
H100_NODE = "h100-1node-8gpu-5colls-v2.17.8.txt"
PAIR_OK = "h100-a3mega-2node-16gpu-all_reduce_perf.txt"
PAIR_SLOW = "a100-oci-bm-gpu4.8-2node-16gpu-all_reduce_perf-10G-single-size.txt"


def make_dir(tmp: Path, hosts: list[str], bad: dict[str, dict[str, str]] | None = None,
             pairs: dict[tuple[str, str], str] | None = None) -> Path:
    """DIR/<host>/... healthy H100 nodes; `bad[host][file] = text` replaces one output."""
    for h in hosts:
        d = tmp / h
        d.mkdir(parents=True)
        files = {
            "topo.txt": shared_file("topo", H100_TOPO).read_text(),
            "gpu-query.csv": gpu_query_csv(),
            "nvlink.txt": nvlink_status(),
            "ibstat.txt": ibstat_text(),
            "xid.txt": "",
            "nccl-node.txt": shared_file("nccl-tests", H100_NODE).read_text(),
        }
        files.update((bad or {}).get(h, {}))
        for name, text in files.items():
            (d / name).write_text(text)
    for (a, b), fixture in (pairs or {}).items():
        (tmp / "pairs").mkdir(exist_ok=True)
        (tmp / "pairs" / f"{a}+{b}.txt").write_text(shared_file("nccl-tests", fixture).read_text())
    return tmp


def failing(bw: BandwidthMap) -> set[tuple[str, str]]:
    return {(c.node, c.check) for c in bw.checks if c.status == "fail"}


HOSTS = ["n1", "n2", "n3", "n4"]


def test_healthy_cluster_passes_with_figures(tmp_path):
    d = make_dir(tmp_path, HOSTS, pairs={("n1", "n2"): PAIR_OK, ("n3", "n4"): PAIR_OK, ("n2", "n3"): PAIR_OK,
                                         ("n4", "n1"): PAIR_OK})
    bw = assemble(load_dir(d))
    assert failing(bw) == set() and bw.exclude == []
    assert bw.intra_node_busbw_gbs == 482.27 and bw.inter_node_busbw_gbs == 338.82
    assert bw.ratio == pytest.approx(482.27 / 338.82)
    n = bw.nodes["n1"]
    assert n.gpus == 8 and n.gpu_model == "NVIDIA H100 80GB HBM3" and n.nvlink_groups == [list(range(8))]
    assert n.gpu_nic["GPU3"] == "mlx5_5" and n.links["GPU0"]["GPU1"] == "NV18"
    c = next(c for c in bw.checks if c.node == "n1" and c.check == "nccl_node")
    assert (c.status, c.value, c.threshold) == ("pass", 482.27, 460.0)
    again = BandwidthMap.from_dict(json.loads(json.dumps(bw.to_dict())))  # JSON round trip keeps the contract
    assert again.nodes["n1"].gpu_nic == n.gpu_nic and again.inter_node_busbw_gbs == 338.82


@pytest.mark.parametrize("bad_file,text_fn,check", [
    ("gpu-query.csv", lambda: gpu_query_csv(overrides={5: {"ecc.errors.uncorrected.volatile.total": "12"}}), "ecc"),
    ("gpu-query.csv", lambda: gpu_query_csv(n=7), "gpu_count"),
    ("gpu-query.csv", lambda: gpu_query_csv(overrides={1: {"pcie.link.width.current": "8"}}), "pcie"),
    ("gpu-query.csv", lambda: gpu_query_csv(overrides={0: {"remapped_rows.failure": "Yes"}}), "ecc"),
    ("gpu-query.csv", lambda: gpu_query_csv(name="NVIDIA A100-SXM4-80GB"), "gpu_model"),
    ("nvlink.txt", lambda: nvlink_status(inactive={6: [0, 1, 2]}), "nvlink"),
    ("nvlink.txt", lambda: "", "nvlink"),
    ("ibstat.txt", lambda: ibstat_text(down=[3]), "ib"),
    ("ibstat.txt", lambda: ibstat_text(rates={2: 200}), "ib"),
    ("xid.txt", lambda: dmesg_xids([("0000:3b:00", 79, "GPU has fallen off the bus.")]), "xid"),
    ("nccl-node.txt", lambda: shared_file("nccl-tests",
                                          "rtx3090-2node-1gpu-all_reduce_perf-WRONG-nonzero-108-FAILED.txt").read_text(),
     "nccl_node"),
    ("nccl-node.txt", lambda: shared_file("nccl-tests", "h100-pairwise-2node-8gpu-FAIL-remote-process-exited.txt")
     .read_text(), "nccl_node"),
    ("nccl-node.txt", lambda: shared_file("nccl-tests", "h100-1node-4gpu-5colls-v2.17.8.txt").read_text(), "nccl_node"),
    ("topo.txt", lambda: "garbage\n", "topology"),
])
def test_one_bad_output_fails_exactly_that_node_and_check(tmp_path, bad_file, text_fn, check):
    d = make_dir(tmp_path, HOSTS, bad={"n3": {bad_file: text_fn()}})
    bw = assemble(load_dir(d))
    assert {n for n, _ in failing(bw)} == {"n3"}, bw.checks
    assert ("n3", check) in failing(bw)
    assert bw.exclude == ["n3"]


def test_idle_gpu_link_downshift_is_not_a_warning(tmp_path):
    d = make_dir(tmp_path, ["a", "b"], bad={"a": {"gpu-query.csv": gpu_query_csv(overrides={
        0: {"pcie.link.gen.current": "1", "clocks_event_reasons.active": "0x0000000000000001"}})}})
    bw = assemble(load_dir(d))
    assert next(c for c in bw.checks if c.node == "a" and c.check == "pcie").status == "pass"


def test_warnings_do_not_fail(tmp_path):
    d = make_dir(tmp_path, HOSTS, bad={"n2": {
        "gpu-query.csv": gpu_query_csv(overrides={0: {"pcie.link.gen.current": "1", "ecc.errors.corrected"
                                                      ".volatile.total": "20000",
                                                      "clocks_event_reasons.active": "0x0000000000000020"}}),
        "xid.txt": dmesg_xids([("0000:1b:00", 13, "Graphics SM Warp Exception")])}})
    bw = assemble(load_dir(d))
    assert failing(bw) == set()
    warned = {(c.node, c.check) for c in bw.checks if c.status == "warn"}
    assert {("n2", "pcie"), ("n2", "ecc"), ("n2", "clocks"), ("n2", "xid")} <= warned


def test_slow_pair_blames_the_node_whose_every_pair_is_slow(tmp_path):
    pairs = {("n1", "n2"): PAIR_OK, ("n3", "n4"): PAIR_SLOW, ("n2", "n3"): PAIR_SLOW, ("n4", "n1"): PAIR_OK}
    bw = assemble(load_dir(make_dir(tmp_path, HOSTS, pairs=pairs)))
    assert failing(bw) == {("n3", "nccl_inter")}
    c = next(c for c in bw.checks if c.node == "n3" and c.check == "nccl_inter")
    assert c.value == 222.88 and "outlier" in c.message
    assert [(p.a, p.b, p.status) for p in bw.pairs[:2]] == [("n2", "n3", "fail"), ("n3", "n4", "fail")]
    assert bw.inter_node_busbw_gbs == 338.82  # median over pairs without the excluded node
    from checks.report import render

    text = render(bw)
    pair_lines = [ln for ln in text.splitlines() if "<->" in ln]
    assert [float(ln.split()[0]) for ln in pair_lines] == [222.9, 222.9, 338.8, 338.8]  # slowest first
    assert "FAIL  n3           nccl_inter" in text and "Exclude: n3" in text


def test_thresholds_file_and_overrides(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("outlier_fail: 0.5\nmodels:\n  H100:\n    intra_busbw_gbs: 490\n")
    cfg = JudgeConfig.load(f)
    assert cfg.for_model("NVIDIA H100 80GB HBM3").intra_busbw_gbs == 490 and cfg.outlier_fail == 0.5
    assert cfg.for_model("NVIDIA A100-SXM4-40GB").intra_busbw_gbs == 228.0
    assert cfg.for_model("Tesla V100-SXM3-32GB").intra_busbw_gbs is None
    bw = assemble(load_dir(make_dir(tmp_path / "d", HOSTS)), cfg)
    assert {c for _, c in failing(bw)} == {"nccl_node"}  # 482.27 < 490 on every node
    f.write_text("nonsense_key: 1\n")
    with pytest.raises(JudgeConfigError, match="unknown key 'nonsense_key'"):
        JudgeConfig.load(f)


def test_judge_primitives():
    assert at_least("n", "x", 10, 20, 0.0).status == "fail"
    assert at_least("n", "x", 20.5, 20, 0.05).status == "warn"
    assert at_least("n", "x", 30, 20, 0.05).status == "pass"
    assert at_least("n", "x", 30, None, 0.05).threshold is None
    flagged = outliers({"a": 100, "b": 98, "c": 101, "d": 60, "e": 85}, 0.75, 0.9)
    assert flagged["d"][0] == "fail" and flagged["e"][0] == "warn" and "a" not in flagged
    assert outliers({"a": 100, "b": 1}, 0.75, 0.9) == {}  # two values: no median to speak of


def test_cli_import_report_json_exit_codes_and_exclude(tmp_path):
    d = make_dir(tmp_path / "run", HOSTS, bad={"n4": {"gpu-query.csv": gpu_query_csv(n=6)}})
    out = tmp_path / "bw.json"
    p = cli("preflight", "import", str(d), "-o", str(out))
    assert p.returncode == 1, p.stderr
    assert "FAIL  n4" in p.stdout and "gpu_count" in p.stdout and "Exclude: n4" in p.stdout
    bw = BandwidthMap.load(out)
    assert bw.exclude == ["n4"] and bw.version == 2
    p = cli("preflight", "import", str(d), "--json")
    assert json.loads(p.stdout)["exclude"] == ["n4"]
    p = cli("preflight", "import", str(d), "--exclude-failed")
    assert p.returncode == 0 and p.stdout.strip() == "n4"
    p = cli("preflight", "import", str(tmp_path / "nope"))
    assert p.returncode == 2 and p.stderr.startswith("error: ")


def test_python_m_checks_assemble_matches_import(tmp_path):
    d = make_dir(tmp_path, HOSTS)
    p = subprocess.run([sys.executable, "-m", "checks", str(d), "-o", str(d / "bwmap.json")],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert BandwidthMap.load(d / "bwmap.json").intra_node_busbw_gbs == 482.27


def test_tcp_fallback_between_ib_nodes_blames_the_node(tmp_path):
    """Pair logs = a real NCCL_DEBUG=INFO init log (nccl-logs/) + a real nccl-tests table."""
    table = shared_file("nccl-tests", PAIR_OK).read_text()
    ib = shared_file("nccl-logs", "h100-roce-2node-16rank-nccl2.27.5-init-INFO-p2p-ipc-net-ib-gdrdma.txt").read_text()
    sock = shared_file("nccl-logs", "2node-8rank-nccl2.7.8-init-INFO-net-socket-fallback-p2p-shm-old-format.txt")
    d = make_dir(tmp_path, HOSTS)
    (d / "pairs").mkdir()
    for (a, b), pre in {("n1", "n2"): ib, ("n3", "n4"): sock.read_text(), ("n2", "n3"): sock.read_text(),
                        ("n4", "n1"): ib}.items():
        (d / "pairs" / f"{a}+{b}.txt").write_text(pre + table)
    bw = assemble(load_dir(d))
    assert failing(bw) == {("n3", "nccl_inter")}
    c = next(c for c in bw.checks if c.node == "n3" and c.check == "nccl_inter")
    assert "NET/Socket" in c.message
    assert {(p.a, p.b) for p in bw.pairs if p.status == "fail"} == {("n3", "n4"), ("n2", "n3")}


def test_two_nodes_one_missing_a_gpu_blames_the_smaller(tmp_path):
    d = make_dir(tmp_path, ["a", "b"], bad={"a": {"gpu-query.csv": gpu_query_csv(n=7)}})
    bw = assemble(load_dir(d))
    assert failing(bw) == {("a", "gpu_count")}
    d2 = make_dir(tmp_path / "x", ["a", "b"], bad={"a": {"gpu-query.csv": gpu_query_csv(n=7)}})
    assert failing(assemble(load_dir(d2), JudgeConfig(expected_gpus=7))) == set()


def _results(texts_by_host: dict[str, dict[str, str]]):
    from checks.results import NcclRun, PreflightResults
    from launcher.transport import Completed

    res = PreflightResults(hosts=list(texts_by_host))
    for h, files in texts_by_host.items():
        res.probes[h] = {k: Completed(0, v, host=h, command=k) for k, v in files.items() if k != "nccl"}
        res.nccl.append(NcclRun("node", [h], "all_reduce", Completed(0, files["nccl"], host=h, command="nccl")))
    return res


def test_fuzz_garbage_on_one_node_never_crashes_or_fails_another():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = {"topo": shared_file("topo", H100_TOPO).read_text(), "gpu-query": gpu_query_csv(),
            "nvlink": nvlink_status(), "ibstat": ibstat_text(), "xid": "",
            "nccl": shared_file("nccl-tests", H100_NODE).read_text()}

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(good)), st.data())
    def check(kind, data):
        text = good[kind]
        i = data.draw(st.integers(0, max(0, len(text) - 1)))
        bad = text[:i] + data.draw(st.text(max_size=10)) + (text[i + 1:] if data.draw(st.booleans()) else "")
        res = _results({"n1": dict(good), "n2": dict(good), "n3": {**good, kind: bad}})
        bw = assemble(res)
        assert {n for n, _ in failing(bw)} <= {"n3"}

    check()
