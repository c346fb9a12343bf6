"""Smoke test of scripts/bench.py: each system trains in its own process and the tables add up.

No timing asserts: the machine running the tests is shared.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def _cells(row: str):
  return [c.strip() for c in row.strip().strip("|").split("|")]


def _number(cell: str) -> float:
  return float(cell.replace(",", "").rstrip("%x"))


def run_bench(tmp_path):
  """scripts/bench.py --quick in its own process: (CompletedProcess, the JSON report's path).

  conftest starts it with the session's first test (early_runs), beside the tests before
  this file; it runs its systems in children of its own as before.
  """
  out = tmp_path / "bench.json"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--quick", "--rounds=1",
       "--steps=2", "--warmup=1", "--sections=peer", f"--out={out}"],
      capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
  return proc, out


@pytest.fixture(scope="module")
def bench_run(early_runs):
  return early_runs["bench_run"].result()


def test_bench_runs_each_system_in_its_own_process(bench_run):
  proc, out = bench_run
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
  assert rows[0].startswith("| system | precision | tokens/s median | best | spread | step ms "
                            "| MFU | executed MFU | vs kerashub | load 1 min |"), proc.stdout
  body = {_cells(r)[0].split()[0]: _cells(r) for r in rows[1:]}
  assert sorted(body) == ["keras-hub", "tfpar"], proc.stdout
  for cells in body.values():
    median, best, spread, step_ms, mfu, executed, ratio = map(_number, cells[2:9])
    assert min(median, best, step_ms, mfu, executed, ratio) > 0 and spread >= 0, cells
    assert executed <= mfu, cells  # Executed FLOPs skip what causal attention skips.
  assert _number(body["keras-hub"][8]) == 1.0

  report = json.loads(out.read_text())
  runs = report["sections"]["peer"]["runs"]
  # Each system trained in a fresh process of its own, not in the parent's.
  assert [r["system"] for r in runs] == ["tfpar", "kerashub"]
  pids = {r["pid"] for r in runs}
  assert len(pids) == 2 and report["pid"] not in pids
  for r in runs:
    assert r["peak_gflops"] > 0 and 0 < r["mfu"] and len(r["load_1min"]) == 2
    assert 0 < r["executed_mfu"] <= r["mfu"]
  rows = {r["system"]: r for r in report["sections"]["peer"]["rows"]}
  tfpar = rows["tfpar"]
  assert tfpar["tokens_per_sec_best"] >= tfpar["tokens_per_sec_median"]
  assert abs(tfpar["vs_reference"] - tfpar["tokens_per_sec_median"]
             / rows["kerashub"]["tokens_per_sec_median"]) < 1e-9
  # Both systems count FLOPs from the same parameter count: the models match.
  assert tfpar["params"] == rows["kerashub"]["params"]
