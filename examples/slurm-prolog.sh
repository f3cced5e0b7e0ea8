#!/bin/bash
# launch4d's quick health check on this node before every job: a Slurm prolog.
#
# Install (on every compute node, launch4d installed there):
#   cp examples/slurm-prolog.sh /etc/slurm/prolog.d/launch4d.sh && chmod 755 /etc/slurm/prolog.d/launch4d.sh
#   slurm.conf:  Prolog=/etc/slurm/prolog.d/launch4d.sh
#                PrologFlags=Alloc      # run it when the job is allocated, before any step starts
#   scontrol reconfigure
#
# What it does: `launch preflight --level quick --no-nccl` on this node only (nvidia-smi topo/query/
# nvlink -s, ibstat, the kernel log's Xids: seconds), and when a check fails it drains the node itself
# with the reason "launch4d: <check>: <figure>" (`sinfo -R` shows it) and exits 1, so Slurm requeues
# the job elsewhere (Slurm drains a node whose prolog fails; the reason it records may then read
# "Prolog error": this script's log keeps launch4d's full report). When the checker itself cannot run
# (not installed, timed out) the node is left in service: a broken checker must not empty a cluster.
# Return a node with: scontrol update nodename=NODE state=resume
#
# Settings (environment, e.g. from a sourced /etc/default file): LAUNCH4D (the `launch` executable),
# LAUNCH4D_PROLOG_TIMEOUT (seconds, default 120), LAUNCH4D_PROLOG_LOG (default
# /var/log/slurm/launch4d-prolog.log), LAUNCH4D_PROLOG_ARGS (extra preflight options, e.g.
# "--expected-gpus 8 --thresholds /etc/launch4d/thresholds.yaml").
LAUNCH="${LAUNCH4D:-launch}"
LOG="${LAUNCH4D_PROLOG_LOG:-/var/log/slurm/launch4d-prolog.log}"
# shellcheck disable=SC2086  # LAUNCH4D_PROLOG_ARGS is a list of options
out=$(timeout -k 5 "${LAUNCH4D_PROLOG_TIMEOUT:-120}" "$LAUNCH" preflight --backend local --level quick --no-nccl \
      --probe-timeout 20 --drain --apply $LAUNCH4D_PROLOG_ARGS 2>&1)
rc=$?
{ printf '%s node %s job %s: exit %s\n' "$(date -Is)" "${SLURMD_NODENAME:-?}" "${SLURM_JOB_ID:-?}" "$rc"
  printf '%s\n' "$out"; } >> "$LOG" 2>/dev/null
[ "$rc" -eq 1 ] && exit 1   # a check failed: drained (reason above); Slurm requeues the job
exit 0                      # healthy (warnings allowed), or the checker itself could not run
