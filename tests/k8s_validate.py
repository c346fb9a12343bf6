"""Offline validation of rendered Kubernetes manifests, needing nothing beside the repository.

Every kind is checked field by field, unknown fields refused (an API server would
silently prune them) and types checked (a string where an integer belongs):

- Core kinds (Job, Service, NetworkPolicy) and every pod or Job template: through
  the `kubernetes` client's models, which list each field and its type.
- TFJob (`kubeflow.org/v1`): through the models of the Kubeflow training operator's
  Python SDK (`kubeflow-training`), generated from the same OpenAPI spec as its CRD.
- JobSet (`jobset.x-k8s.io/v1alpha2`): the JobSet project publishes no Python
  models, so its own fields are checked against JOBSET_FIELDS below (taken from
  its v1alpha2 CRD), and the Job and pod templates inside it through the
  `kubernetes` client's models.

A model is checked by a round trip: deserialized into the client's objects and
serialized back, it must equal the input; a dropped (unknown) field or a coerced
type changes it. Where the full CRD schemas are present, tests/test_k8s.py also
validates against them.
"""

import json

from kubeflow.training import ApiClient as KubeflowApiClient
from kubernetes import client as k8s_client

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
TFJOB_API_VERSION = "kubeflow.org/v1"
CORE_MODELS = {"Job": "V1Job", "Service": "V1Service", "NetworkPolicy": "V1NetworkPolicy"}

# JobSet v1alpha2's own fields. A value is a type, a tuple of allowed strings (an
# enum), a dict (an object: only these keys), a one-item list (an array of it),
# or the name of a `kubernetes` client model. Required keys: REQUIRED.
_RULE_ACTIONS = ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
                 "RestartJobAndIgnoreMaxRestarts")
JOBSET_FIELDS = {
    "apiVersion": (JOBSET_API_VERSION,), "kind": ("JobSet",), "metadata": "V1ObjectMeta",
    "spec": {
        "replicatedJobs": [{"name": str, "groupName": str, "replicas": int,
                            "template": "V1JobTemplateSpec",
                            "dependsOn": [{"name": str, "status": ("Ready", "Complete")}]}],
        "network": {"enableDNSHostnames": bool, "subdomain": str, "publishNotReadyAddresses": bool},
        "successPolicy": {"operator": ("All", "Any"), "targetReplicatedJobs": [str]},
        "failurePolicy": {"maxRestarts": int,
                          "restartStrategy": ("Recreate", "BlockingRecreate", "InPlaceRestart"),
                          "rules": [{"name": str, "action": _RULE_ACTIONS,
                                     "onJobFailureReasons": [str],
                                     "onJobFailureMessagePatterns": [str],
                                     "targetReplicatedJobs": [str]}]},
        "startupPolicy": {"startupPolicyOrder": ("AnyOrder", "InOrder")},
        "coordinator": {"replicatedJob": str, "jobIndex": int, "podIndex": int},
        "volumeClaimPolicies": [{"templates": ["V1PersistentVolumeClaim"],
                                 "retentionPolicy": {"whenDeleted": ("Delete", "Retain")}}],
        "suspend": bool, "ttlSecondsAfterFinished": int, "managedBy": str}}
REQUIRED = {"spec.replicatedJobs[]": {"name", "template"}, "spec.failurePolicy.rules[]": {"action", "name"},
            "spec.successPolicy": {"operator"}, "spec.startupPolicy": {"startupPolicyOrder"},
            "spec.coordinator": {"replicatedJob"}}

_K8S = k8s_client.ApiClient()
_KUBEFLOW = KubeflowApiClient()


class _Response:  # What ApiClient.deserialize reads (kubernetes < 36, as kubeflow-training pins).

  def __init__(self, obj):
    self.data = json.dumps(obj)


def validate_model(obj, model: str, where: str = "") -> None:
  """Round-trips `obj` through a client model: an unknown or mistyped field fails."""
  api = _KUBEFLOW if model.startswith("KubeflowOrg") else _K8S
  parsed = api.deserialize(_Response(obj), model)
  back = api.sanitize_for_serialization(parsed)
  if back != obj:
    raise AssertionError(f"{where or obj.get('kind', '?')}: {model} dropped or changed fields: "
                         f"{_first_difference(obj, back)}")


def _first_difference(a, b, path=""):
  if isinstance(a, dict) and isinstance(b, dict):
    for key in list(a) + [k for k in b if k not in a]:
      if a.get(key) != b.get(key):
        return _first_difference(a.get(key), b.get(key), f"{path}.{key}")
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    for i, (x, y) in enumerate(zip(a, b)):
      if x != y:
        return _first_difference(x, y, f"{path}[{i}]")
  return f"{path.lstrip('.')}: {a!r} became {b!r}"


def check_fields(obj, table, path: str = "") -> None:
  """Checks `obj` against a field table (see JOBSET_FIELDS)."""
  where = path or "JobSet"
  if isinstance(table, str):
    validate_model(obj, table, where)
  elif isinstance(table, tuple):
    if obj not in table:
      raise AssertionError(f"{where}: {obj!r} is not one of {', '.join(table)}")
  elif isinstance(table, list):
    if not isinstance(obj, list):
      raise AssertionError(f"{where}: expected a list, got {obj!r}")
    for item in obj:
      check_fields(item, table[0], f"{path}[]")
  elif isinstance(table, dict):
    if not isinstance(obj, dict):
      raise AssertionError(f"{where}: expected an object, got {obj!r}")
    unknown = sorted(set(obj) - set(table))
    if unknown:
      raise AssertionError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(table)})")
    missing = sorted(REQUIRED.get(path, set()) - set(obj))
    if missing:
      raise AssertionError(f"{where}: required field {missing[0]!r} is missing")
    for key, value in obj.items():
      check_fields(value, table[key], f"{path}.{key}" if path else key)
  elif type(obj) is not table:  # bool is an int subclass: compare types exactly.
    raise AssertionError(f"{where}: expected {table.__name__}, got {obj!r}")


def validate_offline(obj) -> None:
  """Validates one rendered object with the models and tables above."""
  kind = obj["kind"]
  if kind == "TFJob":
    assert obj["apiVersion"] == TFJOB_API_VERSION, obj["apiVersion"]
    validate_model(obj, "KubeflowOrgV1TFJob")
  elif kind == "JobSet":
    check_fields(obj, JOBSET_FIELDS)
  else:
    validate_model(obj, CORE_MODELS[kind])
