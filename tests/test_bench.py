"""Smoke test of scripts/bench.py: both systems run and report positive numbers (no timing asserts)."""

import json
import os
import subprocess
import sys

from conftest import REPO


def _numbers(row: str):
  """'| name | 1,234 | 5.6 | 7.8 | 9.0% | 1.00x |' -> [1234.0, 5.6, 7.8, 9.0, 1.0]."""
  cells = [c.strip() for c in row.strip().strip("|").split("|")][1:]
  return [float(c.replace(",", "").rstrip("%x")) for c in cells]


def test_bench_quick(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--quick", "--steps=2",
       "--warmup=1", f"--out={out}"],
      capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
  assert rows[0].startswith("| system | tokens/s | step ms | GFLOP/s | MFU | vs keras-hub |")
  tfpar = [r for r in rows if r.startswith("| tfpar")]
  kerashub = [r for r in rows if r.startswith("| keras-hub")]
  assert len(tfpar) == 1 and len(kerashub) == 1, proc.stdout
  for row in tfpar + kerashub:
    assert all(n > 0 for n in _numbers(row)), row
  assert _numbers(kerashub[0])[-1] == 1.0
  report = json.loads(out.read_text())
  assert {r["key"] for r in report["rows"]} == {"tfpar", "kerashub"}
  assert report["peak_gflops"] > 0
  # Both systems count FLOPs from the same parameter count: the models match.
  assert report["rows"][0]["params"] == report["rows"][1]["params"]
