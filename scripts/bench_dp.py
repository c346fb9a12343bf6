"""Data-parallel scaling and gradient compression: `python scripts/bench.py --sections=data_parallel`.

    python scripts/bench.py --sections=data_parallel --steps=12 --rounds=1 --out=bench_dp.json

Each configuration trains the benchmark GPT (4 layers, d_model 256, 4 heads,
d_ff 1024, seq 256, global batch 16; `--quick`: TINY shapes) with the real
CLI, `python -m tfpar.train` (or `python -m tfpar.launch --num_workers=2`), in
its own process(es), for `--steps` steps:

  * one_device, the reference;
  * mirrored on 2 logical CPUs, and multi_worker_mirrored with 2 local
    worker processes (one replica each), the same global batch, for each
    of --grad_compression none, fp16, bf16 and powersgd rank 1, 4, 16, and
    of --optimizer_sharding zero1 and zero2 (configurations named zero1, zero2).

Rounds alternate: round r runs every configuration once, in an order
rotated by r, so load drift hits them alike; each configuration's best round
counts. Throughput is the run's own `tokens_per_sec` (metrics.jsonl) over
its log windows after the first (which holds the XLA compile); bytes per
step are the run's `comm_bytes` (per replica, handed to the collectives)
and the loss is the training loss of the last window (deterministic: the
same in every round). bench.py writes the report into its JSON (`--out`),
and a PNG beside it (`<out>_data_parallel.png`): loss against step per
configuration, and bytes per step. `--systems` picks configurations by name
(e.g. mirrored/none,mirrored/powersgd4); one_device/none always runs.

Logical CPUs and local workers share the machine's cores: these numbers say
what the exchange costs here, not what more hardware would gain.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = ["--num_layers=4", "--d_model=256", "--num_heads=4", "--d_ff=1024", "--seq_len=256",
        "--global_batch_size=16"]
QUICK = ["--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64", "--seq_len=32",
         "--global_batch_size=8", "--powersgd_min_size=0"]
COMPRESSIONS = {"none": [], "fp16": ["--grad_compression=fp16"],
                "bf16": ["--grad_compression=bf16"]}
COMPRESSIONS.update({f"powersgd{r}": ["--grad_compression=powersgd", f"--powersgd_rank={r}"]
                     for r in (1, 4, 16)})
# --optimizer_sharding (tfpar.parallel.zero), uncompressed: rows beside <strategy>/none.
COMPRESSIONS.update({mode: [f"--optimizer_sharding={mode}"] for mode in ("zero1", "zero2")})


def configurations() -> Dict[str, List[str]]:
  """name -> the command (after `python -m`) without the shared flags."""
  out = {"one_device/none": ["tfpar.train", "--strategy=one_device"]}
  for name, flags in COMPRESSIONS.items():
    out[f"mirrored/{name}"] = ["tfpar.train", "--strategy=mirrored", "--num_cpu_devices=2",
                               *flags]
  for name, flags in COMPRESSIONS.items():
    out[f"multi_worker/{name}"] = ["tfpar.launch", "--num_workers=2", "--",
                                   "--strategy=multi_worker_mirrored", *flags]
  return out


def run_one(command: List[str], shared: List[str], model_dir: str, timeout: int) -> dict:
  """Runs one configuration to the end; returns its summary from metrics.jsonl."""
  shutil.rmtree(model_dir, ignore_errors=True)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", *command, *shared, f"--model_dir={model_dir}"],
                        capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  train = [r for r in records if r["kind"] == "train"]
  timed = train[1:] or train
  return {"tokens_per_sec": max(r["tokens_per_sec"] for r in timed),
          "comm_bytes": train[-1]["comm_bytes"],
          "comm_bytes_uncompressed": train[-1]["comm_bytes_uncompressed"],
          "final_loss": train[-1]["loss"],
          "loss_curve": [(r["step"], r["loss"]) for r in train]}


def run(*, steps: int, rounds: int, log_every: int, quick: bool, only: List[str] = None,
        png: str = None) -> dict:
  """Runs every configuration `rounds` times, alternated; plots to `png`; returns the report."""
  shared = (QUICK if quick else FULL) + [
      f"--train_steps={steps}", f"--log_every={log_every}", f"--steps_per_call={log_every}",
      f"--warmup_steps={max(1, steps // 10)}", "--eval_steps=0", f"--checkpoint_every={steps}",
      "--input_sharding=data", "--seed=0"]
  configs = configurations()
  if only:  # Configuration names (one_device/none always runs).
    wanted = set(only) | {"one_device/none"}
    unknown = wanted - set(configs)
    if unknown:
      raise ValueError(f"unknown configurations {sorted(unknown)}: pick from {list(configs)}")
    configs = {k: v for k, v in configs.items() if k in wanted}
  names = list(configs)
  results: Dict[str, List[dict]] = {n: [] for n in names}
  work = tempfile.mkdtemp(prefix="tfpar_bench_dp_")
  try:
    for r in range(rounds):
      order = names[r % len(names):] + names[:r % len(names)]
      for name in order:
        result = run_one(configs[name], shared, os.path.join(work, name.replace("/", "_")),
                         timeout=3600)
        results[name].append(result)
        print(f"round {r + 1}/{rounds} {name}: {result['tokens_per_sec']:,.0f} tok/s, "
              f"{result['comm_bytes'] / 1024:,.1f} KiB/step, loss {result['final_loss']:.4f}",
              flush=True)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  reference = max(x["tokens_per_sec"] for x in results["one_device/none"])
  rows = []
  for name in names:
    best = max(results[name], key=lambda x: x["tokens_per_sec"])
    uncompressed = best["comm_bytes_uncompressed"]
    rows.append({"config": name, "tokens_per_sec": best["tokens_per_sec"],
                 "tokens_per_sec_per_round": [x["tokens_per_sec"] for x in results[name]],
                 "vs_one_device": best["tokens_per_sec"] / reference,
                 "comm_bytes": best["comm_bytes"], "comm_bytes_uncompressed": uncompressed,
                 "compression_ratio": uncompressed / best["comm_bytes"] if best["comm_bytes"] else None,
                 "final_loss": best["final_loss"], "loss_curve": best["loss_curve"]})
  report = {"shape": QUICK if quick else FULL, "steps": steps, "rounds": rounds,
            "command": " ".join(["python"] + sys.argv), "load": _load(), "rows": rows}
  print(table(rows), flush=True)
  if png:
    plot(rows, png)
  return report


def _load() -> str:
  try:
    return "load average (1, 5, 15 min) at the end: " + ", ".join(
        f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
  except OSError:
    return "unknown"


def table(rows: List[dict]) -> str:
  lines = ["| configuration | tokens/s | vs one device | KiB/step sent | compression | loss |",
           "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    ratio = f"{r['compression_ratio']:.1f}x" if r["compression_ratio"] else "-"
    lines.append(f"| {r['config']} | {r['tokens_per_sec']:,.0f} | {r['vs_one_device']:.2f}x | "
                 f"{r['comm_bytes'] / 1024:,.1f} | {ratio} | {r['final_loss']:.4f} |")
  return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
  """Loss against step per configuration, and bytes per step (log scale)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
  for r in rows:
    steps, losses = zip(*r["loss_curve"])
    style = "--" if r["config"].startswith("multi_worker") else "-"
    left.plot(steps, losses, style, label=r["config"], linewidth=1.2)
  left.set_xlabel("step")
  left.set_ylabel("training loss")
  left.legend(fontsize=7)
  left.set_title("loss per compression")
  dp = [r for r in rows if r["comm_bytes_uncompressed"]]
  right.barh([r["config"] for r in dp], [r["comm_bytes"] / 1024 for r in dp])
  right.set_xscale("log")
  right.set_xlabel("KiB per replica per step handed to the collectives")
  right.tick_params(axis="y", labelsize=7)
  right.set_title("gradient bytes per step")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
