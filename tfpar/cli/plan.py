"""Plan a large run before renting it: `python -m tfpar.plan --flagfile=X.flags --cluster=CLUSTER`.

Reads the model from the same flags `tfpar.train` takes, searches every data
x pipeline x tensor degree, micro-batch size, recompute mode (none, full,
selective), pipeline schedule, optimizer sharding (none, zero1, zero2) and
sequence parallelism (off, on with T > 1) the cluster allows (tensor shards
inside a node, pipeline stages across nodes), and prints the fastest plans
that fit, with predicted memory per device, the step time split into its
parts, tokens/s, TFLOP/s per device and MFU, and why the others lose. Given
--data_parallel, --pipeline_stages, --tensor_parallel, --microbatches,
--remat, --pipeline_schedule, --virtual_stages, --optimizer_sharding or
--sequence_parallel, it evaluates only plans with those values.

  python -m tfpar.plan --flagfile=configs/gpt_tiny.flags --cluster=a100-80gb:64 --top=5
  python -m tfpar.plan ... --format=json            # machine-readable
  python -m tfpar.plan ... --explain                # the formulas with numbers
  python -m tfpar.plan ... --emit_flags=best.flags  # then: python -m tfpar.train --flagfile=best.flags
  python -m tfpar.plan ... --train_tokens=300e9 --price_per_device_hour=2.5  # time, energy, cost

The cost model is tfpar.planner.cost (formulas and sources in docs/planner.md).
Bad input ends with one line on stderr and exit status 2.
"""

import functools
import json
import os
import sys
import time

from absl import app, flags

from tfpar.config import config as config_lib
from tfpar import console
from tfpar.cli import tool
from tfpar.config import flags as tfpar_flags
from tfpar.config.schema import ConfigError
from tfpar.planner import clusters, cost, report, search

tfpar_flags.define_plan_flags()
FLAGS = flags.FLAGS

# Flags that a plan sets (the rest of the user's training flags are copied as given).
PLAN_FLAGS = ("strategy", "num_cpu_devices", "data_parallel", "pipeline_stages", "tensor_parallel",
              "microbatches", "remat", "global_batch_size", "stage_layers", "pipeline_schedule",
              "virtual_stages", "optimizer_sharding", "sequence_parallel")


class PlanError(ValueError):
  """Input the planner cannot plan for; the message says what would work."""


fail = functools.partial(tool.fail, "plan")


def fixed_degrees(fv) -> dict:
  """The degrees the user gave explicitly: the planner evaluates only plans with them."""
  given = lambda name: fv[name].present
  system = cost.SYSTEMS[fv.system]
  if given("optimizer_sharding") and fv.optimizer_sharding not in system.shardings:
    raise PlanError(f"--optimizer_sharding={fv.optimizer_sharding} is not in --system="
                    f"{fv.system}'s runtime (it shards with {', '.join(system.shardings)}): "
                    "pass one of those")
  if given("remat") and fv.remat == "full" and fv.dropout > 0 and system is cost.TFPAR:
    raise PlanError(f"--remat=full with --dropout={fv.dropout}: tfpar's recomputed blocks would "
                    "draw other dropout masks than the forward did, so tfpar.train refuses it; "
                    "use --remat=selective, --dropout=0, or --system=megatron")
  schedule = fv.pipeline_schedule if given("pipeline_schedule") else None
  if given("virtual_stages") and fv.virtual_stages > 1 and schedule not in (None, "interleaved"):
    raise PlanError(f"--virtual_stages={fv.virtual_stages} needs --pipeline_schedule=interleaved "
                    f"(not {schedule}): drop one of them")
  return dict(data_parallel=fv.data_parallel if given("data_parallel") else None,
              pipeline_stages=fv.pipeline_stages if given("pipeline_stages") else None,
              tensor_parallel=fv.tensor_parallel if given("tensor_parallel") else None,
              microbatches=fv.microbatches if given("microbatches") else None,
              remat=fv.remat if given("remat") else None,
              pipeline_schedule=schedule,
              virtual_stages=fv.virtual_stages if given("virtual_stages") else None,
              optimizer_sharding=fv.optimizer_sharding if given("optimizer_sharding") else None,
              sequence_parallel=fv.sequence_parallel if given("sequence_parallel") else None)


def plan(m, cluster, *, global_batch, precision, system, fixed) -> search.Ranked:
  """Searches (or evaluates the fixed plan); raises PlanError when nothing can run or fit."""
  start = time.perf_counter()
  plans = search.candidates(m, cluster, global_batch, system, precision=precision, **fixed)
  if not len(plans):  # The first rule the fixed values break, and its fix.
    raise PlanError(search.refusal(m, cluster, global_batch, system, fixed, precision))
  ranked = search.rank(m, cluster, plans, global_batch=global_batch, precision=precision,
                       system=system)
  if not ranked.results["fits"].any():
    raise PlanError(nothing_fits(m, cluster, ranked, global_batch, precision, system, fixed))
  ranked.seconds = time.perf_counter() - start
  return ranked


def nothing_fits(m, cluster, ranked, global_batch, precision, system, fixed) -> str:
  """One line: the smallest footprint found, and how many such devices (or how much memory) would do."""
  smallest = ranked.row(ranked.order[0])
  need = smallest["memory_bytes_per_device"]
  line = (f"{console.count(m.num_layers, 'block')} of d_model={m.d_model} "
          f"{'does' if m.num_layers == 1 else 'do'} not fit on {cluster.name}: the "
          f"smallest plan ({report.degrees(smallest)}) needs {need / 2 ** 30:.1f} GiB per device, "
          f"a device has {cluster.memory_bytes / 2 ** 30:.1f} GiB")
  n = cluster.devices
  if system is cost.TFPAR and cluster.kind == "tpu":
    # tfpar on TPUs is data parallel: a replica never spans more than one chip.
    return line + (f"; tfpar runs only data parallelism on TPUs: use chips with >= "
                   f"{need / 2 ** 30:.0f} GiB, or a smaller model")
  for _ in range(16):  # Up to 65,536x the devices.
    n *= 2
    bigger = clusters.Cluster(**{**cluster.__dict__, "devices": n, "name": f"{n} devices"})
    plans = search.candidates(m, bigger, global_batch, system, precision=precision, **fixed)
    if len(plans) and cost.evaluate(m, bigger, plans, global_batch=global_batch,
                                    precision=precision, system=system)["fits"].any():
      return line + f"; it fits on {n} such devices, or on devices with >= {need / 2 ** 30:.0f} GiB"
  return line + f"; use devices with >= {need / 2 ** 30:.0f} GiB"


def check_writable(path: str) -> None:
  """--emit_flags' directory must exist (through tf.io.gfile: gs:// works too)."""
  console.import_tensorflow_quietly()
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  parent = os.path.dirname(path)
  if tf.io.gfile.isdir(path):
    raise PlanError(f"--emit_flags={path} is a directory: name the flagfile to write")
  if parent and not tf.io.gfile.isdir(parent):
    raise PlanError(f"--emit_flags={path}: the directory {parent} does not exist: create it "
                    "or write the flagfile elsewhere")


# What the cost model is built for, far past any model trained today (GPT-3: 96 blocks of
# 12,288, 2,048 tokens); past these its arrays (one entry per block split) outgrow memory.
LIMITS = {"num_layers": 4096, "d_model": 2 ** 20, "d_ff": 2 ** 22, "num_heads": 2 ** 16,
          "seq_len": 2 ** 24, "vocab_size": 2 ** 24, "global_batch_size": 2 ** 24, "top": 10 ** 4,
          "virtual_stages": 4096, "train_tokens": 1e18}
DEGREES = ("data_parallel", "pipeline_stages", "tensor_parallel", "microbatches", "virtual_stages")


def _check_sizes(fv) -> None:
  for name, most in LIMITS.items():
    if fv[name].value is not None and fv[name].value > most:
      raise PlanError(f"--{name}={fv[name].value} is past what the planner models (at most "
                      f"{most:,}): pass a smaller value")
  for name in DEGREES:
    if fv[name].present and fv[name].value is not None and fv[name].value <= 0:
      raise PlanError(f"--{name}={fv[name].value} must be positive: drop it to let the "
                      f"planner search, or pass e.g. --{name}=2")


def add_training_run(fv, m, cluster, ranked: search.Ranked) -> None:
  """--train_tokens: each plan's wall-clock time, device-hours, energy and cost, in its results."""
  if fv.train_tokens is None:
    return
  ranked.results.update(cost.training_run(
      ranked.results, cluster.devices, cluster, global_batch=fv.global_batch_size,
      seq_len=m.seq_len, train_tokens=fv.train_tokens, pue=fv.pue,
      price_per_device_hour=fv.price_per_device_hour))  # Every plan uses every device.


def _check_training_run(fv, cluster) -> None:
  for name in ("train_tokens", "price_per_device_hour"):
    if fv[name].value is not None and not 0 < fv[name].value < float("inf"):
      raise PlanError(f"--{name}={fv[name].value:g} must be positive, e.g. --{name}="
                      f"{'300e9' if name == 'train_tokens' else '2.5'}")
  if not 1 <= fv.pue <= 10:
    raise PlanError(f"--pue={fv.pue:g} must be between 1 (no facility overhead) and 10; "
                    "typical: 1.1 (Google) to 1.6 (average data center)")
  if fv.price_per_device_hour is not None and fv.train_tokens is None:
    raise PlanError("--price_per_device_hour prices a run: give its length with --train_tokens")
  if fv.train_tokens is not None and cluster.power_watts is None:
    raise PlanError(f"--cluster={fv.cluster} has no published device power for --train_tokens' "
                    "energy: use a YAML cluster file with power_watts (docs/planner.md)")


def answer(fv):
  """Validates the flags and plans: (model, cluster, system, ranked plans).

  Raises:
    ConfigError, ClusterError or PlanError: one line naming the flag and the fix.
  """
  if not fv.cluster:
    raise PlanError("--cluster is not set: pass e.g. --cluster=a100-80gb:64 or a YAML file")
  _check_sizes(fv)
  m = config_lib.model_from_flags(fv)
  if fv.global_batch_size <= 0:
    raise PlanError(f"--global_batch_size={fv.global_batch_size} must be positive")
  if fv.top <= 0:
    raise PlanError(f"--top={fv.top} must be positive")
  cluster = clusters.parse(fv.cluster)
  system = cost.SYSTEMS[fv.system]
  if cost.COMPUTE_DTYPE[fv.precision] not in cluster.peak_flops:
    raise PlanError(f"--cluster={fv.cluster} gives no peak_flops for "
                    f"{cost.COMPUTE_DTYPE[fv.precision]} (--precision={fv.precision})")
  if fv.emit_flags and system is not cost.TFPAR:
    raise PlanError("--emit_flags writes tfpar flags: use it with --system=tfpar")
  _check_training_run(fv, cluster)
  fixed = fixed_degrees(fv)
  if fv.emit_flags:
    check_writable(fv.emit_flags)
  ranked = plan(m, cluster, global_batch=fv.global_batch_size, precision=fv.precision,
                system=system, fixed=fixed)
  add_training_run(fv, m, cluster, ranked)
  return m, cluster, system, ranked


def main(argv):
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}: flags are written --name=value")
  # Planning is pure Python. A YAML --cluster and --emit_flags go through tf.io.gfile (gs://
  # works too), so only then is TensorFlow imported: quietly, first.
  if FLAGS.emit_flags or clusters.is_file(FLAGS.cluster or ""):
    console.import_tensorflow_quietly(FLAGS.verbosity if FLAGS["verbosity"].present else None)
  try:
    m, cluster, system, ranked = answer(FLAGS)
  except (ConfigError, clusters.ClusterError, PlanError) as e:
    fail(str(e))
  best = ranked.row(ranked.order[0])
  if FLAGS.format == "json":
    print(json.dumps(report.to_json(m, cluster, ranked, FLAGS.top, FLAGS.precision, system),
                     indent=2))
  else:
    print(report.text(m, cluster, ranked, FLAGS.top, FLAGS.precision, system))
    if FLAGS.explain:
      print(report.explain(m, cluster, ranked, FLAGS.precision, system))
  if FLAGS.emit_flags:
    # The user's training flags as given; the plan sets its own (planner flags are not copied).
    training = tfpar_flags.define_flags(flags.FlagValues())
    given = [FLAGS[name].serialize() for name in training
             if name not in PLAN_FLAGS and FLAGS[name].present]
    path = report.write_flagfile(FLAGS.emit_flags, given, best, cluster)
    print(f"wrote {path}: python -m tfpar.train --flagfile={path}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main, flags_parser=tool.app_flags_parser(fail))
