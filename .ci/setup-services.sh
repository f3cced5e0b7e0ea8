#!/usr/bin/env bash
# Install (as root, where missing) the system packages the integration tests run for real:
# openssh-server (preflight and submit over SSH), slurm-wlm + munge (a multi-node Slurm on
# this machine). The tests start private instances themselves (tests/services/*).
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-services: missing ${need[*]} and not root; those integration tests will skip" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
for hook in .ci/services.d/*.sh; do
  [ -e "$hook" ] && bash "$hook"
done
exit 0
