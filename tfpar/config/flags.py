"""The central place to define tfpar's flags.

Every absl flag of `python -m tfpar.train` is a field of tfpar.config.schema's
dataclasses, defined here from it (name, default, help, enum choices) and
nowhere else; `tfpar.config.config.from_flags` turns the parsed values back into a
frozen, validated `Config` before TensorFlow initialises; nothing below the
entry point reads `FLAGS`. The planner's and the Kubernetes renderer's own
flags, which are no part of a run's config, are defined by hand below.
"""

from absl import flags

from tfpar.config import schema


def _define(define, flag_values, *args, **kwargs):
  define(*args, flag_values=flag_values, **kwargs)


class _BooleanEnumParser(flags.EnumParser):
  """An enum whose flag was once a boolean: `--flag` alone is `on`, `--noflag` is `off`.

  absl hands a boolean flag's bare and --no forms to the parser as 'true' and
  'false' (also what an old flagfile's --flag=true or --flag=false says).
  """

  def __init__(self, choices, off: str, on: str):
    super().__init__(choices)
    self.words = {"true": on, "1": on, "false": off, "0": off}

  def parse(self, argument):
    if isinstance(argument, bool):
      argument = str(argument)
    return super().parse(self.words.get(str(argument).lower(), argument))

  def flag_type(self):
    return f"[no]flag or one of {', '.join(self.enum_values)}"


class _BooleanEnumFlag(flags.Flag):
  """`--[no]flag` or `--flag=choice` (absl's boolean parsing; an enum's values)."""

  def __init__(self, name, default, help_text, choices, off, on):
    self.off = off
    super().__init__(_BooleanEnumParser(list(choices), off, on), flags.ArgumentSerializer(),
                     name, default, help_text, boolean=True)

  def _serialize(self, value):
    if value is None:
      return ""
    return f"--no{self.name}" if value == self.off else f"--{self.name}={value}"

  def _get_parsed_value_as_string(self, value):
    return None if value is None else repr(str(value))


_DEFINE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
           str: flags.DEFINE_string, tuple: flags.DEFINE_list}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagValues:
  """Defines all training flags on `flag_values` (idempotent); returns it."""
  if "train_steps" in flag_values:
    return flag_values
  for s in schema.settings():
    if s.boolean:
      flags.DEFINE_flag(_BooleanEnumFlag(s.flag, s.default, s.help, s.choices, *s.boolean),
                        flag_values)
    elif s.choices:
      _define(flags.DEFINE_enum, flag_values, s.flag, s.default, list(s.choices), s.help)
    else:
      _define(_DEFINE[s.kind], flag_values, s.flag, s.default, s.help)
  return flag_values


PLAN_FORMATS = ("text", "json")


def define_plan_flags(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagValues:
  """Defines the flags of `python -m tfpar.plan` on top of the training flags (idempotent)."""
  fv = define_flags(flag_values)
  if "cluster" in fv:
    return fv
  _define(flags.DEFINE_string, fv, "cluster", None,
          "Devices to plan for: a100-40gb:N, a100-80gb:N, h100-80gb:N, tpu-v4:N, tpu-v5p:N, "
          "cpu:N (logical CPUs of this host) or a YAML cluster file (docs/planner.md).")
  _define(flags.DEFINE_integer, fv, "top", 5, "How many plans to print.")
  _define(flags.DEFINE_string, fv, "emit_flags", None,
          "Write the best plan as a flagfile for python -m tfpar.train to this path.")
  _define(flags.DEFINE_bool, fv, "explain", False,
          "Print the cost model's formulas with the best plan's numbers substituted.")
  _define(flags.DEFINE_enum, fv, "format", "text", list(PLAN_FORMATS), "Output format.")
  _define(flags.DEFINE_enum, fv, "system", "tfpar", ["tfpar", "megatron"],
          "Layout to plan for: what tfpar runs (embedding unsplit, stages balanced by "
          "parameters) or Megatron-LM's (vocabulary-parallel embedding; for comparison).")
  _define(flags.DEFINE_float, fv, "train_tokens", None,
          "Tokens to train on: adds wall-clock time, device-hours, energy and cost to the plans.")
  _define(flags.DEFINE_float, fv, "pue", 1.1,
          "Power usage effectiveness of the data center (facility energy / IT energy) for "
          "--train_tokens' energy.")
  _define(flags.DEFINE_float, fv, "price_per_device_hour", None,
          "Price of one device for one hour (any currency) for --train_tokens' cost.")
  return fv


def parse(argv) -> flags.FlagValues:
  """Parses a list of '--name=value' strings into fresh FlagValues (tests, tools)."""
  fv = define_flags(flags.FlagValues())
  fv(['tfpar'] + list(argv))
  return fv


KINDS = ("tfjob", "jobset", "indexed-job")


def define_render_flags(flag_values: flags.FlagValues) -> flags.FlagValues:
  """Defines the flags of `python -m tfpar.k8s render` on `flag_values`; returns it."""
  fv = flag_values
  _define(flags.DEFINE_enum, fv, "kind", None, list(KINDS),
          "Workload: a Kubeflow TFJob (the operator writes TF_CONFIG), a JobSet (restarts the "
          "whole group), or an Indexed Job with a headless Service (no extra controller).")
  _define(flags.DEFINE_string, fv, "name", None,
          "Name of the job, its Service and NetworkPolicy (a DNS label: a-z, 0-9, '-').")
  _define(flags.DEFINE_integer, fv, "workers", None, "Worker pods.", lower_bound=1, upper_bound=1024)
  _define(flags.DEFINE_integer, fv, "ps", 0,
          "Parameter-server pods (--strategy=parameter_server; a chief pod is added).",
          lower_bound=0, upper_bound=256)
  _define(flags.DEFINE_string, fv, "image", None, "Container image built from the repo's Dockerfile.")
  _define(flags.DEFINE_integer, fv, "gpus_per_worker", 0, "nvidia.com/gpu limit of each worker.",
          lower_bound=0, upper_bound=16)
  _define(flags.DEFINE_string, fv, "tpu_topology", None,
          "GKE TPU slice topology, e.g. 2x4 (with --strategy=tpu and --tpu_accelerator).")
  _define(flags.DEFINE_string, fv, "tpu_accelerator", None,
          "GKE TPU accelerator node label, e.g. tpu-v5-lite-podslice.")
  _define(flags.DEFINE_string, fv, "cpu", "4", "CPU request of each pod (a Kubernetes quantity).")
  _define(flags.DEFINE_string, fv, "memory", "16Gi",
          "Memory request and limit of each pod (a Kubernetes quantity).")
  _define(flags.DEFINE_string, fv, "pvc", None,
          "A ReadWriteMany PersistentVolumeClaim mounted in every pod at --mount_path, for a "
          "local --model_dir (not needed when --model_dir is a bucket, gs://...).")
  _define(flags.DEFINE_string, fv, "mount_path", "/mnt/tfpar", "Where --pvc is mounted.")
  _define(flags.DEFINE_integer, fv, "port", 2222, "Port of TensorFlow's gRPC server in every pod.",
          lower_bound=1024, upper_bound=65535)
  _define(flags.DEFINE_integer, fv, "grace_seconds", 300,
          "terminationGracePeriodSeconds: time from SIGTERM to SIGKILL, to save a checkpoint.",
          lower_bound=30, upper_bound=3600)
  _define(flags.DEFINE_integer, fv, "max_restarts", None,
          "Whole-job restarts (JobSet failurePolicy; TFJob backoffLimit with parameter servers). "
          "Default: 3 where the kind can restart the whole job, else 0.",
          lower_bound=0, upper_bound=100)
  _define(flags.DEFINE_integer, fv, "peer_timeout", 300,
          "Seconds a pod waits for its peers' DNS names before failing (JobSet, Indexed Job).",
          lower_bound=1, upper_bound=3600)
  return fv
