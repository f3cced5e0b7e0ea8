"""Nothing user-controlled executes: property tests (hypothesis) over job-file values and file
names that render, for the Slurm script and the Kubernetes pod command.

Each example renders (or is refused with a UserError: also fine), must pass `bash -n`, and is then
*run* by bash with stub commands first on PATH (srun, scontrol, mkdir, python, and `pwned`), which
record their argv and environment. The values are built from shell metacharacters and payloads
(`$(...)`, backticks, `;`, newlines, `a=b`, quotes, `touch pwned`). The properties: no `pwned` file
or command ever appears, the interpreter the job file names is run as exactly one word
(`backend.slurm.python: "a=b"` is a command, not an assignment), and every environment value and
the run dir arrive byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from launcher.errors import UserError
from launcher.formats.shell import SBATCH_SAFE, quote
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from launcher.render.k8s import render_k8s
from launcher.render.sbatch import render_slurm
from tests.cli_helpers import invoke
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.unit

# Modest: the suite runs on 2 cores; each example renders and runs a few bash processes.
PROPERTY = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLURM_PROPERTY = settings(PROPERTY, max_examples=80)  # about half are refused by validation
K8S_PROPERTY = settings(PROPERTY, max_examples=30)  # each render validates through the kubernetes client

FRAGMENTS = ["pwned", "touch pwned", ";", "&&", "||", "|", "&", "$(", ")", "`", "'", '"', "\\", "\n", "\r",
             "\t", " ", "=", "a=b", "x+=1", "#", "$HOME", "${IFS}", "$'", "!", "*", "?", "~", "-", "--",
             "{", "}", "<", ">", ">>", "\x01", "\x7f", "é", "\u2028", "%", ":", ","]
_any = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=8).map("".join)
# Validation refuses control characters in free text; most examples keep to printable ones so they
# get as far as running (metacharacters, quotes, `=`, `$(...)` and non-ASCII are all printable).
_printable = st.lists(st.one_of(
    st.sampled_from([f for f in FRAGMENTS if f.isprintable()]),
    st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=3)), max_size=8).map("".join)
hostile = st.one_of(_printable, _printable, _any)
# Names are checked strictly (a refused name stops the example early): mostly keep the job's own.
names = st.one_of(st.none(), st.none(), st.none(), hostile)
env_names = st.from_regex(r"[A-Z][A-Z0-9_]{0,7}", fullmatch=True).filter(
    lambda k: k not in os.environ and not k.startswith(("SLURM", "LAUNCH4D", "BASH", "PATH")))


# --- stubs ---------------------------------------------------------------------------------------
STUBS = {
    # srun: run the per-node command once per node, with a handler that records what bash could not
    # find (the trainer's interpreter is never on PATH here): its argv and environment.
    "srun": r"""#!/bin/bash
printf '%s\0' "$@" > "$STUBLOG/srun.argv"
command_not_found_handle() {
  { printf '%s\0' "$@"; } > "$STUBLOG/cnf.$SLURM_NODEID.argv"
  env -0 > "$STUBLOG/cnf.$SLURM_NODEID.env"
  return 127
}
export -f command_not_found_handle
rc=0
for i in $(seq 0 $((STUB_NODES - 1))); do
  SLURM_NODEID=$i SLURMD_NODENAME=n$i "${@: -3}" || rc=$?
done
exit $rc
""",
    "scontrol": r"""#!/bin/bash
printf '%s\0' "$@" >> "$STUBLOG/scontrol.argv"
case "$1 $2" in
  "show hostnames") for i in $(seq 0 $((STUB_NODES - 1))); do echo "n$i"; done ;;
  "show node") echo "NodeName=$3 NodeAddr=127.0.0.1 State=IDLE" ;;
esac
""",
    "python": r"""#!/bin/bash
printf '%s\0' "$@" > "$STUBLOG/python.argv"
env -0 > "$STUBLOG/python.env"
""",
    "mkdir": r"""#!/bin/bash
printf '%s\0' "$@" >> "$STUBLOG/mkdir.argv"
""",
    "pwned": r"""#!/bin/bash
touch "$STUBLOG/PWNED"
""",
}


def stub_dir(root: Path, names: tuple[str, ...]) -> Path:
    d = root / "stubs"
    d.mkdir()
    for name in names:
        (d / name).write_text(STUBS[name])
        (d / name).chmod(0o755)
    return d


def run_bash(root: Path, args: list[str], stubs: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess:
    log = root / "log"
    log.mkdir()
    path = f"{stub_dir(root, stubs)}:/usr/bin:/bin"
    work = root / "work"
    work.mkdir()
    full = {"PATH": path, "HOME": str(root), "STUBLOG": str(log), "LANG": "C.UTF-8", **env}
    return subprocess.run(["bash", *args], cwd=work, env=full, capture_output=True, timeout=60)


def nul_list(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def nul_env(path: Path) -> dict[str, str]:
    return dict(item.split("=", 1) for item in nul_list(path) if "=" in item)


def assert_nothing_executed(root: Path) -> None:
    assert not (root / "log" / "PWNED").exists(), "a user-controlled `pwned` ran"
    made = [p for p in root.rglob("*pwned*") if p.parent.name != "stubs"]
    assert not made, f"a user-controlled `touch pwned` ran: {made}"


# --- the job -------------------------------------------------------------------------------------
@cache
def base_job(example: str) -> tuple[dict, object]:
    data = yaml.safe_load((EXAMPLES / example).read_text())
    return data, plan_job(spec_from_dict(data, source=example)).best


def job_with(example: str, source: str = "job.yaml", name: str | None = None, python: str | None = None,
             env: dict[str, str] | None = None, log_dir: str | None = None, partition: str | None = None):
    data, plan = base_job(example)
    data = json.loads(json.dumps(data))
    backend = data["backend"]
    if name == "":
        data.pop("name", None)  # the job is named after its file's stem
    elif name is not None:
        data["name"] = name
    if python is not None:
        backend["slurm"]["python"] = python
    if env is not None:
        backend["env"] = env
    if log_dir is not None:
        backend["log_dir"] = log_dir
    if partition is not None:
        backend["slurm"]["partition"] = partition
    return spec_from_dict(data, source=source), plan


# --- Slurm ---------------------------------------------------------------------------------------
def check_slurm(spec, plan, root: Path) -> None:
    """Render, check the #SBATCH lines, run the script with stubs, check what ran."""
    run_dir = str(root / "run")
    try:
        script = render_slurm(spec, plan, run_dir).files["train.sbatch"]
    except UserError:
        event("refused by render")
        return  # refused with a clear message: nothing to run
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            opt = line[len("#SBATCH "):]
            assert re.fullmatch(r"--[a-z-]+(=.*)?", opt), line
            if "=" in opt:
                assert SBATCH_SAFE.fullmatch(opt.split("=", 1)[1]), line
    (root / "train.sbatch").write_text(script)
    proc = run_bash(root, [str(root / "train.sbatch")], ("srun", "scontrol", "pwned"),
                    {"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n[0-1]", "STUB_NODES": str(plan.nodes)})
    assert_nothing_executed(root)
    for node in range(plan.nodes):
        argv = nul_list(root / "log" / f"cnf.{node}.argv")
        assert argv[0] == spec.backend.slurm.python, (argv[:3], proc.stderr[-2000:])
        assert argv[1:3] == ["-m", "torch.distributed.run"]
        assert argv[argv.index("--run-dir") + 1] == run_dir
        env = nul_env(root / "log" / f"cnf.{node}.env")
        for key, value in spec.backend.env.items():
            assert env.get(key) == value, key


@SLURM_PROPERTY
@given(python=hostile, env=st.dictionaries(env_names, hostile, max_size=3),
       name=st.one_of(names, st.just("")), source=hostile, partition=st.none() | hostile)
def test_slurm_script_runs_nothing_user_controlled(python, env, name, source, partition):
    source = source.replace("/", "_").replace("\0", "")[:200] or "job"  # a file name: one component
    with tempfile.TemporaryDirectory() as tmp:
        try:
            spec, plan = job_with("tiny-slurm.yaml", source=f"/jobs/{source}.yaml", python=f"py-{python.replace('/', '_')}",
                                  env={"GLOO_SOCKET_IFNAME": "lo", **env}, name=name,
                                  partition=partition or None)
        except UserError:
            event("refused by validation")
            return
        check_slurm(spec, plan, Path(tmp))


@pytest.mark.parametrize("python", ["a=b", "x+=1", "$(touch pwned)", "py;pwned", "`pwned`",
                                    "py'\"pwned", "py #pwned"])
def test_slurm_python_is_one_command_word(tmp_path, python):
    """The deterministic half of the property: these values are accepted and run as one word."""
    spec, plan = job_with("tiny-slurm.yaml", python=python)
    check_slurm(spec, plan, tmp_path)


def test_slurm_python_with_a_control_character_is_refused():
    """Free text never carries a control character (the job-file loader refuses it, naming the field)."""
    with pytest.raises(UserError, match=r"^backend\.slurm\.python: .*control character"):
        job_with("tiny-slurm.yaml", python="py\npwned")


def test_job_file_name_with_a_newline_stays_in_its_comment(tmp_path):
    """Issue 14 item 1, end to end: the file name reaches the script only quoted, on one line."""
    job = tmp_path / "job\ntouch pwned\n#.yaml"
    job.write_text((EXAMPLES / "tiny-slurm.yaml").read_text())
    out = tmp_path / "out"
    res = invoke("render", str(job), "--backend", "slurm", "-o", str(out))
    assert res.exit_code == 0, res.output
    script = (out / "train.sbatch").read_text()
    assert "rendered from $'job\\x0atouch pwned\\x0a#.yaml'" in script
    _, plan = base_job("tiny-slurm.yaml")
    spec, _ = job_with("tiny-slurm.yaml", source=str(job), python="py-not-on-path")
    (tmp_path / "check").mkdir()
    check_slurm(spec, plan, tmp_path / "check")


# --- Kubernetes ----------------------------------------------------------------------------------
def check_k8s(spec, plan, root: Path) -> None:
    try:
        rendered = render_k8s(spec, plan)
    except UserError:
        event("refused by render")
        return
    job = [d for d in yaml.safe_load_all(rendered.files["manifest.yaml"]) if d][-1]
    containers = ([job["spec"]["trainer"]] if job["kind"] == "TrainJob" else
                  [rs["template"]["spec"]["containers"][0] for rs in job["spec"]["pytorchReplicaSpecs"].values()])
    for c in containers:
        env = {e["name"]: e["value"] for e in c["env"]}
        for key, value in spec.backend.env.items():
            assert env[key] == value, key
        assert c["command"][:2] == ["bash", "-c"]
    script = containers[0]["command"][2]
    proc = run_bash(root, ["-c", script], ("python", "mkdir", "pwned"),
                    {"PET_NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_nothing_executed(root)
    argv = nul_list(root / "log" / "python.argv")
    assert argv[:2] == ["-m", "torch.distributed.run"]
    assert argv[argv.index("--run-dir") + 1] == rendered.run_dir
    made = nul_list(root / "log" / "mkdir.argv")
    assert made[0] == "-p" and made[1] == f"{rendered.run_dir}/logs/nccl"
    python_env = nul_env(root / "log" / "python.env")
    for key, value in spec.backend.env.items():
        assert python_env.get(key) == value, key


@K8S_PROPERTY
@given(env=st.dictionaries(env_names, hostile, max_size=3), log_dir=hostile, name=names)
def test_k8s_pod_command_runs_nothing_user_controlled(env, log_dir, name):
    with tempfile.TemporaryDirectory() as tmp:
        try:
            spec, plan = job_with("tiny-k8s.yaml", env=env, log_dir=log_dir or None, name=name or None)
        except UserError:
            event("refused by validation")
            return
        check_k8s(spec, plan, Path(tmp))


@pytest.mark.parametrize("log_dir", ["$(touch pwned)", "a;pwned", "`pwned`", "a=b", "'\"$HOME"])
def test_k8s_run_dir_arrives_byte_for_byte(tmp_path, log_dir):
    spec, plan = job_with("tiny-k8s.yaml", log_dir=log_dir, env={"X": "$(touch pwned);pwned"})
    check_k8s(spec, plan, tmp_path)


@pytest.mark.parametrize("field, over", [("backend.log_dir", {"log_dir": "runs\npwned"}),
                                         ("backend.env.X", {"env": {"X": "$(touch pwned)\n;pwned"}})])
def test_control_characters_are_refused_by_the_loader(field, over):
    """Free text never carries a control character: one line naming the field, before any rendering."""
    with pytest.raises(UserError, match=rf"^{re.escape(field)}: .*control character"):
        job_with("tiny-k8s.yaml", **over)


# --- the quoting function itself -----------------------------------------------------------------
@PROPERTY
@given(value=st.text().filter(lambda s: "\0" not in s))
def test_quote_is_one_line_and_round_trips_in_command_position(value):
    value = "zq" + value  # never a real command, still an assignment when followed by `=`
    q = quote(value)
    assert "\n" not in q and "\r" not in q
    with tempfile.TemporaryDirectory() as tmp:
        proc = run_bash(Path(tmp), ["-c", f"command_not_found_handle() {{ printf '%s' \"$1\" > \"$STUBLOG/w\"; }}\n"
                                           f"{q} arg"], ("pwned",), {})
        assert_nothing_executed(Path(tmp))
        if not (Path(tmp) / "log" / "w").exists():  # the value names a real command or a path: it ran as one
            return
        assert (Path(tmp) / "log" / "w").read_bytes().decode() == value, proc.stderr
