"""Workers of one job started with different flags: every task refuses, in one line, before training.

Two real multi_worker_mirrored jobs of two `python -m tfpar.train` processes each
(their own TF_CONFIG, as two pods with different args would be), run side by
side: one differs in --learning_rate (once: both exit 0, a mixed config), one in
--d_model (once: exit 1 after ~113 lines of gRPC text). Each task publishes its
config in the coordination service and compares every task's with the chief's
(tfpar.parallel.agreement).
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY, make_config
from tfpar.cli import launch
from tfpar.parallel import agreement

MWMS = TINY + ["--strategy=multi_worker_mirrored", "--jit_compile=false", "--train_steps=2"]
CASES = {"learning_rate": (["--learning_rate=1e-3"], ["--learning_rate=2e-3"]),
         "d_model": (["--d_model=32"], ["--d_model=64"])}


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
  """{case: (model_dir, [(exit status, stdout, stderr) of worker 0, of worker 1])}, all 4 at once."""
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  procs = {}
  for case, extras in CASES.items():
    model_dir = tmp_path_factory.mktemp(case) / "run"
    tasks = [launch.Task("worker", i) for i in range(2)]
    configs = launch.tf_configs(tasks, launch.free_ports(2))
    procs[case] = (model_dir, [subprocess.Popen(
        [sys.executable, "-m", "tfpar.train", *MWMS, f"--model_dir={model_dir}", *extra],
        env=dict(env, TF_CONFIG=configs[task]), cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for task, extra in zip(tasks, extras)])
  out = {}
  for case, (model_dir, started) in procs.items():
    results = []
    for p in started:
      try:
        stdout, stderr = p.communicate(timeout=300)
      except subprocess.TimeoutExpired:
        p.kill()
        raise
      results.append((p.returncode, stdout, stderr))
    out[case] = (model_dir, results)
  return out


@pytest.mark.parametrize("case", list(CASES))
def test_every_worker_refuses_a_job_of_mixed_flags_in_one_line(mismatched, case):
  model_dir, results = mismatched[case]
  first, second = (extra[0].split("=")[1] for extra in CASES[case])
  for status, stdout, stderr in results:
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith("tfpar.train: error: worker 1 was started with "
                             f"--{case}={float(second) if case == 'learning_rate' else second}"), stderr
    assert f"worker 0 with --{case}=" in stderr and "same command line" in stderr, stderr
  assert not model_dir.exists()  # Nothing written: refused before any file.
  assert first != second


def test_the_first_differing_task_and_flag_are_named():
  base = make_config(TINY + ["--model_dir=/tmp/unused"])
  other = base.replace(optim={"weight_decay": 0.5}, model={"dropout": 0.25})
  same = agreement.flag_values(base)
  assert agreement.first_difference([("worker 0", same), ("worker 1", same),
                                     ("worker 2", same)]) is None
  line = agreement.first_difference([("worker 0", same), ("worker 1", same),
                                     ("worker 2", agreement.flag_values(other))])
  assert line.startswith("worker 2 was started with --dropout=0.25 but worker 0 with "
                         "--dropout=0.0"), line
