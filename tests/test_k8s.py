"""Kubernetes without a cluster: every overlay of k8s/ renders and validates against its schema, its failure rules
restart on 75 and 76 and never on 2, and k8s/entrypoint.sh trains as two pods on two simulated hosts, through an
in-place restart, a replaced pod and a scale-down.

    python -m pytest tests/test_k8s.py -q -k "render or rules or bad"            # kubectl; seconds
    flock /tmp/slurm-tests.lock python -m pytest tests/test_k8s.py -q -k pods   # root: the two hosts

Schemas: core kinds (ConfigMap, PVC, RBAC, and each JobSet's Job template as a batch/v1 Job) with
kubernetes-validate's bundled Kubernetes 1.35 schemas, strict (unknown fields fail); JobSet, TrainingRuntime and
TrainJob with jsonschema against the CRDs' openAPIV3Schema in k8s/crds/ (k8s/crds/SOURCES.md), with unknown
fields refused as `kubectl apply`'s strict field validation refuses them.

The pods: tests/slurm_cluster.py's hosts (own network, host name, /etc/hosts and /dev/shm each; no SLURM daemons),
one entrypoint each, given the environment the operator gives a pod: a JobSet's (JOB_COMPLETION_INDEX and the
downward-API names) or Kubeflow Trainer's (PET_*). The pods' DNS names (fsdp-node-0-<i>.fsdp, the JobSet's headless
service) are in each host's /etc/hosts. ckpt.memory_dir is each host's /dev/shm, as the emptyDir{medium: Memory}
of a pod; run.dir is shared, as the RWX volume. "Every container killed and started again" is SIGKILL to every
process of both hosts, the hosts (pods) and their /dev/shm kept; "a pod replaced" is its memory folder wiped.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from common.launcher import (CONTRACT, DONE, EXIT_FAILED, EXIT_HANG, EXIT_PREEMPTED, FAIL, LAUNCHERS, RESTART,
                             UNCOUNTED)
from conftest import FAST, ROOT, events, free_port, run_train, token_cache
from finetune.metrics import read_metrics
from test_preemption import metrics_so_far

OVERLAYS = sorted(glob.glob(os.path.join(ROOT, "k8s", "overlays", "*")))
ENTRYPOINT = os.path.join(ROOT, "k8s", "entrypoint.sh")
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (client) is not installed: it renders k8s/")


# ---------------------------------------------------------------- render and validate

def render(overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", overlay], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def closed(schema):
    """`schema` with unknown fields refused wherever it lists the known ones (an apiserver's strict validation)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({name: closed(s) for name, s in v.items()} if k == "properties" else closed(v))
           for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> schema, from k8s/crds/<group>_<version>_<Kind>.json."""
    found = {}
    for path in glob.glob(os.path.join(ROOT, "k8s", "crds", "*.json")):
        group, version, kind = os.path.basename(path)[:-len(".json")].rsplit("_", 2)
        with open(path) as f:
            found[(f"{group}/{version}", kind)] = closed(json.load(f))
    return found


def schema_errors(doc: dict, crds: dict) -> list[str]:
    """Why `doc` is invalid ([] if it is valid)."""
    import jsonschema
    import kubernetes_validate
    key = (doc["apiVersion"], doc["kind"])
    if key in crds:
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}"
                for e in jsonschema.Draft7Validator(crds[key]).iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, "1.35.0", strict=True)
    except (kubernetes_validate.ValidationError, kubernetes_validate.InvalidSchemaError) as e:
        return [str(e)[:500]]
    return []


def job_templates(doc: dict) -> list[dict]:
    """The Job template of every replicated job of a JobSet, or of a TrainingRuntime's JobSet template."""
    spec = doc["spec"] if doc["kind"] == "JobSet" else doc["spec"]["template"]["spec"]
    return [rj["template"] for rj in spec["replicatedJobs"]]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=os.path.basename)
def test_every_overlay_renders_and_validates(overlay):
    crds, docs = crd_schemas(), render(overlay)
    kinds = {d["kind"] for d in docs}
    assert kinds & {"JobSet", "TrainJob"}, kinds
    for doc in docs:
        assert not schema_errors(doc, crds), (doc["kind"], schema_errors(doc, crds))
        if doc["kind"] in ("JobSet", "TrainingRuntime"):
            for template in job_templates(doc):
                job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"}, "spec": template["spec"]}
                assert not schema_errors(job, crds), schema_errors(job, crds)


@needs_kubectl
def test_the_validators_refuse_what_an_apiserver_refuses():
    """So that the test above can fail: a wrong enum and an unknown field in a JobSet, a number as a ConfigMap
    value, an unknown field in the pod of a Job template."""
    crds = crd_schemas()
    docs = {d["kind"]: d for d in render(os.path.join(ROOT, "k8s", "overlays", "jobset-recreate"))}
    jobset = json.loads(json.dumps(docs["JobSet"]))
    jobset["spec"]["failurePolicy"]["restartStrategy"] = "InPlace"
    assert any("InPlace" in e for e in schema_errors(jobset, crds))
    jobset = json.loads(json.dumps(docs["JobSet"]))
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    assert schema_errors(jobset, crds)
    config = {**docs["ConfigMap"], "data": {"NNODES": 2}}
    assert schema_errors(config, crds)
    template = json.loads(json.dumps(job_templates(docs["JobSet"])[0]))
    template["spec"]["template"]["spec"]["containers"][0]["envFrm"] = []
    assert schema_errors({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
                          "spec": template["spec"]}, crds)


# ---------------------------------------------------------------- the controllers, modelled from their sources
# Each rule the manifests rely on, as the controller's source at the tag docs/kubernetes.md names says it:
# JobSet v0.12.0 (kubernetes-sigs/jobset), Kubernetes 1.35 (the Job controller's pkg/controller/job/
# pod_failure_policy.go; KEP-5532 for restartPolicyRules), Kubeflow Trainer v2.3.0. A manifest change that breaks a
# promise of docs/kubernetes.md changes what these return, and the tests below (and tests/test_exit_codes.py) fail.

GATES = ("jobset InPlaceRestart", "kube-apiserver RestartAllContainersOnContainerExits",
         "kubelet RestartAllContainersOnContainerExits")
ALL_ON = dict.fromkeys(GATES, True)


def failure_policy_and_job(docs: dict) -> tuple[dict, dict]:
    """(the JobSet's failurePolicy, its one Job template), from a JobSet or a TrainingRuntime's JobSet template."""
    owner = docs.get("JobSet") or docs["TrainingRuntime"]
    spec = owner["spec"] if owner["kind"] == "JobSet" else owner["spec"]["template"]["spec"]
    (job,) = job_templates(owner)
    return spec["failurePolicy"], job


def node_container(job: dict) -> dict:
    (node,) = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "node"]
    return node


def admission(docs: dict, gates: dict) -> str:
    """'admitted', or why nothing runs. JobSet webhook ValidateCreate (jobset_webhook.go:169-175): InPlaceRestart
    without JobSet's gate is refused, at `kubectl apply` for a JobSet, on every reconcile of a TrainJob (Trainer
    creates the JobSet: the TrainJob is accepted and never starts). KEP-5532 (Kubernetes 1.35, alpha): the
    apiserver refuses a pod with restartPolicyRules unless its gate is on, so the Job creates no pod."""
    policy, job = failure_policy_and_job(docs)
    if policy.get("restartStrategy") == "InPlaceRestart" and not gates[GATES[0]]:
        return "TrainJob stalls: its JobSet is refused" if "TrainJob" in docs else "refused at kubectl apply"
    if "restartPolicyRules" in node_container(job) and not gates[GATES[1]]:
        return "stalls: the Job's pods are refused"
    return "admitted"


def container_exit(container: dict, code: int, pod_deleted: bool, gates: dict) -> str:
    """What the kubelet does when `container` exits `code` (KEP-5532): the first matching restartPolicyRule, if
    the kubelet has the gate ("Upgrade": without it the rules are ignored and the container's restartPolicy,
    Never, applies) and the pod is not being deleted (a SIGTERM'd pod is terminating: it is never restarted,
    whatever its rules). 'restart in place' or 'pod failed'."""
    if code == 0:
        return "pod succeeded"
    if not pod_deleted and gates[GATES[2]]:
        for rule in container.get("restartPolicyRules", []):
            on = rule["exitCodes"]
            if (code in on.get("values", [])) == (on["operator"] == "In"):
                return "restart in place" if rule["action"] == "RestartAllContainers" else "pod failed"
    return "pod failed"


def job_on_failed_pod(job: dict, code: int) -> tuple[str, str] | None:
    """The Job controller on a failed pod whose container `node` exited `code` (pod_failure_policy.go
    matchPodFailurePolicy: rules in order, the first match acts; FailJob's message is "Container <name> for pod
    <ns>/<pod> failed with exit code <code> matching FailJob rule at index <i>"). Returns the Job's failure
    (reason, message), or None: the pod is replaced (backoffLimit not reached; podReplacementPolicy Failed, a
    new pod once the old one is terminal: with a new, empty emptyDir)."""
    for index, rule in enumerate(job["spec"].get("podFailurePolicy", {}).get("rules", [])):
        on = rule["onExitCodes"]
        if on.get("containerName", "node") == "node" and (code in on["values"]) == (on["operator"] == "In"):
            if rule["action"] == "FailJob":
                return "PodFailurePolicy", (f"Container node for pod ns/fsdp-node-0-1-x failed with exit code {code} "
                                            f"matching FailJob rule at index {index}")
            if rule["action"] == "Ignore":
                return None
            break  # Count: as no rule
    if job["spec"].get("backoffLimit", 6) > 0:
        return None
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def jobset_action(policy: dict, reason: str, message: str) -> str:
    """The JobSet controller on a failed Job (failure_policy.go:87-119 findFirstFailedPolicyRuleAndJob, :142-164
    ruleIsApplicable: reasons, then any onJobFailureMessagePatterns regexp matching, first rule wins; :45 the
    default RestartJobSet). Under InPlaceRestart too: a failed Job falls back to the rules (jobset_types.go on
    InPlaceRestart; jobset_controller.go:247-251)."""
    for rule in policy.get("rules", []):
        if reason in rule.get("onJobFailureReasons", [reason]) and \
                any(re.search(p, message) for p in rule.get("onJobFailureMessagePatterns", [".*"])):
            return rule["action"]
    return "RestartJobSet"


def counts_against_max_restarts(policy: dict, how: str) -> bool:
    """Whether a restart by `how` ('restart in place', 'pod replaced', or a JobSet action) uses up maxRestarts.
    Recreate: RestartJobSet counts, RestartJobSetAndIgnoreMaxRestarts does not (failure_policy.go
    failurePolicyRecreateAll, shouldCountTowardsMax). In place: the highest pod attempt, less only the uncounted
    Recreate restarts, is held to maxRestarts (in_place_restart.go:161-171): every in-place attempt counts, and a
    replaced pod's new attempt too; container restartCount is held to it as well (:49-56)."""
    if policy.get("restartStrategy") == "InPlaceRestart" and how in ("restart in place", "pod replaced"):
        return True
    return how != "RestartJobSetAndIgnoreMaxRestarts"


def job_outcome(docs: dict, codes: dict[str, int], gates: dict = ALL_ON) -> str:
    """What the cluster does with the run when each pod's container `node` exits: `codes` maps 'deleted' (the pod
    the kubelet SIGTERMed: being deleted, drained, preempted) and 'peer' (every other pod) to its exit code.
    One of common/launcher.py's outcomes (DONE, FAIL, RESTART, UNCOUNTED), or why nothing runs."""
    if admission(docs, gates) != "admitted":
        return admission(docs, gates)
    policy, job = failure_policy_and_job(docs)
    node = node_container(job)
    actions = []
    for who, code in codes.items():
        kubelet = container_exit(node, code, who == "deleted", gates)
        if kubelet != "pod failed":
            actions.append(kubelet)
            continue
        failure = job_on_failed_pod(job, code)
        actions.append("pod replaced" if failure is None else jobset_action(policy, *failure))
    if all(a == "pod succeeded" for a in actions):
        return DONE
    if "FailJobSet" in actions:
        return FAIL
    restarts = [a for a in actions if a != "pod succeeded"]
    return RESTART if any(counts_against_max_restarts(policy, a) for a in restarts) else UNCOUNTED


def scenario(code: int) -> dict[str, int]:
    """The pods' exit codes when the workers end with `code`, as k8s/entrypoint.sh turns them (tests/test_exit_codes.py
    runs the entrypoint for each): a preemption SIGTERMs one pod ('deleted', 75 from its trap) and its peers' workers
    join the save and exit 75 (through torchrun's error file); any other code, every pod alike."""
    return {"deleted": 75, "peer": 75} if code == EXIT_PREEMPTED else {"peer": code}


def overlays_of(mode: str) -> list[str]:
    return [o for o in OVERLAYS if ("inplace" in os.path.basename(o)) == (mode == LAUNCHERS[3])]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=os.path.basename)
def test_every_exit_code_does_what_the_contract_says(overlay):
    """Each code of common/launcher.py's contract, through the controllers' rules, does what its k8s column says,
    on every overlay of that restart mode: 2 and 77 fail the JobSet once (a rank's deterministic error is not
    retried), 75 restarts without counting under Recreate and counts in place, 76 and 1 restart and count."""
    docs = {d["kind"]: d for d in render(overlay)}
    mode = LAUNCHERS[3] if failure_policy_and_job(docs)[0]["restartStrategy"] == "InPlaceRestart" else LAUNCHERS[2]
    assert overlay in overlays_of(mode), "an overlay's name says its restart mode"
    for code, (_, outcomes) in CONTRACT.items():
        assert job_outcome(docs, scenario(code)) == outcomes[mode], (code, mode)


@needs_kubectl
@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if "inplace" in o], ids=os.path.basename)
def test_in_place_needs_three_gates_and_says_what_each_missing_one_does(overlay):
    """JobSet's InPlaceRestart gate off: the JobSet refused at apply, a TrainJob that never starts. The apiserver's
    gate off: no pod is created. The kubelet's alone off: the rules are ignored, a hang (76) or a lost peer (1) fails
    the pod and the Job replaces it, empty (the memory tier lost), counted. docs/kubernetes.md says each."""
    docs = {d["kind"]: d for d in render(overlay)}
    with open(os.path.join(ROOT, "docs", "kubernetes.md")) as f:
        doc = f.read()
    for gate in GATES:
        off = {**ALL_ON, gate: False}
        said = admission(docs, off)
        if gate == GATES[2]:
            assert said == "admitted"
            _, job = failure_policy_and_job(docs)
            assert container_exit(node_container(job), EXIT_HANG, False, off) == "pod failed"
            assert job_on_failed_pod(job, EXIT_HANG) is None, "replaced: a new pod, an empty emptyDir"
            assert job_outcome(docs, scenario(EXIT_FAILED), off) == FAIL, "77 still fails the job"
        else:
            assert said != "admitted", gate
        assert f"{gate} off: " in doc, f"docs/kubernetes.md must say what happens with {gate} off"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=os.path.basename)
def test_restart_budgets_are_the_ones_the_docs_state(overlay):
    """In place every attempt counts (preemptions too), so maxRestarts there is the run's whole budget, sized
    larger; the barrier's startup probe waits out a replacement pod's node and image pull (30 min) before the
    agent restarts (a restart that counts); docs/kubernetes.md states both numbers."""
    docs = {d["kind"]: d for d in render(overlay)}
    policy, job = failure_policy_and_job(docs)
    with open(os.path.join(ROOT, "docs", "kubernetes.md")) as f:
        doc = f.read()
    if policy["restartStrategy"] == "InPlaceRestart":
        assert policy["maxRestarts"] >= 50 and f"maxRestarts: {policy['maxRestarts']}` in place" in doc
        (agent,) = job["spec"]["template"]["spec"]["initContainers"]
        probe = agent["startupProbe"]
        assert probe["failureThreshold"] * probe["periodSeconds"] >= 1800
        assert counts_against_max_restarts(policy, "restart in place")
    else:
        assert f"maxRestarts: {policy['maxRestarts']}` under Recreate" in doc
        assert not counts_against_max_restarts(policy, jobset_action(policy, *job_on_failed_pod(job, 75)))


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=os.path.basename)
def test_params_reach_the_pods_and_recreate_has_the_tier_off(overlay):
    """params.env's values are in place (N, GPUs, memory, sizes, grace); the ConfigMap is immutable under a hashed
    name that the pods' envFrom names (a later apply makes a new one: a running pod never reads another apply's
    NNODES); Recreate overlays run without the memory tier (every restart replaces every pod: it would save
    nothing); no overlay renders the PVC (k8s/storage: `kubectl delete -k` leaves the checkpoints); the Volcano
    overlay names Volcano's scheduler; only the in-place agent gets an API token."""
    docs = {d["kind"]: d for d in render(overlay)}
    assert "PersistentVolumeClaim" not in docs, "the PVC is k8s/storage's, applied once apart from the job"
    policy, job = failure_policy_and_job(docs)
    node, pod = node_container(job), job["spec"]["template"]["spec"]
    config = docs["ConfigMap"]
    params = config["data"]
    assert config["immutable"] is True and re.fullmatch(r"fsdp-params-[a-z0-9]{10}", config["metadata"]["name"])
    assert node["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    in_place = policy["restartStrategy"] == "InPlaceRestart"
    assert (int(params["MEMORY_INTERVAL"]) > 0) == in_place, "the tier on in place only"
    assert pod["terminationGracePeriodSeconds"] == int(params["GRACE_SECONDS"])
    (tier,) = [v for v in pod["volumes"] if v["name"] == "memory-tier"]
    assert tier["emptyDir"] == {"medium": "Memory", "sizeLimit": params["MEMORY_TIER_SIZE"]}
    assert "ckpt.memory_dir=/mnt/memory-tier/fsdp" in node["args"], "a folder the tier makes, not the mount point"
    assert node["resources"]["limits"]["nvidia.com/gpu"] == int(params["NPROC_PER_NODE"])
    assert node["resources"]["limits"]["memory"] == params["POD_MEMORY"]
    if "TrainJob" in docs:
        assert docs["TrainJob"]["spec"]["trainer"]["numNodes"] == int(params["NNODES"])
    else:
        assert job["spec"]["parallelism"] == job["spec"]["completions"] == int(params["NNODES"])
    if "volcano" in overlay:
        assert pod["schedulerName"] == "volcano" and "volcano" in docs["TrainingRuntime"]["spec"]["podGroupPolicy"]
    if in_place:
        assert pod["automountServiceAccountToken"] is False
        (agent,) = pod["initContainers"]
        assert [m["mountPath"] for m in agent["volumeMounts"]] == ["/var/run/secrets/kubernetes.io/serviceaccount"]
        assert "volumeMounts" not in node or all("serviceaccount" not in m["mountPath"] for m in node["volumeMounts"])
        assert agent["resources"]["limits"]["memory"], "every container limited: the pod gets a memory limit"


@needs_kubectl
def test_storage_and_cluster_kustomizations_validate_and_the_policy_allows_only_the_attempt_annotation():
    """k8s/storage (the PVC) and k8s/cluster (upstream's ValidatingAdmissionPolicy, every namespace) render and
    validate; the policy's CEL allows the agent's restart-attempt patch and refuses an image change (its own
    expressions, evaluated by a small reading of them: spec, labels and other annotations must be unchanged)."""
    crds = crd_schemas()
    for folder in ("storage", "cluster"):
        for doc in render(os.path.join(ROOT, "k8s", folder)):
            assert not schema_errors(doc, crds), (doc["kind"], schema_errors(doc, crds))
    (policy,) = [d for d in render(os.path.join(ROOT, "k8s", "cluster")) if d["kind"] == "ValidatingAdmissionPolicy"]
    (match,) = policy["spec"]["matchConditions"]
    user = re.search(r"matches\('(.+)'\)", match["expression"]).group(1)
    assert re.search(user, "system:serviceaccount:team-a:jobset-in-place-restart")
    assert not re.search(user, "system:serviceaccount:team-a:default")
    exprs = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert exprs["isSpecUnchanged"] == "oldObject.spec == object.spec"
    annotations = exprs["isAnnotationsUnchangedExceptForInPlaceRestartAttempt"]
    assert "'jobset.sigs.k8s.io/in-place-restart-attempt'" in annotations
    (rule,) = policy["spec"]["validations"]
    assert all(f"variables.{name}" in rule["expression"] for name in
               ("isSpecUnchanged", "isLabelsUnchanged", "isAnnotationsUnchangedExceptForInPlaceRestartAttempt"))


RANK_RAM_GIB = 8  # host RAM per rank beside the tier and staging (k8s/base/params.env says where it comes from)


def gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=os.path.basename)
def test_the_pods_command_is_a_valid_config_and_params_cover_its_plan(overlay, capsys, monkeypatch):
    """The container's args, $(VAR) expanded from the ConfigMap, are a config train_fsdp.py --plan accepts for
    NNODES x NPROC_PER_NODE; the memory-tier and /dev/shm emptyDirs, the pod's memory and the grace period in
    params.env cover what the plan says they must hold: POD_MEMORY holds both memory-backed emptyDirs (their pages
    are charged to the container's memory cgroup), the tier's staging, and RANK_RAM_GIB per rank for the ranks'
    own host memory (k8s/base/params.env)."""
    from train_fsdp import main
    docs = {d["kind"]: d for d in render(overlay)}
    params = docs["ConfigMap"]["data"]
    (job,) = job_templates(docs.get("JobSet") or docs["TrainingRuntime"])
    (node,) = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "node"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: params[m.group(1)], a) for a in node["args"]]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert "run.dir=/mnt/run/fsdp" in args and "persistentVolumeClaim" in volumes["run"], \
        "run.dir (the tokenized-data cache every pod reads) must be on the shared volume"
    monkeypatch.chdir(ROOT)
    assert main(["--config", *args, "--plan", "--nodes", params["NNODES"], "--gpus-per-node",
                 params["NPROC_PER_NODE"]]) == 0
    plan = capsys.readouterr().out
    tier_line = re.search(r"memory tier \(ckpt.memory_interval=\d+\): ([\d.]+) GiB per node in "
                          r"/mnt/memory-tier/fsdp .*, and ([\d.]+) GiB of RAM", plan)
    tier, tier_staging = map(float, tier_line.groups()) if tier_line else (0.0, 0.0)
    assert (tier_line is not None) == (int(params["MEMORY_INTERVAL"]) > 0), plan
    shm = float(re.search(r"host per node: ([\d.]+) GiB of /dev/shm", plan).group(1))
    lead = float(re.search(r"preemption lead time >= ~([\d.]+) s", plan).group(1))
    assert tier <= gib(params["MEMORY_TIER_SIZE"]) and shm <= gib(params["SHM_SIZE"]), plan
    ranks = RANK_RAM_GIB * int(params["NPROC_PER_NODE"])
    assert gib(params["POD_MEMORY"]) >= gib(params["MEMORY_TIER_SIZE"]) + gib(params["SHM_SIZE"]) + tier_staging + ranks
    assert int(params["GRACE_SECONDS"]) >= 2 * lead


# ---------------------------------------------------------------- bad input: one line, exit 2

def entrypoint(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "JOB", "NNODES", "AWS_", "AZURE_"))}
    return subprocess.run([ENTRYPOINT, "configs/tiny.yaml", *args], env={**keep, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=timeout, cwd="/")


JOBSET_ALONE = {"JOBSET_NAME": "fsdp", "REPLICATED_JOB_NAME": "node", "JOB_COMPLETION_INDEX": "0", "NNODES": "1",
                "MASTER_ADDR": "127.0.0.1"}


@pytest.mark.parametrize("env, args, words", [
    ({}, [], "no operator's environment"),
    (JOBSET_ALONE, ["ckpt.dir=s3://bucket/run"],
     "needs S3 credentials and the pod has none: create the Secret fsdp-s3"),
    (JOBSET_ALONE, ["ckpt.dir=az://c/run"], "create the Secret fsdp-azure"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "x", "NNODES": "3"}, [],
     "the TrainJob gives PET_NNODES=2 but k8s/base/params.env says NNODES=3"),
    ({**JOBSET_ALONE, "JOB_COMPLETION_INDEX": "1"}, [], "this pod's index '1' is not below the number of pods 1"),
], ids=["no-operator", "s3-no-secret", "az-no-secret", "nnodes-edited", "index-beyond-n"])
def test_bad_manifest_parameters_are_one_line_and_exit_2(env, args, words):
    out = entrypoint(env, *args)
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [out.stderr.strip()] and out.stderr.startswith("error: "), out.stderr
    assert words in out.stderr, out.stderr


def test_a_hung_rank_is_exit_76_with_its_line(tmp_path):
    """Rank 1 SIGSTOPped inside step 3: the watchdog ends the attempt (the workers' 76, torchrun's 1); the hang
    file turns it into the container's 76, which the failure rules restart."""
    once = "mid_step:3,rank=1,attempt=0"
    out = entrypoint({**JOBSET_ALONE, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
                      "CKPT_FAULT": f"sleep@{once},secs=1;stop@{once}"},
                     *FAST, f"run.dir={tmp_path}", f"data.cache_dir={token_cache()}", "train.max_steps=6",
                     "train.hang_timeout=10", timeout=240)
    assert out.returncode == 76, out.stdout[-3000:] + out.stderr[-3000:]
    assert "hung (torchrun exit 1): error: hang:" in out.stdout and "exit 76: restarted" in out.stdout, out.stdout


def test_a_ranks_own_error_is_exit_77_which_no_rule_restarts(tmp_path):
    """Rank 1 raises inside step 2 (an OSError standing for a CUDA OOM): the workers exit 77 and write it into
    torchrun's error file; torchrun exits 1, the entrypoint 77, which the failure rules never restart
    (test_every_exit_code_does_what_the_contract_says; tests/test_exit_codes.py)."""
    out = entrypoint({**JOBSET_ALONE, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
                      "CKPT_FAULT": "oserror@mid_step:2,rank=1"},
                     *FAST, f"run.dir={tmp_path}", f"data.cache_dir={token_cache()}", "train.max_steps=4", timeout=240)
    assert out.returncode == EXIT_FAILED, out.stdout[-3000:] + out.stderr[-3000:]
    assert "error: rank 1: OSError: [Errno 28]" in out.stderr, out.stderr[-3000:]
    assert "a rank failed (torchrun exit 1, the workers' exit 77" in out.stdout, out.stdout[-3000:]


def test_a_world_size_the_preset_cannot_take_is_exit_2_not_torchruns_1(tmp_path):
    """N x G = 3 ranks for tiny.yaml's global batch of 32: the workers' one error line, their exit 2 through
    torchrun's error file (torchrun itself exits 1), and the entrypoint's line saying it will not restart."""
    out = entrypoint({**JOBSET_ALONE, "NPROC_PER_NODE": "3", "MASTER_PORT": str(free_port())},
                     f"run.dir={tmp_path}")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "not divisible by world size 3" in errors[0], out.stderr[-3000:]
    assert "bad input (torchrun exit 1, the workers' exit 2" in out.stdout and "not restarting" in out.stdout


# ---------------------------------------------------------------- two pods on two hosts

STEPS = ["train.max_steps=20", "ckpt.interval=8", "ckpt.keep_last=0"]
MEMORY = ["ckpt.memory_interval=1", "ckpt.memory_dir=/dev/shm/fsdp-memory-tier"]
POD_DNS = "fsdp-node-0-{}.fsdp"


@pytest.fixture(scope="module")
def hosts():
    from slurm_cluster import SlurmCluster, hosts_unavailable_reason
    reason = hosts_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=2).start_hosts()
    try:
        for name in cluster.nodes:  # the headless service's names, as the cluster DNS answers them
            with open(os.path.join(cluster.root, f"hosts.{name}"), "a") as f:  # in place: it is bind-mounted
                for i, other in enumerate(cluster.nodes):
                    f.write(f"{cluster.addr(other)} {POD_DNS.format(i)} fsdp-node-0-{i}\n")
        yield cluster
    finally:
        cluster.stop()
        cluster.cleanup()


def operator_env(operator: str, nodes: int, index: int) -> dict:
    if operator == "jobset":
        return {"JOBSET_NAME": "fsdp", "REPLICATED_JOB_NAME": "node", "JOB_COMPLETION_INDEX": str(index),
                "NNODES": str(nodes), "NPROC_PER_NODE": "1"}
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": POD_DNS.format(0), "PET_MASTER_PORT": "29400"}


def start_pods(cluster, run, operator: str, nodes: int, fault: str = "") -> list[subprocess.Popen]:
    """One entrypoint per host (pod i on node<i+1>), with `operator`'s environment and CKPT_FAULT `fault`."""
    args = [*FAST, f"run.dir={run}", f"data.cache_dir={token_cache()}", *STEPS, *MEMORY]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "JOB", "NNODES", "MASTER_"))}
    env.update({"SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CKPT_FAULT": fault,
                "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    logs = [open(f"{run}.{operator}-{nodes}-pod{i}.log", "a") for i in range(nodes)]
    return [subprocess.Popen(cluster.hosts[cluster.nodes[i]].cmd(ENTRYPOINT, "configs/tiny.yaml", *args),
                             env={**env, **operator_env(operator, nodes, i), "HOSTNAME": POD_DNS.format(i)[:-5]},
                             stdout=logs[i], stderr=subprocess.STDOUT) for i in range(nodes)]


def pod_log(run, operator: str, nodes: int, i: int) -> str:
    with open(f"{run}.{operator}-{nodes}-pod{i}.log") as f:
        return f.read()


def pause_after_memory_step(run, step: int) -> str:
    """CKPT_FAULT: after step `step` + 1, wait for this host's marker of memory step `step`, then sleep (the test
    kills everything meanwhile); the pause file says the rank got there."""
    return (f"wait_for@after_step:{step + 1},secs=120,file=/dev/shm/fsdp-memory-tier/step-{step:06d}/commit.json;"
            f"sleep@after_step:{step + 1},secs=600,file={run}.paused-{step}")


def kill_every_container(cluster, pods, run, step: int) -> None:
    """Once both hosts marked memory step `step` and a rank paused: SIGKILL to every process of both hosts."""
    markers = [f"{cluster.hosts[n].shm}/fsdp-memory-tier/step-{step:06d}/commit.json" for n in cluster.nodes]
    end = time.monotonic() + 240
    while not (os.path.exists(f"{run}.paused-{step}") and all(map(os.path.exists, markers))):
        assert all(p.poll() is None for p in pods) and time.monotonic() < end, \
            f"pods ended or never paused after step {step + 1}: {[p.poll() for p in pods]}"
        time.sleep(0.2)
    for name in cluster.nodes:
        cluster.hosts[name].kill_all(signal.SIGKILL)
    for p in pods:
        p.wait(30)


def last_event(run, name: str) -> dict:
    return events(run, name)[-1]


def one_pod_preempted_then_finishing(cluster, run) -> tuple[dict, int]:
    """Pod 0 alone (NNODES=1) resumes; after step 16 its entrypoint gets SIGTERM, as the kubelet sends a
    container's PID 1 on a preemption: exit 75 after a committed checkpoint. Started again, it finishes.
    Returns the first start's resume event and the preempted step."""
    (one,) = start_pods(cluster, run, "jobset", 1, "sleep@after_step,secs=0.3")
    end = time.monotonic() + 240
    while max((r["step"] for r in metrics_so_far(run) if "loss" in r), default=0) < 16 and one.poll() is None:
        assert time.monotonic() < end, pod_log(run, "jobset", 1, 0)[-4000:]
        time.sleep(0.2)
    resumed = last_event(run, "resume")
    one.send_signal(signal.SIGTERM)
    assert one.wait(120) == 75, pod_log(run, "jobset", 1, 0)[-4000:]
    preempted = last_event(run, "preempted")["step"]
    assert 16 <= preempted < 20
    for line in ("got SIGTERM: forwarding it to torchrun", "preempted (torchrun exit 1): exit 75"):
        assert line in pod_log(run, "jobset", 1, 0)
    (one,) = start_pods(cluster, run, "jobset", 1)  # restarted (the JobSet rule "preempted")
    assert one.wait(300) == 0, pod_log(run, "jobset", 1, 0)[-4000:]
    assert "training finished" in pod_log(run, "jobset", 1, 0)
    return resumed, preempted


def test_pods_resume_from_pod_ram_in_place_from_a_peer_and_at_fewer_pods(hosts, tmp_path):
    """JobSet pods train to step 5 and are killed; started again in place (Kubeflow's environment this time),
    they resume from memory step 4 reading only their own /dev/shm; killed after step 10, pod 1 replaced (its
    memory folder wiped), they resume from memory step 9, pod 1's rank fetched from pod 0's replica; killed after
    step 15, pod 0 alone (N=1) resumes from memory step 14 at world size 1; SIGTERM after step 16 (a preemption):
    exit 75 after a committed checkpoint, from which the pod started again finishes. Steps 1-14 (W=2) equal an
    uninterrupted run's bit for bit; steps 15-20 (W=1) train its samples, losses within the world-size tolerance."""
    reference = tmp_path / "reference"
    run_train(reference, 2, STEPS)
    ref = read_metrics(os.path.join(str(reference), "metrics.jsonl"))[0]
    run = tmp_path / "run"

    pods = start_pods(hosts, run, "jobset", 2, pause_after_memory_step(run, 4))
    kill_every_container(hosts, pods, run, 4)
    assert "start (jobset, pod 1 of 2): 2 node(s) x 1 worker(s), rendezvous fsdp-node-0-0.fsdp:29500" in \
        pod_log(run, "jobset", 2, 1)

    pods = start_pods(hosts, run, "trainjob", 2, pause_after_memory_step(run, 9))  # in place: /dev/shm kept
    kill_every_container(hosts, pods, run, 9)
    assert (last_event(run, "resume")["step"], last_event(run, "resume")["tier"]) == (4, "memory")
    fetched = last_event(run, "memory_fetch")
    assert (fetched["files"], fetched["bytes"]) == (0, 0), "in place, every rank reads its own pod's memory folder"
    assert "rendezvous fsdp-node-0-0.fsdp:29400" in pod_log(run, "trainjob", 2, 1)

    hosts.hosts["node2"].sh("rm", "-rf", "/dev/shm/fsdp-memory-tier")  # pod 1 replaced: a new, empty emptyDir
    pods = start_pods(hosts, run, "jobset", 2, pause_after_memory_step(run, 14))
    kill_every_container(hosts, pods, run, 14)
    resumed = last_event(run, "resume")
    assert (resumed["step"], resumed["tier"], resumed["world_size"]) == (9, "memory", 2)
    assert last_event(run, "memory_fetch")["files"] > 0, "the replaced pod's rank came from its peer"

    resumed, preempted = one_pod_preempted_then_finishing(hosts, run)
    assert (resumed["step"], resumed["tier"], resumed["saved_world_size"], resumed["world_size"]) == \
        (14, "memory", 2, 1)
    assert (last_event(run, "resume")["step"], last_event(run, "resume")["tier"]) == (preempted, "disk")
    after = read_metrics(os.path.join(str(run), "metrics.jsonl"))[0]
    assert sorted(after) == list(range(1, 21))
    for s in range(1, 15):
        assert (after[s]["world_size"], after[s]["loss"]) == (2, ref[s]["loss"]), f"step {s}"
    for s in range(15, 21):
        assert after[s]["world_size"] == 1
        assert after[s]["sample_ids"] == ref[s]["sample_ids"], f"step {s}: a different global batch"
        assert after[s]["loss"] == pytest.approx(ref[s]["loss"], abs=1e-4), f"step {s}"


# ---------------------------------------------------------------- k8s/check-cluster.sh on a misconfigured cluster

# A cluster as a Trainer v2.3.0 install leaves it, on Kubernetes 1.35 with the gate on the apiserver and one node's
# kubelet only: JobSet (kubeflow-system) without its InPlaceRestart gate, no admission policy, the volume applied.
FAKE_KUBECTL = r'''#!/usr/bin/env python3
import sys
said = " ".join(sys.argv[1:])
metric = 'kubernetes_feature_enabled{name="RestartAllContainersOnContainerExits",stage="ALPHA"} %d'
answers = {
    "version -o json": '{"serverVersion": {"major": "1", "minor": "35"}}',
    "-n kubeflow-system get deployment jobset-controller-manager -o jsonpath={.spec.template.spec.containers[0].image}":
        "registry.k8s.io/jobset/jobset:v0.12.0",
    "-n kubeflow-system get configmap jobset-manager-config -o jsonpath={.data.controller_manager_config\\.yaml}":
        "apiVersion: config.jobset.x-k8s.io/v1alpha1\nkind: Configuration\nleaderElection:\n  leaderElect: true",
    "get --raw /metrics": metric % 1,
    "get nodes -o jsonpath={.items[*].metadata.name}": "gpu-a gpu-b",
    "get --raw /api/v1/nodes/gpu-a/proxy/metrics": metric % 1,
    "get --raw /api/v1/nodes/gpu-b/proxy/metrics": metric % 0,
    "get pvc fsdp-run -o name": "persistentvolumeclaim/fsdp-run",
}
if said not in answers:
    sys.exit(1)
print(answers[said])
'''


def test_check_cluster_names_each_missing_gate(tmp_path):
    """k8s/check-cluster.sh --help works; against a fake kubectl of a misconfigured cluster it names JobSet's gate,
    the kubelet that lacks its gate and the missing admission policy, exits 1, and docs/kubernetes.md shows exactly
    that output."""
    script = os.path.join(ROOT, "k8s", "check-cluster.sh")
    helped = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: k8s/check-cluster.sh"), helped
    (tmp_path / "kubectl").write_text(FAKE_KUBECTL)
    (tmp_path / "kubectl").chmod(0o755)
    out = subprocess.run([script, "--overlay", "jobset-inplace"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert out.returncode == 1 and out.stderr == "", out
    lines = out.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["ok", "ok", "MISSING", "ok", "MISSING", "MISSING", "ok"], out.stdout
    assert "InPlaceRestart" in lines[2] and "gpu-b" in lines[4] and "gpu-a" not in lines[4], out.stdout
    with open(os.path.join(ROOT, "docs", "kubernetes.md")) as f:
        assert "$ k8s/check-cluster.sh --overlay jobset-inplace\n" + out.stdout in f.read(), \
            "docs/kubernetes.md shows this output:\n" + out.stdout


def test_a_non_root_pod_keeps_the_tier_in_a_folder_it_makes_under_the_root_owned_mount():
    """The kubelet makes an emptyDir's mount point root-owned, mode 0777. A non-root pod's tier refuses that folder
    itself (another user's), so ckpt.memory_dir is a folder below it, which the tier makes with this uid's mode
    0700 (memory_tier/peers.py make_step_folder): run as uid 65534, the mount point is refused, the subfolder is
    made and accepted."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a root-owned folder and run as another uid")
    mount = tempfile.mkdtemp(prefix="fsdp-test-emptydir-", dir="/dev/shm")  # pytest's tmp_path is root's alone
    os.chmod(mount, 0o777)
    probe = ("import os, sys; sys.path.insert(0, sys.argv[2])\n"
             "from ckpt.memory_tier.tier import foreign_folder\n"
             "from ckpt.memory_tier.peers import make_step_folder\n"
             "os.setgid(65534); os.setuid(65534)  # imports done: now the pod's non-root uid\n"
             "mount = sys.argv[1]; folder = os.path.join(mount, 'fsdp')\n"
             "make_step_folder(os.path.join(folder, 'step-000001'))\n"
             "print(bool(foreign_folder(mount)), foreign_folder(folder), oct(os.stat(folder).st_mode & 0o777))\n")
    try:
        out = subprocess.run([sys.executable, "-c", probe, mount, ROOT], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(mount, ignore_errors=True)
    assert out.returncode == 0 and out.stdout.split() == ["True", "None", "0o700"], out
