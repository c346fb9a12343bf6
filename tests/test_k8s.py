"""`python -m tfpar.k8s render` prints manifests that validate offline, and pods that get them work.

- Every object validates offline with nothing beside the repository
  (tests/k8s_validate.py): core kinds and every pod and Job template through the
  `kubernetes` client's models, TFJob through the Kubeflow training SDK's models,
  JobSet's own fields against the table kept there; unknown fields are refused
  (the API server would silently prune them), and so are mistyped ones.
- Where the projects' full CRD schemas are present (TFPAR_K8S_SCHEMAS=DIR, or
  ../shared/k8s-schemas beside the checkout when TFPAR_K8S_SCHEMAS is unset),
  TFJob and JobSet objects also validate against them (jsonschema).
- Every pod of a JobSet or Indexed Job builds its TF_CONFIG with tfpar.config.cluster
  from the rendered environment, and together they form one cluster; two
  pods of a rendered Indexed Job (hostnames mapped to 127.0.0.1) train a real
  multi_worker_mirrored job; two pods of a rendered JobSet train with pipeline
  stages across them (pod 1 serves pod 0's second stage) and both exit 0.
- Cross-worker pipeline jobs follow worker 0 (its Job's success policy), and
  their pods are pinned to the GPU count they were rendered with.
- Bad render or training flags: one line, exit 2, nothing printed.
"""

import copy
import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
import yaml

from conftest import (OPTIONAL_K8S_SCHEMAS, REPO, TINY, in_background, read_metrics,
                      selected_tests_use)
from tfpar.config import cluster as cluster_lib
from tfpar.cli import k8s as k8s_cli
from tfpar.k8s import manifests
from tfpar.cli.launch import free_ports

import k8s_validate

# Optional: the full CRD schemas. Setting TFPAR_K8S_SCHEMAS (even to an empty
# directory) turns off the lookup beside the checkout.
SCHEMAS = os.environ.get("TFPAR_K8S_SCHEMAS", OPTIONAL_K8S_SCHEMAS)
CRDS = {(k8s_validate.TFJOB_API_VERSION, "TFJob"): "kubeflow.org_tfjobs.yaml",
        (k8s_validate.JOBSET_API_VERSION, "JobSet"): "jobset.x-k8s.io_jobsets.yaml"}

MWMS = ["--strategy=multi_worker_mirrored", "--model_dir=gs://bucket/runs/gpt"]
PS = ["--strategy=parameter_server", "--model_dir=gs://bucket/runs/gpt"]
VARIANTS = {  # name -> (render flags, train flags)
    "multi_worker": (["--workers=2"], MWMS),
    "multi_worker_gpus": (["--workers=3", "--gpus_per_worker=4"],
                          MWMS + ["--global_batch_size=24"]),  # 12 replicas
    "parameter_server": (["--workers=2", "--ps=1"], PS),
    "parameter_server_gpus": (["--workers=2", "--ps=2", "--gpus_per_worker=1"], PS),
    "one_worker_pvc": (["--workers=1", "--pvc=runs-claim"],
                       ["--model_dir=/mnt/tfpar/runs/gpt", "--data=/mnt/tfpar/data/*.txt"]),
    # Pipeline stages across workers: a replica of 2 stages spans 2 CPU workers (D=2)...
    # (every worker its own program, a vision task's too: tfpar.engines.stage_worker)
    "stages_across": (["--workers=4"], MWMS + ["--pipeline_stages=2", "--microbatches=2",
                                               "--task=classify"]),
    # ...or 2x4 devices span 2 workers of 4 GPUs; and 2 stages fit in one such worker.
    "stages_across_gpus": (["--workers=2", "--gpus_per_worker=4"],
                           MWMS + ["--pipeline_stages=2", "--tensor_parallel=4"]),
    "stages_within_gpus": (["--workers=2", "--gpus_per_worker=4"],
                           MWMS + ["--pipeline_stages=2", "--microbatches=2"]),
}


def render(kind, flags, train_flags, name="gpt"):
  args = ["render", f"--kind={kind}", f"--name={name}", "--image=registry.example/tfpar:1",
          *flags, "--", *train_flags]
  return list(yaml.safe_load_all(k8s_cli.to_yaml(k8s_cli.parse(args), args)))


@pytest.fixture(scope="module")
def crd_schemas():
  """(apiVersion, kind) -> the served version's schema, with unknown fields refused.

  Empty where no CRD schemas are reachable: the offline validators still run.
  """
  schemas = {}
  for (api_version, kind), filename in CRDS.items():
    path = os.path.join(SCHEMAS, filename)
    if not os.path.isfile(path):
      continue
    with open(path) as f:
      crd = yaml.safe_load(f)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schemas[(api_version, kind)] = _refuse_unknown(served["schema"]["openAPIV3Schema"])
  return schemas


def _refuse_unknown(schema):
  """A copy of a structural schema in which objects accept only their listed properties."""
  schema = copy.deepcopy(schema)

  def visit(node):
    if isinstance(node, dict):
      if ("properties" in node and "additionalProperties" not in node
          and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
      for value in node.values():
        visit(value)
    elif isinstance(node, list):
      for value in node:
        visit(value)

  visit(schema)
  return schema


def pod_templates(obj):
  """{task type: pod template} of a rendered workload."""
  if obj["kind"] == "TFJob":
    return {name.lower(): spec["template"] for name, spec in obj["spec"]["tfReplicaSpecs"].items()}
  if obj["kind"] == "JobSet":
    return {rj["name"]: rj["template"]["spec"]["template"] for rj in obj["spec"]["replicatedJobs"]}
  return {"all": obj["spec"]["template"]}


def validate(objs, crd_schemas):
  """Offline, always; against the CRD schemas too where they are present."""
  for obj in objs:
    k8s_validate.validate_offline(obj)
    key = (obj["apiVersion"], obj["kind"])
    if key in crd_schemas:
      jsonschema.validate(obj, crd_schemas[key])


def mistyped():
  """A rendered object of each workload kind with one field misspelt or of the wrong type."""
  [_, jobset] = render("jobset", *VARIANTS["multi_worker"])
  jobset["spec"]["network"]["enableDNSHostname"] = jobset["spec"]["network"].pop("enableDNSHostnames")
  [_, jobset_pod] = render("jobset", *VARIANTS["multi_worker"])
  (jobset_pod["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
   ["imagePullPolicy"]) = {"always": True}
  [_, _, job] = render("indexed-job", *VARIANTS["multi_worker"])
  job["spec"]["template"]["spec"]["containers"][0]["commands"] = ["python"]
  [_, tfjob] = render("tfjob", *VARIANTS["multi_worker"])
  tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"] = "300"
  [_, tfjob_typo] = render("tfjob", *VARIANTS["multi_worker"])
  tfjob_typo["spec"]["runPolicy"]["backoffLimits"] = tfjob_typo["spec"]["runPolicy"].pop("backoffLimit")
  return {"JobSet": jobset, "JobSet pod": jobset_pod, "Job": job, "TFJob type": tfjob,
          "TFJob name": tfjob_typo}


@pytest.mark.parametrize("case, message", [
    ("JobSet", "spec.network: unknown field 'enableDNSHostname'"),
    ("JobSet pod", "spec.replicatedJobs[].template: V1JobTemplateSpec dropped or changed fields: "
                   "spec.template.spec.containers[0].imagePullPolicy"),
    ("Job", "V1Job dropped or changed fields: spec.template.spec.containers[0].commands"),
    ("TFJob type", "KubeflowOrgV1TFJob dropped or changed fields: spec.tfReplicaSpecs.Worker."
                   "template.spec.terminationGracePeriodSeconds: '300' became 300"),
    ("TFJob name", "KubeflowOrgV1TFJob dropped or changed fields: spec.runPolicy.backoffLimits")])
def test_the_offline_validators_refuse_an_unknown_or_mistyped_field(case, message):
  """Needs nothing beside the repository: a typo in a field name or a type is caught at any depth."""
  with pytest.raises(AssertionError) as raised:
    k8s_validate.validate_offline(mistyped()[case])
  assert message in str(raised.value), raised.value


def test_the_crd_schemas_refuse_them_too_where_present(crd_schemas):
  """Where the CRD schemas are reachable, they refuse the same mistakes in TFJob and JobSet."""
  cases = mistyped()
  for (_, kind), schema in crd_schemas.items():
    for case in [c for c in cases if c.startswith(kind)]:
      with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cases[case], schema)
  missing = [f for key, f in CRDS.items() if key not in crd_schemas]
  assert not any(os.path.exists(os.path.join(SCHEMAS, f)) for f in missing)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("kind", ["tfjob", "jobset", "indexed-job"])
def test_manifests_render_and_validate(kind, variant, crd_schemas):
  flags, train_flags = VARIANTS[variant]
  objs = render(kind, flags, train_flags)
  validate(objs, crd_schemas)
  kinds = [o["kind"] for o in objs]
  assert kinds == {"tfjob": ["NetworkPolicy", "TFJob"], "jobset": ["NetworkPolicy", "JobSet"],
                   "indexed-job": ["NetworkPolicy", "Service", "Job"]}[kind]
  workload = objs[-1]
  labels = {"app.kubernetes.io/name": "tfpar", "app.kubernetes.io/instance": "gpt"}
  workers = int(re.search(r"--workers=(\d+)", " ".join(flags)).group(1))
  ps = int((re.search(r"--ps=(\d+)", " ".join(flags)) or [0, 0])[1])
  gpus = (re.search(r"--gpus_per_worker=(\d+)", " ".join(flags)) or [0, None])[1]

  # Only the job's own pods reach the TF port (the gRPC servers are unauthenticated).
  policy = objs[0]["spec"]
  assert policy["podSelector"]["matchLabels"] == labels and policy["policyTypes"] == ["Ingress"]
  assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": labels}}],
                                "ports": [{"protocol": "TCP", "port": 2222}]}]

  templates = pod_templates(workload)
  for role, template in templates.items():
    assert labels.items() <= template["metadata"]["labels"].items()
    spec = template["spec"]
    [container] = spec["containers"]
    assert container["name"] == "tensorflow"  # TFJob injects TF_CONFIG into this one
    assert container["command"] == ["tini", "--", "python", "-m", "tfpar.train"]
    assert container["args"] == train_flags
    assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222, "protocol": "TCP"}]
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    gpu_here = gpus and role in ("worker", "all")
    assert container["resources"]["limits"].get("nvidia.com/gpu") == (gpus if gpu_here else None)
    assert spec["terminationGracePeriodSeconds"] == 300
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    if "--pvc=runs-claim" in flags:
      assert spec["volumes"] == [{"name": "model-dir",
                                  "persistentVolumeClaim": {"claimName": "runs-claim"}}]
      assert container["volumeMounts"] == [{"name": "model-dir", "mountPath": "/mnt/tfpar"}]
    else:
      assert "volumes" not in spec and "volumeMounts" not in container
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    # Model-parallel multi-worker pods decide the plan on the GPUs they were rendered with.
    assert env.get("TFPAR_GPUS_PER_WORKER") == (
        (gpus or "0") if variant.startswith("stages") else None)
    if kind == "tfjob":
      assert set(env) <= {"TFPAR_GPUS_PER_WORKER"}  # The operator writes TF_CONFIG.
    else:
      assert spec["restartPolicy"] == "Never"
      assert json.loads(env["TFPAR_CLUSTER"]) == manifests.hostnames(k8s_cli.parse(
          ["render", f"--kind={kind}", "--name=gpt", "--image=i", *flags, "--", *train_flags]))

  if kind == "tfjob":
    replicas = workload["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == (
        {"Chief": 1, "Worker": workers, "PS": ps} if ps else {"Worker": workers})
    # A multi-worker TFJob cannot restart the group: a failure fails the job.
    assert {v["restartPolicy"] for v in replicas.values()} == {"OnFailure" if ps else "Never"}
    assert workload["spec"]["runPolicy"]["backoffLimit"] == (3 if ps else 0)
    # The operator's default: the job succeeds when the chief (else worker 0) completes.
    assert "successPolicy" not in workload["spec"]
  elif kind == "jobset":
    spec = workload["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert spec["failurePolicy"]["maxRestarts"] == 3  # Any failed Job restarts the whole set...
    # ...except what no restart fixes (exit 2, 3, 4): it fails; and preemption (75):
    # restarts, not counted.
    assert [(r["name"], r["action"], r["onJobFailureReasons"], r["onJobFailureMessagePatterns"])
            for r in spec["failurePolicy"]["rules"]] == [
        ("NotRestartable", "FailJobSet", ["PodFailurePolicy"],
         ["failed with exit code (2|3|4) matching"]),
        ("Preempted", "RestartJobSetAndIgnoreMaxRestarts", ["PodFailurePolicy"],
         ["failed with exit code 75 matching"])]
    jobs = {rj["name"]: rj["template"]["spec"] for rj in spec["replicatedJobs"]}
    assert {k: v["completions"] for k, v in jobs.items()} == (
        {"chief": 1, "worker": workers, "ps": ps} if ps else {"worker": workers})
    for job in jobs.values():
      assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
      assert [(r["action"], r["onExitCodes"]["values"]) for r in job["podFailurePolicy"]["rules"]
              ] == [("FailJob", [2, 3, 4]), ("FailJob", [75])]
      # The JobSet's patterns match the message the Job controller writes for these rules.
      message = ("Container tensorflow for pod default/gpt-worker-0-1-x7k2p failed with exit "
                 "code {} matching FailJob rule at index {}")
      for code, index, rule in ((2, 0, "NotRestartable"), (3, 0, "NotRestartable"),
                                (4, 0, "NotRestartable"), (75, 1, "Preempted")):
        matching = [r["name"] for r in spec["failurePolicy"]["rules"]
                    if any(re.search(p, message.format(code, index))
                           for p in r["onJobFailureMessagePatterns"])]
        assert matching[:1] == [rule]
      assert not any(re.search(p, message.format(1, 0)) or re.search(p, message.format(137, 0))
                     or re.search(p, message.format(24, 0)) or re.search(p, message.format(130, 0))
                     for r in spec["failurePolicy"]["rules"] for p in r["onJobFailureMessagePatterns"])
    assert spec["successPolicy"]["targetReplicatedJobs"] == (["chief"] if ps else ["worker"])
    # Every worker trains (stages across workers too): the worker Job waits for all of them.
    assert jobs["worker"].get("successPolicy") is None
  else:
    service = objs[1]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == labels
    job = workload["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == workers + ps + bool(ps)
    assert job["backoffLimit"] == 0
    assert job["template"]["spec"]["subdomain"] == "gpt"
    # Parameter servers never finish first: the chief (index 0) finishing ends the Job.
    assert job.get("successPolicy") == ({"rules": [{"succeededIndexes": "0"}]} if ps else None)


def test_tpu_workers_request_chips_on_nodes_of_the_topology(crd_schemas):
  objs = render("jobset", ["--workers=1", "--tpu_topology=2x4",
                           "--tpu_accelerator=tpu-v5-lite-podslice"],
                ["--strategy=tpu", "--model_dir=gs://bucket/runs/tpu"])
  validate(objs, crd_schemas)
  spec = pod_templates(objs[-1])["worker"]["spec"]
  assert spec["containers"][0]["resources"]["limits"]["google.com/tpu"] == "8"
  assert spec["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                  "cloud.google.com/gke-tpu-topology": "2x4"}


def pods(objs):
  """(environment, own address) of every pod a rendered JobSet or Indexed Job creates."""
  result = []
  for role, template in pod_templates(objs[-1]).items():
    env = {e["name"]: e["value"] for e in template["spec"]["containers"][0]["env"]}
    json.loads(env["TFPAR_CLUSTER"])  # Each pod is given a cluster spec that parses.
    count = (objs[-1]["spec"]["completions"] if role == "all" else
             next(rj["template"]["spec"]["completions"] for rj in objs[-1]["spec"]["replicatedJobs"]
                  if rj["name"] == role))
    for index in range(count):  # Kubernetes sets JOB_COMPLETION_INDEX in each pod.
      pod_env = dict(env, JOB_COMPLETION_INDEX=str(index))
      name = (f"gpt-{role}-0-{index}" if role != "all" else f"gpt-{index}")  # pod hostname
      result.append((pod_env, name))
  return result


@pytest.mark.parametrize("kind", ["jobset", "indexed-job"])
@pytest.mark.parametrize("variant", ["multi_worker", "parameter_server"])
def test_every_pod_builds_its_own_place_in_one_cluster(kind, variant):
  objs = render(kind, *VARIANTS[variant])
  seen = []
  for env, hostname in pods(objs):
    config, spec, task_type, index = cluster_lib.pod_tf_config(env)
    parsed = json.loads(config)
    assert parsed["cluster"] == spec and parsed["task"] == {"type": task_type, "index": index}
    assert spec[task_type][index] == f"{hostname}.gpt:2222"  # Its own DNS name.
    seen.append((task_type, index, json.dumps(spec, sort_keys=True)))
  assert len({s[2] for s in seen}) == 1  # One cluster for all.
  assert sorted(s[:2] for s in seen) == sorted(cluster_lib.tasks_in_order(json.loads(seen[0][2])))


def test_a_pod_waits_for_its_peers_then_names_those_not_found():
  env = {"TFPAR_CLUSTER": json.dumps({"worker": ["localhost:2222", "gpt-1.nowhere.invalid:2222",
                                                 "gpt-2.nowhere.invalid:2222"]}),
         "JOB_COMPLETION_INDEX": "0", "TFPAR_PEER_TIMEOUT": "1"}
  with pytest.raises(cluster_lib.PeersNotFound,
                     match=r"after 1 s: gpt-1\.nowhere\.invalid:2222, gpt-2\.nowhere\.invalid:2222"):
    cluster_lib.from_env(env)
  assert "TF_CONFIG" not in env
  # A peer whose DNS record appears late is waited for.
  calls = []

  def resolve(host, port, **_):
    calls.append(host)
    if len(calls) < 3:
      raise OSError("not yet")

  cluster_lib.wait_for_peers(["gpt-1.gpt:2222"], timeout=30, interval=0.01, resolve=resolve)
  assert calls == ["gpt-1.gpt"] * 3
  # Peers that resolve: TF_CONFIG is exported for TensorFlow's resolvers.
  env = {"TFPAR_CLUSTER": json.dumps({"worker": ["localhost:2222", "127.0.0.1:2223"]}),
         "JOB_COMPLETION_INDEX": "1"}
  cluster = cluster_lib.from_env(env)
  assert (cluster.task_type, cluster.task_index, cluster.num_workers) == ("worker", 1, 2)
  assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}


def test_a_pod_whose_peers_never_appear_exits_1_with_one_line(tmp_path):
  """Not bad input (exit 2): the JobSet may restart it and DNS may have caught up."""
  env = dict(os.environ, PYTHONPATH=REPO, TFPAR_PEER_TIMEOUT="1", JOB_COMPLETION_INDEX="0",
             TFPAR_CLUSTER=json.dumps({"worker": ["localhost:2222", "gpt-1.gpt.invalid:2222"]}))
  env.pop("TF_CONFIG", None)
  proc = subprocess.run([sys.executable, "-m", "tfpar.train", f"--model_dir={tmp_path}",
                         "--strategy=multi_worker_mirrored"], capture_output=True, text=True,
                        env=env, cwd=REPO, timeout=60)
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "tfpar.train: error: peers not found in DNS after 1 s: gpt-1.gpt.invalid:2222 (are their "
      "pods scheduled, and the headless Service and publishNotReadyAddresses in place?)"]
  assert not os.listdir(tmp_path)


POD_TRAIN_FLAGS = [*TINY, "--strategy=multi_worker_mirrored", "--jit_compile=false",
                   "--eval_steps=0", "--train_steps=2", "--checkpoint_every=2"]
# A replica of 2 stages on 2 CPU pods: each pod runs its own stage's program.
STAGES = ["--pipeline_stages=2", "--microbatches=2"]


def two_pods(tmp_path, kind="indexed-job", train_flags=("--input_sharding=data",)):
  """Two pods of a rendered job, as real processes: (their exit statuses, their outputs).

  Started by `started` with this module's first test, they run beside the tests before it.
  """
  objs = render(kind, ["--workers=2", "--pvc=claim", f"--mount_path={tmp_path}"],
                [*POD_TRAIN_FLAGS, *train_flags, f"--model_dir={tmp_path}/runs/gpt"])
  [template] = pod_templates(objs[-1]).values()  # Workers only: one template.
  [container] = template["spec"]["containers"]
  local = {f"{host}.gpt:2222": f"127.0.0.1:{port}"
           for (_, host), port in zip(pods(objs), free_ports(2))}
  procs = []
  for env, _ in pods(objs):
    cluster = json.dumps({job: [local[a] for a in addresses]
                          for job, addresses in json.loads(env["TFPAR_CLUSTER"]).items()})
    env = dict(os.environ, **dict(env, TFPAR_CLUSTER=cluster), PYTHONPATH=REPO,
               TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    command = container["command"][2:]  # tini is the image's PID 1; here the test is the parent.
    assert command == ["python", "-m", "tfpar.train"]
    procs.append(subprocess.Popen([sys.executable, *command[1:], *container["args"]], env=env,
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  try:
    outputs = [p.communicate(timeout=600)[0] for p in procs]  # ~20 s on an idle 2-core machine
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [p.returncode for p in procs], outputs


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
  """{fixture name: (model dir's parent, the run's future)} of the pod runs the selected tests use."""
  runs = {"pods_run": ("indexed-job", ["--input_sharding=data"]),
          "stage_pods_run": ("jobset", STAGES)}
  futures = {}
  for fixture, (kind, flags) in runs.items():
    if selected_tests_use(request, fixture):
      directory = tmp_path_factory.mktemp(fixture)
      futures[fixture] = directory, in_background(two_pods, directory, kind, flags)
  return futures


@pytest.fixture(scope="module")
def pods_run(started):
  directory, future = started["pods_run"]
  return directory, *future.result()


@pytest.fixture(scope="module")
def stage_pods_run(started):
  directory, future = started["stage_pods_run"]
  return directory, *future.result()


def test_two_pods_of_a_rendered_indexed_job_train_together(pods_run):
  """The pods' environment and command line as rendered; only their hostnames become 127.0.0.1."""
  tmp_path, codes, outputs = pods_run
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  assert "2 workers" in outputs[0], outputs[0][-2000:]
  assert [r["step"] for r in read_metrics(f"{tmp_path}/runs/gpt")] == [1, 2]
  assert os.path.exists(f"{tmp_path}/runs/gpt/checkpoints/checkpoint")


def test_two_pods_of_a_rendered_stage_jobset_train_and_both_exit_0(stage_pods_run):
  """Each pod runs its own stage's program (tfpar.engines.stage_worker) and both end with
  status 0, as the JobSet's policies expect."""
  tmp_path, codes, outputs = stage_pods_run
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  assert "one program per worker, stages ['worker:0', 'worker:1']" in outputs[0], (
      outputs[0][-2000:])
  assert [r["step"] for r in read_metrics(f"{tmp_path}/runs/gpt")] == [1, 2]
  with open(f"{tmp_path}/runs/gpt/plan.json") as f:
    assert json.load(f)["stage_workers"] == [["worker:0", "worker:1"]]


BAD = [
    ([], "the only command is render"),
    (["render", "--kind=tfjob", "--name=gpt", "--workers=2", "--image=i"], "no '--' before"),
    (["render", "--kind=pod", "--name=gpt", "--workers=2", "--image=i", "--", *MWMS], "kind"),
    (["render", "--name=gpt", "--workers=2", "--image=i", "--", *MWMS], "--kind is not set"),
    (["render", "--kind=jobset", "--workers=2", "--image=i", "--", *MWMS], "--name is not set"),
    (["render", "--kind=jobset", "--name=gpt", "--image=i", "--", *MWMS], "--workers is not set"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--", *MWMS], "--image is not set"),
    (["render", "--kind=jobset", "--name=GPT_1", "--workers=2", "--image=i", "--", *MWMS],
     "--name=GPT_1 is not a DNS label"),
    (["render", "--kind=jobset", "--name=" + "g" * 60, "--workers=2", "--image=i", "--", *MWMS],
     "is too long"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=0", "--image=i", "--", *MWMS],
     "workers"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=two", "--image=i", "--", *MWMS],
     "workers"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--cpu=lots", "--",
      *MWMS], "--cpu=lots is not a Kubernetes quantity"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--"],
     "no tfpar.train flags after '--'"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--", *MWMS,
      "--num_heads=3"], "training flags: --num_heads=3 does not divide --d_model=128"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--", *MWMS,
      "--no_such_flag=1"], "training flags:"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--",
      "--strategy=multi_worker_mirrored"], "--model_dir is not set"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--",
      "--model_dir=gs://b/r"], "--workers=2 with --strategy=one_device would train independent"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--ps=1", "--image=i", "--", *MWMS],
     "--ps=1 starts parameter servers"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--", *PS],
     "pass --ps=1"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--",
      "--strategy=multi_worker_mirrored", "--model_dir=runs/gpt"],
     "--model_dir=runs/gpt is a local path that pods do not share"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--pvc=c", "--",
      "--strategy=multi_worker_mirrored", "--model_dir=/data/runs/gpt"],
     "is not on the volume --pvc=c mounted at /mnt/tfpar"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--pvc=c", "--", *MWMS],
     "--pvc=c is unused"),
    (["render", "--kind=tfjob", "--name=gpt", "--workers=2", "--image=i", "--max_restarts=2", "--",
      *MWMS], "a multi-worker TFJob cannot restart the whole job"),
    (["render", "--kind=indexed-job", "--name=gpt", "--workers=2", "--image=i",
      "--max_restarts=1", "--", *MWMS], "an Indexed Job cannot restart the whole job"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=1", "--image=i", "--tpu_topology=2x4",
      "--", "--strategy=tpu", "--model_dir=gs://b/r"], "go together"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=1", "--image=i", "--tpu_topology=8",
      "--tpu_accelerator=a", "--", "--strategy=tpu", "--model_dir=gs://b/r"], "not a topology"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--tpu_topology=2x4",
      "--tpu_accelerator=a", "--", *MWMS], "pass --strategy=tpu"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=1", "--image=i", "--",
      "--strategy=tpu", "--model_dir=gs://b/r"], "--strategy=tpu needs TPU nodes"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--port=80", "--",
      *MWMS], "port"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--grace_seconds=5",
      "--", *MWMS], "grace_seconds"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=3", "--image=i", "--", *MWMS,
      "--global_batch_size=16"],
     "--global_batch_size=16 does not split evenly over 3 replicas (--workers=3)"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--gpus_per_worker=4", "--image=i",
      "--", *MWMS, "--global_batch_size=12"],
     "over 8 replicas (--workers=2 x --gpus_per_worker=4)"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=3", "--image=i", "--", *MWMS,
      "--pipeline_stages=2", "--microbatches=2"],
     "spans 2 workers of 1 device, and 3 workers do not split into replicas"),
    (["render", "--kind=jobset", "--name=gpt", "--workers=2", "--gpus_per_worker=4", "--image=i",
      "--", *MWMS, "--pipeline_stages=3", "--tensor_parallel=2"],
     "--gpus_per_worker=4: --pipeline_stages x --tensor_parallel = 3x2 = 6 devices per replica "
     "do not fill whole workers of 4 devices"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_one_line_exit_2_and_prints_no_manifest(argv, message, capsys):
  assert k8s_cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfpar.k8s: error: "), err
  assert message in lines[0], lines[0]


def test_the_command_renders_without_importing_tensorflow():
  script = ("import sys\nfrom tfpar.cli.k8s import main\n"
            "code = main(sys.argv[1:])\n"
            "assert 'tensorflow' not in sys.modules, 'rendering imported TensorFlow'\n"
            "sys.exit(code)\n")
  args = ["render", "--kind=jobset", "--name=gpt", "--workers=2", "--image=i", "--", *MWMS]
  proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("# Rendered by: python -m tfpar.k8s render --kind=jobset")
  proc = subprocess.run([sys.executable, "-m", "tfpar.k8s", *args[:-1], "--num_heads=3"],
                        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                        cwd=REPO, timeout=60)
  assert (proc.returncode, proc.stdout) == (2, "")
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_dockerfile_installs_the_package_and_runs_tini_as_pid_1():
  """Docker cannot run here: the Dockerfile is read, not built."""
  with open(os.path.join(REPO, "Dockerfile")) as f:
    lines = [l.strip() for l in f.read().replace("\\\n", " ").splitlines()
             if l.strip() and not l.startswith("#")]
  instructions = [(l.split(None, 1)[0], l.split(None, 1)[1]) for l in lines]
  assert instructions[0][0] == "FROM" and instructions[0][1].startswith("python:3.11")
  runs = [arg for op, arg in instructions if op == "RUN"]
  assert any(re.search(r"apt-get install .*\btini\b", r) for r in runs)
  copied = [arg.split()[:-1] for op, arg in instructions if op == "COPY"]
  for sources in copied:
    for source in sources:
      assert os.path.exists(os.path.join(REPO, source)), f"COPY {source}: no such path"
  assert {"setup.py", "tfpar", "configs"} <= {s for sources in copied for s in sources}
  # README installs the package from the repo root with pip: so does the image (not editable).
  assert any(re.fullmatch(r"pip install (--no-cache-dir )?\.", r) for r in runs), runs
  entrypoint = json.loads(dict(instructions)["ENTRYPOINT"])
  assert entrypoint == list(manifests.ENTRYPOINT[:2]) == ["tini", "--"]
  assert dict(instructions)["USER"] == str(manifests.UID)


def documented_commands():
  """Every `python -m tfpar.k8s render` command in README.md, docs/kubernetes.md and docs/operations.md."""
  commands = []
  for doc in ("README.md", "docs/kubernetes.md", "docs/operations.md"):
    with open(os.path.join(REPO, doc)) as f:
      text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
      if line.startswith("python -m tfpar.k8s render "):
        commands.append((doc, line.split("|")[0].split()[3:]))
  return commands


def test_every_documented_command_renders_valid_manifests(crd_schemas):
  commands = documented_commands()
  kinds = {re.search(r"--kind=(\S+)", " ".join(argv)).group(1) for _, argv in commands}
  assert kinds == {"tfjob", "jobset", "indexed-job"} and len(commands) >= 8, commands
  for doc, argv in commands:
    # Run from the repo root, as the docs do (flagfiles are relative to it).
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
      job = k8s_cli.parse(argv)
    except k8s_cli.RenderError as e:
      raise AssertionError(f"{doc}: python -m tfpar.k8s {' '.join(argv)}: {e}") from None
    finally:
      os.chdir(cwd)
    validate(manifests.render(job), crd_schemas)


def test_a_pod_that_sees_other_gpus_than_rendered_stops_with_one_line():
  """The render checked the job's plan on --gpus_per_worker; a pod deciding on another
  count would plan other stages than its peers: it refuses instead (exit 2)."""
  from tfpar import strategies  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import ConfigError  # pylint: disable=import-outside-toplevel
  job = k8s_cli.parse(["render", "--kind=jobset", "--name=gpt", "--workers=4", "--image=i",
                       "--", *VARIANTS["stages_across"][1]])
  cfg = k8s_cli._check_train_flags(job.train_args)  # pylint: disable=protected-access
  env = {cluster_lib.GPUS_ENV: "0"}  # As rendered for CPU pods: this machine has no GPU.
  assert strategies.stages_across_workers(cfg, env) is job.model_parallel is True
  with pytest.raises(ConfigError, match=r"this pod sees 0 GPU\(s\) but was rendered with "
                     r"TFPAR_GPUS_PER_WORKER=4 .*--gpus_per_worker=0"):
    strategies.stages_across_workers(cfg, {cluster_lib.GPUS_ENV: "4"})
