"""Pipeline stages on different worker processes train exactly like one device.

Real processes on 127.0.0.1 (tfpar.launch), started with the session's first
test (conftest.EARLY) and shared by every test here:

  two     2 workers x 1 stage each, each stage tensor-parallel over its
          worker's 2 logical CPUs (D=1 x K=2 x T=2), 1F1B over M=4
          micro-batches, XLA on, 4 steps: one program per worker
          (tfpar.engines.stage_worker);
  eight   8 workers as D=2 x K=4 (4 blocks, one per stage), GPipe over M=2,
          XLA off, --optimizer_sharding=zero1 (each copy of a stage updates its
          shard of m and v after the copies' sum), 4 steps: one program per
          worker;
  four    4 workers as D=2 x K=2, interleaved 1F1B over v=2 chunks per stage
          (4 blocks), XLA off, --optimizer_sharding=zero2, one program per
          worker: each copy of a stage keeps its shard of m and v, reduce-
          scatters the gradient with its copy (collective sums, chunk by
          chunk) and all-gathers the new weights; resumed at step 2 from the
          step-2 checkpoint of `zero3` (zero3 on 4 mirrored replicas in one
          process, 4 steps, XLA on);
  bf16    4 workers as D=2 x K=2, 1F1B, --precision=mixed_bfloat16 (XLA
          off: its default) and --grad_compression=powersgd, 4 steps, one
          program per worker: PowerSGD's two sums among each stage's copies
          by collectives, each worker holding its own matrices' residuals and Q.

D=2 copies run under GPipe in `eight` (K=4: a first, two middle and a last
stage, the tied embedding's sum between the first and the last) and in `vit`
(K=2, an untied model), under interleaved 1F1B in `four` and under 1F1B in
`bf16` (D=2 x K=2 all three). (`bf16` under GPipe was not held by its
in-worker twin at 1e-4: its step-3 gradient norm 2.4e-4 apart, the loss
within 1e-5; not looked into, so `bf16` stays under 1F1B.)
Each of `two`, `eight` and `four` is held to one device's loss per step at
relative 1e-5 and its gradient norm at 1e-4; their final weights and AdamW
slots (zero2's gathered from its shards, each written by the workers that
hold them, each its own slices) to one device's; the 2-worker run's step-2
checkpoint restores on one device and trains on to the same losses. The
restore chain zero3 x 4 -> `four` -> one device -> zero1 x 2: `zero3`'s
steps are one device's, `four` resumes its checkpoint (cut into each copy's
zero2 shards) to one device's steps and final state, and one device and
then zero1 x 2 restore the previous hop's checkpoint in the test's process
unchanged, bit for bit. `bf16` is held to the same plan inside one
worker (`bf16_in_worker`: 4 logical CPUs, the codec in replica context) at
the same tolerances, its whole final state too (each copy's PowerSGD
residual and Q included): it also holds the plain float32 sum among the
copies of a stage (PowerSGD's vectors go through it) and the unsharded
AdamW update of D=2 copies.

  vit     the ViT classifier on the digits (tests/test_vit.py's flags), 4
          workers as D=2 x K=2, GPipe over M=2, one program per worker:
          held to one device's loss per step (1e-5), gradient norm (1e-4) and
          held-out loss and accuracy (its eval outputs, per-example tensors,
          summed over the job from the last stage's worker).

  faults  2 workers x 1 stage, GPipe, XLA off, under `tfpar.launch
          --max_restarts=1`, each worker its own program: SIGTERM to worker 1
          (not the chief) at step 3, then, once the job has restarted and
          trained 2 steps on, SIGKILL to the new worker 1.

The SIGTERM must end in a save at a step both workers agree on, exit 75 from
both tasks and an uncounted restart that resumes at the next step; the
SIGKILL in the one counted restart of the whole job, which resumes from that
checkpoint again and finishes. Its metrics hold every step once, each at one
device's loss (1e-5) and gradient norm (1e-4).
"""

import glob
import json
import os
import re
import shutil
import signal

import numpy as np
import pytest

from conftest import (TINY, assert_same_state, build_engine, read_metrics, run_modules,
                      train_in_process)
from test_launch import Launched, assert_every_line_prefixed, group_alive
from test_vit import VIT

STEPS = 4
BASE = TINY + [f"--train_steps={STEPS}", "--eval_every=0", "--checkpoint_every=2"]
CROSS = ["--strategy=multi_worker_mirrored", "--pipeline_stages=2"]
# The same plans inside one worker, on its logical CPUs (their twins under compression).
IN_WORKER = ["--strategy=mirrored", "--num_cpu_devices=4", "--pipeline_stages=2"]
NO_XLA = ["--jit_compile=false"]
# Each run's schedule (plan.json names it); interleaving cuts 4 blocks into K x v = 4 chunks.
# Tensor 2 inside each worker (its 2 logical CPUs) x pipeline 2 across workers.
TWO = CROSS + ["--num_cpu_devices=2", "--tensor_parallel=2", "--microbatches=4",
               "--pipeline_schedule=1f1b"]
FOUR_MODEL = ["--num_layers=4"] + NO_XLA
FOUR = ["--microbatches=2", "--pipeline_schedule=interleaved", "--virtual_stages=2",
        "--optimizer_sharding=zero2"] + FOUR_MODEL
# Four stages, each copy's on 4 workers of its own (D=2 x K=4: 8 processes), against one_nojit.
EIGHT = ["--strategy=multi_worker_mirrored", "--pipeline_stages=4", "--microbatches=2",
         "--pipeline_schedule=gpipe", "--optimizer_sharding=zero1"] + FOUR_MODEL
# zero3 on 4 mirrored replicas in one process; `four` resumes its step-2 checkpoint. Its
# per-replica steps compiled (XLA): the suite's one zero3 run under XLA. 71 s of CPU for the
# run, 46 s without XLA (168 s without before bb51fc6, whose sums walked the step's graph;
# `/usr/bin/time python -m tfpar.train` with these flags, one run each, 6 Dec 2026).
ZERO3 = FOUR_MODEL + ["--strategy=mirrored", "--num_cpu_devices=4", "--optimizer_sharding=zero3",
                      "--jit_compile=true"]
# bf16 precision (XLA off: its default) and PowerSGD (rank 2, every matrix, error feedback
# carried), D=2 x K=2 across 4 workers and in one.
# Both sides without XLA's auto-clustering (mirrored's bf16 default; refused across workers).
BF16 = ["--precision=mixed_bfloat16", "--xla_auto_clustering=none", "--grad_compression=powersgd",
        "--powersgd_rank=2", "--powersgd_min_size=0", "--microbatches=2",
        "--pipeline_schedule=1f1b"]


# The ViT on the digits (tests/test_vit.py) over 4 workers as D=2 x K=2, against one device.
VIT_CROSS = ["--strategy=multi_worker_mirrored", "--pipeline_stages=2", "--microbatches=2"]


# Steps enough that the chief's save (within a second of the server's SIGTERM, the relay's
# poll: ~10 steps of ~40 ms here) and the kill 2 steps after the restart land before the end.
FAULT_STEPS = 100
FAULTS = TINY + [f"--train_steps={FAULT_STEPS}", "--eval_steps=0", "--checkpoint_every=1000"] + \
    NO_XLA


def drop_checkpoint(model_dir, step):
  """Removes ckpt-`step` (restore then takes the newest one left)."""
  for path in glob.glob(os.path.join(model_dir, "checkpoints", f"ckpt-{step}.*")):
    os.remove(path)


def launch_args(num_workers, args):
  return [f"--num_workers={num_workers}", "--"] + BASE + args


def run_cross_worker(tmp_path):
  """({name: model_dir}, the launchers' output) of the module docstring's runs."""
  names = ("two", "one_nojit", "bf16", "bf16_in_worker", "zero3", "four", "eight")
  dirs = {name: str(tmp_path / name) for name in names}
  first = run_modules([
      ("tfpar.launch", launch_args(2, TWO + [f"--model_dir={dirs['two']}"]), {"timeout": 600}),
      ("tfpar.train", BASE + FOUR_MODEL + [f"--model_dir={dirs['one_nojit']}"],
       {"timeout": 600}),
      ("tfpar.launch", launch_args(4, CROSS + BF16 + [f"--model_dir={dirs['bf16']}"]),
       {"timeout": 600}),
      ("tfpar.train", BASE + IN_WORKER + BF16 + [f"--model_dir={dirs['bf16_in_worker']}"],
       {"timeout": 600}),
      ("tfpar.train", BASE + ZERO3 + [f"--model_dir={dirs['zero3']}"], {"timeout": 600})],
                      at_once=5)
  for proc in first:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  shutil.copytree(dirs["zero3"], dirs["four"])
  drop_checkpoint(dirs["four"], STEPS)
  dirs["vit"] = str(tmp_path / "vit")
  four, eight, vit = run_modules([
      ("tfpar.launch", launch_args(4, CROSS + FOUR + [f"--model_dir={dirs['four']}"]),
       {"timeout": 600}),
      ("tfpar.launch", launch_args(8, EIGHT + [f"--model_dir={dirs['eight']}"]),
       {"timeout": 600}),
      ("tfpar.launch", ["--num_workers=4", "--"] + VIT + VIT_CROSS +
       [f"--model_dir={dirs['vit']}"], {"timeout": 600})], at_once=3)
  for proc in (four, eight, vit):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return dirs, {"four": four.stdout + four.stderr, "bf16": first[2].stdout + first[2].stderr,
                "two": first[0].stdout + first[0].stderr, "eight": eight.stdout + eight.stderr,
                "vit": vit.stdout + vit.stderr}


def run_stage_worker_faults(tmp_path):
  """The module docstring's faults run: (the launcher's exit status, its Launched, model_dir)."""
  model_dir = str(tmp_path / "faults")
  job = Launched(["--num_workers=2", "--max_restarts=1", "--restart_backoff=0.5", "--",
                  *FAULTS, *CROSS, "--microbatches=2", f"--model_dir={model_dir}"])
  try:
    job.wait_for(r"^\[worker 0\] step +3/", timeout=400)
    os.kill(job.task_pids()["worker 1"][0], signal.SIGTERM)
    resumed = job.wait_for(r"^\[worker 0\] resumed from .* at step (\d+)$", timeout=400)
    job.wait_for(rf"^\[worker 0\] step +{int(resumed.group(1)) + 2}/", timeout=400)
    os.kill(job.task_pids()["worker 1"][1], signal.SIGKILL)
    code = job.finish(timeout=400)
  finally:
    job.cleanup()
  return code, job, model_dir


@pytest.fixture(scope="module")
def cross_worker_runs(early_runs):
  return early_runs["cross_worker_runs"].result()


@pytest.fixture(scope="module")
def stage_worker_faults(early_runs):
  return early_runs["stage_worker_faults"].result()


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp("one_device"))
  train_in_process(BASE + [f"--model_dir={model_dir}"])
  return model_dir


def assert_same_steps(model_dir, reference_dir, steps):
  """Both runs logged steps 1..STEPS, and `steps` of them at the same loss and gradient norm."""
  got = {r["step"]: r for r in read_metrics(model_dir)}
  want = {r["step"]: r for r in read_metrics(reference_dir)}
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
    np.testing.assert_allclose([got[s][key] for s in steps], [want[s][key] for s in steps],
                               rtol=rtol, err_msg=key)


def test_tensor_2_in_each_of_two_workers_x_pipeline_2_matches_one_device(cross_worker_runs,
                                                                          one_device):
  dirs, outs = cross_worker_runs
  assert "one program per worker, stages ['worker:0', 'worker:1']" in outs["two"]
  assert "D=1 x K=2 x T=2, M=4, 1f1b" in outs["two"]
  assert "stage 1: blocks 1-1 + head, 8,608 params on [worker:1/CPU:0 worker:1/CPU:1]" in \
      outs["two"]
  assert_same_steps(dirs["two"], one_device, range(1, STEPS + 1))


@pytest.mark.parametrize("name,stages,plan,tasks,zero", [
    ("eight", "['worker:0', 'worker:1', 'worker:2', 'worker:3']", "D=2 x K=4 x T=1, M=2, gpipe",
     8, "zero1"),
    ("four", "['worker:0', 'worker:1']", "D=2 x K=2 x T=1, M=2, interleaved v=2", 4, "zero2")])
def test_eight_and_four_workers_each_in_its_own_program_match_one_device(
    cross_worker_runs, name, stages, plan, tasks, zero):
  """D=2 x K=4 under GPipe and zero1 on 8 workers, and D=2 x K=2 interleaved under zero2 (steps 1-2
  zero3 x 4's, then resumed from its step-2 checkpoint), each worker its own program: one
  device's losses, gradient norms and final checkpoint (written from the workers' parts:
  weights, AdamW slots, step)."""
  from tfpar.training.checkpoint import read_checkpoint  # pylint: disable=import-outside-toplevel
  dirs, outs = cross_worker_runs
  assert f"one program per worker, stages {stages}" in outs[name]
  assert plan in outs[name] and f"optimizer {zero}" in outs[name]
  assert f"job succeeded ({tasks} tasks)" in outs[name]
  assert_same_steps(dirs[name], dirs["one_nojit"], range(1, STEPS + 1))
  got, want = (read_checkpoint(os.path.join(dirs[n], "checkpoints", f"ckpt-{STEPS}"))
               for n in (name, "one_nojit"))
  assert sorted(got) == sorted(want)
  assert_same_state(got, want, f"{name}: {tasks} workers vs one device at the last step")


def test_a_vision_task_across_workers_trains_and_evaluates_as_one_device(cross_worker_runs,
                                                                        tmp_path):
  """--task=classify, D=2 x K=2 on 4 workers under GPipe, each its own program: one
  device's loss per step, gradient norm and held-out loss and accuracy (each copy's last
  stage's worker computes its per-example outputs, every worker gets them by one sum over
  the job)."""
  dirs, outs = cross_worker_runs
  assert "D=2 x K=2 x T=1, M=2, gpipe" in outs["vit"]
  assert "one program per worker, stages ['worker:0', 'worker:1']" in outs["vit"]
  reference = str(tmp_path / "vit_one_device")
  train_in_process(VIT + [f"--model_dir={reference}"])
  got, want = read_metrics(dirs["vit"]), read_metrics(reference)
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
  for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=rtol,
                               err_msg=key)
  (got,), (want,) = (read_metrics(d, "eval") for d in (dirs["vit"], reference))
  assert got["accuracy"] == want["accuracy"] and sorted(got) == sorted(want)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


def test_plan_says_which_worker_holds_which_stage_under_which_schedule(cross_worker_runs):
  dirs, outs = cross_worker_runs
  four_out = outs["four"]
  for name, workers, schedule, chunks in (
      ("two", [["worker:0", "worker:1"]], "1f1b", 1),
      ("four", [["worker:0", "worker:1"], ["worker:2", "worker:3"]], "interleaved", 2)):
    with open(os.path.join(dirs[name], "plan.json")) as f:
      plan = json.load(f)
    assert plan["stage_workers"] == workers
    assert plan["data_parallel"] == len(workers)
    assert (plan["schedule"], plan["virtual_stages"]) == (schedule, chunks)
    # The chief's peak beside what the plan puts on its own devices (its stage, not nothing).
    chief = plan["process_memory"]["worker 0"]
    own = sum(b["parameters"] + b["optimizer"] for d, b in plan["bytes_per_device"].items()
              if d.startswith("worker:0/"))
    assert own < chief["predicted_host_bytes"] < chief["peak_rss_bytes"], chief
  assert "schedule interleaved over v=2 chunks per stage" in four_out
  assert "stage 1: blocks 1-1, 3-3 + head" in four_out  # Chunks 1 and 3 on worker 1 (and 3).
  assert "[worker:1/CPU:0 | worker:3/CPU:0]" in four_out
  assert "job succeeded (4 tasks)" in four_out


def test_two_workers_final_weights_and_slots_are_one_devices(cross_worker_runs, one_device):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  dirs, _ = cross_worker_runs
  got, want = (tf.train.load_checkpoint(os.path.join(d, "checkpoints", f"ckpt-{STEPS}"))
               for d in (dirs["two"], one_device))
  names = [n for n in want.get_variable_to_shape_map() if n.startswith("state/")]
  assert sorted(got.get_variable_to_shape_map()) == sorted(want.get_variable_to_shape_map())
  assert len(names) > 50
  for name in names:
    a, b = got.get_tensor(name), want.get_tensor(name)
    if "attn.Skey.Sbias" in name:
      # Softmax ignores a shift shared by all keys: this bias's gradient is 0 in exact
      # arithmetic, so it and its slots are rounding noise (~1e-7) in both runs.
      assert max(np.abs(a).max(), np.abs(b).max()) < 1e-5, name
      continue
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=name)


def test_restore_chain_zero3_x4_workers_one_device_zero1_x2(cross_worker_runs, tmp_path):
  """zero3 x 4 -> D=2 x K=2 across 4 workers under zero2 -> one device -> zero1 x 2.

  zero3 x 4's steps are one device's. The first hop: `four` resumes its step-2 checkpoint
  (canonical: each worker reads the slots of its own weights whole and keeps its zero2 shard)
  and its steps 3-4 and final state are one device's (the test above). Then one device
  and zero1 x 2 each restore the previous hop's checkpoint in this process, and the state
  arrives unchanged: weights, AdamW slots and step, bit for bit.
  """
  from tfpar.training.checkpoint import read_checkpoint  # pylint: disable=import-outside-toplevel
  from test_sharded_state import canonical  # pylint: disable=import-outside-toplevel
  dirs, outs = cross_worker_runs
  assert f"resumed from {dirs['four']}/checkpoints/ckpt-2 at step 2" in outs["four"]
  assert "optimizer zero2" in outs["four"]
  with open(os.path.join(dirs["zero3"], "plan.json")) as f:  # four's own plan is in four/.
    assert json.load(f)["optimizer_sharding"] == "zero3"
  assert_same_steps(dirs["zero3"], dirs["one_nojit"], range(1, STEPS + 1))
  path = os.path.join(dirs["four"], "checkpoints", f"ckpt-{STEPS}")
  want = read_checkpoint(path)
  for name, args in (("one", ["--strategy=one_device"]),
                     ("zero1_2", ["--strategy=mirrored", "--num_cpu_devices=2",
                                  "--optimizer_sharding=zero1"])):
    engine = build_engine(BASE + FOUR_MODEL + args + [f"--model_dir={tmp_path / name}"])
    assert engine.checkpointer(str(tmp_path / name)).restore(path) == path
    for copy in range(len(engine.layouts)):
      got = canonical(engine, copy)
      assert sorted(got) == sorted(want), name
      for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=f"{name} {key}")
    path = engine.checkpointer(str(tmp_path / name)).save(STEPS)


def test_bf16_and_powersgd_across_workers_are_as_in_one_worker_and_train(cross_worker_runs):
  """mixed_bfloat16 and PowerSGD, D=2 x K=2: across 4 workers as on one worker's CPUs.

  The same ops in the same order on the same kind of device (XLA off, bf16's
  default; a sum of two copies is the same in either order): held to the
  float32 twins' tolerances, not a bf16 one.
  """
  from tfpar.training.checkpoint import read_checkpoint  # pylint: disable=import-outside-toplevel
  dirs, outs = cross_worker_runs
  assert "D=2 x K=2 x T=1, M=2, 1f1b" in outs["bf16"] and "xla off" in outs["bf16"]
  assert_same_steps(dirs["bf16"], dirs["bf16_in_worker"], range(1, STEPS + 1))
  records = read_metrics(dirs["bf16"])  # Bytes one replica hands on: P and Q.
  assert all(r["comm_bytes"] < r["comm_bytes_uncompressed"] / 3 for r in records), records
  losses = [r["loss"] for r in records]
  assert losses[-1] < losses[0] - 0.05, losses
  # The whole final state: weights, AdamW's slots, and each copy's residual and Q.
  got, want = (read_checkpoint(os.path.join(dirs[name], "checkpoints", f"ckpt-{STEPS}"))
               for name in ("bf16", "bf16_in_worker"))
  errors = got["compression/powersgd@error"]
  assert errors.shape[0] == 2 and np.abs(errors[0] - errors[1]).max() > 1e-4
  assert_same_state(got, want, "across 4 workers vs in one at the last step")


def test_cross_worker_checkpoint_restores_on_one_device(cross_worker_runs, one_device, tmp_path,
                                                        capsys):
  dirs, _ = cross_worker_runs
  model_dir = str(tmp_path / "restored")
  shutil.copytree(dirs["two"], model_dir)
  drop_checkpoint(model_dir, STEPS)
  train_in_process(BASE + [f"--model_dir={model_dir}"])
  assert f"resumed from {model_dir}/checkpoints/ckpt-2 at step 2" in capsys.readouterr().out
  assert_same_steps(model_dir, one_device, range(1, STEPS + 1))


def test_a_stage_worker_s_sigterm_saves_and_its_kill_9_restarts_the_whole_job(
    stage_worker_faults, tmp_path):
  code, job, model_dir = stage_worker_faults
  out = job.output
  assert code == 0, out[-4000:]
  # SIGTERM: both workers agree on the step after the chunk, both save and exit 75 (each worker
  # runs its own program: tfpar.engines.stage_worker, and writes its own stage's slices).
  saved = re.search(r"^\[worker 0\] tfpar: preempted \(SIGTERM\), saved .*ckpt-(\d+) at step "
                    r"(\d+); the next start resumes at step (\d+)$", out, re.M)
  assert saved, out[-4000:]
  step = int(saved.group(2))
  assert int(saved.group(1)) == step and int(saved.group(3)) == step + 1
  assert 3 <= step < FAULT_STEPS - 2
  assert re.search(rf"^\[worker 1\] tfpar: worker 1: preempted \(SIGTERM\), saved its part at "
                   rf"step {step}; the next start resumes at step {step + 1}$", out, re.M), out
  # Both exited 75; the launcher restarts at once (not counted).
  assert re.search(r"^tfpar\.launch: (worker \d, )*worker \d exited with status 75: every task "
                   r"saved; restarting the job \(a preemption restart, not counted in "
                   r"--max_restarts\)", out, re.M), out[-4000:]
  # SIGKILL: the one counted restart of the whole job; both starts resume at the saved step.
  assert "tfpar.launch: worker 1 was killed by SIGKILL: stopped every task; restarting the job " \
         "(restart 1 of 1, in 0.5 s)" in out
  # The chief's one line names the peer and what TensorFlow said of it (e.g.
  # "UnavailableError: recvmsg:Connection reset by peer"), not its "<stack traces unavailable>".
  error = re.search(r"^\[worker 0\] tfpar\.train: error: worker 0 waited for worker 1 "
                    r"\(127\.0\.0\.1:\d+\), which stopped answering: "
                    r"(Unavailable|Aborted|Cancelled|DeadlineExceeded)Error: (.+?)\. The latest "
                    r"checkpoint is intact", out, re.M)
  assert error, out[-4000:]
  assert re.search(r"reset|closed|refused|connect|socket|unavailable|abort", error.group(2),
                   re.I) and "stack trace" not in error.group(2), error.group(0)
  assert re.findall(r"^\[worker 0\] resumed from .*ckpt-(\d+) at step (\d+)$", out, re.M) == \
      [(str(step), str(step))] * 2
  assert "tfpar.launch: job succeeded (2 tasks)" in out
  for attempts in job.task_pids().values():
    assert len(attempts) == 3 and not any(group_alive(pid) for pid in attempts)
  assert_every_line_prefixed(job)
  # Every step once, each one device's (GPipe across workers is the serial twin).
  reference = str(tmp_path / "one_device")
  train_in_process(FAULTS + [f"--model_dir={reference}"])
  got, want = read_metrics(model_dir), read_metrics(reference)
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, FAULT_STEPS + 1))
  for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=rtol,
                               err_msg=key)
