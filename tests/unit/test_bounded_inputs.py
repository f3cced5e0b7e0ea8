"""Reads of remote or user data are bounded and never block, and missing data is "not measured":
a flooding command is stopped at the output limit (its whole session ends), `preflight parse` refuses
devices and does not wait on a FIFO, diagnose keeps a bounded amount whatever the log's size, refuses a
FIFO given as its target and reports files it could not read (exit 1, not "no problem found"), and
`preflight import` of a folder without one probe's output excludes nobody for it."""

from __future__ import annotations

import json
import os
import subprocess
import tracemalloc
from pathlib import Path

import pytest

from launcher.backends import procs
from launcher.diagnose import diagnose
from launcher.diagnose.collect import read_sources
from tests.cli_helpers import LAUNCH, launch
from tests.job_helpers import wait_until

pytestmark = pytest.mark.unit


def test_local_runner_stops_a_flooding_command_and_its_children():
    from checks.probe import run_local

    r = run_local("yes | cat", 60, env={**os.environ, procs.MARKER: "flood"}, limit=1 << 20)
    assert not r.ok and "output larger than 1 MiB" in r.reason() and len(r.stdout) == 1 << 20
    assert wait_until(lambda: not procs.marked((procs.MARKER, "flood")), 10)  # yes and cat are gone too
    ok = run_local("echo out; echo err >&2; exit 3", 10)
    assert (ok.stdout, ok.stderr, ok.rc, ok.error) == ("out\n", "err\n", 3, None)


def test_preflight_parse_refuses_devices_and_never_waits_on_a_fifo(tmp_path):
    r = launch("preflight", "parse", "topo", "/dev/zero", timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: /dev/zero: cannot read") \
        and "character device" in r.stderr and len(r.stderr.splitlines()) == 1
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    r = launch("preflight", "parse", "topo", str(fifo), timeout=60)  # no writer: empty, not a hang
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1


def test_diagnose_refuses_a_fifo_and_reports_what_it_could_not_read(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    r = launch("diagnose", str(fifo), timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {fifo}: not a regular file or a directory")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("[rank0]: step 1/8 | loss 5.0\n")
    os.mkfifo(logs / "rank1.log")                     # would block a reader forever
    (logs / "a").symlink_to("b")
    (logs / "b").symlink_to("a")                      # unreadable for root too: ELOOP
    if os.geteuid() != 0:
        (logs / "rank2.log").write_text("secret")
        (logs / "rank2.log").chmod(0)
    r = launch("diagnose", str(logs), "--json", timeout=120)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"].startswith("could not read ") and "rank1.log (not a regular file)" in out["verdict"]
    assert "a (Too many levels of symbolic links)" in out["verdict"]
    assert out["files"] == ["rank0.log"]


def _flood_log(path: Path, lines: int) -> None:
    with open(path, "w") as f:
        for i in range(lines):
            r = i % 64
            k = i % 4
            if k == 0:
                f.write(f"node{r % 8}:{1000 + r}:{2000 + r} [{r % 8}] NCCL INFO Channel {i % 32:02d}/0 : {r}[{r % 8}] "
                        f"-> {(r + 1) % 64}[{(r + 1) % 8}] via P2P/IPC\n")
            elif k == 1:
                f.write(f"node{r % 8}:{1000 + r}:{2000 + r} [{r % 8}] NCCL WARN NET/IB : Got completion from peer "
                        f"10.0.0.{r}<{40000 + i % 1000}> with status=12 opcode=0 len=0 vendor err 129 (Recv) "
                        f"hca mlx5_{r % 8}\n")
            elif k == 2:
                f.write(f"node{r % 8}:{1000 + r}:{2000 + r} [{r % 8}] NCCL WARN Call to connect returned Connection "
                        f"refused, retrying\n")
            else:
                f.write(f"[rank{r}]: step {i} | loss 5.{i % 1000:03d}\n")


def test_diagnose_memory_stays_bounded_as_the_log_grows(tmp_path):
    """What the parsers keep does not grow with the number of lines: 4x the log, about the same memory."""
    kept = []
    for n in (40_000, 160_000):
        log = tmp_path / f"big{n}.log"
        _flood_log(log, n)
        tracemalloc.start()
        src = read_sources(log)
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        kept.append(current)
        assert len(src.failures.ib_errors) <= 64 * 8  # one per (host, GPU, peer, status, HCA)
        assert all(len(ev) <= 8 for ev in src.failures.warns.values())
        del src
    assert kept[1] < 1.5 * kept[0] + (1 << 20), kept
    report = diagnose(tmp_path / "big160000.log")
    warn = next(f for f in report.findings if "Connection refused" in f.message)
    assert "(40000x)" in warn.message  # every line still counted


def test_import_without_an_nvlink_file_excludes_nobody(tmp_path):
    from checks.assemble import assemble
    from checks.folder import load_dir
    from tests.unit.test_preflight_judges import HOSTS, make_dir

    d = make_dir(tmp_path, HOSTS)
    for h in HOSTS:
        (d / h / "nvlink.txt").unlink()
    bw = assemble(load_dir(d))
    assert bw.exclude == []
    nv = [c for c in bw.checks if c.check == "nvlink"]
    assert len(nv) == len(HOSTS) and all(c.status == "warn" and c.message.startswith("not measured") for c in nv)
    r = launch("preflight", "import", str(d), "--json", timeout=60)
    assert json.loads(r.stdout)["exclude"] == [], r.stderr


def test_slurm_client_output_in_another_encoding_is_read_not_a_traceback(tmp_path):
    """squeue/sacct print job names and reasons as the bytes they were given (Latin-1, say): the Slurm
    backend's command runner decodes them with replacement instead of raising."""
    from launcher.backends.slurm_login import run
    from launcher.transport.local import LocalTransport

    rc, out, err = run(LocalTransport(), ["bash", "-c", r"printf '42|RUNNING|caf\xe9|n1|0:05\n'; printf '\xff' >&2"])
    assert rc == 0 and out == "42|RUNNING|caf\ufffd|n1|0:05\n" and err == "\ufffd"


# --- logs as they really arrive (issue 23) ----------------------------------------------------------
def test_diagnose_streams_a_line_of_any_length(tmp_path):
    """One multi-MB line holding "NCCL" (the rank-prefix pattern used to backtrack over it: 80 kB took
    53 s) is read in pieces and parsed on its first MAX_LINE_CHARS; the lines after it still count."""
    from launcher.diagnose.collect import MAX_LINE_CHARS

    log = tmp_path / "big.log"
    warn = "node1:11:12 [1] NCCL WARN Call to connect returned Connection refused, retrying\n"
    with open(log, "w") as f:
        f.write("a" * (4 << 20) + " NCCL INFO x\n")                       # one run of host characters
        f.write("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=X"
                + "y" * (4 << 20) + "\n")
        f.write("x" * MAX_LINE_CHARS + warn)                              # cut before the WARN: not seen
        f.write(warn)
    report = diagnose(log)
    found = [f for f in report.findings if "Connection refused" in f.message]
    assert len(found) == 1 and found[0].evidence == ["big.log:4"], [(f.message, f.evidence) for f in report.findings]


def _decorated(lines: list[str], how: str) -> bytes:
    if how == "ansi":
        lines = [f"\x1b[32m{ln[:20]}\x1b[0m{ln[20:]}" for ln in lines]
    elif how == "kubectl":
        lines = [f"2026-05-01T12:00:{i % 60:02d}.123456789Z {ln}" for i, ln in enumerate(lines)]
    elif how == "bracketed":
        lines = [f"[2026-05-01 12:00:{i % 60:02d},123] {ln}" for i, ln in enumerate(lines)]
    text = "".join(ln + ("\r\n" if how == "crlf" else "\n") for ln in lines)
    if how == "utf16":
        return text.encode("utf-16")
    data = text.encode()
    if how == "gz":
        import gzip
        return gzip.compress(data)
    if how == "bz2":
        import bz2
        return bz2.compress(data)
    if how == "xz":
        import lzma
        return lzma.compress(data)
    return data


@pytest.mark.parametrize("how", ["gz", "bz2", "xz", "ansi", "kubectl", "bracketed", "utf16", "crlf"])
def test_diagnose_reads_logs_compressed_coloured_and_stamped(tmp_path, how):
    """Rotated (.gz/.bz2/.xz), coloured, kubectl --timestamps, bracketed stamps, UTF-16, CRLF: the same
    findings as the plain log."""
    lines = []
    for i in range(8):
        lines.append(f"node{i % 2}:{100 + i}:{200 + i} [{i % 2}] NCCL WARN NET/IB : Got completion from peer "
                     f"10.0.0.{i}<4000{i}> with status=12 opcode=0 len=0 vendor err 129 (Recv) hca mlx5_{i % 2}")
        lines.append(f"node{i % 2}:{100 + i}:{200 + i} [{i % 2}] NCCL WARN Call to connect returned Connection "
                     "refused, retrying")
    lines += ["[rank1]:[E501 12:00:00.000000000 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective "
              "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
              "ran for 600010 milliseconds before timing out."]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "rank.log").write_text("\n".join(lines) + "\n")
    (tmp_path / how).mkdir()
    (tmp_path / how / f"rank.log.{how}").write_bytes(_decorated(lines, how))
    plain = diagnose(tmp_path / "plain")
    got = diagnose(tmp_path / how)
    assert [f.message for f in got.findings] == [f.message for f in plain.findings] and len(plain.findings) >= 2
    assert got.verdict == plain.verdict and got.files == [f"rank.log.{how}"]


def test_diagnose_reports_a_truncated_or_huge_compressed_log(tmp_path, monkeypatch):
    import gzip

    from launcher.diagnose import collect

    line = b"node1:11:12 [1] NCCL WARN Call to connect returned Connection refused, retrying\n"
    data = gzip.compress(line * 2000)
    (tmp_path / "cut.log.gz").write_bytes(data[: len(data) // 2])
    src = read_sources(tmp_path)
    assert src.unread and "cut.log.gz (gzip data ends early" in src.unread[0]
    monkeypatch.setattr(collect, "MAX_TEXT_BYTES", 10 * len(line))   # a decompression bomb, in small
    (tmp_path / "cut.log.gz").unlink()
    (tmp_path / "bomb.log.gz").write_bytes(data)
    src = read_sources(tmp_path)
    assert src.unread == ["bomb.log.gz (more than 0 MiB once decompressed; read that much)"]


def test_diagnose_skips_heartbeats_with_nan_or_infinite_values(tmp_path):
    """JSON NaN/Infinity parse as numbers: a heartbeat without a real time, rank or step is said to be
    skipped, not judged (a NaN time made a rank look fresh for ever)."""
    beats = tmp_path / "heartbeat"
    beats.mkdir()
    for r, updated, step in ((0, "NaN", 5), (1, "1764600000.0", 5), (2, "Infinity", 5), (3, "1764600000.0", -1)):
        (beats / f"rank{r}.json").write_text(f'{{"rank": {r}, "host": "n{r}", "step": {step}, "phase": "forward", '
                                             f'"updated": {updated}, "step_time_s": Infinity}}')
    src = read_sources(tmp_path)
    assert sorted(src.beats.beats) == [1] and src.beats.beats[1].step_time_s is None
    assert sorted(src.skipped) == [f"heartbeat/rank{r}.json (a heartbeat without a finite rank, step or time)"
                                   for r in (0, 2, 3)]


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
def test_a_terminal_that_cannot_show_an_em_dash_gets_the_output_not_a_traceback(encoding):
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    job = str(Path(__file__).resolve().parents[2] / "examples" / "tiny-slurm.yaml")
    for args in (["plan", job], ["render", job, "--backend", "slurm"]):
        r = subprocess.run([LAUNCH, *args], capture_output=True, env=env, timeout=120)
        assert r.returncode == 0 and b"Traceback" not in r.stderr and r.stdout, (args, r.stderr[-500:])


def test_ctrl_c_during_preflight_does_not_wait_for_a_host_that_never_answers():
    """A host that accepted the connection but never sends its banner held Ctrl-C for its timeouts
    (~116 s, issue 23): the fan-out no longer waits for its workers once interrupted, and the runner is
    closed so what they wait on (the handshake, a remote command) ends at once."""
    import threading

    from checks.orchestrate import PreflightOptions, run_preflight
    from checks.runners.base import Runner
    from launcher.transport import Completed

    class Hung(Runner):
        launcher = None

        def __init__(self):
            self.closed = threading.Event()
            self.connecting = threading.Event()
            self.released_by_close: list[bool] = []

        def run(self, host, command, timeout):
            if host == "b":
                self.connecting.wait(60)       # (on a loaded machine "hung" may not have started yet)
                raise KeyboardInterrupt        # Ctrl-C arrives while "hung" is still connecting
            self.connecting.set()
            self.released_by_close.append(self.closed.wait(60))   # bounded: a regression fails, not hangs
            return Completed(host=host, command=command, error="connection closed")

        def close(self):
            self.closed.set()

    runner = Hung()
    with pytest.raises(KeyboardInterrupt):
        run_preflight(runner, ["b", "hung"], PreflightOptions(workers=2))
    assert runner.closed.is_set()
    for t in threading.enumerate():                # the worker ends once released
        if t.name.startswith("ThreadPoolExecutor"):
            t.join(60)
    assert runner.released_by_close == [True]
