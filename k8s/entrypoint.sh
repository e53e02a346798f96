#!/bin/bash
# The container entrypoint of the Kubernetes manifests (k8s/, docs/kubernetes.md): one torchrun per pod, from the
# environment the operator gives the pod, with the exit codes of slurm/train.sbatch.
#   k8s/entrypoint.sh <config.yaml> [key=value ...]       # as the JobSet or the TrainJob runs it (args: in k8s/)
#
# Kubeflow Trainer sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT. A plain
# JobSet sets JOB_COMPLETION_INDEX (the pod's index in its Job) and, through the downward API in k8s/base/jobset,
# JOBSET_NAME and REPLICATED_JOB_NAME; the first pod is <jobset>-<replicated job>-0-0.<jobset> in the JobSet's
# headless service; NNODES and NPROC_PER_NODE come from k8s/base/params.env. The rendezvous is static (--node-rank):
# a pod keeps its ranks across restarts, so after an in-place restart each rank finds its memory-tier files in
# its own pod's emptyDir and nothing moves between pods (docs/memory-tier.md).
#
# Exit codes (common/launcher.py, the contract; docs/reliability.md's table, with this script's column): 0 done;
# 75 preempted (SIGTERM to this pod, or the workers' 75: a peer pod's SIGTERM, their checkpoint committed); 76 a rank
# hung (finetune/hang.py's file); 2 bad input (this script's checks below, or the workers' own); 77 a rank's own
# error (an exception in training) and its peers; else torchrun's (1: a peer pod lost, a collective's timeout).
# torchrun reports any failed worker as 1; its error file (TORCHELASTIC_ERROR_FILE) keeps the first failed worker's
# code, which the workers write there for 2, 75 and 77 (common/launcher.py tell_torchrun). 2 and 77 fail the job,
# the others restart it (the manifests' podFailurePolicy, JobSet rules and restartPolicyRules;
# tests/test_exit_codes.py).
# LAUNCH_RESTART_COUNT (common/launcher.py) is the JobSet's restart attempt plus its in-place attempt, from the
# pod's annotations (k8s/base/jobset.yaml), so test faults and hang stack files of one attempt are not another's.
# The lines and codes follow slurm/train.sbatch, which cannot source a shared file (slurmd runs a copy of a batch
# script from its spool folder); what differs is who restarts: SLURM's requeue there, the failure rules here.

set -uo pipefail  # no -e: this script must see torchrun's exit code and act on it
CONFIG=${1:?usage: k8s/entrypoint.sh <config.yaml> [key=value ...]}
shift
cd "$(dirname "$0")/.." || exit 1  # the repository: configs/ and assets/ paths in a preset are relative to it

POD=${HOSTNAME:-pod}
log() { echo "$(date '+%F %T') entrypoint[$POD]: $*"; }
bad_input() { echo "error: k8s/entrypoint.sh: $*" >&2; exit 2; }
is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }

# ---- who launched us: Kubeflow Trainer or a plain JobSet
if [ -n "${PET_NNODES:-}" ]; then
  OPERATOR=trainjob NODES=$PET_NNODES NPROC=${PET_NPROC_PER_NODE:-1} RANK_OF_NODE=${PET_NODE_RANK:-}
  MASTER=${PET_MASTER_ADDR:-} PORT=${PET_MASTER_PORT:-29400}
  for pair in "PET_NNODES NNODES" "PET_NPROC_PER_NODE NPROC_PER_NODE"; do  # the TrainJob edited by hand
    pet=${pair% *} ours=${pair#* }
    if [ -n "${!ours:-}" ] && [ "${!ours}" != "${!pet:-}" ]; then
      bad_input "the TrainJob gives $pet=${!pet:-} but k8s/base/params.env says $ours=${!ours}: set it in" \
                "k8s/base/params.env only (kustomize copies it into the TrainJob)"
    fi
  done
elif [ -n "${JOBSET_NAME:-}" ] && [ -n "${JOB_COMPLETION_INDEX:-}" ]; then
  OPERATOR=jobset NODES=${NNODES:-} NPROC=${NPROC_PER_NODE:-1} RANK_OF_NODE=$JOB_COMPLETION_INDEX
  PORT=${MASTER_PORT:-29500}
  MASTER=${MASTER_ADDR:-$JOBSET_NAME-${REPLICATED_JOB_NAME:-}-0-0.${JOBSET_SUBDOMAIN:-$JOBSET_NAME}}
else
  bad_input "no operator's environment: neither Kubeflow Trainer's PET_NNODES nor JobSet's JOBSET_NAME and" \
            "JOB_COMPLETION_INDEX is set (start this image with the manifests in k8s/, docs/kubernetes.md)"
fi
is_count "$NODES" || bad_input "the number of pods is '$NODES', not a positive integer (NNODES, k8s/base/params.env)"
is_count "$NPROC" || bad_input "workers per pod is '$NPROC', not a positive integer (NPROC_PER_NODE, k8s/base/params.env)"
if ! [[ $RANK_OF_NODE =~ ^[0-9]+$ ]] || [ "$RANK_OF_NODE" -ge "$NODES" ]; then
  bad_input "this pod's index '$RANK_OF_NODE' is not below the number of pods $NODES: the $OPERATOR runs more" \
            "pods than NNODES in k8s/base/params.env says"
fi
[ -n "$MASTER" ] || bad_input "no rendezvous address (PET_MASTER_ADDR) in the TrainJob's environment"

# ---- object storage: the Secret's keys are optional in the manifests, so a missing Secret lands here as one line
for arg in "$@"; do
  case $arg in
    ckpt.dir=s3://*)
      [ -n "${AWS_ACCESS_KEY_ID:-}${AWS_WEB_IDENTITY_TOKEN_FILE:-}${AWS_CONTAINER_CREDENTIALS_FULL_URI:-}" ] ||
        bad_input "${arg#ckpt.dir=} needs S3 credentials and the pod has none: create the Secret fsdp-s3 with" \
                  "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (k8s/components/s3, docs/kubernetes.md)" ;;
    ckpt.dir=az://*)
      [ -n "${AZURE_STORAGE_CONNECTION_STRING:-}${AZURE_STORAGE_ACCOUNT_NAME:-}" ] ||
        bad_input "${arg#ckpt.dir=} needs Azure credentials and the pod has none: create the Secret fsdp-azure" \
                  "with AZURE_STORAGE_CONNECTION_STRING (k8s/components/azure, docs/kubernetes.md)" ;;
  esac
done

# ---- as slurm/train.sbatch: the interface, open files, the workers' time to save after SIGTERM
SOCKET_IFNAME=${SOCKET_IFNAME:-}
if [ -n "$SOCKET_IFNAME" ]; then  # NCCL_/GLOO_SOCKET_IFNAME set by you win
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}
fi
ulimit -n "$(ulimit -Hn)" 2>/dev/null || ulimit -n 65536 2>/dev/null || true
# torchrun waits this long for the workers' emergency save after SIGTERM, then SIGKILLs them: below the pod's
# terminationGracePeriodSeconds (GRACE_SECONDS in k8s/base/params.env), after which the kubelet SIGKILLs everything.
GRACE_SECONDS=${GRACE_SECONDS:-300}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((GRACE_SECONDS * 9 / 10))}
# NCCL's flight recorder: train_fsdp.py sets TORCH_FR_DUMP_TEMP_FILE to <run.dir>/hang/flight-attempt<k>/nccl_rank_
# (not the container's /tmp, lost with the pod) unless it is set here; run.dir on the PVC keeps it across restarts.
# Which start of this job this is (common/launcher.py): Recreate restarts plus in-place restarts, both only grow.
export LAUNCH_RESTART_COUNT=${LAUNCH_RESTART_COUNT:-$(( ${JOBSET_RESTART_ATTEMPT:-0} + ${JOBSET_IN_PLACE_ATTEMPT:-0} ))}
# A hang's one line (finetune/hang.py), and torchrun's record of the first failed worker: in $TMPDIR, else (a
# readOnlyRootFilesystem) in /dev/shm, the pod's memory-backed emptyDir.
STATE=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-entrypoint.XXXXXX" 2>/dev/null || mktemp -d /dev/shm/fsdp-entrypoint.XXXXXX) ||
  bad_input "no writable folder for this script's state: neither ${TMPDIR:-/tmp} nor /dev/shm (set TMPDIR to one)"
export FINETUNE_HANG_FILE=$STATE/hang.txt
ERROR_FILE=$STATE/torchrun-error.json

log "start ($OPERATOR, pod $RANK_OF_NODE of $NODES): $NODES node(s) x $NPROC worker(s), rendezvous $MASTER:$PORT," \
    "interface ${GLOO_SOCKET_IFNAME:-from host name}, open files $(ulimit -n), $CONFIG $*"

# ---- preemption: the kubelet sends SIGTERM (pod deleted, node drained, Kueue preempting); the workers decide
got_signal="" step_pid=""  # set before the trap: a SIGTERM before torchrun starts must not meet an unset name
forward_signal() {
  got_signal=TERM
  log "got SIGTERM: forwarding it to torchrun (emergency checkpoint, then exit)"
  [ -n "$step_pid" ] && kill -TERM "$step_pid" 2>/dev/null
}
trap forward_signal TERM

# ---- train, in the background so that the trap runs during `wait` (as in slurm/train.sbatch)
TORCHELASTIC_ERROR_FILE=$ERROR_FILE torchrun --nnodes="$NODES" --nproc-per-node="$NPROC" --node-rank="$RANK_OF_NODE" \
  --master-addr="$MASTER" --master-port="$PORT" train_fsdp.py --config "$CONFIG" "$@" &
step_pid=$!
wait "$step_pid"; rc=$?
while [ "$rc" -gt 128 ] && kill -0 "$step_pid" 2>/dev/null; do wait "$step_pid"; rc=$?; done

# ---- done, preempted, hung, bad input or failed; torchrun reports any worker exit but 0 as 1
workers_exit=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["message"].get("errorCode", ""))' \
               "$ERROR_FILE" 2>/dev/null)
if [ "$rc" -eq 0 ]; then
  log "training finished"
  exit 0
fi
if [ "$got_signal" = TERM ]; then
  log "preempted (torchrun exit $rc): exit 75; restarted, the pods resume from the newest committed checkpoint"
  exit 75
fi
if [ -s "$FINETUNE_HANG_FILE" ]; then
  log "hung (torchrun exit $rc): $(head -c 1000 "$FINETUNE_HANG_FILE")"
  log "exit 76: restarted (at most failurePolicy.maxRestarts times), the pods resume from the newest checkpoint"
  exit 76
fi
case $workers_exit in
  2) log "bad input (torchrun exit $rc, the workers' exit 2; their error: line is above): exit 2, not restarting"
     exit 2 ;;
  77) log "a rank failed (torchrun exit $rc, the workers' exit 77; its error: line is above): exit 77, not" \
          "restarting: a restart would fail the same way"
      exit 77 ;;
  75) log "preempted elsewhere (torchrun exit $rc, the workers' exit 75: another pod's SIGTERM, their checkpoint" \
          "committed): exit 75; restarted, the pods resume from it"
      exit 75 ;;
esac
log "training failed (torchrun exit $rc): a peer lost or a collective's timeout; exit $rc, the failure policy" \
    "restarts it"
exit "$rc"
