"""Calibrates tfpar.plan's cost model on this host and checks it against real tfpar runs.

  python scripts/planner_calibrate.py [--steps=16] [--rounds=2] [--across_workers]

Splits the CPU into 8 logical devices, measures the float32 matmul rate
(512 x 512, no XLA), and trains a small GPT (4 blocks, d_model 128, 4 heads,
d_ff 512, seq 128, batch 16; XLA off, as model-parallel steps run) under nine
plans, rounds alternated; a plan's step time is the median over its rounds
of the per-step times after the first three steps (tracing). The host model
(tfpar.planner.calibrate: logical devices take turns on the cores, a step
costs a fixed part plus every device's block passes, its matmuls at the
measured rate and its memory traffic) has two constants, solved from two
reference runs (4 and 16 micro-batches). It then predicts the other seven
plans, and the script prints predicted and measured step times, the error,
both orders, their rank correlation and how many pairs of plans are in the
same order (the bytes per device are checked by tests/test_planner.py). Run
it on an idle machine: other processes change every step time.

--across_workers adds the plans whose devices are split over worker processes
(`python -m tfpar.launch`, 1 logical CPU per worker, loopback gRPC between
them): data parallel over 2 workers (the reference that solves the loopback
bandwidth), then a pipeline of 2 stages on 2 workers and D=2 x K=2 on 4
workers, predicted and measured. The last two need tfpar's cross-worker
pipeline runtime (issue 16); a tfpar.train that refuses them (each worker must
hold a replica's K x T devices) is reported as such, not measured.
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

SHAPE = ["--num_layers=4", "--d_model=128", "--num_heads=4", "--d_ff=512", "--seq_len=128",
         "--global_batch_size=16", "--eval_steps=1", "--steps_per_call=1", "--log_every=1",
         "--learning_rate=3e-3", "--warmup_steps=1", "--eval_every=0", "--checkpoint_every=1000",
         "--jit_compile=false"]
TWO, FOUR, EIGHT = (f"--num_cpu_devices={n}" for n in (2, 4, 8))
RUNS = {  # name: (flags, (D, K, T, M, recompute)); the first two are the references.
    "4 micro-batches": (["--data_parallel=1", "--microbatches=4"], (1, 1, 1, 4, False)),
    "16 micro-batches": (["--data_parallel=1", "--microbatches=16"], (1, 1, 1, 16, False)),
    "one device": (["--data_parallel=1"], (1, 1, 1, 1, False)),
    "8 micro-batches": (["--data_parallel=1", "--microbatches=8"], (1, 1, 1, 8, False)),
    "recompute": (["--data_parallel=1", "--remat=true"], (1, 1, 1, 1, True)),
    "pipeline K=2, M=4": ([TWO, "--pipeline_stages=2", "--microbatches=4"], (1, 2, 1, 4, False)),
    "tensor T=2": ([TWO, "--tensor_parallel=2"], (1, 1, 2, 1, False)),
    "tensor T=4": ([FOUR, "--tensor_parallel=4"], (1, 1, 4, 1, False)),
    "hybrid 2x2x2, M=2": (["--strategy=mirrored", EIGHT, "--data_parallel=2",
                           "--pipeline_stages=2", "--tensor_parallel=2", "--microbatches=2"],
                          (2, 2, 2, 2, False)),
}
REFERENCES = (0, 1)
# name: (workers, flags, (D, K, T, M, recompute, workers)); the first is the link's reference.
ACROSS = {
    "2 workers, data parallel": (2, [], (2, 1, 1, 1, False, 2)),
    "2 workers, a stage each, M=4": (2, ["--data_parallel=1", "--pipeline_stages=2",
                                         "--microbatches=4"], (1, 2, 1, 4, False, 2)),
    "4 workers, D=2 x K=2, M=2": (4, ["--data_parallel=2", "--pipeline_stages=2",
                                      "--microbatches=2"], (2, 2, 1, 2, False, 4)),
}


def run_across(workers, flags, model_dir):
  """One cross-worker run through tfpar.launch: its step times, or tfpar's refusal (a string)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  from conftest import read_metrics  # pylint: disable=import-outside-toplevel
  proc = subprocess.run(
      [sys.executable, "-m", "tfpar.launch", f"--num_workers={workers}", "--",
       "--strategy=multi_worker_mirrored", "--num_cpu_devices=1", f"--model_dir={model_dir}"]
      + flags, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
      check=False)
  if proc.returncode:  # A worker's own error line first, else the launcher's last line.
    lines = (proc.stderr + proc.stdout).splitlines() or ["no output"]
    worker = [l for l in lines if "error:" in l and "tfpar.launch" not in l]
    return (worker or lines)[-1].strip()
  return [rec["step_time"] for rec in read_metrics(model_dir)][3:]  # After tracing.


def ranks(x):
  import numpy as np  # pylint: disable=import-outside-toplevel
  return np.argsort(np.argsort(x))


def main(argv):
  arg = lambda name, default: int(next((a.split("=")[1] for a in argv
                                        if a.startswith(f"--{name}=")), default))
  steps, rounds = arg("steps", 16), arg("rounds", 2)
  across = "--across_workers" in argv
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
  from conftest import make_config, read_metrics, train_in_process  # pylint: disable=import-outside-toplevel
  from tfpar.planner import calibrate  # pylint: disable=import-outside-toplevel
  base = SHAPE + [f"--train_steps={steps}"]
  rate = calibrate.matmul_rate()
  times = {name: [] for name in list(RUNS) + (list(ACROSS) if across else [])}
  names = list(RUNS)
  refused = {}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      model_dir = tempfile.mkdtemp()
      train_in_process(base + RUNS[name][0] + [f"--model_dir={model_dir}"])
      times[name] += [rec["step_time"] for rec in read_metrics(model_dir)][3:]  # After tracing.
    for name, (workers, flags, _) in ACROSS.items() if across else ():
      if name not in refused:
        out = run_across(workers, base + flags, tempfile.mkdtemp())
        if isinstance(out, str):
          refused[name] = out
        else:
          times[name] += out
  ran = [name for name in ACROSS if across and name not in refused]
  names += ran
  measured = np.array([np.median(times[name]) for name in names])
  cfg = make_config(base + ["--model_dir=/tmp/unused"])
  g = cfg.train.global_batch_size
  configs = [plan + (g,) for _, plan in RUNS.values()]
  configs += [ACROSS[name][2][:5] + (g, ACROSS[name][2][5]) for name in ran]
  link_reference = len(RUNS) if ran and ran[0] == list(ACROSS)[0] else None
  try:
    predicted, fit = calibrate.fit(cfg.model, rate, configs, measured, references=REFERENCES,
                                   global_batch=g, link_reference=link_reference)
  except ValueError as e:
    sys.exit(f"planner_calibrate: {e}")
  print(f"matmul rate {rate / 1e9:.1f} GFLOP/s (512^2 float32, no XLA); solved from the "
        f"{' and '.join(names[i] for i in REFERENCES)} runs: {fit.step_seconds * 1e3:.1f} ms per "
        f"step, {fit.op_seconds * 1e3:.3f} ms per block and pass on each device"
        + (f"; from the {names[link_reference]} run: loopback link "
           f"{fit.link_bandwidth / 1e6:.0f} MB/s" if link_reference is not None else ""))
  for name, why in refused.items():
    print(f"not run: {name}: {why}")
  references = REFERENCES + ((link_reference,) if link_reference is not None else ())
  print(f"| plan | predicted ms | measured ms (median of {rounds} rounds) | error |")
  print("|---|---:|---:|---:|")
  for i, (name, p, m) in enumerate(zip(names, predicted, measured)):
    tag = " (reference)" if i in references else ""
    print(f"| {name}{tag} | {p * 1e3:.1f} | {m * 1e3:.1f} | {100 * (p / m - 1):+.1f}% |")
  held = [i for i in range(len(names)) if i not in references]
  rho = float(np.corrcoef(ranks(predicted[held]), ranks(measured[held]))[0, 1])
  worst = max(abs(predicted[i] / measured[i] - 1) for i in held)
  print(f"predicted plans: largest error {100 * worst:.1f}%, Spearman rank correlation {rho:.2f}")
  print(f"fastest first, predicted: {', '.join(names[i] for i in np.array(held)[np.argsort(predicted[held])])}")
  print(f"fastest first, measured:  {', '.join(names[i] for i in np.array(held)[np.argsort(measured[held])])}")
  for apart in (0.0, 0.05, 0.10):
    pairs = [(i, j) for i in held for j in held if i < j and
             abs(measured[i] - measured[j]) > apart * min(measured[i], measured[j])]
    alike = [(i, j) for i, j in pairs
             if (predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0]
    print(f"pairs measured more than {100 * apart:.0f}% apart: {len(alike)} of {len(pairs)} "
          "in the same order" + "".join(f"; not: {names[i]} / {names[j]}"
                                        for i, j in pairs if (i, j) not in alike))


if __name__ == "__main__":
  main(sys.argv[1:])
