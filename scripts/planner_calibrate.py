"""Calibrates tfpar.plan on this host and checks it against real tfpar runs.

  python scripts/planner_calibrate.py [--steps=8]

Splits the CPU into 8 logical devices, measures the float32 matmul rate,
trains the TINY model of tests/conftest.py under several plans (one device,
8 micro-batches, pipeline, tensor, hybrid; XLA off, as model-parallel steps
run), solves the per-block fixed cost from the first run's step time
(tfpar.planner.calibrate), and prints, per plan, the predicted and measured
step time and the predicted and measured bytes on the busiest device. Run it
on an idle machine: logical devices share the cores, and other processes
change every step time.
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

RUNS = {  # name: (flags, D, K, T, M)
    "one device (K=T=M=1)": (["--data_parallel=1"], 1, 1, 1, 1),
    "8 micro-batches": (["--data_parallel=1", "--microbatches=8"], 1, 1, 1, 8),
    "pipeline K=2, M=4": (["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=4"],
                          1, 2, 1, 4),
    "tensor T=2": (["--num_cpu_devices=2", "--tensor_parallel=2"], 1, 1, 2, 1),
    "hybrid 2x2x2, M=2": (["--strategy=mirrored", "--num_cpu_devices=8", "--data_parallel=2",
                           "--pipeline_stages=2", "--tensor_parallel=2", "--microbatches=2"],
                          2, 2, 2, 2),
}


def main(argv):
  steps = int(next((a.split("=")[1] for a in argv if a.startswith("--steps=")), 8))
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
  from conftest import TINY, make_config, read_metrics, train_in_process  # pylint: disable=import-outside-toplevel
  from tfpar.planner import calibrate  # pylint: disable=import-outside-toplevel
  base = TINY + [f"--train_steps={steps}", "--eval_every=0", "--checkpoint_every=1000",
                 "--jit_compile=false"]
  rate = calibrate.matmul_rate()
  measured = []
  for name, (flags, *_) in RUNS.items():
    model_dir = tempfile.mkdtemp()
    train_in_process(base + flags + [f"--model_dir={model_dir}"])
    times = [r["step_time"] for r in read_metrics(model_dir)][2:]  # After tracing.
    measured.append(float(np.median(times)))
  cfg = make_config(base + ["--model_dir=/tmp/unused"])
  configs = [(d, k, t, mb, False, cfg.train.global_batch_size) for _, d, k, t, mb in RUNS.values()]
  predicted, op_seconds = calibrate.predict(cfg.model, rate, configs, reference=0,
                                            measured_reference=measured[0],
                                            global_batch=cfg.train.global_batch_size)
  print(f"matmul rate {rate / 1e9:.1f} GFLOP/s (512^2 float32, no XLA); op_seconds solved from "
        f"the first run: {op_seconds * 1e3:.3f} ms per block and pass")
  print(f"{'plan':<22}{'predicted ms':>14}{'measured ms':>13}")
  for name, p, m in zip(RUNS, predicted, measured):
    print(f"{name:<22}{p * 1e3:>14.1f}{m * 1e3:>13.1f}")
  same = list(np.argsort(predicted)) == list(np.argsort(measured))
  print(f"order of step times: predicted {list(np.argsort(predicted))}, measured "
        f"{list(np.argsort(measured))} -> {'same' if same else 'different'}")


if __name__ == "__main__":
  main(sys.argv[1:])
