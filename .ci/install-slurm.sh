#!/usr/bin/env bash
# Install a real single-machine SLURM (Debian packages) for tests/test_slurm.py and, with iproute2 and
# util-linux (unshare, nsenter) for its simulated hosts, tests/test_slurm_multinode.py; tests skip without it.
#   bash .ci/install-slurm.sh
# Only installs: tests/slurm_cluster.py starts munged, slurmctld and slurmd itself, with its own config
# and state in a temp dir (no systemd, nothing under /etc touched). Never fails the CI run: when it
# cannot install, test_slurm.py skips and says why.
set -uo pipefail
have() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ]; }  # /usr/sbin is not on every PATH
if have slurmctld && have slurmd && have sbatch && have munged && have ip && have unshare && have nsenter; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-slurm: not root, SLURM tests will be skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
(apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null) \
  || echo "install-slurm: apt-get failed, SLURM tests will be skipped" >&2
exit 0
