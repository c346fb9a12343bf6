"""--optimizer_sharding on the data-parallel dimension of hybrid plans (zero.PlanZero).

D=2 copies x K=2 pipeline stages (zero1, zero2) and D=2 x T=2 tensor shards (zero1) on 4
logical CPUs, 5 steps of the TINY model at seq 16 (zero2 under --jit_compile: each stage's
forward and backward and each (stage, copy)'s shard update one XLA program; the others and
one device without XLA), --clip_norm=0.05 (clips every step) and --on_nonfinite=skip: each
must take one device's steps (loss, gradient norm, the first gradient through AdamW's m, the
final weights and the gathered m and v, at 1e-5).
zero3 on the 2 x 2 hybrid (each stage's weights, gradients, m and v cut by rows over its 2
copies, 2 micro-batches per copy) starts from one device's weights exactly and takes its steps.
Then checkpoints cross between the plans both ways (zero3's written from its rows, resumed on
one device), and plan.json's measured optimizer bytes per device are half the unsharded ones
(zero3's weights too). (Two worker processes under zero1:
tests/test_model_parallel.py::test_hybrid_across_two_worker_processes.)
"""

import json

import numpy as np
import pytest

from conftest import TINY, assert_same_state, assert_twin, build_engine, make_config, train_twin
from tfpar.config import rules
from tfpar.layout import placement as plan_lib
from tfpar.parallel import zero3
from tfpar.planner import clusters, cost
from tfpar.training.optimizer import inner_optimizer
from tfpar.training.checkpoint import (CanonicalCheckpointer, assign_canonical, read_canonical,
                                       read_checkpoint)

STEPS = 5  # Twinned; a sixth is trained after the checkpoints cross, a seventh skipped.
BASE = TINY + ["--seq_len=16", f"--train_steps={STEPS + 2}", "--seed=3", "--jit_compile=false",
               "--clip_norm=0.05", "--on_nonfinite=skip", "--input_sharding=data"]
HYBRID = ["--strategy=mirrored", "--num_cpu_devices=4", "--data_parallel=2",
          "--pipeline_stages=2", "--microbatches=1"]
PLANS = {"one": ["--strategy=one_device"],
         "zero1 2x2": HYBRID + ["--optimizer_sharding=zero1"],
         # Each stage's forward and backward, and each (stage, copy)'s update, under XLA.
         "zero2 2x2": HYBRID + ["--optimizer_sharding=zero2", "--jit_compile=true"],
         "zero1 D2xT2": ["--strategy=mirrored", "--num_cpu_devices=4", "--data_parallel=2",
                         "--tensor_parallel=2", "--optimizer_sharding=zero1"],
         # Weights, gradients, m and v of each stage cut by rows over its 2 copies; 2
         # micro-batches of 2 per copy.
         "zero3 2x2": ["--strategy=mirrored", "--num_cpu_devices=4", "--data_parallel=2",
                       "--pipeline_stages=2", "--microbatches=2", "--optimizer_sharding=zero3"]}


def build(args, model_dir):
  return build_engine(BASE + args + [f"--model_dir={model_dir}"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for name, args in PLANS.items():
    model_dir = tmp_path_factory.mktemp(name.replace(" ", "_"))
    out[name] = dict(train_twin(build(args, model_dir), STEPS), model_dir=model_dir)
  return out


@pytest.mark.parametrize("plan", ["zero1 2x2", "zero2 2x2", "zero1 D2xT2"])
def test_zero_on_a_2x2_hybrid_is_one_devices_twin(runs, plan):
  one, run = runs["one"], runs[plan]
  engine = run["engine"]
  assert min(one["norms"]) > engine.cfg.optim.clip_norm  # Clipping binds on every step.
  assert engine.zero.mode == plan.split()[0] and engine.num_replicas == 2
  assert not any(c.optimizer.built for c in engine.copies)  # No Keras slots: the shards hold them.
  assert len(engine.zero.updates) == 2  # One ZeroUpdate per device position (stage or shard).
  programs = [f for u in engine.zero.updates for f in u._updates]  # One per (position, copy).
  assert [getattr(f, "experimental_get_tracing_count", lambda: 0)() > 0 for f in programs] == \
      [engine.cfg.train.jit_compile] * 4
  assert_twin(run, one)
  assert int(run["final"]["optimizer/iterations"]) == STEPS


def test_zero3_on_a_2x2_hybrid_is_one_devices_twin(runs):
  """Each stage's weights, gradients, m and v sharded 1/2 over its 2 copies, each device
  making its own rows (the start is one device's, element for element: assert_twin), and
  the steps one device's (loss, norm, first gradient, final state at 1e-5)."""
  one, run = runs["one"], runs["zero3 2x2"]
  engine = run["engine"]
  assert min(one["norms"]) > engine.cfg.optim.clip_norm  # Clipping binds on every step.
  assert type(engine).__name__ == "HybridZero3Engine" and engine.num_replicas == 2
  assert engine.zero.mode == "zero3" and engine.zero.microbatches == 2
  assert not inner_optimizer(engine.optimizer).built  # No Keras slots: the rows hold them.
  assert_twin(run, one)
  assert int(run["final"]["optimizer/iterations"]) == STEPS
  # Each device holds its stage's rows of weights, m and v: half of the stage's parameters
  # (row rounding apart), as plan.json predicts.
  with open(run["model_dir"] / "plan.json") as f:
    plan = json.load(f)
  assert plan["optimizer_sharding"] == "zero3"
  unsharded = {plan_lib.device_key(d): engine.plan.params_on(k, 0) * 4
               for row in engine.plan.devices for k, stage in enumerate(row) for d in stage}
  assert len(unsharded) == 4
  for device, got in plan["measured_bytes_per_device"].items():
    assert abs(got["parameters"] / (unsharded[device] / 2) - 1) < 0.1, (device, got)
    assert abs(got["optimizer"] / got["parameters"] - 2) < 0.01, (device, got)  # m and v.
    predicted = plan["bytes_per_device"][device]
    for kind in ("parameters", "optimizer"):
      assert abs(predicted[kind] / got[kind] - 1) < 0.1, (device, kind, predicted, got)


def one_step(engine, step):
  """(loss, norm, canonical state) of step `step` + 1, from a fresh iterator at `step`."""
  losses, norms = engine.train(engine.train_iterator(step), 1)
  return float(losses[0]), float(norms[0]), read_canonical(engine.layouts[0])


def test_checkpoints_cross_between_the_hybrid_zero_plans_and_one_device(runs, tmp_path):
  """zero1 2x2's step-5 checkpoint is one device's state and resumes on one device; one
  device's resumes under zero2 2x2: the same sixth step as one device's own (1e-5)."""
  one, zero1, zero2 = (runs[p]["engine"] for p in ("one", "zero1 2x2", "zero2 2x2"))
  CanonicalCheckpointer(one.layouts, str(tmp_path / "one")).save(STEPS)
  CanonicalCheckpointer(zero1.layouts, str(tmp_path / "zero1")).save(STEPS)
  written = read_checkpoint(str(tmp_path / "zero1" / f"ckpt-{STEPS}"))
  assert_same_state(written, runs["one"]["final"], "zero1 2x2's checkpoint",
                    skip=("dropout_rng/",))
  want = one_step(one, STEPS)
  for engine, source in ((one, "zero1"), (zero2, "one")):
    assert CanonicalCheckpointer(engine.layouts, str(tmp_path / "restore")).restore(
        str(tmp_path / source / f"ckpt-{STEPS}"))
    assert engine.step == STEPS
    loss, norm, state = one_step(engine, STEPS)
    np.testing.assert_allclose([loss, norm], want[:2], rtol=1e-5)
    assert_same_state(state, want[2], f"step {STEPS + 1} from {source}'s checkpoint",
                      skip=("dropout_rng/",))


def test_a_nonfinite_step_is_skipped_on_every_copy_under_zero2(runs):
  """A NaN weight makes every gradient NaN: --on_nonfinite=skip keeps every weight, m and v
  of both copies (the gathered shards) and still counts the step."""
  engine = runs["zero2 2x2"]["engine"]
  step = engine.step
  values = read_canonical(engine.layouts[0])
  name = next(n for n in values if n.endswith("@m")).removesuffix("@m")
  values[name] = values[name].copy()
  values[name].flat[0] = np.nan
  for layout in engine.layouts:
    assign_canonical(layout, values)
  losses, norms = engine.train(engine.train_iterator(step), 1)
  assert np.isnan(losses[0]) and not np.isfinite(norms[0])
  assert engine.step == step + 1
  for layout in engine.layouts:
    after = read_canonical(layout)
    for key, want in values.items():
      if key != "optimizer/iterations" and not key.startswith("dropout_rng/"):
        np.testing.assert_array_equal(after[key], want, err_msg=key)


def test_plan_json_measures_half_the_optimizer_bytes_per_device_under_zero1(runs, tmp_path):
  """Per device, zero1's slots at D=2 are half of unsharded's (within 10%, the step counter
  apart); the runtime plan predicts them; so does the planner (tfpar.planner.cost) for the
  device it finds the busiest, within 10%."""
  build(HYBRID, tmp_path)  # Unsharded: built only (plan.json is written at start-up).
  plans = {}
  for name, model_dir in (("none", tmp_path), ("zero1", runs["zero1 2x2"]["model_dir"])):
    with open(model_dir / "plan.json") as f:
      plans[name] = json.load(f)
  assert plans["zero1"]["optimizer_sharding"] == "zero1"
  none, zero1 = (plans[n]["measured_bytes_per_device"] for n in ("none", "zero1"))
  assert sorted(none) == sorted(zero1) and len(none) == 4
  anchors = {plan_lib.device_key(row[0][0]) for row in plans["none"]["devices"]}
  for device, want in none.items():
    got = zero1[device]
    assert got["parameters"] == want["parameters"]  # The weights stay replicated.
    counter = 8 if device in anchors else 0  # AdamW's int64 step, on each copy's first device.
    assert abs((got["optimizer"] - counter) / ((want["optimizer"] - counter) / 2) - 1) < 0.1, (
        device, got, want)
    predicted = plans["zero1"]["bytes_per_device"][device]
    assert abs(predicted["optimizer"] / got["optimizer"] - 1) < 0.1, (device, predicted, got)
  cfg = runs["zero1 2x2"]["engine"].cfg
  shardings = [cost.SHARDINGS.index(z) for z in ("none", "zero1")]
  predicted = cost.evaluate(cfg.model, clusters.parse("cpu:4"), cost.Plans(
      D=np.full(2, 2), K=np.full(2, 2), T=np.ones(2, int), b=np.full(2, 2),
      remat=np.zeros(2, int), sharding=np.array(shardings)),
      global_batch=cfg.train.global_batch_size, precision="float32", system=cost.TFPAR)
  for i, measured in enumerate((none, zero1)):  # On the device (stage) it finds the busiest.
    device = min(measured, key=lambda d: abs(measured[d]["parameters"] - predicted["weights"][i]))
    for part, kind in (("weights", "parameters"), ("optimizer", "optimizer")):
      assert abs(predicted[part][i] / measured[device][kind] - 1) < 0.1, (i, part, measured)


def test_stages_on_different_workers_take_it(tmp_path):
  """A replica over whole workers (each worker its own stage's program) shards too
  (trained in tests/test_cross_worker.py's four-worker run)."""
  cfg = make_config(TINY + ["--strategy=multi_worker_mirrored", "--pipeline_stages=2",
                            "--optimizer_sharding=zero2", f"--model_dir={tmp_path}"])
  assert rules.worker_layout(cfg.parallel, 2, 2) == (2, 1)  # A replica per worker.
  assert rules.worker_layout(cfg.parallel, 4, 1) == (2, 2)  # Stages on different workers.


def test_zero3_2x2_writes_its_rows_and_one_device_resumes_them(runs, tmp_path):
  """zero3 2x2's step-5 checkpoint is written from the devices' rows (no tensor gathered),
  holds one device's state, and one device restores it to take zero3's own sixth step.
  (Last: it changes the one-device engine.)"""
  one, engine = runs["one"]["engine"], runs["zero3 2x2"]["engine"]
  checkpointer = engine.checkpointer(str(tmp_path / "zero3"))
  held = {id(x) for replica in engine.zero.slots for kind in replica.values() for x in kind}
  rows = [p for p in checkpointer.written_slices if id(p.variable) in held]
  assert not any(isinstance(p.variable, zero3.View) for p in checkpointer.written_slices)
  assert len(rows) == 3 * 2 * len(engine.zero.variables)  # w, m, v of each weight, 2 copies.
  assert all(p.size[0] < p.shape[0] for p in rows)  # Each a part of its tensor's rows.
  checkpointer.save(STEPS)
  written = read_checkpoint(str(tmp_path / "zero3" / f"ckpt-{STEPS}"))
  assert_same_state(written, runs["one"]["final"], "zero3 2x2's checkpoint",
                    skip=("dropout_rng/",))
  want = one_step(engine, STEPS)
  assert CanonicalCheckpointer(one.layouts, str(tmp_path / "restore")).restore(
      str(tmp_path / "zero3" / f"ckpt-{STEPS}"))
  assert one.step == STEPS
  loss, norm, state = one_step(one, STEPS)
  np.testing.assert_allclose([loss, norm], want[:2], rtol=1e-5)
  assert_same_state(state, want[2], f"step {STEPS + 1} from zero3's checkpoint",
                    skip=("dropout_rng/",))
