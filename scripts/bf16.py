"""Where bfloat16 is fast on this CPU (AVX512_BF16), each case in its own process.

    python scripts/bf16.py --sections=matmul --rounds=3 --out=bf16.json
    python scripts/bf16.py --sections=step --rounds=2 --steps=10 --warmup=3
    python scripts/bf16.py --sections=loss --png=docs/bf16_loss.png

Three tables (`--sections`):

  * matmul: GFLOP/s of float32 and bfloat16 matmuls at the benchmark GPT's
    shapes ([4096, 256] x [256, 768] the fused Q/K/V projection, x [256, 1024]
    the MLP's up projection, [4096, 1024] x [1024, 256] its down projection,
    and a 2048^2) under each backend (BACKENDS): XLA's CPU dot as TensorFlow
    2.21 ships it, XLA with its dots handed to another library through
    XLA_FLAGS, and TensorFlow's own kernels without XLA (oneDNN, which
    TF_ENABLE_ONEDNN_OPTS turns on by default on x86, and Eigen with it off).
    A case is one (backend, dtype): a child process that times each shape
    (the best of up to 10 calls of one `tf.function`, as scripts/bench.py's
    peak) and checks its result against float64 products of the same inputs.
  * step: tfpar's whole training step on the benchmark GPT (scripts/bench.py's
    peer shapes, its `--only` children: tfpar as it is, tfpar_xla, tfpar_noxla
    and tfpar_onednn of its `precision` section) under float32 and
    mixed_bfloat16, with XLA, with XLA's auto-clustering of the fusible ops
    only (--xla_auto_clustering), without XLA at all, or in a BACKENDS
    environment (`--step_cases`): tokens/s medians and the ratio to float32
    with XLA.
  * loss: configs/gpt_tiny.flags trained `--loss_steps` steps in float32 and
    in mixed_bfloat16 by the CLI (scripts/bench_dp.run_one), each in its own
    process; prints both curves' final losses and draws them (`--png`).

Rounds alternate the cases, so a drift in the machine's load hits them alike;
every row carries the 1-minute load average around its children. The numbers
mean something only on an idle machine: read the load column.
"""

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # pylint: disable=wrong-import-position  (its flags: --sections, --rounds, --steps,
# --warmup, --quick, --out)
import bench_dp  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("backends", None, "Only these BACKENDS in the matmul table (default: all).")
flags.DEFINE_list("step_cases", ["tfpar:float32", "tfpar_xla:mixed_bfloat16",
                                 "tfpar_onednn:mixed_bfloat16", "tfpar:mixed_bfloat16"],
                  "Step table cases, SYSTEM[@ENV]:PRECISION; @ENV runs the child in the "
                  "environment of that BACKENDS entry (e.g. "
                  "tfpar@xla_eigen:mixed_bfloat16).")
flags.DEFINE_integer("loss_steps", 200, "Steps of each loss-curve run.")
flags.DEFINE_string("png", None, "Draw the loss curves here.")
flags.DEFINE_string("case", None, "Child mode: BACKEND:DTYPE, one matmul case.")

# (m, k, n): [m, k] x [k, n]; the benchmark GPT's (batch 16 x seq 256 = 4096 rows, d 256).
SHAPES = [(4096, 256, 768), (4096, 256, 1024), (4096, 1024, 256), (2048, 2048, 2048)]
QUICK_SHAPES = [(64, 32, 96), (128, 128, 128)]


@dataclasses.dataclass(frozen=True)
class Backend:
  """How a child computes its matmuls: XLA or not, and the environment TensorFlow starts in."""
  jit_compile: bool
  env: Dict[str, str]
  text: str


YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="  # An empty list: no YNNPACK dots.
BACKENDS = {
    "xla": Backend(True, {}, "XLA's CPU dot as shipped (its default library rewrites)"),
    "xla_eigen": Backend(True, {"XLA_FLAGS": YNN_OFF}, "XLA, YNNPACK off: Eigen's dot"),
    "xla_xnn": Backend(True, {"XLA_FLAGS": f"{YNN_OFF} --xla_cpu_experimental_xnn_fusion_type=dot"},
                       "XLA, its dots to XNNPACK"),
    "xla_onednn": Backend(
        True, {"XLA_FLAGS": f"{YNN_OFF} --xla_cpu_experimental_onednn_fusion_type=dot"},
        "XLA, its dots to oneDNN (fusion type dot)"),
    "xla_onednn_thunk": Backend(True, {"XLA_FLAGS": "--xla_cpu_use_onednn=true"},
                                "XLA with --xla_cpu_use_onednn"),
    "tf_onednn": Backend(False, {"TF_ENABLE_ONEDNN_OPTS": "1"},
                         "TensorFlow without XLA, oneDNN kernels (the x86 default)"),
    "tf_eigen": Backend(False, {"TF_ENABLE_ONEDNN_OPTS": "0"},
                        "TensorFlow without XLA, oneDNN off: Eigen kernels"),
}
DTYPES = ("float32", "bfloat16")


# --- matmul: one child per (backend, dtype) -------------------------------------------


def matmul_case(backend: str, dtype: str) -> dict:
  """Child: GFLOP/s and relative error of each shape's matmul under `backend` in `dtype`."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  jit = BACKENDS[backend].jit_compile
  out = {"backend": backend, "dtype": dtype, "pid": os.getpid(), "shapes": {}}
  for m, k, n in (QUICK_SHAPES if FLAGS.quick else SHAPES):
    a = tf.cast(tf.random.normal([m, k], seed=1), dtype)
    b = tf.cast(tf.random.normal([k, n], seed=2), dtype)
    matmul = tf.function(lambda a, b: tf.matmul(a, b), jit_compile=jit)
    c = matmul(a, b)  # Compiles (XLA) or traces; on CPU the call returns once computed.
    exact = a.numpy().astype(np.float64) @ b.numpy().astype(np.float64)
    error = float(np.abs(c.numpy().astype(np.float64) - exact).max() / np.abs(exact).max())
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 10 and (calls < 3 or spent < 3.0):
      start = time.perf_counter()
      matmul(a, b)
      took = time.perf_counter() - start
      best, spent, calls = min(best, took), spent + took, calls + 1
    entry = {"gflops": 2 * m * k * n / best / 1e9, "rel_error": error, "calls": calls}
    if jit:  # Which kernel XLA chose: the optimised HLO's dot, fusion or custom call.
      hlo = matmul.experimental_get_compiler_ir(a, b)(stage="optimized_hlo")
      entry["hlo"] = [l.strip()[:120] for l in hlo.splitlines()
                      if any(w in l for w in (" dot(", "custom-call(", "kind=kCustom"))]
    out["shapes"][f"{m}x{k}x{n}"] = entry
  return out


def matmul_table(runs: List[dict]) -> str:
  """Per backend and shape: float32 and bfloat16 GFLOP/s (medians over rounds) and their ratio."""
  shapes = list(runs[0]["shapes"])
  lines = ["| backend | shape (m x k x n) | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 / f32 "
           "| bf16 rel. error | load 1 min |", "|---|---|---:|---:|---:|---:|---|"]
  for backend in dict.fromkeys(r["backend"] for r in runs):
    mine = [r for r in runs if r["backend"] == backend]
    loads = [x for r in mine for x in r["load_1min"]]
    for shape in shapes:
      med = {d: statistics.median(r["shapes"][shape]["gflops"] for r in mine if r["dtype"] == d)
             for d in DTYPES if any(r["dtype"] == d for r in mine)}
      err = max((r["shapes"][shape]["rel_error"] for r in mine if r["dtype"] == "bfloat16"),
                default=float("nan"))
      cell = lambda d: f"{med[d]:.0f}" if d in med else "-"
      ratio = f"{med['bfloat16'] / med['float32']:.2f}x" if len(med) == 2 else "-"
      lines.append(f"| {backend} | {shape} | {cell('float32')} | {cell('bfloat16')} | {ratio} | "
                   f"{err:.1e} | {min(loads):.2f}-{max(loads):.2f} |")
  return "\n".join(lines)


def run_matmul() -> dict:
  names = FLAGS.backends or list(BACKENDS)
  unknown = [n for n in names if n not in BACKENDS]
  if unknown:
    raise app.UsageError(f"--backends: unknown {unknown}; known: {', '.join(BACKENDS)}")
  runs = []
  for i in range(FLAGS.rounds):
    for backend in names:
      for dtype in DTYPES:  # Alternated, so load drift hits every case alike.
        runs.append(bench.run_script(
            [os.path.abspath(__file__), f"--case={backend}:{dtype}"] +
            (["--quick"] if FLAGS.quick else []), BACKENDS[backend].env))
        r = runs[-1]
        print(f"  round {i + 1}: {backend} {dtype}: " + ", ".join(
            f"{s} {v['gflops']:.0f}" for s, v in r["shapes"].items()) +
              f" GFLOP/s, load {r['load_1min'][0]:.2f}->{r['load_1min'][1]:.2f}", flush=True)
  for backend in names:
    hlo = next(r["shapes"] for r in runs if r["backend"] == backend and r["dtype"] == "bfloat16")
    if "hlo" in next(iter(hlo.values())):
      print(f"{backend}, bfloat16, optimised HLO of the first shape: "
            f"{next(iter(hlo.values()))['hlo']}")
  print("\n## bfloat16 and float32 matmuls per backend (best of up to 10 calls per process, "
        f"median over {FLAGS.rounds} processes)")
  for backend in names:
    print(f"- {backend}: {BACKENDS[backend].text} {BACKENDS[backend].env or ''}")
  text = matmul_table(runs)
  print("\n" + text, flush=True)
  return {"runs": runs, "table": text}


# --- step: tfpar's whole training step, scripts/bench.py's children ----------------------


def run_step() -> dict:
  envs = {"": {}, **{name: b.env for name, b in BACKENDS.items()}}
  cases = []
  for case in FLAGS.step_cases:
    system, _, precision = case.partition(":")
    system, _, backend = system.partition("@")
    if backend not in envs or precision not in ("float32", "mixed_bfloat16"):
      raise app.UsageError(f"--step_cases: {case}: want SYSTEM[@ENV]:PRECISION, ENV one of "
                           f"{', '.join(e for e in envs if e)}")
    cases.append((case, system, precision, envs[backend]))
  runs = []
  for i in range(FLAGS.rounds):
    for case, system, precision, env in cases:
      r = bench.run_child(system, precision, env)
      r["case"] = case
      runs.append(r)
      print(f"  round {i + 1}: {case}: {r['tokens_per_sec']:,.0f} tokens/s, loss "
            f"{r['last_loss']:.4f}, load {r['load_1min'][0]:.2f}->{r['load_1min'][1]:.2f}",
            flush=True)
  med = {c[0]: statistics.median(r["tokens_per_sec"] for r in runs if r["case"] == c[0])
         for c in cases}
  reference = med.get("tfpar:float32")
  lines = ["| case | tokens/s median | per round | vs tfpar:float32 | last loss | load 1 min |",
           "|---|---:|---|---:|---:|---|"]
  for case, *_ in cases:
    mine = [r for r in runs if r["case"] == case]
    loads = [x for r in mine for x in r["load_1min"]]
    ratio = f"{med[case] / reference:.2f}x" if reference else "-"
    lines.append(f"| {case} | {med[case]:,.0f} | "
                 f"{', '.join(format(r['tokens_per_sec'], ',.0f') for r in mine)} | {ratio} | "
                 f"{mine[-1]['last_loss']:.4f} | {min(loads):.2f}-{max(loads):.2f} |")
  text = "\n".join(lines)
  shape = bench.QUICK if FLAGS.quick else bench.PEER
  print(f"\n## tfpar's training step, shapes {shape}: {FLAGS.warmup} warmup + {FLAGS.steps} "
        f"timed steps per process, {FLAGS.rounds} processes per case, alternated\n\n{text}",
        flush=True)
  return {"runs": runs, "table": text}


# --- loss: float32 against mixed_bfloat16 on gpt_tiny ----------------------------------


def run_loss() -> dict:
  steps = FLAGS.loss_steps
  shared = ["--flagfile=configs/gpt_tiny.flags", f"--train_steps={steps}", "--log_every=10",
            "--steps_per_call=10", "--eval_steps=0", f"--checkpoint_every={steps}", "--seed=0"]
  if FLAGS.quick:
    shared += bench_dp.QUICK
  curves = {}
  with tempfile.TemporaryDirectory(prefix="tfpar_bf16_loss_") as work:
    for precision in ("float32", "mixed_bfloat16"):
      load = os.getloadavg()[0]
      result = bench_dp.run_one(["tfpar.train", f"--precision={precision}"], shared,
                                os.path.join(work, precision), timeout=3600)
      result["load_1min"] = [load, os.getloadavg()[0]]
      curves[precision] = result
  f32, bf16 = (dict(curves[p]["loss_curve"]) for p in ("float32", "mixed_bfloat16"))
  gap = max(abs(bf16[s] - f32[s]) for s in f32)
  lines = ["| precision | final loss (step {}) | tokens/s | load 1 min |".format(steps),
           "|---|---:|---:|---|"]
  for precision, r in curves.items():
    lines.append(f"| {precision} | {r['final_loss']:.4f} | {r['tokens_per_sec']:,.0f} | "
                 f"{r['load_1min'][0]:.2f}-{r['load_1min'][1]:.2f} |")
  text = "\n".join(lines) + f"\n\nlargest |bf16 - f32| over the logged steps: {gap:.4f}"
  print(f"\n## gpt_tiny, {steps} steps, each precision in its own process\n\n{text}", flush=True)
  if FLAGS.png:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for precision, r in curves.items():
      ax.plot(*zip(*r["loss_curve"]), label=f"{precision} (final {r['final_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"configs/gpt_tiny.flags, {steps} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(FLAGS.png, dpi=80)
  return {"curves": curves, "table": text, "largest_gap": gap}


SECTIONS = {"matmul": run_matmul, "step": run_step, "loss": run_loss}
FLAGS.set_default("sections", list(SECTIONS))  # bench.py's flags, this script's tables.


def main(argv):
  del argv
  if FLAGS.case:
    backend, _, dtype = FLAGS.case.partition(":")
    print(bench.RESULT + json.dumps(matmul_case(backend, dtype)), flush=True)
    return
  unknown = [s for s in FLAGS.sections if s not in SECTIONS]
  if unknown:
    raise app.UsageError(f"--sections: unknown {unknown}; known: {', '.join(SECTIONS)}")
  report = {"command": " ".join(["python"] + sys.argv), "cpu_count": os.cpu_count(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
  for name in FLAGS.sections:
    report[name] = SECTIONS[name]()
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  app.run(main)
