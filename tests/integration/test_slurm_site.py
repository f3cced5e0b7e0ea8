"""Site options, container runtimes and the node self-check in the rendered batch script.

No scheduler here: the script runs under bash with stand-ins for srun (runs the command once per
node), scontrol (records its calls), nvidia-smi and apptainer. Debian has no apptainer package,
so the apptainer stand-in records its arguments and runs the command after the image, as
`apptainer exec` does. test_slurm_e2e.py runs the node check and the site options under a real
Slurm.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from launcher.errors import UserError
from launcher.render.sbatch import render_slurm
from tests.plan_helpers import chosen
from tests.unit.test_render import spec_plan

pytestmark = pytest.mark.integration

SRUN = """#!/bin/bash
echo "srun $*" >> "$CALLS"
while [[ "$1" == --* ]]; do shift; done
for ni in $NODES; do SLURMD_NODENAME=${ni%%:*} SLURM_NODEID=${ni##*:} "$@"; done
"""
SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$CALLS"
case "$1 $2" in
  "show hostnames") for ni in $NODES; do echo "${ni%%:*}"; done ;;
  "show node") echo "NodeName=$3 NodeAddr=127.0.0.1" ;;
  "show job") echo "JobId=$3 ExcNodeList=$EXC" ;;
esac
"""
# nvidia-smi's stand-in: two GPUs, except on $BAD_NODE, where it fails as a GPU that fell off
# the bus does (message from ../shared/fixtures/nvidia-smi-query, the Xid 79 capture).
NVIDIA_SMI = """#!/bin/bash
if [ "$SLURMD_NODENAME" = "$BAD_NODE" ]; then
  echo "Unable to determine the device handle for GPU0000:A1:00.0: Unknown Error"; exit 255
fi
echo 0; echo 1
"""
PYTHON = "#!/bin/bash\necho \"RUN $SLURMD_NODENAME rank=$LAUNCH4D_NODE_RANK hosts=$LAUNCH4D_HOSTS $*\"\n"
APPTAINER = """#!/bin/bash
echo "apptainer $*" >> "$CALLS"
[ "$1" = exec ] || exit 2
shift
while [[ "$1" == --* ]]; do case "$1" in --nv) shift ;; *) shift 2 ;; esac; done
shift   # the image
exec "$@"
"""


def run_script(script: str, tmp_path: Path, nodes: str = "n1:0 n2:1", bad: str = "", exc: str = "(null)",
               env_extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("nvidia-smi", NVIDIA_SMI),
                       ("fakepython", PYTHON), ("apptainer", APPTAINER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = script.replace(shlex.quote("python3") + " -m", str(bin_dir / "fakepython") + " -m")
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "n[1-2]", "NODES": nodes, "BAD_NODE": bad, "EXC": exc, "CALLS": str(calls),
           **(env_extra or {})}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    return out, calls.read_text().splitlines() if calls.exists() else []


# --- site options -----------------------------------------------------------------------------
def test_site_options_render_as_sbatch_reads_them(tmp_path):
    spec, plan = spec_plan(**{"backend.slurm.reservation": "maint-2026", "backend.slurm.constraint": "a100&ib",
                              "backend.slurm.gres": "nvme:1", "backend.slurm.mail_user": "me@example.org",
                              "backend.slurm.mail_type": "END,FAIL", "backend.slurm.comment": 'run "7" # ok',
                              "backend.slurm.segment": 4, "backend.slurm.switches": 1,
                              "backend.slurm.switches_wait": "02:00:00",
                              "backend.slurm.extra": ["--hint=nomultithread", "--contiguous", "--wckey=a b\\c",
                                                      "--reserv=r2", "--container-image=x"]})
    s = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    for line in ("--reservation=maint-2026", '--constraint="a100&ib"', "--gres=nvme:1", "--mail-user=me@example.org",
                 "--mail-type=END,FAIL", '--comment="run \\"7\\" # ok"', "--segment=4", "--switches=1@02:00:00",
                 "--hint=nomultithread", "--contiguous", '--wckey="a b\\\\c"', "--reserv=r2",
                 "--container-image=x"):   # an unambiguous abbreviation; a SPANK plugin's option
        assert f"#SBATCH {line}\n" in s, line


@pytest.mark.parametrize("extra,message", [
    (["-p debug"], r"backend.slurm.extra\[0\]: '-p debug' is not one sbatch option"),
    (["--hint=a\n#SBATCH --uid=0"], r"backend.slurm.extra\[0\]: .*(control character|is not one sbatch option)"),
    (["--ok", "--Bad"], r"backend.slurm.extra\[1\]: '--Bad' is not one sbatch option"),
    (["--nodes=3"], r"backend.slurm.extra\[0\]: --nodes is set by launch4d itself; use cluster.nodes"),
    (["--signal=USR1@60"], r"backend.slurm.extra\[0\]: --signal is set by launch4d itself; use backend.slurm.checkpoint_signal"),
    # issue 23: sbatch takes any unambiguous prefix of a long option (getopt_long)
    *[([f"--{abbr}"], rf"backend.slurm.extra\[0\]: --{abbr.split('=')[0]} \(sbatch reads it as --{full}\) is set by "
                    "launch4d itself")
      for abbr, full in (("arr=0-2", "array"), ("sig=B:KILL@5", "signal"), ("job-n=other", "job-name"),
                         ("ntasks-per-n=4", "ntasks-per-node"), ("gpus-per-n=1", "gpus-per-node"),
                         ("open-m=truncate", "open-mode"), ("no-req", "no-requeue"), ("ch=/tmp", "chdir"),
                         ("outp=/tmp/x", "output"), ("wr=id", "wrap"), ("tasks-per-n=2", "tasks-per-node"))],
    (["--n=2"], r"--n \(an abbreviation sbatch may read as --no-requeue\) is set by launch4d itself"),
    (["--o=/tmp/x"], r"--o \(an abbreviation sbatch may read as --open-mode\)"),
    (["--ex=n1"], r"backend.slurm.extra\[0\]: --ex is ambiguous to sbatch \(--exclude, --exclusive, "),
])
def test_bad_extra_options_are_refused_with_their_path(tmp_path, extra, message):
    with pytest.raises(UserError, match=message):    # the job file's loader or the renderer
        spec, plan = spec_plan(**{"backend.slurm.extra": extra})
        render_slurm(spec, plan, str(tmp_path))


@pytest.mark.parametrize("over,message", [
    ({"backend.slurm.switches_wait": "2:00:00"}, "set backend.slurm.switches too"),
    ({"backend.slurm.switches": 2, "backend.slurm.switches_wait": "soon"}, "is not a Slurm time"),
    ({"backend.slurm.comment": "a\nb"}, "backend.slurm.comment: .* control character"),
    ({"backend.slurm.checkpoint_signal": "KILL"}, "backend.slurm.checkpoint_signal: 'KILL' is not valid"),
    ({"backend.slurm.container_runtime": "apptainer"}, "set backend.slurm.container_image"),
])
def test_bad_site_values(tmp_path, over, message):
    with pytest.raises(UserError, match=message):
        spec, plan = spec_plan(**over)
        render_slurm(spec, plan, str(tmp_path))


# --- containers -------------------------------------------------------------------------------
def test_apptainer_runs_the_node_function_in_the_image_with_binds(tmp_path):
    run = str(tmp_path / "run")
    spec, plan = spec_plan(**{"backend.slurm.container_runtime": "apptainer",
                              "backend.slurm.container_image": "/images/pytorch.sif",
                              "backend.slurm.container_mounts": ["/data:/data"]})
    s = render_slurm(spec, plan, run).files["train.sbatch"]
    assert "--container-image" not in s
    out, calls = run_script(s, tmp_path)
    assert out.returncode == 0, out.stderr
    app = [c for c in calls if c.startswith("apptainer ")]
    assert app == [f"apptainer exec --nv --bind {run},/data:/data --pwd {run} /images/pytorch.sif "
                   "bash -c launch4d_node"] * 2
    runs = [ln for ln in out.stdout.splitlines() if ln.startswith("RUN ")]
    assert [ln.split()[1:3] for ln in runs] == [["n1", "rank=0"], ["n2", "rank=1"]]


def test_runtime_none_ignores_the_image(tmp_path):
    spec, plan = spec_plan(**{"backend.slurm.container_runtime": "none", "backend.slurm.container_image": "x.sif"})
    s = render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]
    assert "--container-image" not in s and "apptainer" not in s


# --- node order and node check -----------------------------------------------------------------
def test_rank_order_follows_the_map_among_the_nodes_given(tmp_path):
    """Map order n3, n2, n1; Slurm gives n1, n2 (n3 busy or down): n2 is node 0, n1 node 1."""
    spec, plan = spec_plan()
    s = render_slurm(spec, plan, str(tmp_path / "run"), node_order=["n3", "n2", "n1"]).files["train.sbatch"]
    assert "#SBATCH --nodelist" not in s
    out, _ = run_script(s, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "launch4d: node order n2 n1" in out.stdout
    runs = {ln.split()[1]: ln for ln in out.stdout.splitlines() if ln.startswith("RUN ")}
    assert "rank=0" in runs["n2"] and "--node-rank=0" in runs["n2"] and "--node-rank=1" in runs["n1"]


def test_a_node_failing_its_check_is_excluded_and_the_job_requeued(tmp_path):
    run = tmp_path / "run"
    spec, plan = spec_plan(**{"backend.slurm.node_check": {"gpus": True}})
    s = render_slurm(spec, plan, str(run)).files["train.sbatch"]
    (run / "logs").mkdir(parents=True)
    (tmp_path / "bin").mkdir()                 # a partition with nodes to spare (not the test Slurm's two)
    (tmp_path / "bin" / "sinfo").write_text("#!/bin/bash\necho n1; echo n2; echo n3; echo bad0\n")
    (tmp_path / "bin" / "sinfo").chmod(0o755)
    out, calls = run_script(s, tmp_path, bad="n2", exc="bad0")
    assert out.returncode == 0, out.stderr
    assert not [ln for ln in out.stdout.splitlines() if ln.startswith("RUN ")]      # torchrun never started
    assert "launch4d: node check: n2 left out: nvidia-smi: Unable to determine the device handle" in out.stdout
    assert calls.index("scontrol requeue 4242") < calls.index("scontrol update jobid=4242 ExcNodeList=bad0,n2")
    log = (run / "logs" / "nodecheck.log").read_text()
    assert re.search(r"job 4242 restart 0: n2 left out: nvidia-smi: Unable", log)


def test_a_tool_missing_on_every_node_fails_the_job_instead_of_requeueing(tmp_path):
    """A GPU check on nodes without nvidia-smi: every node fails it, and a requeue without all of
    them would pend for ever (issue 23). A configuration error, said so, exit 3, no requeue."""
    run = tmp_path / "run"
    spec, plan = spec_plan(**{"backend.slurm.node_check": {"gpus": True}})
    s = render_slurm(spec, plan, str(run)).files["train.sbatch"]
    (run / "logs").mkdir(parents=True)
    bare = tmp_path / "bare"                       # srun and scontrol, but no nvidia-smi
    bare.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bare / name).write_text(text)
        (bare / name).chmod(0o755)
    out, calls = run_script(s, tmp_path, env_extra={"PATH": f"{bare}:/usr/bin:/bin"})
    assert out.returncode == 3, out.stderr
    assert "nvidia-smi is not installed on the node on every allocated node (n1 n2): a configuration error" in out.stdout
    assert "launch4d: step finished with exit code 3" in out.stdout
    assert not any("requeue" in c or "update" in c for c in calls)
    assert "n1 left out: missing: nvidia-smi is not installed" in (run / "logs" / "nodecheck.log").read_text()


def test_exclusions_that_leave_too_few_nodes_fail_the_job(tmp_path):
    """The partition has three nodes and the job needs two: once n2 fails its check and bad0 was left
    out before, one is left; the job would pend as BadConstraints, so it fails with the reasons."""
    run = tmp_path / "run"
    spec, plan = spec_plan(**{"backend.slurm.node_check": {"gpus": True}})
    s = render_slurm(spec, plan, str(run)).files["train.sbatch"]
    (run / "logs").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sinfo").write_text("#!/bin/bash\necho n1; echo n2; echo bad0\n")
    (tmp_path / "bin" / "sinfo").chmod(0o755)
    out, calls = run_script(s, tmp_path, bad="n2", exc="bad0", env_extra={"SLURM_JOB_PARTITION": "gpu"})
    assert out.returncode == 3, out.stderr
    assert "launch4d: node check: n2 left out: nvidia-smi: Unable to determine the device handle" in out.stdout
    assert "1 node(s) of partition gpu left once bad0,n2 are excluded; the job needs 2: not requeueing" in out.stdout
    assert not any("requeue" in c or "update" in c for c in calls)
    (tmp_path / "bin" / "sinfo").write_text("#!/bin/bash\necho n1; echo n2; echo bad0; echo n3\n")
    out, calls = run_script(s, tmp_path, bad="n2", exc="bad0", env_extra={"SLURM_JOB_PARTITION": "gpu"})
    assert out.returncode == 0 and "scontrol requeue 4242" in calls, out.stdout   # n1 and n3 are enough


def test_healthy_nodes_pass_and_train(tmp_path):
    spec, plan = spec_plan(**{"backend.slurm.node_check": {"gpus": True, "command": "test -d /"}})
    s = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    out, calls = run_script(s, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "launch4d: node check passed on n1 n2" in out.stdout
    assert len([ln for ln in out.stdout.splitlines() if ln.startswith("RUN ")]) == 2
    assert not any("requeue" in c for c in calls)


def test_site_check_failure_and_no_requeue(tmp_path):
    """A site command that fails on one node; without requeue the job ends (exit 3) and says why."""
    spec, plan = spec_plan(**{"backend.slurm.requeue": False,
                              "backend.slurm.node_check": {"command": '[ "$SLURMD_NODENAME" != n1 ] || '
                                                                     '{ echo "ib0 flapping"; exit 1; }'}})
    s = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    (tmp_path / "run" / "logs").mkdir(parents=True)
    out, calls = run_script(s, tmp_path)
    assert out.returncode == 3
    assert "launch4d: node check: n1 left out: site check: ib0 flapping" in out.stdout
    assert "launch4d: step finished with exit code 3" in out.stdout
    assert not any("requeue" in c or "update" in c for c in calls)


def test_no_check_step_when_there_is_nothing_to_check(tmp_path):
    spec, plan = spec_plan()                      # CPU plan, no NICs, no site command
    s = render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]
    assert "launch4d_nodecheck" not in s
    spec, plan = spec_plan(**{"backend.slurm.node_check": {"enabled": False, "gpus": True}})
    assert "launch4d_nodecheck" not in render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]


# --- job arrays ---------------------------------------------------------------------------------
def test_an_array_runs_each_tasks_own_plan_and_run_dir(tmp_path):
    from launcher.plan.planner import plan_job
    from launcher.render.sbatch import render_slurm_array

    spec, _ = spec_plan(**{"parallel": "auto"})
    result = plan_job(spec, top=3, ranks_for=2)
    plans = [chosen(result), *result.alternatives][:2]
    assert len(plans) == 2 and plans[0].degrees != plans[1].degrees
    base = tmp_path / "bench"
    dirs = [str(base / f"{i}-variant") for i in range(2)]
    script, tasks = render_slurm_array(spec, plans, str(base), dirs)
    for line in ("#SBATCH --array=0-1", f"#SBATCH --output={base}/logs/slurm-%A_%a.out",
                 f"#SBATCH --chdir={base}", "#SBATCH --nodes=2", "#SBATCH --signal=B:USR2@60"):
        assert line + "\n" in script, line
    assert script.count("--output=") == 1
    for d, t in zip(dirs, tasks):
        (Path(d) / "logs").mkdir(parents=True)
        (Path(d) / "train.sbatch").write_text(t.files["train.sbatch"].replace(
            shlex.quote("python3") + " -m", str(tmp_path / "bin" / "fakepython") + " -m"))
    out, _ = run_script(script, tmp_path, env_extra={"SLURM_ARRAY_TASK_ID": "1"})
    assert out.returncode == 0, out.stderr
    runs = [ln for ln in out.stdout.splitlines() if ln.startswith("RUN ")]
    assert len(runs) == 2 and all(f"--plan {dirs[1]}/plan.json --run-dir {dirs[1]} " in ln for ln in runs)
    spec1, plan1 = spec_plan(**{"cluster.nodes": 1, "cluster.gpus_per_node": 4})
    with pytest.raises(UserError, match="other resources than plan 0"):
        render_slurm_array(spec, [plans[0], plan1], str(base), dirs)


DMESG = """#!/bin/bash
cat "$DMESG_FILE" 2>/dev/null
"""


def test_a_new_xid_since_the_last_check_leaves_the_node_out(tmp_path):
    """First check: the kernel log's last Xid is the baseline. A new Xid on n1 before the next
    check (a real line from a captured dmesg) leaves n1 out."""
    from tests.conftest import shared_file

    xid = next(ln for ln in shared_file("xid", "akash-provider-gpu-xid79-fallen-off-bus-dmesg-T-crash-dump-multiline"
                                                ".txt").read_text().splitlines() if "NVRM: Xid" in ln)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    spec, plan = spec_plan(**{"backend.slurm.node_check": {"xid": True}})
    s = render_slurm(spec, plan, str(run)).files["train.sbatch"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dmesg").write_text(DMESG)
    (bin_dir / "dmesg").chmod(0o755)
    old = tmp_path / "old.log"
    old.write_text("[Fri Apr  5 21:00:00 2024] NVRM: Xid (PCI:0000:a1:00): 13, an old one\n")
    out, _ = run_script(s, tmp_path, env_extra={"DMESG_FILE": str(old)})
    assert "launch4d: node check passed on n1 n2" in out.stdout, out.stdout + out.stderr
    new = tmp_path / "new.log"
    new.write_text(old.read_text() + xid + "\n")
    out, calls = run_script(s, tmp_path, env_extra={"DMESG_FILE": str(new)})
    assert f"node check: n1 left out: new Xid since the last check: {xid}" in out.stdout
    assert f"node check: n2 left out: new Xid since the last check: {xid}" in out.stdout   # same log here
    assert "scontrol update jobid=4242 ExcNodeList=n1,n2" in calls


@pytest.mark.parametrize("nic,left_out", [("lo", None), ("mlx5_9", "NIC mlx5_9 not found")])
def test_the_plans_nics_must_be_up(tmp_path, nic, left_out):
    """The NICs the plan expects (from the BandwidthMap): `lo` is there (operstate unknown, carrier
    1); an HCA this machine lacks leaves the node out."""
    spec, plan = spec_plan()
    for r in plan.ranks:
        r.nic = nic
    s = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    (tmp_path / "run" / "logs").mkdir(parents=True)
    out, _ = run_script(s, tmp_path)
    if left_out is None:
        assert "launch4d: node check passed on n1 n2" in out.stdout, out.stdout
    else:
        assert f"node check: n1 left out: {left_out}" in out.stdout
