#!/bin/bash
# Does this cluster have what an overlay of k8s/ needs? Read-only kubectl calls (get, version, get --raw): versions,
# feature gates, the controllers, the volume, the admission policy. One line per check; exit 1 if any is missing.
#   k8s/check-cluster.sh [--overlay NAME] [--namespace NS] [--jobset-namespace NS]
#   k8s/check-cluster.sh --help
# docs/kubernetes.md ("Versions and gates") says what each missing piece does; tests/test_k8s.py runs this script
# against a fake kubectl of a misconfigured cluster, and the docs show that output.

set -uo pipefail
usage() {
  cat <<'EOF'
usage: k8s/check-cluster.sh [--overlay NAME] [--namespace NS] [--jobset-namespace NS]
  --overlay NAME          one of k8s/overlays (default jobset-inplace): what it needs is checked
  --namespace NS          where the job runs (default: kubectl's current namespace)
  --jobset-namespace NS   where the JobSet controller runs (default: jobset-system, else kubeflow-system)
Read-only: kubectl version, get and get --raw (the apiserver's and each node's kubelet's /metrics: needs the
rights to read /metrics and nodes/proxy). Prints one line per check, "ok:" or "MISSING:", and exits 1 if any is
missing. What each one does when missing: docs/kubernetes.md, "Versions and gates".
EOF
}
OVERLAY=jobset-inplace NS_ARGS=() JOBSET_NS=""
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --overlay) OVERLAY=${2:?--overlay needs a name}; shift 2 ;;
    --namespace|-n) NS_ARGS=(-n "${2:?--namespace needs a name}"); shift 2 ;;
    --jobset-namespace) JOBSET_NS=${2:?--jobset-namespace needs a name}; shift 2 ;;
    *) echo "error: k8s/check-cluster.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
  esac
done
case $OVERLAY in
  jobset-inplace|jobset-inplace-s3-kueue|trainjob-inplace|jobset-recreate|trainjob-azure-volcano) ;;
  *) echo "error: k8s/check-cluster.sh: no overlay '$OVERLAY' in k8s/overlays (--help)" >&2; exit 2 ;;
esac
command -v kubectl >/dev/null || { echo "error: k8s/check-cluster.sh: kubectl is not on PATH" >&2; exit 2; }

missing=0
ok() { echo "ok: $*"; }
miss() { echo "MISSING: $*"; missing=1; }
GATE=RestartAllContainersOnContainerExits
gate_in_metrics() {  # kubernetes_feature_enabled{name="<gate>",stage="..."} 1, from a component's /metrics
  grep -E "^kubernetes_feature_enabled\{[^}]*name=\"$1\"" | grep -Eo '[01]$' | head -n 1
}

# ---- Kubernetes itself
minor=$(kubectl version -o json 2>/dev/null | python3 -c 'import json,sys
print(json.load(sys.stdin)["serverVersion"]["minor"].rstrip("+"))' 2>/dev/null)
in_place=""; case $OVERLAY in *inplace*) in_place=1 ;; esac
if [ -z "$minor" ]; then
  miss "the API server's version: kubectl version cannot reach it"
elif [ -n "$in_place" ] && [ "$minor" -lt 35 ]; then
  miss "Kubernetes 1.$minor: in-place restart needs 1.35 or later (restartPolicyRules, KEP-5532)"
else
  ok "Kubernetes 1.$minor"
fi

# ---- the JobSet controller: v0.12.0 and, in place, its own InPlaceRestart gate (config featureGates)
for ns in ${JOBSET_NS:-jobset-system kubeflow-system}; do
  image=$(kubectl -n "$ns" get deployment jobset-controller-manager \
          -o jsonpath='{.spec.template.spec.containers[0].image}' 2>/dev/null) && { JOBSET_NS=$ns; break; }
done
if [ -z "${image:-}" ]; then
  miss "the JobSet controller (deployment jobset-controller-manager in ${JOBSET_NS:-jobset-system or kubeflow-system})"
else
  case $image in *:v0.12.*) ok "JobSet controller $image in $JOBSET_NS" ;;
    *) miss "JobSet v0.12: the controller runs $image (in-place restart and these manifests need v0.12.0)" ;; esac
  if [ -n "$in_place" ]; then
    config=$(kubectl -n "$JOBSET_NS" get configmap jobset-manager-config \
             -o jsonpath='{.data.controller_manager_config\.yaml}' 2>/dev/null)
    if printf '%s\n' "$config" | grep -Eq '^[[:space:]]*InPlaceRestart:[[:space:]]*true'; then
      ok "JobSet feature gate InPlaceRestart in $JOBSET_NS/jobset-manager-config (restart the controller after an edit)"
    else
      miss "JobSet feature gate InPlaceRestart: $JOBSET_NS/jobset-manager-config has no" \
           "'featureGates: {InPlaceRestart: true}' (alpha, off by default): a JobSet is refused at apply, a TrainJob" \
           "never starts"
    fi
  fi
fi

# ---- RestartAllContainersOnContainerExits on kube-apiserver and on every kubelet
if [ -n "$in_place" ]; then
  seen=$(kubectl get --raw /metrics 2>/dev/null | gate_in_metrics "$GATE")
  case $seen in
    1) ok "kube-apiserver feature gate $GATE" ;;
    0) miss "kube-apiserver feature gate $GATE is off: the Job's pods are refused, nothing starts" ;;
    *) miss "kube-apiserver feature gate $GATE: cannot read the apiserver's /metrics (no right to, or no metric)" ;;
  esac
  off="" unknown=""
  for node in $(kubectl get nodes -o jsonpath='{.items[*].metadata.name}' 2>/dev/null); do
    seen=$(kubectl get --raw "/api/v1/nodes/$node/proxy/metrics" 2>/dev/null | gate_in_metrics "$GATE")
    case $seen in 1) ;; 0) off="$off $node" ;; *) unknown="$unknown $node" ;; esac
  done
  if [ -n "$off" ]; then
    miss "kubelet feature gate $GATE is off on:$off: there a restart rule is ignored and a failed pod is replaced" \
         "empty (the memory tier lost)"
  fi
  [ -z "$unknown" ] || miss "kubelet feature gate $GATE: cannot read /metrics of:$unknown"
  [ -n "$off$unknown" ] || ok "kubelet feature gate $GATE on every node"
  if kubectl get validatingadmissionpolicy jobset-in-place-restart -o name >/dev/null 2>&1; then
    ok "admission policy jobset-in-place-restart (k8s/cluster)"
  else
    miss "admission policy jobset-in-place-restart: apply k8s/cluster once (without it the agent's Role may patch" \
         "any pod of the namespace)"
  fi
fi

# ---- what the overlay's components need
case $OVERLAY in trainjob-*)
  if kubectl get crd trainjobs.trainer.kubeflow.org -o name >/dev/null 2>&1; then ok "Kubeflow Trainer (TrainJob CRD)"
  else miss "Kubeflow Trainer v2.3.0: no TrainJob CRD"; fi ;;
esac
case $OVERLAY in *volcano*)
  if kubectl get crd podgroups.scheduling.volcano.sh -o name >/dev/null 2>&1; then ok "Volcano (PodGroup CRD)"
  else miss "Volcano: no PodGroup CRD (the pods name schedulerName: volcano and would stay Pending)"; fi ;;
esac
case $OVERLAY in *kueue*)
  if kubectl get crd localqueues.kueue.x-k8s.io -o name >/dev/null 2>&1; then ok "Kueue (LocalQueue CRD)"
  else miss "Kueue: no LocalQueue CRD (the queue label would be ignored)"; fi ;;
esac
if kubectl "${NS_ARGS[@]}" get pvc fsdp-run -o name >/dev/null 2>&1; then ok "the run's volume: PVC fsdp-run"
else miss "the run's volume: no PVC fsdp-run here: kubectl apply -k k8s/storage (once, apart from the job)"; fi

exit "$missing"
