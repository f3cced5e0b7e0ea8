"""The batch script's preemption path, run by bash with stand-ins for srun, scontrol and torchrun.

What Slurm does with `--signal=B:USR2@N` (backend.slurm.checkpoint_signal) is send it to the batch shell only; the script must
pass it to the step, let the trainer checkpoint and exit, and only then requeue, and must not
requeue a step that finished cleanly anyway. The stand-ins behave like the real tools in the
respects that matter: `srun` forwards the signal to its tasks, torchrun's agent is the parent of the
worker processes. (test_slurm_e2e.py runs the same script under a real Slurm.)
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.render.sbatch import render_slurm
from tests.unit.test_render import spec_plan

pytestmark = pytest.mark.integration

SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ni in n1:0 n2:1; do
  SLURMD_NODENAME=${ni%%:*} SLURM_NODEID=${ni##*:} "$@" &
  pids+=($!)
done
trap 'kill -$SIG "${pids[@]}" 2>/dev/null' $SIG
rc=0
for p in "${pids[@]}"; do
  while :; do
    wait "$p"; r=$?
    if ! kill -0 "$p" 2>/dev/null; then
      if [ "$r" -gt 128 ]; then wait "$p" 2>/dev/null; s=$?; [ "$s" = 127 ] || r=$s; fi
      break
    fi
  done
  [ "$r" -gt "$rc" ] && rc=$r
done
exit $rc
"""

SCONTROL = """#!/bin/bash
echo "$*" >> "$CALLS"
case "$1 $2" in
  "show hostnames") echo n1; echo n2 ;;
  "show node") echo "NodeName=$3 NodeAddr=127.0.0.1" ;;
esac
"""

# torchrun's stand-in: the agent (this bash) starts one worker and exits with its code.
AGENT = """#!/bin/bash
"$WORKER_PY" -c '
import os, signal, sys, time
def stop(*_):
    open(os.environ["MARKS"] + "/checkpoint-" + os.environ["SLURMD_NODENAME"], "w").close()
    sys.exit(int(os.environ["WORKER_RC"]))
signal.signal(signal.Signals["SIG" + os.environ["LAUNCH4D_CHECKPOINT_SIGNAL"]], stop)
open(os.environ["MARKS"] + "/started-" + os.environ["SLURMD_NODENAME"], "w").close()
time.sleep(120)
' &
wait $!
"""


def run_preempted(tmp_path: Path, worker_rc: int, sig: str = "USR2") -> tuple[int, list[str], str]:
    spec, plan = spec_plan(**{"backend.slurm.signal_seconds": 20, "backend.slurm.checkpoint_signal": sig})
    script = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    bin_dir, marks = tmp_path / "bin", tmp_path / "marks"
    bin_dir.mkdir()
    marks.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("agent", AGENT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = script.replace(shlex.quote("python3") + " -m torch.distributed.run", str(bin_dir / "agent"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "SLURM_JOB_NODELIST": "n[1-2]", "CALLS": str(tmp_path / "calls"), "MARKS": str(marks),
           "WORKER_PY": sys.executable, "WORKER_RC": str(worker_rc), "SIG": sig}
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60
    while len(list(marks.glob("started-*"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
        time.sleep(0.05)
    proc.send_signal(signal.Signals["SIG" + sig])          # what Slurm's --signal=B:<sig>@N does
    out, _ = proc.communicate(timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert sorted(p.name for p in marks.glob("checkpoint-*")) == ["checkpoint-n1", "checkpoint-n2"], out
    return proc.returncode, calls, out


@pytest.mark.parametrize("worker_rc,sig", [(75, "USR2"), (1, "USR2"), (75, "URG")])
def test_checkpoint_signal_checkpoints_then_requeues(tmp_path, worker_rc, sig):
    """The default signal (USR2: NCCL 2.12.7-2.13.4 take USR1) and another one, through the batch
    shell's trap, srun, the node function's forwarding, to the worker's handler."""
    rc, calls, out = run_preempted(tmp_path, worker_rc, sig)
    assert rc == 0 and "requeue 77" in calls, out
    assert "launch4d: requeueing job 77" in out and f"launch4d: {sig} at " in out


def test_no_requeue_when_the_step_finished_cleanly(tmp_path):
    rc, calls, out = run_preempted(tmp_path, 0)
    assert rc == 0 and "requeue 77" not in calls, out
    assert "launch4d: step finished with exit code 0" in out
