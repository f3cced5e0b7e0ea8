"""nccl-tests parser on the real captures in ../shared/fixtures/nccl-tests (all three table generations)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks.parsers.base import ParseError
from checks.parsers.nccl_tests import parse_nccl_tests, parse_nccl_tests_all
from tests.conftest import REPO, absent, shared_file, shared_texts

pytestmark = pytest.mark.unit


def runs_in(name: str):
    return parse_nccl_tests_all(shared_file("nccl-tests", name).read_text())


def test_new_format_five_collectives_split_and_named():
    ts = runs_in("h100-1node-8gpu-5colls-v2.17.8.txt")
    assert [t.collective for t in ts] == ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"]
    ar = ts[0]
    assert ar.version == "2.17.8" and ar.nthread == 1 and ar.ngpus == 1
    assert ar.min_bytes == 33554432 and ar.max_bytes == 68719476736
    assert len(ar.ranks) == 8 and ar.ranks[7].device == 7 and ar.ranks[0].host == "cnode3-002"
    assert ar.ranks[0].gpu == "NVIDIA H100 80GB HBM3" and ar.ranks[0].bus_id == "0000:1b:00"
    assert len(ar.rows) == 10
    last = ar.rows[-1]
    assert (last.size, last.count, last.type, last.redop, last.root) == (17179869184, 2147483648, "double", "sum", -1)
    assert (last.busbw_oop, last.busbw_ip, last.wrong_oop, last.wrong_ip) == (482.27, 482.12, 0, 0)
    assert ar.busbw_at_max_size == 482.27 and ar.avg_busbw == 437.957
    assert ar.errors == [] and ar.complete


def test_sendrecv_in_place_wrong_is_na():
    sr = parse_nccl_tests(shared_file("nccl-tests", "h100-10node-80gpu-5colls-v2.17.8.txt").read_text(), "sendrecv")
    assert sr.rows[0].wrong_oop == 0 and sr.rows[0].wrong_ip is None
    assert sr.busbw_at_max_size == 15.22 and len(sr.ranks) == 80 and len(sr.hosts) == 10


def test_pre_2_14_format_without_version_lines():
    t = runs_in("h100-a3mega-2node-16gpu-all_reduce_perf.txt")[0]
    assert t.version is None and t.collective is None
    assert len(t.ranks) == 16 and t.hosts == ["ztan-mig-235z", "ztan-mig-gq73"]
    assert len(t.rows) == 31 and t.busbw_at_max_size == 338.82 and t.avg_busbw == 70.742
    assert parse_nccl_tests(shared_file("nccl-tests", "h100-a3mega-2node-16gpu-all_reduce_perf.txt").read_text(),
                            "all_reduce").collective == "all_reduce"


def test_single_size_run():
    t = runs_in("a100-oci-bm-gpu4.8-2node-16gpu-all_reduce_perf-10G-single-size.txt")[0]
    assert len(t.rows) == 1 and t.rows[0].size == 10737418240 and t.busbw_at_max_size == 222.88


def test_old_format_error_column_and_interleaved_nccl_info():
    t = runs_in("a100-sxm4-40gb-1node-8gpu-allreduce-old-nccl-tests-format.txt")[0]
    assert t.ngpus == 8 and len(t.ranks) == 8 and t.ranks[0].group is None
    assert len(t.rows) == 34 and t.rows[0].wrong_oop is None and t.rows[0].error_oop is None
    assert t.busbw_at_max_size == 235.26 and t.errors == []


def test_old_format_alltoall_with_blank_redop():
    t = runs_in("a100-sxm4-40gb-1node-8gpu-alltoall-old-nccl-tests-format.txt")[0]
    assert t.rows[-1].redop is None and t.rows[-1].busbw_oop == 224.31 and t.rows[-1].busbw_ip == 226.16


def test_oldest_format_out_of_bounds_failed_and_wrapper_lines():
    ts = runs_in("dgx2-v100-12gpu-single-node-5colls-v2.0-oldformat-FAILED.txt")
    assert [t.collective for t in ts] == ["all_gather", "all_reduce", "broadcast", "reduce", "reduce_scatter"]
    ag = ts[0]
    assert ag.out_of_bounds == 4 and any("Out of bounds values: 4 FAILED" in e for e in ag.errors)
    assert any(r.error_oop == 1.0 for r in ag.rows)
    assert ts[1].errors == []


def test_nonzero_wrong_is_data_corruption():
    t = runs_in("rtx3090-2node-1gpu-all_reduce_perf-WRONG-nonzero-108-FAILED.txt")[0]
    assert len(t.rows) == 27 and len(t.wrong_rows) == 27
    assert t.rows[18].wrong_oop == 1048580 or t.rows[18].wrong_oop == pytest.approx(1.04858e06)
    assert t.errors[0].startswith("#wrong non-zero in 27 of 27 rows (data corruption")
    assert t.out_of_bounds == 108 and t.failed


@pytest.mark.parametrize("name", ["h100-pairwise-2node-8gpu-FAIL-remote-process-exited.txt",
                                  "h100-pairwise-2node-1gpu-alltoall-FAIL-network-error.txt"])
def test_died_runs_are_failures_without_avg(name):
    for t in runs_in(name):
        assert not t.complete and t.failed
        assert any("Test NCCL failure" in e for e in t.errors)
        assert any("incomplete" in e for e in t.errors)


def test_nccl_warn_lines_are_collected():
    base = shared_file("nccl-tests", "h100-2node-1gpu-per-node-allreduce-sendrecv-smoke.txt").read_text()
    warn = shared_file("nccl-logs", "nccl-warn-net-ib-completion-status5-status12-roce-pair.txt").read_text()
    lines = base.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("    "))  # first data row of all_reduce
    t = parse_nccl_tests("\n".join(lines[:i] + warn.splitlines() + lines[i:]), "all_reduce")
    assert len(t.warnings) == 2 and "status=12" in t.warnings[1]


def test_not_nccl_tests_output_is_a_parse_error():
    with pytest.raises(ParseError) as e:
        parse_nccl_tests(shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt").read_text())
    assert e.value.line_no == 1


def test_truncated_row_names_the_line():
    lines = shared_file("nccl-tests", "h100-1node-4gpu-5colls-v2.17.8.txt").read_text().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("    "))
    with pytest.raises(ParseError) as e:
        parse_nccl_tests("\n".join(lines[:i] + [lines[i][:40]]))
    assert e.value.line_no == i + 1 and "truncated" in str(e.value)


def test_missing_collective_is_a_parse_error():
    with pytest.raises(ParseError):
        parse_nccl_tests(shared_file("nccl-tests", "h100-2node-1gpu-per-node-allreduce-sendrecv-smoke.txt").read_text(),
                         "alltoall")


def test_cli_parse_nccl_tests_json_keys():
    f = shared_file("nccl-tests", "h100-1node-8gpu-5colls-v2.17.8.txt")
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "parse",
                        "nccl-tests", str(f), "--json"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["collective"] == "all_reduce" and d["avg_busbw"] == 437.957 and d["errors"] == []
    row = d["rows"][-1]
    assert {"size", "busbw_oop", "busbw_ip", "wrong_oop", "wrong_ip"} <= set(row)
    assert row["size"] == 17179869184 and row["busbw_oop"] == 482.27
    assert len(d["tests"]) == 5


def test_cli_parse_error_is_one_line_exit_2(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_text("# nThread 1 nGpus 1 minBytes 8 maxBytes 8 step: 2(factor)\n#  size count type redop root time "
                 "algbw busbw #wrong time algbw busbw #wrong\n 8 2 float sum -1 12.0 0.00\n")
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "parse",
                        "nccl-tests", str(f)], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and "line 3" in p.stderr and "Traceback" not in p.stderr


REAL = shared_texts("nccl-tests")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_truncated_and_garbled_real_outputs(data):
    if not REAL:
        absent("third-party nccl-tests fixtures absent (set LAUNCH4D_FIXTURES)")
    text = data.draw(st.sampled_from(REAL))
    mode = data.draw(st.sampled_from(["truncate", "garble", "delete_line"]))
    if mode == "truncate":
        text = text[: data.draw(st.integers(0, len(text)))]
    elif mode == "garble":
        i = data.draw(st.integers(0, len(text) - 1))
        text = text[:i] + data.draw(st.text(min_size=1, max_size=8)) + text[i + 1:]
    else:
        lines = text.splitlines()
        del lines[data.draw(st.integers(0, len(lines) - 1))]
        text = "\n".join(lines)
    try:
        tests = parse_nccl_tests_all(text)
    except ParseError as exc:
        assert exc.line_no is not None
        return
    for t in tests:
        if not t.complete:
            assert t.failed  # a run without its Avg line is never taken as a pass


def test_launcher_lines_interleaved_are_kept_and_srun_errors_fail():
    lines = shared_file("nccl-tests", "h100-2node-1gpu-per-node-allreduce-sendrecv-smoke.txt").read_text().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("    "))
    # CONSTRUCTED interleavings (a launcher's stderr merged into the log)
    noisy = lines[:i] + ["Warning: Permanently added 'node2' (ED25519) to the list of known hosts."] + lines[i:]
    t = parse_nccl_tests("\n".join(noisy), "all_reduce")
    assert t.other_lines == ["Warning: Permanently added 'node2' (ED25519) to the list of known hosts."]
    assert t.errors == [] and t.busbw_at_max_size == 46.32
    bad = lines[:i] + ["srun: error: n2: task 1: Exited with exit code 1"] + lines[i:]
    assert parse_nccl_tests("\n".join(bad), "all_reduce").failed


def test_transports_from_nccl_debug_info_lines():
    """Real NCCL_DEBUG=INFO init logs (nccl-logs/) in front of a real nccl-tests table, as mpirun prints them."""
    table = shared_file("nccl-tests", "h100-2node-1gpu-per-node-allreduce-sendrecv-smoke.txt").read_text()
    sock = shared_file("nccl-logs", "2node-8rank-nccl2.7.8-init-INFO-net-socket-fallback-p2p-shm-old-format.txt")
    t = parse_nccl_tests(sock.read_text() + table, "all_reduce")
    assert t.transports == ["NET/Socket", "P2P/IPC", "direct shared memory"] and t.network == "Socket"
    assert t.errors == [] and t.warnings[0] == "NCCL WARN Failed to open libibverbs.so[.1]"
    assert t.other_lines == ["NCCL version 2.7.8+cuda10.1"]
    ib = shared_file("nccl-logs", "h100-roce-2node-16rank-nccl2.27.5-init-INFO-p2p-ipc-net-ib-gdrdma.txt")
    t = parse_nccl_tests(ib.read_text() + table, "all_reduce")
    assert t.transports == ["NET/IB", "P2P/IPC"] and t.network == "IB" and t.busbw_at_max_size == 46.32


@pytest.mark.parametrize("name", ["h100-1node-8gpu-5colls-v2.17.8.txt", "h100-a3mega-2node-16gpu-all_reduce_perf.txt",
                                  "a100-sxm4-40gb-1node-8gpu-allreduce-old-nccl-tests-format.txt"])
def test_every_line_cut_is_an_error_or_a_failed_run(name):
    """Output cut at any line (a run killed mid-way) is never taken for a complete, passing run."""
    lines = shared_file("nccl-tests", name).read_text().splitlines()
    for k in range(1, len(lines)):
        try:
            tests = parse_nccl_tests_all("\n".join(lines[:k]) + "\n")
        except ParseError:
            continue
        last = tests[-1]
        assert last.complete or last.failed, k
