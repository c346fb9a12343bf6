"""Input sharding across replicas and workers, through the real tf.distribute path.

The issue's example: 10,000 samples over 4 replicas. Each replica sees its own
2,500 per epoch, none twice, and together they see every sample. The indices
come from tfpar.data.pipeline.sample_indices (the function training uses),
distributed by MirroredStrategy.distribute_datasets_from_function over 4
logical CPUs, exactly as DataParallelEngine feeds its replicas.
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import TINY, train_in_process
from tfpar import strategies
from tfpar.config.schema import ConfigError
from tfpar.data import corpus, pipeline

NUM_SAMPLES, REPLICAS, GLOBAL_BATCH = 10_000, 4, 100
STEPS_PER_EPOCH = NUM_SAMPLES // GLOBAL_BATCH


def distributed_indices(strategy, *, seed, epochs=1, global_batch=GLOBAL_BATCH):
  """[steps, replicas, per_replica_batch] sample indices, as the replicas receive them."""

  def dataset_fn(ctx: tf.distribute.InputContext):
    local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    shard = pipeline.Shard(global_batch, ctx.num_replicas_in_sync,
                           ctx.input_pipeline_id * local, local)
    return pipeline.sample_indices(NUM_SAMPLES, shard, seed=seed)

  iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
  steps = []
  for _ in range(epochs * NUM_SAMPLES // global_batch):
    per_replica = strategy.experimental_local_results(next(iterator))
    steps.append(np.stack([np.asarray(x) for x in per_replica]))
  return np.stack(steps)


@pytest.fixture(scope="module")
def four_replicas():
  strategy = tf.distribute.MirroredStrategy(strategies.compute_devices(REPLICAS),
                                            cross_device_ops=tf.distribute.ReductionToOneDevice())
  assert strategy.num_replicas_in_sync == REPLICAS
  return strategy


def test_each_of_4_replicas_sees_its_own_2500_of_10000_samples(four_replicas):
  seen = distributed_indices(four_replicas, seed=3)  # [100, 4, 25]
  assert seen.shape == (STEPS_PER_EPOCH, REPLICAS, GLOBAL_BATCH // REPLICAS)
  per_replica = [seen[:, r].ravel() for r in range(REPLICAS)]
  for r, samples in enumerate(per_replica):
    assert len(samples) == 2_500, r
    assert len(np.unique(samples)) == 2_500, f"replica {r} saw a sample twice in one epoch"
  union = np.concatenate(per_replica)
  assert len(np.unique(union)) == NUM_SAMPLES, "replicas overlap or a sample was dropped"
  assert set(union.tolist()) == set(range(NUM_SAMPLES))


def test_replicas_together_see_what_one_device_sees(four_replicas):
  """Step t of 4 replicas, concatenated, is step t of one device: the same global batch."""
  sharded = distributed_indices(four_replicas, seed=3)  # [100, 4, 25]
  one = tf.distribute.OneDeviceStrategy(strategies.compute_devices()[0])
  whole = distributed_indices(one, seed=3)  # [100, 1, 100]
  np.testing.assert_array_equal(sharded.reshape(STEPS_PER_EPOCH, -1), whole[:, 0])


def test_next_epoch_is_a_new_order_over_the_whole_set(four_replicas):
  two_epochs = distributed_indices(four_replicas, seed=3, epochs=2)
  first, second = two_epochs[:STEPS_PER_EPOCH], two_epochs[STEPS_PER_EPOCH:]
  assert set(second.ravel().tolist()) == set(range(NUM_SAMPLES))
  assert not np.array_equal(first, second), "every epoch should be shuffled anew"


def test_a_global_batch_that_does_not_split_over_the_replicas_is_a_clear_error(tmp_path):
  args = [a for a in TINY if not a.startswith("--global_batch_size")]
  with pytest.raises(ConfigError, match=r"--global_batch_size=10 does not split evenly over "
                                        r"4 replicas: use a multiple of 4"):
    train_in_process(args + ["--strategy=mirrored", "--num_cpu_devices=4",
                             "--global_batch_size=10", "--train_steps=2",
                             f"--model_dir={tmp_path}"])


@pytest.mark.parametrize("num_files, num_workers, expected", [
    (8, 2, "file"),   # 4 files per worker: each reads its own
    (7, 2, "data"),   # fewer: every worker reads its slice of each global batch
    (100, 1, "data"),  # one worker has nothing to split
])
def test_auto_sharding_reads_files_per_worker_when_there_are_4_each(num_files, num_workers,
                                                                    expected):
  assert pipeline.choose_sharding("auto", num_files, num_workers) == expected
  assert pipeline.choose_sharding("data", num_files, num_workers) == "data"


def test_file_sharding_gives_workers_disjoint_files_covering_all(tmp_path):
  for i in range(8):
    (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 200)
  shards = [pipeline.load_corpus(str(tmp_path), seq_len=16, eval_fraction=0.1, worker_index=w,
                                 num_workers=2, sharding="file") for w in range(2)]
  files = [set(s.files) for s in shards]
  assert not files[0] & files[1]
  assert files[0] | files[1] == set(corpus.list_files(str(tmp_path)))
  assert len(files[0]) == len(files[1]) == 4
