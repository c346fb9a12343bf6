"""Prints docs/planner.md's Megatron-LM table: published, predicted, picked.

  python scripts/planner_table.py          # the table (Narayanan et al. 2021, Table 1)
  python scripts/planner_table.py --fit    # re-fit the efficiency constants (grid search)
  python scripts/planner_table.py --published  # runs outside the fit: MT-NLG 530B, BLOOM 176B

For every row the planner evaluates the published D x K x T with full
recompute (it picks the micro-batch size), predicts per-GPU TFLOP/s as the
paper counts them, and searches the plan it would choose itself on the same
GPUs and batch (tfpar.planner.megatron).
"""

import itertools
import sys

import numpy as np

from tfpar.planner import clusters, cost, megatron


def fit():
  """The efficiency constants minimising the largest relative TFLOP/s error over the rows."""
  best = None
  for e_max, width, rows in itertools.product(np.arange(0.60, 0.801, 0.02), [32, 64, 96, 128, 160, 256],
                                              [0, 32, 64, 128, 256]):
    eff = clusters.Efficiency(max_efficiency=round(float(e_max), 2), width_half=width,
                              rows_half=rows)
    errors = [c.predicted_tflops / c.row.tflops - 1 for c in megatron.compare_all(eff, search_own=False)]
    worst = max(abs(e) for e in errors)
    if best is None or worst < best[0]:
      best = (worst, eff, errors)
  worst, eff, errors = best
  print(f"best fit: {eff} -> largest error {worst:.1%}; per row: "
        + ", ".join(f"{e:+.1%}" for e in errors))


def main(argv):
  if "--fit" in argv:
    fit()
    return
  if "--published" in argv:
    print("Published runs the constants were not fitted to, each its own layout under "
          "Megatron-DeepSpeed's pipeline (tfpar.planner.cost.MEGATRON_DEEPSPEED), and under "
          "Megatron-LM's (cost.MEGATRON) for comparison:\n")
    print(megatron.published_table())
    print()
    print(megatron.published_table(cost.MEGATRON))
    return
  print(f"A100 80 GB ({clusters.BUILT_IN['a100-80gb']['peak_flops']['float16'] / 1e12:.0f} "
        f"TFLOP/s fp16), efficiency constants {clusters.Efficiency()}:\n")
  print(megatron.table(megatron.compare_all()))


if __name__ == "__main__":
  main(sys.argv[1:])
