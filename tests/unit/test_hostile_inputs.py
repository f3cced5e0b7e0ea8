"""Hostile and careless inputs against every command that reads a user file or writes one: each
command x each bad input -> exit 2, one error line naming the field or file, no traceback, and
nothing written anywhere under the test's directory (compared before and after), devices intact.

The cases are the reproductions of issue 14 (items 3, 7, 8, 14 and the validation holes of item 2
and 12), kept as a permanent, data-driven suite: a new command or input is one more row. Issue 23 adds
links planted in a run dir while the job runs (the trainer's writers and the local backend's log here;
the batch script's own output in tests/unit/test_render.py), an Xid code outside NVIDIA's catalog, and
elsewhere half-truncated checkpoints (tests/e2e/test_checkpoint_faults.py) and captures mutated at every
tenth of their length (tests/unit/test_health_captures.py).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import UserError
from tests.conftest import EXAMPLES
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit

SLURM_JOB = EXAMPLES / "tiny-slurm.yaml"
CPU_JOB = EXAMPLES / "tiny-cpu.yaml"


# --- the world a case runs in -------------------------------------------------------------------
class World:
    """tmp_path with inputs in in/, the working dir cwd/ (relative log_dir `runs` lands there) and
    the job state under state/."""

    def __init__(self, root: Path):
        self.root = root
        for d in ("in", "cwd", "state"):
            (root / d).mkdir()
        (root / "in" / "afile").write_text("not a directory\n")

    def path(self, name: str) -> Path:
        return self.root / "in" / name

    def job(self, name: str, base: Path, mutate: Callable[[dict], object] | None = None) -> Path:
        data = yaml.safe_load(base.read_text())
        if mutate:
            mutate(data)
        p = self.path(name)
        p.write_text(yaml.safe_dump(data))
        return p

    def raw(self, name: str, data: bytes) -> Path:
        p = self.path(name)
        p.write_bytes(data)
        return p

    def unwritable_dir(self) -> Path:
        """An existing directory nobody here may create files in (root ignores modes: /proc/self)."""
        if os.geteuid() == 0:
            return Path("/proc/self")
        d = self.root / "in" / "ro"
        d.mkdir(exist_ok=True)
        d.chmod(0o555)
        return d


def snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return out


DEVICES = ("/dev/null", "/dev/full", "/dev/zero")


def device_kinds() -> dict[str, int]:
    return {d: stat.S_IFMT(os.lstat(d).st_mode) for d in DEVICES if os.path.lexists(d)}


def run_cli(world: World, args: list[str]):
    env = {"LAUNCH4D_STATE": str(world.root / "state"), "XDG_STATE_HOME": str(world.root / "state")}
    old = os.getcwd()
    os.chdir(world.root / "cwd")
    try:
        return CliRunner().invoke(cli, args, env=env)
    finally:
        os.chdir(old)


def assert_refused(world: World, args: list[str], expect: str) -> None:
    before, devices = snapshot(world.root), device_kinds()
    res = run_cli(world, args)
    err = res.stderr
    assert res.exit_code == 2, f"exit {res.exit_code} for {args}\n{res.output}\n{err}"
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output + err
    errors = [ln for ln in err.splitlines() if ln.lower().startswith("error")]
    assert len(errors) == 1, f"expected one error line, got:\n{err}"
    assert re.search(expect, errors[0], re.I), f"{expect!r} not in {errors[0]!r}"
    assert snapshot(world.root) == before, f"{args} wrote something"
    assert device_kinds() == devices


# --- job files ------------------------------------------------------------------------------------
def _set(path: str, value) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        *parents, leaf = path.split(".")
        for p in parents:
            if not isinstance(d.get(p), dict):
                d[p] = {}
            d = d[p]
        d[leaf] = value
    return mutate


def alias_bomb(w: World, base: Path) -> Path:
    """Seven lines of YAML aliases that stand for 9**7 values (issue 14 item 10: 30 s, 72 MB printed)."""
    data = yaml.safe_load(base.read_text())
    del data["backend"]
    anchors = ['x0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    anchors += [f"x{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 7)]
    text = "backend:\n  env:\n" + "".join(f"    {a}\n" for a in anchors) + yaml.safe_dump(data)
    return w.raw("bomb.yaml", re.sub(r"seq_len: \d+", "seq_len: *a6", text).encode())


def fifo_no_writer(w: World, base: Path) -> Path:
    """A named pipe that nothing writes to: reading it must not block."""
    p = w.path("fifo")
    os.mkfifo(p)
    return p


def _planted_script(w: World) -> str:
    """A script that would leave a mark under the test's directory if anything ran it."""
    p = w.path("planted.sh")
    p.write_text(f"touch {w.root / 'cwd' / 'pwned'}\n")
    p.chmod(0o755)
    return str(p)


def _env_runs_code(key: str) -> Callable[[World, Path], Path]:
    """A job whose backend.env sets `key` to a script planted for the test."""
    return lambda w, b: w.job("code.yaml", b, _set("backend.env", {key: _planted_script(w)}))


#: name -> (how to build the job file from a base, what the error line must name)
JOB_INPUTS: dict[str, tuple[Callable[[World, Path], Path], str]] = {
    "invalid-utf8": (lambda w, b: w.raw("bad.yaml", b.read_bytes() + b"\n# \xff\xfe\n"), "UTF-8"),
    "binary": (lambda w, b: w.raw("bin.yaml", bytes(range(256)) * 4), "bin.yaml"),
    "char-device": (lambda w, b: Path("/dev/zero"), "/dev/zero"),
    "too-large": (lambda w, b: w.raw("big.yaml", b.read_bytes() + b"#" * (2 << 20)), "limit"),
    "nested-1000": (lambda w, b: w.raw("deep.yaml", b.read_bytes() + b"\nx: " + b"[" * 1000 + b"]" * 1000),
                    "deep.yaml"),
    "fifo-no-writer": (fifo_no_writer, "fifo"),
    "empty": (lambda w, b: w.raw("empty.yaml", b""), "empty.yaml"),
    "yaml-alias-bomb": (alias_bomb, "seq_len|expands"),
    # a deep log_dir, so an escape would still land under tmp_path (and show in the snapshot)
    "name-escapes-log-dir": (lambda w, b: w.job("esc.yaml", b, lambda d: (
        _set("name", "../../../../esc")(d), _set("backend.log_dir", str(w.root / "l" / "a" / "b" / "c"))(d))),
        "name"),
    "name-newline": (lambda w, b: w.job("nl.yaml", b, _set("name", "x\ny")), "name"),
    "name-300-chars": (lambda w, b: w.job("long.yaml", b, _set("name", "a" * 300)), "name"),
    "env-key-newline": (lambda w, b: w.job("env.yaml", b, _set("backend.env", {"FOO\n": "bar"})), "backend.env"),
    "partition-newline": (lambda w, b: w.job("part.yaml", b, _set("backend.slurm.partition", "gpu\n")),
                          "backend.slurm.partition"),
    "lr-nan": (lambda w, b: w.job("nan.yaml", b, _set("train.lr", float("nan"))), "train.lr"),
    "memory-inf": (lambda w, b: w.job("inf.yaml", b, _set("gpu.memory_gb", float("inf"))), "gpu"),
    # issue 23: YAML 1.1 and repeated keys; environment variables that run code (refused when the job
    # file is read, so nothing is rendered, started or sourced)
    "duplicate-section": (lambda w, b: w.raw("dups.yaml", b.read_bytes() + b"\nmodel: tiny\n"),
                          "duplicate key 'model'"),
    "duplicate-key": (lambda w, b: w.raw("dupk.yaml", b.read_bytes().replace(b"train:\n", b"train:\n  seq_len: 8\n", 1)),
                      "duplicate key 'seq_len'"),
    "zero-true": (lambda w, b: w.job("zt.yaml", b, _set("parallel.zero", True)), "parallel.zero"),
    "zero-float": (lambda w, b: w.job("zf.yaml", b, _set("parallel.zero", 1.0)), "parallel.zero"),
    "tokens-2**62": (lambda w, b: w.job("tok.yaml", b, lambda d: (d["train"].pop("steps", None),
                                                                  _set("train.tokens", 2**62)(d))), "train.tokens"),
    **{f"env-{k.lower().replace('%', '')}": (_env_runs_code(k), f"backend.env.{k[:9]}")
       for k in ("BASH_ENV", "ENV", "PROMPT_COMMAND", "PS4", "SHELLOPTS", "LD_PRELOAD", "LD_AUDIT", "PYTHONSTARTUP",
                 "PYTHONHOME", "BASH_FUNC_launch4d_node%%")},
}

#: command -> (base job file, argv with {job} and {out})
JOB_COMMANDS: dict[str, tuple[Path, list[str]]] = {
    "plan": (SLURM_JOB, ["plan", "{job}"]),
    "plan-o": (SLURM_JOB, ["plan", "{job}", "-o", "{out}/p.json"]),
    "render-slurm": (SLURM_JOB, ["render", "{job}", "--backend", "slurm"]),
    "render-slurm-o": (SLURM_JOB, ["render", "{job}", "--backend", "slurm", "-o", "{out}/r"]),
    "render-k8s": (SLURM_JOB, ["render", "{job}", "--backend", "k8s"]),
    "submit-dry-run": (SLURM_JOB, ["submit", "{job}", "--backend", "slurm", "--dry-run"]),
    "run-dry-run": (CPU_JOB, ["run", "{job}", "--dry-run"]),
    "run": (CPU_JOB, ["run", "{job}"]),
    "verify": (SLURM_JOB, ["verify", "{job}"]),
}


def _job_cases():
    """Every command x every bad job file; the job-file loader refuses names, control characters
    and non-finite numbers for every command (launcher.plan.spec, launcher.plan.schema)."""
    for cmd in JOB_COMMANDS:
        for inp in JOB_INPUTS:
            yield pytest.param(cmd, inp, id=f"{cmd}:{inp}")


@pytest.mark.parametrize("command,inp", list(_job_cases()))
def test_bad_job_file(tmp_path, command, inp):
    w = World(tmp_path)
    base, argv = JOB_COMMANDS[command]
    build, expect = JOB_INPUTS[inp]
    job = build(w, base)
    args = [a.format(job=job, out=tmp_path / "cwd") for a in argv]
    assert_refused(w, args, expect)


# --- output paths ---------------------------------------------------------------------------------
#: name -> (argv, what the error line must name); {afile} is a regular file, {ro} an unwritable dir
OUTPUTS: dict[str, tuple[list[str], str]] = {
    "plan-o-under-a-file": (["plan", str(SLURM_JOB), "-o", "{afile}/p.json"], "afile"),
    "plan-o-dev-null": (["plan", str(SLURM_JOB), "-o", "/dev/null"], "/dev/null"),
    "plan-o-dev-full": (["plan", str(SLURM_JOB), "-o", "/dev/full"], "/dev/full"),
    "plan-o-symlink": (["plan", str(SLURM_JOB), "-o", "{link}"], "symbolic link"),
    "plan-o-unwritable": (["plan", str(SLURM_JOB), "-o", "{ro}/p.json"], "p.json"),
    "render-o-a-file": (["render", str(SLURM_JOB), "--backend", "slurm", "-o", "{afile}"], "afile"),
    "render-o-under-a-file": (["render", str(SLURM_JOB), "--backend", "slurm", "-o", "{afile}/x"], "afile"),
    "render-o-dev-null": (["render", str(SLURM_JOB), "--backend", "slurm", "-o", "/dev/null"], "/dev/null"),
    "render-o-unwritable": (["render", str(SLURM_JOB), "--backend", "slurm", "-o", "{ro}"], "cannot"),
    "render-o-another-job": (["render", str(SLURM_JOB), "--backend", "slurm", "-o", "{other}"], "another job"),
    "render-o-k8s-another-job": (["render", str(EXAMPLES / "tiny-k8s.yaml"), "--backend", "k8s", "-o", "{other}"],
                                 "another job"),
    "templates-device": (["render", str(SLURM_JOB), "--backend", "slurm", "--templates", "{tdev}"], "regular file"),
    "templates-fifo": (["render", str(SLURM_JOB), "--backend", "slurm", "--templates", "{tfifo}"], "regular file"),
    "render-o-plan-is-symlink": (["render", str(SLURM_JOB), "--backend", "slurm", "-o", "{linked}", "--force"],
                                 "symbolic link"),
    "run-dir-a-file": (["run", str(CPU_JOB), "--run-dir", "{afile}"], "afile"),
    "run-dir-under-a-file": (["run", str(CPU_JOB), "--run-dir", "{afile}/rd"], "afile"),
    "run-dir-unwritable": (["run", str(CPU_JOB), "--run-dir", "{ro}/rd"], "run dir"),
    "run-dir-another-job": (["run", str(CPU_JOB), "--run-dir", "{other}"], "different job"),
    # issue 23: links planted in a run dir (a resume would write through them to their targets)
    **{f"run-dir-planted-{what.replace('/', '-')}": (["run", str(CPU_JOB), "--run-dir",
                                                      "{planted_" + re.sub(r"\W", "_", what) + "}",
                                                      "--resume", "auto"], "symbolic link")
       for what in ("logs/node0.log", "logs/exit_code.tmp", "checkpoints/.latest.tmp", "logs")},
    # Slurm here (sbatch on PATH or not): the run dir is refused before anything is submitted
    "submit-run-dir-under-a-file": (["submit", str(SLURM_JOB), "--backend", "slurm", "--run-dir", "{afile}/rd"],
                                    "afile|sbatch not found"),
    "submit-run-dir-unwritable": (["submit", str(SLURM_JOB), "--backend", "slurm", "--run-dir", "{ro}/rd"],
                                  "rd|sbatch not found"),
}


def _other_job_dir(w: World) -> Path:
    """What `launch render -o` of another job left: its plan.json, job.yaml and script."""
    other = w.job("other.yaml", SLURM_JOB, _set("name", "other-job"))
    d = w.root / "in" / "other"
    res = run_cli(w, ["render", str(other), "--backend", "slurm", "-o", str(d)])
    assert res.exit_code == 0, res.output
    (d / "checkpoints").mkdir()
    return d


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_bad_output(tmp_path, case):
    w = World(tmp_path)
    link = w.path("link")
    link.symlink_to(w.path("target.json"))
    linked = w.path("linked")
    linked.mkdir()
    (linked / "plan.json").symlink_to(w.path("elsewhere.json"))
    tdev, tfifo = w.path("tdev"), w.path("tfifo")
    (tdev / "slurm").mkdir(parents=True)
    (tdev / "slurm" / "train.sbatch.j2").symlink_to("/dev/zero")
    (tfifo / "slurm").mkdir(parents=True)
    os.mkfifo(tfifo / "slurm" / "train.sbatch.j2")
    fmt = {"afile": w.path("afile"), "ro": w.unwritable_dir(), "link": link, "linked": linked, "tdev": tdev,
           "tfifo": tfifo}
    if "another" in case:
        fmt["other"] = _other_job_dir(w)
    for what in ("logs/node0.log", "logs/exit_code.tmp", "checkpoints/.latest.tmp", "logs"):
        rd = w.path(f"planted-{what.replace('/', '-')}")
        (rd / "checkpoints").mkdir(parents=True)
        if what != "logs":
            (rd / "logs").mkdir()
        (rd / what).symlink_to(w.path("target.json"))
        fmt["planted_" + re.sub(r"\W", "_", what)] = rd
    argv, expect = OUTPUTS[case]
    assert_refused(w, [a.format(**fmt) for a in argv], expect)
    assert not w.path("target.json").exists() and not w.path("elsewhere.json").exists()


def test_render_o_same_job_rewrites_and_force_overwrites(tmp_path):
    w = World(tmp_path)
    other = _other_job_dir(w)
    res = run_cli(w, ["render", str(SLURM_JOB), "--backend", "slurm", "-o", str(other), "--force"])
    assert res.exit_code == 0, res.output
    assert '"name": "tiny-slurm"' in (other / "plan.json").read_text()
    again = run_cli(w, ["render", str(SLURM_JOB), "--backend", "slurm", "-o", str(other)])
    assert again.exit_code == 0, again.output  # the same job: re-rendering is fine
    assert not [p for p in other.iterdir() if p.name.endswith(".tmp")]


# --- files given to flags -------------------------------------------------------------------------
FLAG_FILES: dict[str, Callable[[World], Path]] = {
    "binary": lambda w: w.raw("bin.json", bytes(range(256))),
    "char-device": lambda w: Path("/dev/zero"),
    "directory": lambda w: w.root / "in",
    "json-list": lambda w: w.raw("list.json", b"[1, 2]"),
    "nested": lambda w: w.raw("deep.json", b"[" * 100000 + b"]" * 100000),
    "wrong-shape": lambda w: w.raw("shape.json", b'{"version": 1, "ranks": 5, "nodes": 5}'),
}

FLAG_COMMANDS: dict[str, list[str]] = {
    "plan-bwmap": ["plan", str(SLURM_JOB), "--bwmap", "{f}"],
    "plan-previous": ["plan", str(SLURM_JOB), "--previous", "{f}"],
    "render-preflight": ["render", str(SLURM_JOB), "--backend", "slurm", "--preflight", "{f}"],
    "submit-preflight": ["submit", str(SLURM_JOB), "--backend", "slurm", "--preflight", "{f}", "--dry-run"],
    "preflight-parse-topo": ["preflight", "parse", "topo", "{f}"],
    "preflight-parse-nccl": ["preflight", "parse", "nccl-tests", "{f}"],
    **{f"preflight-parse-{k}": ["preflight", "parse", k, "{f}"]
       for k in ("dcgm-diag", "nvbandwidth", "perftest", "nvlink-errors", "gpu-q")},
    "diagnose-plan": ["diagnose", str(CPU_JOB), "--plan", "{f}"],
    "diagnose-bwmap": ["diagnose", str(CPU_JOB), "--bwmap", "{f}"],
}


@pytest.mark.parametrize("command", list(FLAG_COMMANDS))
@pytest.mark.parametrize("inp", list(FLAG_FILES))
def test_bad_flag_file(tmp_path, command, inp):
    w = World(tmp_path)
    f = FLAG_FILES[inp](w)
    expect = "" if inp == "directory" else str(f.name)  # click itself refuses a directory here
    assert_refused(w, [a.format(f=f) for a in FLAG_COMMANDS[command]], expect)


# --- the job state file ---------------------------------------------------------------------------
STATES: dict[str, Callable[[Path], object]] = {
    "binary": lambda p: p.write_bytes(bytes(range(256))),
    "directory": lambda p: p.mkdir(),
    "json-list": lambda p: p.write_text("[1, 2]"),
    "jobs-not-a-list": lambda p: p.write_text('{"jobs": 5}'),
    "record-wrong-shape": lambda p: p.write_text('{"jobs": [{"id": 1}]}'),
    "truncated": lambda p: p.write_text('{"jobs": [{"id": "1", '),
}

STATE_COMMANDS: dict[str, list[str]] = {
    "status": ["status", "some-job"],
    "logs": ["logs", "some-job"],
    "cancel": ["cancel", "some-job"],
    "diagnose": ["diagnose", "some-job"],
    "jobs": ["jobs"],
    # found before anything is submitted or started (item 7): no sbatch call, no trainer
    "submit": ["submit", str(SLURM_JOB), "--backend", "slurm"],
    "run": ["run", str(CPU_JOB)],
}


@pytest.mark.parametrize("command", list(STATE_COMMANDS))
@pytest.mark.parametrize("state", list(STATES))
def test_bad_state_file(tmp_path, command, state):
    w = World(tmp_path)
    STATES[state](w.root / "state" / "jobs.json")
    assert_refused(w, STATE_COMMANDS[command], "jobs.json")


# --- run-dir links the job itself would meet (issue 23) ---------------------------------------------
def test_local_wrapper_records_the_exit_code_without_following_a_link(tmp_path):
    """The local run's wrapper writes logs/exit_code through a new file (O_EXCL) renamed into place: an
    exit_code.tmp link planted while the job ran is replaced, its target untouched; backend.env's
    trainer-only names reach the command, not the wrapper shell."""
    import subprocess

    from launcher.backends.local import LocalBackend

    target, exit_file = tmp_path / "target", tmp_path / "exit_code"
    target.write_text("precious\n")
    probe = ["bash", "-c", 'echo "LDLP=$LD_LIBRARY_PATH"; exit 3']
    script = LocalBackend.wrapper(probe, exit_file, {"LD_LIBRARY_PATH": "/opt/x y"})
    script = script.replace("rc=$?\n", f'rc=$?\nln -s {target} {exit_file}.tmp\necho "SHELL=${{LD_LIBRARY_PATH-unset}}"\n')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    assert out.returncode == 3 and out.stdout.splitlines() == ["LDLP=/opt/x y", "SHELL=unset"], out
    assert exit_file.read_text() == "3\n" and not exit_file.is_symlink()
    assert target.read_text() == "precious\n" and not os.path.lexists(f"{exit_file}.tmp")


def _precious(tmp_path: Path) -> tuple[Path, Path]:
    """A file and a directory outside the run dir that a planted link points at; neither may change."""
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep").write_text("precious dir\n")
    (tmp_path / "victim.txt").write_text("precious\n")
    return tmp_path / "victim.txt", tmp_path / "victim"


def _untouched(file: Path, folder: Path) -> None:
    assert file.read_text() == "precious\n"
    assert sorted(p.name for p in folder.iterdir()) == ["keep"] and (folder / "keep").read_text() == "precious dir\n"


def _write_latest(rd: Path) -> None:
    from launcher.trainer.checkpoint import Checkpointer

    Checkpointer(rd, 1)._write_latest("step-3")
    assert (rd / "checkpoints" / "latest").read_text() == "step-3\n"
    assert not (rd / "checkpoints" / "latest").is_symlink()


def _save_checkpoint(rd: Path) -> None:
    from launcher.trainer.checkpoint import Checkpointer
    from tests.integration.test_trainer_checkpoint import make_training

    model, opt, sched = make_training()
    Checkpointer(rd, 1).save(3, model, opt, sched, {"pos": 3})
    assert (rd / "checkpoints" / "step-3" / "extra.pt").is_file() and not (rd / "checkpoints" / "step-3").is_symlink()


def _metrics(rd: Path) -> None:
    import io

    from launcher.trainer.metrics import MetricsLogger
    from tests.trainer_helpers import make_plan

    MetricsLogger(rd, 0, make_plan(), stream=io.StringIO()).log_step(1, 1.0, 1.0, 1.0, 10)


def _heartbeat(rd: Path) -> None:
    from launcher.trainer.metrics import Heartbeat

    Heartbeat(rd, 0, "h").beat(1, "forward")
    assert not (rd / "heartbeat" / "rank0.json").is_symlink()


def _stacks(rd: Path) -> None:
    from launcher.trainer.stalls import StallWatchdog

    StallWatchdog(rd, 0, "h", 0).close()


def _flight(rd: Path) -> None:
    from launcher.formats import nofollow

    nofollow.write_atomic(rd, rd / "logs" / "flight" / "rank_0", b"dump")
    assert (rd / "logs" / "flight" / "rank_0").read_bytes() == b"dump"


#: where a link is planted while the job runs -> (points at the file or the dir, the writer that meets it,
#: refused: PlantedLinkError naming the link | replaced: the write lands in a new file of ours). Issue 23.
RUN_DIR_LINKS: dict[str, tuple[str, str, Callable[[Path], None], str]] = {
    "latest-tmp": ("checkpoints/.latest.tmp", "file", _write_latest, "replaced"),
    "latest": ("checkpoints/latest", "file", _write_latest, "replaced"),
    "checkpoints-dir": ("checkpoints", "dir", _write_latest, "refused"),
    "step-tmp-dir": ("checkpoints/step-3.tmp", "dir", _save_checkpoint, "replaced"),
    "step-final": ("checkpoints/step-3", "dir", _save_checkpoint, "replaced"),
    "metrics": ("metrics.jsonl", "file", _metrics, "refused"),
    "heartbeat-file": ("heartbeat/rank0.json", "file", _heartbeat, "replaced"),
    "heartbeat-tmp": ("heartbeat/.rank0.json.tmp", "file", _heartbeat, "replaced"),
    "heartbeat-dir": ("heartbeat", "dir", _heartbeat, "refused"),
    "stacks-file": ("logs/stacks/rank0.txt", "file", _stacks, "refused"),
    "logs-dir": ("logs", "dir", _stacks, "refused"),
    "flight-tmp": ("logs/flight/.rank_0.tmp", "file", _flight, "replaced"),
}


@pytest.mark.parametrize("case", list(RUN_DIR_LINKS))
def test_the_trainer_never_writes_through_a_link_planted_in_its_run_dir(tmp_path, case):
    """Each of the trainer's writes inside the run dir (checkpoints and their .tmp dirs, latest, metrics,
    heartbeats, stack and flight-recorder dumps) with a link planted at its path while the job runs: the
    link's target is untouched; the write either replaces the link with a file of its own or stops with one
    line naming the link (launcher.formats.nofollow)."""
    from launcher.formats.nofollow import PlantedLinkError

    file, folder = _precious(tmp_path)
    rel, kind, writer, outcome = RUN_DIR_LINKS[case]
    rd = tmp_path / "run"
    (rd / rel).parent.mkdir(parents=True, exist_ok=True)
    (rd / rel).symlink_to(file if kind == "file" else folder)
    if outcome == "refused":
        with pytest.raises(PlantedLinkError) as info:
            writer(rd)
        assert str(info.value).startswith(f"{rd / rel} is a symbolic link (-> ") and "\n" not in str(info.value)
    else:
        writer(rd)
        assert not (rd / rel).is_symlink()
    _untouched(file, folder)


def test_local_backend_opens_its_log_without_following_a_link(tmp_path, monkeypatch):
    """logs/node0.log (or logs/ itself) planted as a link between the run-dir check and the job's start:
    `launch run` refuses in one line naming it, and starts nothing."""
    import launcher.backends.local as local
    from launcher.backends import prepare_run_dir
    from launcher.plan.planner import plan_job
    from launcher.plan.spec import load_spec

    file, folder = _precious(tmp_path)
    spec = load_spec(CPU_JOB)
    plan = chosen(plan_job(spec))
    for rel, target in (("logs/node0.log", file), ("logs", folder)):
        rd = tmp_path / f"run-{rel.replace('/', '-')}"

        def prepare_then_plant(run_dir, plan, job_text, rel=rel, target=target):
            out = prepare_run_dir(run_dir, plan, job_text)
            victim = Path(run_dir) / rel
            if victim.is_dir():
                import shutil

                shutil.rmtree(victim)
            victim.symlink_to(target)
            return out

        monkeypatch.setattr(local, "prepare_run_dir", prepare_then_plant)
        backend = local.LocalBackend()
        request = backend.dryrun(spec, plan, run_dir=rd)
        request.extra["argv"] = ["true"]
        with pytest.raises(UserError, match=re.escape(f"{rd / rel} is a symbolic link (-> {target})")):
            backend.submit(request)
        _untouched(file, folder)
        assert not backend._procs


# --- bandwidth maps with wrong values (issue 23) ----------------------------------------------------
def _bwmap_dict() -> dict:
    from launcher.formats.bwmap import BandwidthMap, NodeReport

    nodes = {h: NodeReport(h, 2, intra_busbw_gbs=100.0) for h in ("n1", "n2")}
    return BandwidthMap(nodes=nodes, intra_node_busbw_gbs=100.0, inter_node_busbw_gbs=20.0).to_dict()


#: name -> (edit of a good map, the field the error line names)
BWMAP_EDITS: dict[str, tuple[Callable[[dict], object], str]] = {
    "inter-nan": (lambda d: d.update(inter_node_busbw_gbs=float("nan")), "inter_node_busbw_gbs: nan"),
    "intra-negative": (lambda d: d.update(intra_node_busbw_gbs=-5), "intra_node_busbw_gbs: -5"),
    "intra-string": (lambda d: d.update(intra_node_busbw_gbs="fast"), "intra_node_busbw_gbs: 'fast'"),
    "inter-inf": (lambda d: d.update(inter_node_busbw_gbs=float("inf")), "inter_node_busbw_gbs: inf"),
    "exclude-string": (lambda d: d.update(exclude="n1"), "exclude: 'n1' is not a list"),
    "gpus-negative": (lambda d: d["nodes"]["n1"].update(gpus=-8), "nodes.n1.gpus: -8"),
    "node-not-object": (lambda d: d["nodes"].update(n1="x"), "nodes.n1: 'x'"),
    "pair-bandwidth-string": (lambda d: d.update(pairs=[{"a": "n1", "b": "n2", "busbw_gbs": "x"}]),
                              r"pairs\[0\].busbw_gbs"),
    "node-intra-nan": (lambda d: d["nodes"]["n2"].update(intra_busbw_gbs=float("nan")), "nodes.n2.intra_busbw_gbs"),
}
BWMAP_COMMANDS: dict[str, list[str]] = {
    "plan-bwmap": ["plan", str(SLURM_JOB), "--bwmap", "{f}"],
    "render-preflight": ["render", str(SLURM_JOB), "--backend", "slurm", "--preflight", "{f}"],
    "diagnose-bwmap": ["diagnose", str(CPU_JOB), "--bwmap", "{f}"],
    "preflight-drain": ["preflight", "drain", "{f}"],
}


@pytest.mark.parametrize("command", list(BWMAP_COMMANDS))
@pytest.mark.parametrize("edit", list(BWMAP_EDITS))
def test_bad_bwmap_values(tmp_path, command, edit):
    import json

    w = World(tmp_path)
    data = _bwmap_dict()
    change, expect = BWMAP_EDITS[edit]
    change(data)
    f = w.raw("bw.json", json.dumps(data).encode())
    assert_refused(w, [a.format(f=f) for a in BWMAP_COMMANDS[command]], f"bw.json: {expect}")


def test_logs_refuses_a_negative_rank(tmp_path):
    """`launch logs JOB --rank -1` printed nothing and exited 0 (issue 23)."""
    assert_refused(World(tmp_path), ["logs", "some-job", "--rank", "-1"], "--rank")


@pytest.mark.parametrize("meta, expect", [
    (b"[1, 2]", "expected a JSON object"), (b'{"topo": "x"}', "topo: expected a JSON object"),
    (b'{"topo": {"rc": "x"}}', r"topo.rc: 'x' is not int"), (b'{"topo": {"timed_out": 1}}', "topo.timed_out"),
    (b'{"topo": {"command": 5}}', "topo.command: 5 is not str"), (b"{", "not JSON"),
])
def test_preflight_import_refuses_probe_metadata_of_the_wrong_shape(tmp_path, meta, expect):
    """probe.json beside a node's outputs, hand-made or damaged: one line naming it (was a traceback)."""
    from tests.unit.test_preflight_judges import make_dir

    w = World(tmp_path)
    d = make_dir(w.root / "in" / "pf", ["n1", "n2"])
    (d / "n1" / "probe.json").write_bytes(meta)
    assert_refused(w, ["preflight", "import", str(d)], f"probe.json: {expect}")


def test_preflight_parse_xid_flags_a_code_outside_nvidias_catalog(tmp_path):
    """An Xid code NVIDIA's catalog does not list went unflagged (issue 23): it warns as unknown, beside the
    known codes' verdicts (tests/unit/test_xid_catalog.py has every code of the catalog)."""
    import json

    from tests.replay.constructed import dmesg_xids

    w = World(tmp_path)
    log = w.raw("dmesg.txt", dmesg_xids([("0000:3b:00", 4242, "from a newer driver")]).encode())
    res = run_cli(w, ["preflight", "parse", "xid", str(log), "--json"])
    out = json.loads(res.output)
    assert res.exit_code == 0 and out["status"] == "warn" and out["parse"]["unknown_codes"] == [4242]
    assert "unknown Xid 4242 (not in NVIDIA's catalog)" in out["findings"][0]["message"]
