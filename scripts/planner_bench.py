"""How long tfpar.plan takes to answer for 4,096 devices (a benchmark line, not a test).

  python scripts/planner_bench.py

Times the whole search (candidates, cost model, ranking) in this process for
a 1T-parameter, a 175B (GPT-3) and a 6.7B model under both layouts on
a100-80gb:4096, h100-80gb:4096 and tpu-v5p:4096, best of 3 rounds each; then
the whole command (`python -m tfpar.plan`, process start and imports included)
once, for GPT-3 175B on 4,096 H100s in tfpar's layout.
"""

import os
import subprocess
import sys
import time

from tfpar.config.schema import ModelConfig
from tfpar.planner import clusters, cost, search

MODELS = {
    "1T": ModelConfig(vocab_size=51200, seq_len=2048, num_layers=128, d_model=25600,
                      num_heads=160, d_ff=102400),
    "175B": ModelConfig(vocab_size=51200, seq_len=2048, num_layers=96, d_model=12288,
                        num_heads=96, d_ff=49152),
    "6.7B": ModelConfig(vocab_size=51200, seq_len=2048, num_layers=32, d_model=4096,
                        num_heads=32, d_ff=16384),
}


def main():
  for cluster_name in ("a100-80gb:4096", "h100-80gb:4096", "tpu-v5p:4096"):
    cluster = clusters.parse(cluster_name)
    for model_name, m in MODELS.items():
      for system in (cost.MEGATRON, cost.TFPAR):
        times = []
        for _ in range(3):
          cost._stages.cache_clear()  # pylint: disable=protected-access  # Cold each round.
          start = time.perf_counter()
          plans = search.candidates(m, cluster, 4096, system)
          ranked = search.rank(m, cluster, plans, global_batch=4096, precision="mixed_bfloat16",
                               system=system) if len(plans) else None
          times.append(time.perf_counter() - start)
        fits = int(ranked.results["fits"].sum()) if ranked else 0
        print(f"{cluster_name} {model_name} {system.name}: {len(plans)} plans, {fits} fit, "
              f"answered in {min(times):.3f} s (best of 3)")
  command = [sys.executable, "-m", "tfpar.plan", "--num_layers=96", "--d_model=12288",
             "--num_heads=96", "--seq_len=2048", "--vocab_size=51200",
             "--global_batch_size=1536", "--precision=mixed_bfloat16",
             "--cluster=h100-80gb:4096", "--top=5", "--train_tokens=300e9"]
  start = time.perf_counter()
  out = subprocess.run(command, check=True, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
  print(f"{' '.join(command[1:])}: {time.perf_counter() - start:.2f} s from process start to "
        f"answer; its own count: {out.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
  main()
