"""Shared test helpers: run tfpar as a real subprocess, read its metrics."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a CLI run takes seconds on 2 cores.
TINY = ["--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64", "--seq_len=32",
        "--global_batch_size=8", "--eval_steps=1", "--steps_per_call=1", "--log_every=1",
        "--learning_rate=3e-3", "--warmup_steps=1"]


def run_module(module, args, *, env=None, timeout=600, check=True):
  """Runs `python -m module args` and returns the CompletedProcess (text)."""
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
  full_env.update(env or {})
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        env=full_env, timeout=timeout, cwd=REPO)
  if check and proc.returncode != 0:
    raise AssertionError(f"{module} {' '.join(args)} exited {proc.returncode}\n"
                         f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
  return proc


def read_metrics(model_dir, kind="train"):
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [r for r in records if r["kind"] == kind]


@pytest.fixture
def tiny():
  return list(TINY)
