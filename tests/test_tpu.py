"""The TPU path as far as a CPU-only machine can take it.

No TPU here, so (1) the TPU config's whole train step (forward, backward, the
gradient all-reduce call, clipping and the AdamW update: tfpar's real
TrainStep, GPT and optimizer, in bfloat16) runs as ONE XLA program under
`tf.function(jit_compile=True)` at the TPU config's shapes: a jit_compile
function fails instead of falling back when an op cannot compile, which is
what TPUStrategy would need. To fit the test budget the block count is cut
from 12 to 1 and the per-core batch from 16 to 2 sequences (SHRINK); d_model,
heads, d_ff, seq_len and dtypes are the config's. Without a strategy the
all-reduce has one replica and is the identity: the cross-replica sum over 8
TPU cores is not exercised.
(2) A --tpu that cannot be reached fails fast with one clear line.
"""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, XLA_TEST_FLAGS, make_config, run_module

TPU_FLAGS = ["--flagfile=" + os.path.join(REPO, "configs", "gpt_tpu.flags")]
TPU_CORES = 8  # A v3-8 / v4-8 / v5e-8 host: the config's global batch is for 8 replicas.


# What the compiled-step check shrinks, to fit the test budget on 2 cores:
# 12 -> 1 block, and 16 -> 2 sequences per core (bfloat16 matmuls are emulated
# on this CPU: at 16 sequences one step runs ~40 s). d_model, heads, d_ff,
# seq_len, dtype policy and optimizer are the config's.
SHRINK = ["--num_layers=1", f"--global_batch_size={2 * TPU_CORES}"]
# XLA's CPU constant folding spends minutes on this program (its slow-operation
# alarm names a dot of two constants); the TPU compiler has its own pipeline,
# so the check skips that one pass (and compiles as every test does: conftest.XLA_TEST_FLAGS).
XLA_FLAGS = f"--xla_disable_hlo_passes=constant_folding {XLA_TEST_FLAGS}"


def compile_and_run_tpu_step():
  """Runs in a fresh process (XLA_FLAGS are read once per process); prints a JSON result."""
  import functools  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
  from tfpar.tasks.task import cross_entropy  # pylint: disable=import-outside-toplevel
  from tfpar.engines.base import build_model  # pylint: disable=import-outside-toplevel
  from tfpar.training.optimizer import make_optimizer  # pylint: disable=import-outside-toplevel
  from tfpar.training.step import TrainStep  # pylint: disable=import-outside-toplevel

  cfg = make_config(TPU_FLAGS + SHRINK)
  g, seq_len = cfg.train.global_batch_size, cfg.model.seq_len
  # One replica's input, as TPUStrategy feeds core 0: static [G/8, seq_len].
  corpus = pipeline.load_corpus(None, seq_len=seq_len, eval_fraction=cfg.data.eval_fraction)
  ds = pipeline.window_dataset(corpus.train, seq_len, pipeline.Shard(g, TPU_CORES, 0, 1),
                               seed=cfg.train.seed)
  shapes = [spec.shape.as_list() for spec in ds.element_spec]
  inputs, targets = next(iter(ds))
  keras.mixed_precision.set_global_policy(cfg.train.precision)
  model = build_model(cfg)
  optimizer = make_optimizer(cfg.optim, cfg.train.train_steps, cfg.train.precision)
  optimizer.build(model.trainable_variables)
  step = TrainStep(model, optimizer, jit_compile=True,
                   loss_fn=functools.partial(cross_entropy, global_count=g * seq_len))
  compiled = tf.function(step.__call__, jit_compile=True)  # Fails, not falls back, if an op can't.
  start = time.perf_counter()
  loss, norm = compiled(inputs, targets)
  seconds = time.perf_counter() - start
  # The warmup starts at lr 0, so step 1 changes the AdamW slots, not yet the weights.
  momentums = optimizer._momentums  # pylint: disable=protected-access
  slots_changed = [bool(np.any(m.numpy() != 0)) for m in momentums]
  print(json.dumps({"shapes": shapes, "loss": float(loss), "grad_norm": float(norm),
                    "iterations": int(optimizer.iterations.numpy()), "seconds": seconds,
                    "compute_dtype": model.blocks[0].compute_dtype,
                    "slots_changed": slots_changed}))


def test_tpu_config_train_step_compiles_and_runs_under_xla_on_cpu():
  import json  # pylint: disable=import-outside-toplevel
  full = make_config(TPU_FLAGS)
  assert (full.dist.strategy, full.dist.tpu, full.train.precision) == ("tpu", "local",
                                                                      "mixed_bfloat16")
  assert full.train.steps_per_call >= 50 and full.model.num_layers == 12
  assert full.train.global_batch_size % TPU_CORES == 0
  code = "import test_tpu; test_tpu.compile_and_run_tpu_step()"
  env = dict(os.environ, XLA_FLAGS=XLA_FLAGS, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"), REPO]))
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        cwd=REPO, timeout=200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  print(f"TPU-config step (1 block, 2 sequences) compiled and ran under XLA in "
        f"{result['seconds']:.1f} s")
  assert result["shapes"] == [[2, full.model.seq_len]] * 2  # Fully static: no None.
  assert result["compute_dtype"] == "bfloat16"
  # The loss is this replica's share of the global mean (divided by G*T, not G/8*T).
  loss = result["loss"] * TPU_CORES
  assert 4.5 < loss < 6.5, loss  # About ln(256) = 5.55 from a fresh init.
  assert np.isfinite(result["grad_norm"]) and result["grad_norm"] > 0
  assert result["iterations"] == 1
  assert all(result["slots_changed"]), "the AdamW update ran inside the compiled step"


def _closed_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]  # Closed once the socket is.


def test_unreachable_grpc_tpu_fails_fast_with_one_line():
  from tfpar.config.schema import ConfigError  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import tpu  # pylint: disable=import-outside-toplevel
  address = f"grpc://127.0.0.1:{_closed_port()}"
  start = time.monotonic()
  with pytest.raises(ConfigError, match=r"no TPU worker reachable") as err:
    tpu.resolve(address)
  assert time.monotonic() - start < 5
  assert "\n" not in str(err.value) and address in str(err.value)
  with pytest.raises(ConfigError, match="grpc://HOST:PORT"):
    tpu.resolve("grpc://no-port-here")


def test_no_local_tpu_is_one_line_on_stderr(tmp_path):
  """End to end through the CLI: exit status 2, one line, no traceback."""
  proc = run_module("tfpar.train", ["--strategy=tpu", "--tpu=local", f"--model_dir={tmp_path}",
                                    "--num_layers=1", "--d_model=32", "--num_heads=4",
                                    "--seq_len=16", "--train_steps=2"],
                    timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("tfpar.train: error:")]
  assert len(errors) == 1 and "--tpu=local: no TPU reachable" in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
