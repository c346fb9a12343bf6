"""How long tfpar.plan takes to answer for 4,096 devices (a benchmark line, not a test).

  python scripts/planner_bench.py

Times the whole search (candidates, cost model, ranking) in this process for
a 1T-parameter model (Megatron layout) and for a 6.7B model (tfpar layout)
on a100-80gb:4096 and tpu-v5p:4096, best of 3 rounds each; then the whole
command (`python -m tfpar.plan`, process start and imports included) once.
"""

import os
import subprocess
import sys
import time

from tfpar.config import ModelConfig
from tfpar.planner import clusters, cost, search

MODELS = {
    "1T": ModelConfig(vocab_size=51200, seq_len=2048, num_layers=128, d_model=25600,
                      num_heads=160, d_ff=102400),
    "6.7B": ModelConfig(vocab_size=51200, seq_len=2048, num_layers=32, d_model=4096,
                        num_heads=32, d_ff=16384),
}


def main():
  for cluster_name in ("a100-80gb:4096", "tpu-v5p:4096"):
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
  command = [sys.executable, "-m", "tfpar.plan", "--num_layers=128", "--d_model=25600",
             "--num_heads=160", "--seq_len=2048", "--vocab_size=51200",
             "--global_batch_size=4096", "--precision=mixed_bfloat16",
             "--cluster=a100-80gb:4096", "--system=megatron", "--top=5"]
  start = time.perf_counter()
  subprocess.run(command, check=True, capture_output=True,
                 env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
                     os.path.abspath(__file__)))))
  print(f"python -m tfpar.plan, 1T model on a100-80gb:4096: {time.perf_counter() - start:.2f} s "
        "from process start to answer")


if __name__ == "__main__":
  main()
