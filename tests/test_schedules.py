"""1F1B and interleaved 1F1B train exactly like one device, and 1F1B keeps fewer activations.

Each plan's engine is built in this process (conftest.build_engine, a 4-layer
TINY model: interleaving needs K v chunks) and compared with one device (the
same engine over one device: one tf.gradients of the full batch's loss). On a
pipeline of 2 devices, with XLA: one batch's loss and every weight's gradient
(within 1e-5 of its norm), for 1F1B and for interleaved 1F1B. On 2 replicas x
2 stages (4 devices), without XLA: the loss and gradient norm of each of 3
training steps, for 1F1B (interleaved on 2 replicas x 2 stages without XLA is
tests/test_cross_worker.py's 4-worker run, its stages on different workers).
The orders cost a trace each, so each plan traces once. The schedules' orders themselves
(bubble, activations in flight, no deadlock) are checked without TensorFlow.

scripts/pipeline_memory.py runs once (one round, GPipe and 1F1B at K=2, M=8,
each in its own process, started with this module's first test): on every
stage, the activations 1F1B holds when a backward runs are the plan's
prediction within 10%, GPipe's are under the plan's bound (all M
micro-batches; its order is the executor's), and 1F1B's peak is below GPipe's.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, TINY, build_engine, canonical_grads, in_background, selected_tests_use
from tfpar.layout import schedule as schedule_lib
from tfpar.parallel import schedules

STEPS = 3
BASE = TINY + ["--num_layers=4", f"--train_steps={STEPS}", "--eval_every=0",
               "--checkpoint_every=100"]
NO_XLA = ["--jit_compile=false"]
PIPELINE = ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=2"]
HYBRID = ["--strategy=mirrored", "--num_cpu_devices=4", "--data_parallel=2", "--pipeline_stages=2",
          "--microbatches=2"]
ONE_F_ONE_B = ["--pipeline_schedule=1f1b"]
INTERLEAVED = ["--pipeline_schedule=interleaved", "--virtual_stages=2"]
PLANS = {
    "1f1b_pipeline_xla": PIPELINE + ONE_F_ONE_B,
    "1f1b_hybrid": HYBRID + ONE_F_ONE_B + NO_XLA,
    "interleaved_pipeline_xla": PIPELINE + INTERLEAVED,
}


def loss_and_grads(engine, batch):
  """(loss, {canonical name: gradient}) of copy 0's pipeline on `batch`, in one tf.function."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  copy = engine.copies[0]
  loss, grads = tf.function(copy.pipeline.loss_and_grads)(*batch)
  return float(loss), canonical_grads(copy.model, grads)


def train(engine):
  losses, norms = engine.train(engine.train_iterator(0), STEPS)
  return np.asarray(losses), np.asarray(norms)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """One device's batch, its loss and gradients, and its 3 steps' losses and gradient norms."""
  engine = build_engine(BASE + NO_XLA + ["--data_parallel=1",
                                         f"--model_dir={tmp_path_factory.mktemp('one')}"])
  batch = next(engine.train_iterator(0))
  return batch, loss_and_grads(engine, batch), train(engine)


@pytest.mark.parametrize("name", PLANS)
def test_schedule_matches_one_device(one_device, tmp_path, name):
  engine = build_engine(BASE + PLANS[name] + [f"--model_dir={tmp_path}"])
  batch, (want_loss, want_grads), (want_losses, want_norms) = one_device
  with open(tmp_path / "plan.json", encoding="utf-8") as f:
    recorded = json.load(f)
  assert recorded["schedule"] == engine.plan.schedule == name.split("_")[0]
  assert recorded["bubble"] == engine.plan.bubble > 0
  assert recorded["in_flight_microbatches"] == engine.plan.in_flight
  assert recorded["activation_bytes_are_a_bound"] is False  # The order is enforced.
  if engine.plan.data_parallel == 1:  # Copy 0 sees the whole batch: its gradients are one device's.
    loss, grads = loss_and_grads(engine, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert sorted(grads) == sorted(want_grads)
    # Each weight's gradient within 1e-5 of one device's, relative to its norm (some are zero
    # up to rounding, a key bias under softmax: relative to the largest then).
    scale = max(np.linalg.norm(g) for g in want_grads.values())
    for weight, want in want_grads.items():
      error = np.linalg.norm(grads[weight] - want)
      assert error <= 1e-5 * max(np.linalg.norm(want), 1e-3 * scale), (weight, error)
  else:
    losses, norms = train(engine)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-4)


@pytest.mark.parametrize("stages,microbatches,virtual", [(2, 4, 1), (4, 8, 1), (4, 3, 1),
                                                         (2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_orders_run_without_deadlock_in_the_bubble_the_formula_gives(stages, microbatches,
                                                                     virtual):
  name = "1f1b" if virtual == 1 else "interleaved"
  rows = schedule_lib.timetable(stages, microbatches, virtual)
  for k, row in enumerate(rows):  # Every chunk of the device, every micro-batch, once each way.
    units = sorted(u for u in row if u)
    assert units == sorted((kind, c, m) for kind in "BF" for c in range(k, stages * virtual, stages)
                           for m in range(microbatches))
  idle = 1 - 2 * virtual * microbatches / len(rows[0])
  assert idle == pytest.approx(schedule_lib.bubble(stages, microbatches, virtual))
  # 1F1B: stage k keeps at most K - k micro-batches' activations, GPipe all M.
  index = schedule_lib.SCHEDULES.index(name)
  flight = list(schedule_lib.in_flight(index, microbatches, virtual, stages))
  if virtual == 1:
    assert flight == [min(stages - k, microbatches) for k in range(stages)]
  # The closed form is the order replayed: a chunk of each micro-batch counts 1/v.
  replayed = schedule_lib.held(name, stages, microbatches, virtual, [1] * stages * virtual)
  assert flight == pytest.approx([n / virtual for n in replayed])
  assert max(flight) < schedule_lib.in_flight(schedule_lib.GPIPE, microbatches, 1, stages)[0] or \
      microbatches <= stages


@pytest.mark.parametrize("name,stages,microbatches,virtual",
                         [("gpipe", 4, 3, 1), ("1f1b", 4, 6, 1), ("interleaved", 2, 4, 2)])
def test_each_workers_units_pair_every_send_with_a_receive_in_one_order(name, stages,
                                                                       microbatches, virtual):
  """One program per worker (tfpar.parallel.stage_program): each worker's units, in the
  timetable's order, hold every chunk and micro-batch once each way; every boundary's
  transfers come in the same order on both sides; GPipe's order runs every forward first."""
  from tfpar.parallel import p2p  # pylint: disable=import-outside-toplevel
  from tfpar.parallel.stage_program import StageProgram  # pylint: disable=import-outside-toplevel

  class Pipe:  # The two attributes StageProgram reads to order units.
    schedule = schedules.make(name, virtual)

  Pipe.microbatches = microbatches
  chunks = stages * virtual
  workers = [c % stages for c in range(chunks)]
  units = [StageProgram(Pipe, workers, w, p2p.Groups(stages), ((), None)).units()
           for w in range(stages)]
  for w, mine in enumerate(units):
    assert sorted(mine) == sorted((kind, c, m) for kind in "FB" for c in range(w, chunks, stages)
                                  for m in range(microbatches))
    if name == "gpipe":
      assert [u[0] for u in mine] == ["F"] * microbatches + ["B"] * microbatches
  for c in range(chunks - 1):  # Chunk c's sends to chunk c+1's worker and its receives.
    sent = [(kind, m) for kind, cc, m in units[workers[c]] if cc == c and kind == "F"]
    got = [(kind, m) for kind, cc, m in units[workers[c + 1]] if cc == c + 1 and kind == "F"]
    assert [m for _, m in sent] == [m for _, m in got]
    back = [m for kind, cc, m in units[workers[c + 1]] if cc == c + 1 and kind == "B"]
    taken = [m for kind, cc, m in units[workers[c]] if cc == c and kind == "B"]
    assert back == taken


def test_group_keys_name_each_set_of_workers_once():
  """The sets a D x K job over N = D K workers uses: every pair, each stage's D copies, the
  whole job; distinct keys, the same for any order of members, within an int32."""
  import itertools  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import p2p  # pylint: disable=import-outside-toplevel
  d, k = 3, 4
  groups = p2p.Groups(d * k)
  sets = list(itertools.combinations(range(d * k), 2)) + [tuple(range(d * k))] + \
      [tuple(c * k + s for c in range(d)) for s in range(k)]
  keys = [groups.key(s) for s in sets]
  assert len(set(keys)) == len(sets) and min(keys) >= p2p.GROUP_BASE
  assert groups.key((3, 1)) == groups.key((1, 3))
  assert p2p.Groups(46000).key((45998, 45999)) < 2 ** 31
  assert p2p.Keys(4, 3).extra(0) > max(p2p.Keys(4, 3).backward(3, 2), p2p.Keys(4, 3).forward(3, 2))


def test_the_docstring_draws_the_timetables():
  assert schedule_lib.draw(4, 6) in schedules.__doc__
  assert schedule_lib.draw(2, 4, 2) in schedules.__doc__


def run_pipeline_memory(tmp_path):
  """scripts/pipeline_memory.py, one round: (CompletedProcess, its JSON report)."""
  out = tmp_path / "memory.json"
  proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pipeline_memory.py"),
                         "--rounds=1", "--steps=0", "--num_layers=2", f"--out={out}"],
                        capture_output=True, text=True, cwd=REPO, timeout=900,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO))
  return proc, json.loads(out.read_text()) if proc.returncode == 0 else None


@pytest.fixture(scope="module", autouse=True)
def memory_started(request, tmp_path_factory):
  """The script's run, started with the module's first test when a selected test reads it."""
  if selected_tests_use(request, "memory_run"):
    return in_background(run_pipeline_memory, tmp_path_factory.mktemp("memory"))
  return None


@pytest.fixture(scope="module")
def memory_run(memory_started):
  return memory_started.result()


def test_1f1b_holds_the_plans_activations_and_gpipe_stays_under_its_bound(memory_run):
  proc, report = memory_run
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "| gpipe | 8, 8 |" in proc.stdout and "| 1f1b | 2, 1 |" in proc.stdout, proc.stdout
  runs = {run["schedule"]: run for run in report["runs"]}
  assert len({run["pid"] for run in runs.values()}) == 2  # Each in a process of its own.
  gpipe, one_f_one_b = runs["gpipe"], runs["1f1b"]
  for stage, predicted in one_f_one_b["predicted_bytes_per_stage"].items():
    # 1F1B's order is enforced: what a stage holds when a backward runs is the plan's count.
    assert one_f_one_b["held_bytes_per_stage"][stage] == pytest.approx(predicted, rel=0.1), (
        stage, report)
    # GPipe's is the executor's: at least micro-batch 0's, at most all M, the plan's bound,
    # plus what a forward still running may hold beside them: the executor may start a
    # backward op while the last micro-batch's forward temporaries (not activations) are
    # alive (seen once, stage 0 at 1.026x the bound, 2026-12-05): 5% of slack for those.
    bound = gpipe["predicted_bytes_per_stage"][stage]
    assert 0.9 * bound / 8 < gpipe["held_bytes_per_stage"][stage] <= 1.05 * bound, (
        stage, report)
    assert 0 < one_f_one_b["peak_bytes_per_stage"][stage] < gpipe["peak_bytes_per_stage"][stage]
  assert 0 < one_f_one_b["all_stages_bytes"] < gpipe["all_stages_bytes"]


def _worker0_program(name, virtual, gpu=False):
  """Worker 0's StageProgram of a GPT of 4 blocks over 2 stages (v chunks each: worker 0 runs
  chunk 0, and 2 interleaved), 2 micro-batches of 4 sequences, a job of 4 workers (its
  stage's copy is worker 2): (program, worker 0's variables, its blocks, its chunks' blocks,
  the model's config, the batch)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import ModelConfig  # pylint: disable=import-outside-toplevel
  from tfpar.models.gpt.model import GPT  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import p2p  # pylint: disable=import-outside-toplevel
  from tfpar.parallel.pipeline import Pipeline  # pylint: disable=import-outside-toplevel
  from tfpar.parallel.stage_program import StageProgram  # pylint: disable=import-outside-toplevel
  from tfpar.tasks.task import cross_entropy  # pylint: disable=import-outside-toplevel

  m = ModelConfig(seq_len=16, num_layers=4, d_model=32, num_heads=4, d_ff=64)
  batch, chunks = 4, 2 * virtual
  model = GPT(m)
  blocks = [list(range(4))[c * 4 // chunks:(c + 1) * 4 // chunks] for c in range(chunks)]
  workers = [c % 2 for c in range(chunks)]  # Worker 0: chunk 0 (and 2, interleaved).
  model.build_embed()
  for c in range(0, chunks, 2):
    for i in blocks[c]:
      model.blocks[i].build(model.block_shape)
  variables = list(model.trainable_variables)
  pipe = Pipeline(model, stage_blocks=blocks, stage_devices=["/device:CPU:0"] * chunks,
                  microbatches=2, schedule=schedules.make(name, virtual),
                  loss_fn=lambda logits, y: cross_entropy(logits, y, batch * m.seq_len))
  program = StageProgram(pipe, workers, 0, p2p.Groups(4, gpu=gpu),
                         (tuple(model.block_shape[1:]), tf.float32))
  mine = [b for c in range(0, chunks, 2) for b in blocks[c]]
  return program, variables, mine, m, batch


def _upstream(op):
  """Every op `op` waits for, by data or control, transitively."""
  seen, todo = set(), [op]
  while todo:
    o = todo.pop()
    for x in [t.op for t in o.inputs] + list(o.control_inputs):
      if x not in seen:
        seen.add(x)
        todo.append(x)
  return seen


@pytest.mark.parametrize("name,gpu,ordered", [("gpipe", False, False), ("gpipe", True, True),
                                              ("1f1b", False, True)])
def test_a_workers_units_wait_for_each_other_only_where_the_order_matters(name, gpu, ordered):
  """One program per worker (worker 0 of 2 stages, 2 micro-batches): under 1F1B each unit
  waits for the worker's previous one (its order bounds the activations held), and so does
  GPipe's on NCCL (every member posts its collectives in one order); GPipe over gRPC runs
  a unit as soon as its inputs exist, as GPipe in one program does: F(0, 1) does not wait
  for F(0, 0). Over gRPC a receive waits for no earlier unit (matched by key, it is posted
  at once); on NCCL it waits for the unit before it."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  program, variables, _, m, batch = _worker0_program(name, 1, gpu=gpu)
  program.accumulators(variables)
  tokens = tf.zeros([batch, m.seq_len], tf.int32)
  graph = tf.function(lambda t: program.loss_and_grads(t, t, variables)[0]).get_concrete_function(
      tokens).graph
  ops = graph.get_operations()
  unit = lambda op: op.name.split("/")[0]
  second = [op for op in ops if unit(op) == "F0_1" and op.type == "Identity"][0]  # Its input.
  assert any(unit(o) == "F0_0" for o in _upstream(second)) == ordered
  receives = [op for op in ops if op.type == "CollectiveBcastRecvV2"]
  assert [unit(op) for op in receives] == ["B0_1", "B0_0"] if name == "gpipe" else receives
  for op in receives:  # Each receive's own unit's ops aside, what it waits for.
    before = {unit(o) for o in _upstream(op)} - {unit(op)}
    assert bool(before & {"F0_0", "F0_1", "B0_1"}) == gpu, (op.name, before)


@pytest.mark.parametrize("name,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_each_buckets_sum_among_copies_waits_only_for_its_own_gradients(name, virtual):
  """One program per worker, D copies of a stage (tfpar.engines.stage_worker's plain sum):
  in worker 0's traced step (2 stages, 4 blocks, 2 micro-batches) the copies' sum is one
  collective per bucket (one per block, then the embedding; under XLA one per chunk),
  issued in the order the backward finishes them; each one's inputs (data and control,
  transitively) hold its own bucket's final gradients and none of a later bucket's: it can
  run while the backward of the earlier blocks does (the overlap). A sum after the whole
  backward waits for all of them."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import p2p  # pylint: disable=import-outside-toplevel
  from tfpar.parallel.exchange import AllReduce  # pylint: disable=import-outside-toplevel

  program, variables, mine, m, batch = _worker0_program(name, virtual)
  groups, pipe = program.groups, program.pipeline
  buckets = program.buckets(variables)
  assert max(buckets) == len(mine)  # One bucket per block of worker 0, the embedding's last.
  pipe.jit_compile = True  # Each chunk one XLA program: its blocks' gradients come at once.
  assert max(program.buckets(variables)) == len(range(0, 2 * virtual, 2))
  pipe.jit_compile = False

  program.accumulators(variables)  # Made before the trace, as StageWorkerEngine makes them.
  grads = []  # The traced graph's own gradient tensors.

  def step(tokens):
    grads.extend(program.loss_and_grads(tokens, tokens, variables)[1])
    among = p2p.Among(groups, [0, 2], 1000, [v.value.device for v in variables], buckets)
    return AllReduce(variables, num_replicas=2).reduce_among(grads, among, False)

  tokens = tf.zeros([batch, m.seq_len], tf.int32)
  graph = tf.function(step).get_concrete_function(tokens).graph
  sums = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
  assert len(sums) == len(mine) + 1

  final = [{grads[i].op for i in range(len(variables)) if buckets[i] == b}
           for b in range(len(sums))]
  for b, op in enumerate(sums):
    inputs = _upstream(op)
    assert final[b] <= inputs, b
    for later in range(b + 1, len(sums)):
      assert not final[later] & inputs, (b, later)
