"""The parallel plan as data: stage balance, bubble, bytes per device, errors for impossible plans."""

import json

import pytest

from conftest import TINY, make_config
from tfpar.config.schema import ConfigError
from tfpar.layout import placement as plan_lib

DEVICES = [f"/device:CPU:{i}" for i in range(8)]


def plan_for(args, devices=DEVICES):
  return plan_lib.make_plan(make_config(TINY + ["--model_dir=/tmp/unused"] + args), devices)


def test_stages_balance_parameters_counting_embedding_and_head():
  # 4 blocks of ~8.6k parameters; the embedding (~9.2k) weighs about one block.
  plan = plan_for(["--num_layers=4", "--num_cpu_devices=2", "--pipeline_stages=2"],
                  DEVICES[:2])
  assert [s.blocks for s in plan.stages] == [(0,), (1, 2, 3)]
  assert plan.stages[0].embedding and plan.stages[1].head
  c = plan.counts
  assert sum(s.parameters for s in plan.stages) == c.embedding + c.head + 4 * c.block


def test_balance_is_optimal_for_uniform_blocks():
  assert plan_lib.balance_stages(8, 4, block=10, first_extra=0, last_extra=0) == (2, 2, 2, 2)
  assert plan_lib.balance_stages(7, 3, block=10, first_extra=25, last_extra=0) == (1, 3, 3)


def test_stage_layers_override():
  plan = plan_for(["--num_layers=4", "--num_cpu_devices=2", "--pipeline_stages=2",
                   "--stage_layers=3,1"], DEVICES[:2])
  assert [s.blocks for s in plan.stages] == [(0, 1, 2), (3,)]


def test_schedules_set_bubble_chunks_and_predicted_activations():
  base = ["--num_layers=8", "--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=8"]
  gpipe, one_f_one_b, interleaved = (plan_for(base + extra, DEVICES[:2]) for extra in (
      [], ["--pipeline_schedule=1f1b"], ["--pipeline_schedule=interleaved", "--virtual_stages=2"]))
  assert gpipe.bubble == one_f_one_b.bubble == pytest.approx(1 / 9)
  assert interleaved.bubble == pytest.approx(1 / 17)  # (K-1)/(vM+K-1)
  # Interleaved: chunks of 2 blocks, chunk c on stage c mod K.
  assert interleaved.chunks == [(0, (0, 1)), (1, (2, 3)), (0, (4, 5)), (1, (6, 7))]
  assert [s.blocks for s in interleaved.stages] == [(0, 1, 4, 5), (2, 3, 6, 7)]
  assert "stage 0: blocks 0-1, 4-5 + embedding" in interleaved.format()
  assert "1/17" in interleaved.format()
  # Activations: GPipe keeps M = 8 micro-batches on each stage, 1F1B K - k.
  assert gpipe.in_flight == [8, 8] and one_f_one_b.in_flight == [2, 1]
  for device, nbytes in gpipe.activation_bytes().items():
    assert one_f_one_b.activation_bytes()[device] < nbytes / 3
    assert one_f_one_b.activation_bytes()[device] < interleaved.activation_bytes()[device] < nbytes
  # Interleaved: the last device holds 3 chunks (1.5 stages) but the head only once (chunk 3's
  # forward is followed by its backward).
  chunk, *_, last = interleaved.microbatch_activations
  assert interleaved.activation_bytes()["CPU:1"] == 3 * chunk + last - chunk


def test_grid_bubble_and_plan_json(tmp_path):
  plan = plan_for(["--strategy=mirrored", "--num_cpu_devices=8", "--pipeline_stages=2",
                   "--tensor_parallel=2", "--microbatches=2"])
  assert plan.data_parallel == 2  # --data_parallel defaults to what the devices hold.
  assert plan.devices[1][0] == ("/device:CPU:4", "/device:CPU:5")
  assert plan.anchors == ["/device:CPU:0", "/device:CPU:4"]
  assert plan.bubble == pytest.approx(1 / 3)
  saved = json.load(open(plan.write(str(tmp_path))))
  assert saved["bubble"] == pytest.approx(1 / 3) and len(saved["bytes_per_device"]) == 8
  assert "bubble (K-1)/(M+K-1) = 1/3" in plan.format()
  # GPipe's order is the executor's: its activations are a bound.
  assert saved["activation_bytes_are_a_bound"] is True
  assert "micro-batches in flight per stage at most 2, 2" in plan.format()


def test_bytes_add_up_to_the_whole_model_per_replica():
  plan = plan_for(["--strategy=mirrored", "--num_cpu_devices=8", "--data_parallel=2",
                   "--pipeline_stages=2", "--tensor_parallel=2", "--microbatches=2"])
  c = plan.counts
  total = c.embedding + c.head + 2 * c.block
  per_device = plan.bytes_per_device()
  assert sum(b["parameters"] for b in per_device.values()) == 2 * 4 * total
  assert sum(b["optimizer"] for b in per_device.values()) == 2 * (2 * 4 * total + 8)
  # The shards of a block hold equal parts; the first device of a stage adds the unsplit rest.
  assert per_device["CPU:1"]["parameters"] == 4 * c.block_shard
  assert per_device["CPU:3"]["parameters"] == 4 * c.block_shard


def test_device_keys_match_between_plan_and_variables():
  assert plan_lib.device_key("/job:worker/replica:0/task:1/device:CPU:3") == "worker:1/CPU:3"
  assert plan_lib.device_key("/job:localhost/replica:0/task:0/device:CPU:3") == "CPU:3"
  assert plan_lib.device_key("/device:CPU:3") == "CPU:3"


def one_line_naming(error, flag):
  message = str(error.value)
  assert "\n" not in message and flag in message, message


@pytest.mark.parametrize("args, flag", [
    (["--num_layers=2", "--pipeline_stages=3", "--num_cpu_devices=3"], "--pipeline_stages"),
    (["--num_heads=4", "--tensor_parallel=3", "--num_cpu_devices=3"], "--tensor_parallel"),
    (["--num_heads=4", "--d_ff=66", "--tensor_parallel=4", "--num_cpu_devices=4"],
     "--tensor_parallel"),
    (["--global_batch_size=8", "--pipeline_stages=2", "--microbatches=3", "--num_cpu_devices=2"],
     "--microbatches"),
    (["--strategy=mirrored", "--num_cpu_devices=8", "--data_parallel=3", "--pipeline_stages=2"],
     "--data_parallel"),
    (["--pipeline_stages=2", "--stage_layers=2,1", "--num_cpu_devices=2"], "--stage_layers"),
])
def test_impossible_plans_fail_in_one_line_naming_the_flag(args, flag):
  with pytest.raises(ConfigError) as error:
    make_config(TINY + ["--model_dir=/tmp/unused"] + args)
  one_line_naming(error, flag)


def test_grid_not_matching_the_devices_fails_in_one_line():
  with pytest.raises(ConfigError) as error:
    plan_for(["--pipeline_stages=2", "--tensor_parallel=2"], DEVICES[:3])
  one_line_naming(error, "--pipeline_stages x --tensor_parallel")


def test_remat_refuses_dropout():
  with pytest.raises(ConfigError) as error:
    plan_for(["--remat", "--dropout=0.1"], DEVICES[:1])
  one_line_naming(error, "--remat")


def test_microbatches_checked_against_the_per_replica_batch():
  # 8 sequences over D=2 replicas leaves 4 per replica: M=8 cannot split it.
  with pytest.raises(ConfigError) as error:
    plan_for(["--global_batch_size=8", "--microbatches=8", "--pipeline_stages=2"], DEVICES[:4])
  one_line_naming(error, "--microbatches")


def test_across_workers_a_replica_fits_one_worker_or_spans_whole_workers():
  def workers(n, g):
    return [[f"/job:worker/replica:0/task:{w}/device:CPU:{j}" for j in range(g)] for w in range(n)]

  def plan(flags, n, g):
    cfg = make_config(TINY + ["--model_dir=/tmp/unused", "--strategy=multi_worker_mirrored",
                              "--pipeline_stages=2"] + flags)
    return plan_lib.make_plan(cfg, [], worker_devices=workers(n, g))

  fits = plan(["--num_cpu_devices=2"], 2, 2)  # Each worker one replica of 2 stages.
  assert fits.data_parallel == 2 and fits.devices[1][1] == (workers(2, 2)[1][1],)
  assert fits.stage_workers == [["worker:0", "worker:0"], ["worker:1", "worker:1"]]
  spans = plan([], 4, 1)  # 2 replicas of 2 stages, each stage its own worker.
  assert spans.data_parallel == 2
  assert spans.stage_workers == [["worker:0", "worker:1"], ["worker:2", "worker:3"]]
  # Stages 0 and 1 on worker 0's two devices, 2 and 3 on worker 1's: T=2 stays in a worker.
  four = plan(["--pipeline_stages=4", "--num_layers=4", "--tensor_parallel=2"], 4, 4)
  assert four.data_parallel == 2 and four.stage_workers[1] == ["worker:2"] * 2 + ["worker:3"] * 2
  assert four.devices[0][1] == tuple(workers(4, 4)[0][2:4])
  for flags, n, g, named in ((["--tensor_parallel=2"], 2, 1, "--tensor_parallel"),
                             ([], 3, 1, "multiple of 2 workers"),
                             (["--pipeline_stages=3", "--num_layers=3"], 4, 2, "whole workers"),
                             (["--data_parallel=2"], 2, 1, "--data_parallel"),
                             (["--grad_compression=bf16"], 2, 1, "--grad_compression")):
    with pytest.raises(ConfigError) as error:
      plan(flags, n, g)
    one_line_naming(error, named)
