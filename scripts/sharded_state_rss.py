"""No process holds the whole state: 4 worker processes as 4 pipeline stages and as 4 zero3
data-parallel replicas, peak RSS each, a checkpoint carried between the two layouts.

Runs, each worker a process of its own (TF_CONFIG on loopback ports), its peak
resident memory taken from the kernel (`os.wait4`'s ru_maxrss). L is --layout
(pipeline: 4 stages under --schedule over 4 micro-batches; zero3: 4 replicas),
O the other one:

  tiny, tiny_other  L's and O's jobs with a tiny model (d_model 32, the model's
            blocks, or --tiny_num_layers): what a process costs without state;
  train     L from scratch, --steps=S, a checkpoint at S/2 and S (every process
            writing its own slices);
  resume    L from train's checkpoint of step S/2: the loss per step must be
            train's (relative 1e-5);
  other     O from train's checkpoint of step S/2 (O reads L's slices), a
            checkpoint every step: train's losses again;
  back      L from other's checkpoint of step S-1 (written by O): train's loss at S;
  one       with --one, one process restores train's last checkpoint whole.

The report also gives the data files of each job's last checkpoint (`bundle_mib`): one per
process that wrote its slices.

Bound: each process's peak < the same process's peak in its layout's tiny job
+ 1.5 x its share of the state (float32 weights, AdamW m and v, gradients: 16
bytes per parameter of the stage it holds, or of its rows under zero3; for
`one`, the whole model's).

  nice -n 10 python scripts/sharded_state_rss.py                   # ~400M params, several GiB
  python scripts/sharded_state_rss.py --d_model=512 --num_layers=16 --steps=4
  python scripts/sharded_state_rss.py --d_model=1024 --num_layers=8 --train_only

Every job runs under --host_allocator (default system: TensorFlow's tensors in malloc's
own mappings, so a process's resident memory follows the tensors alive; bfc, TensorFlow's
default pool, keeps its high-water mark, fragments included: docs/sharded_state.md).
--train_only runs the tiny and train jobs alone (the step's memory, without the restores);
--no_resume skips the resume job, --no_other the other layout's jobs (tiny_other, other, back).
Under --schedule=gpipe a stage worker may run two backward units at once, each with its
stage's gradients (tfpar.parallel.stage_program). Prints one JSON object (and
--out=FILE writes it); exit status 1 when a bound or a check fails.
"""

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # tfpar (bundle_bytes), run from any directory.
WORKERS = 4
TINY = ["--d_model=32", "--num_heads=4", "--d_ff=64"]  # And --tiny_num_layers blocks.
LAYOUTS = ("pipeline", "zero3")


def model_flags(a):
  return [f"--num_layers={a.num_layers}", f"--d_model={a.d_model}",
          f"--num_heads={max(1, a.d_model // 64)}", f"--d_ff={4 * a.d_model}"]


def common(a, steps, every=None):
  # --input_sharding=data: every layout's step reads the same global batch (step for step).
  return ["--dropout=0", "--seq_len=32", "--global_batch_size=8", "--steps_per_call=1",
          "--log_every=1", "--input_sharding=data",
          "--eval_every=0", "--eval_steps=0", "--learning_rate=1e-3", "--warmup_steps=1",
          f"--train_steps={steps}", f"--checkpoint_every={every or a.steps // 2}",
          "--keep_checkpoints=5", "--jit_compile=false", f"--async_checkpoint={a.async_checkpoint}",
          f"--host_allocator={a.host_allocator}"]


def free_ports(n):
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def layout_flags(layout, schedule):
  return (["--optimizer_sharding=zero3"] if layout == "zero3" else
          [f"--pipeline_stages={WORKERS}", "--microbatches=4", f"--pipeline_schedule={schedule}"])


def run_job(flags, workers, log, wrap=""):
  """Runs `python -m tfpar.train flags` as `workers` processes, worker 0's command behind the
  `wrap` command's words; ([peak RSS bytes], output)."""
  env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
  procs = []
  if workers > 1:
    hosts = [f"127.0.0.1:{p}" for p in free_ports(workers)]
    flags = flags + ["--strategy=multi_worker_mirrored"]
  else:
    flags = flags + ["--strategy=one_device"]
  for i in range(workers):
    if workers > 1:
      env = dict(env, TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                            "task": {"type": "worker", "index": i}}))
    out = open(f"{log}.{i}", "w+", encoding="utf-8")  # pylint: disable=consider-using-with
    command = [sys.executable, "-m", "tfpar.train", *flags]
    if i == 0 and wrap:
      command = shlex.split(wrap) + command
    procs.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                   stderr=subprocess.STDOUT), out))
  peaks, text, codes = [], [], []
  for proc, out in procs:
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    codes.append(proc.returncode)
    peaks.append(usage.ru_maxrss * 1024)
    out.seek(0)
    text.append(out.read())
    out.close()
  if any(codes):
    raise SystemExit(f"{flags}: exit statuses {codes}\n" + text[0][-4000:] + text[-1][-2000:])
  return peaks, text[0]


def losses(model_dir):
  with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def shares(model_dir):
  """[16 bytes x parameters process k holds] (float32 weights, m, v, gradients) from plan.json:
  stage k's, or (zero3) a replica's rows, as measured."""
  with open(os.path.join(model_dir, "plan.json"), encoding="utf-8") as f:
    plan = json.load(f)
  if "stages" in plan:
    return [16 * s["parameters"] for s in plan["stages"]]
  (held,) = plan["measured_bytes_per_device"].values()
  return [4 * held["parameters"]] * WORKERS


def bundle_bytes(model_dir):
  """Bytes of each data file of `model_dir`'s newest checkpoint (the one a restore takes): one
  per process that wrote slices of it (MergeV2Checkpoints joins their indexes, not their
  data)."""
  from tfpar import storage  # pylint: disable=import-outside-toplevel
  from tfpar.training.checkpoint import list_checkpoints  # pylint: disable=import-outside-toplevel
  (_, prefix), *_ = list_checkpoints(os.path.join(model_dir, "checkpoints"))
  return sorted(storage.size(path) for path in storage.glob(prefix + ".data-*"))


def copy_before(source, target, step):
  """`source`'s model dir as `target`, without its checkpoints after `step` (the checkpoints'
  files hard links: a save writes new files and renames them into place, never into one)."""
  ckpt = os.sep + "checkpoints" + os.sep
  shutil.copytree(source, target, copy_function=lambda src, dst: (
      os.link(src, dst) if ckpt in src else shutil.copy2(src, dst)))
  ckpts = os.path.join(target, "checkpoints")
  for name in os.listdir(ckpts):
    if name.startswith("ckpt-") and int(name[5:].split(".")[0]) > step:
      os.remove(os.path.join(ckpts, name))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_layers", type=int, default=8)
  parser.add_argument("--d_model", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=4, help="S: even, at least 4")
  parser.add_argument("--layout", choices=LAYOUTS, default="pipeline",
                      help="L, the layout that trains from scratch (the other restores it)")
  parser.add_argument("--async_checkpoint", choices=("true", "false"), default="true")
  parser.add_argument("--host_allocator", choices=("system", "bfc"), default="system",
                      help="every job's --host_allocator (system: resident memory follows the "
                      "tensors alive; bfc, TensorFlow's default pool, keeps its high-water mark)")
  parser.add_argument("--no_resume", action="store_true",
                      help="skip the resume job (other and back still resume, across layouts)")
  parser.add_argument("--no_other", action="store_true",
                      help="skip tiny_other, other and back (train and its resume only)")
  parser.add_argument("--train_only", action="store_true",
                      help="the tiny and train jobs only (module docstring)")
  parser.add_argument("--one", action="store_true",
                      help="also one process restoring train's last checkpoint whole")
  parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"),
                      help="the stages' schedule (1F1B runs each worker's units one at a time; "
                      "GPipe's may run two backwards at once, each with its stage's gradients)")
  parser.add_argument("--tiny_num_layers", type=int, default=0,
                      help="the tiny jobs' blocks (0: the model's, whose graph and per-block "
                      "collectives the tiny jobs then pay alike)")
  parser.add_argument("--wrap", default="",
                      help="a command that runs train's worker 0, e.g. 'heaptrack -o FILE' "
                      "(what is alive at its peak; the wrapper's memory then counts in its RSS)")
  parser.add_argument("--out", default="")
  parser.add_argument("--work_dir", default="")
  a = parser.parse_args(argv)
  if a.steps < 4 or a.steps % 2:
    parser.error("--steps: an even number, at least 4 (checkpoints at S/2, S/2+1, ..., S)")
  if a.train_only:
    a.no_resume = a.no_other = True
  work = a.work_dir or tempfile.mkdtemp(prefix="sharded_state_rss_")
  os.makedirs(work, exist_ok=True)
  names = ("tiny", "train", "resume", "tiny_other", "other", "back", "one", "one_tiny")
  d = {name: os.path.join(work, name) for name in names}
  other = LAYOUTS[1 - LAYOUTS.index(a.layout)]
  own, theirs = layout_flags(a.layout, a.schedule), layout_flags(other, a.schedule)
  S, half = a.steps, a.steps // 2
  base, model = common(a, S), model_flags(a)
  tiny = TINY + [f"--num_layers={a.tiny_num_layers or a.num_layers}"]
  report = {"model": model, "workers": WORKERS, "steps": S, "layout": a.layout,
            "other_layout": other, "schedule": a.schedule, "async_checkpoint": a.async_checkpoint,
            "host_allocator": a.host_allocator}
  peaks, checks = {}, {}
  run = lambda name, flags, workers=WORKERS, wrap="": run_job(
      flags + [f"--model_dir={d[name]}"], workers, d[name], wrap)
  peaks["tiny"], _ = run("tiny", base + tiny + own)
  peaks["train"], _ = run("train", base + model + own, wrap=a.wrap)
  share = dict.fromkeys(("train", "resume", "back"), shares(d["train"]))
  want = losses(d["train"])

  def resumed(name, step, out, steps):
    """Whether job `name` resumed at `step` and logged train's loss at each of `steps`."""
    got = losses(d[name])
    return (f"resumed from {d[name]}/checkpoints/ckpt-{step} at step {step}" in out and
            all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in steps))

  if not a.no_resume:
    copy_before(d["train"], d["resume"], half)
    peaks["resume"], out = run("resume", base + model + own)
    checks["resumed_exactly"] = resumed("resume", half, out, range(half + 1, S + 1))
  if not a.no_other:
    peaks["tiny_other"], _ = run("tiny_other", base + tiny + theirs)
    copy_before(d["train"], d["other"], half)
    peaks["other"], out = run("other", common(a, S, every=1) + model + theirs)
    checks[f"{other}_resumed_{a.layout}s_exactly"] = resumed("other", half, out,
                                                             range(half + 1, S + 1))
    share["other"] = shares(d["other"])
    copy_before(d["other"], d["back"], S - 1)
    peaks["back"], out = run("back", base + model + own)
    checks[f"{a.layout}_resumed_{other}s_exactly"] = resumed("back", S - 1, out, [S])
  if a.one:
    copy_before(d["train"], d["one"], S)
    peaks["one"], out = run("one", common(a, S + 1) + model, 1)
    checks["restored_whole_in_one_process"] = resumed("one", S, out, [])
    peaks["one_tiny"], _ = run("one_tiny", common(a, S + 1) + tiny, 1)
    share["one"] = [sum(share["train"])]
  baseline = {"other": "tiny_other", "one": "one_tiny"}
  bounds = {name: [peaks[baseline.get(name, "tiny")][w] + 1.5 * x
                   for w, x in enumerate(share[name])] for name in peaks
            if name in share}
  checks["losses"] = {name: losses(d[name]) for name in ("train", "resume", "other", "back")
                      if os.path.exists(os.path.join(d[name], "metrics.jsonl"))}
  report["bundle_mib"] = {name: [round(b / 2**20, 1) for b in bundle_bytes(d[name])]
                          for name in share if name in peaks and name != "one"}
  return finish(a, report, peaks, share, bounds, checks, work)


def finish(a, report, peaks, share, bounds, checks, work):
  """Prints (and --out writes) the report; 0 if every bound and check held, else 1."""
  within = {name: all(p < b for p, b in zip(peaks[name], bounds[name])) for name in bounds}
  gib = lambda xs: [round(x / 2**30, 3) for x in xs]
  mib = lambda xs: [round(x / 2**20, 1) for x in xs]
  report.update(
      parameters=sum(share["train"]) // 16, state_gib=round(sum(share["train"]) / 2**30, 3),
      share_mib={k: mib(v) for k, v in share.items()},
      peak_rss_mib={k: mib(v) for k, v in peaks.items()},
      bound_mib={k: mib(v) for k, v in bounds.items()},
      peak_rss_gib={k: gib(v) for k, v in peaks.items()},
      bound_gib={k: gib(v) for k, v in bounds.items()}, within_bound=within, **checks,
      work_dir=work)
  text = json.dumps(report, indent=2)
  print(text)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      f.write(text)
  ok = all(within.values()) and all(v for k, v in checks.items() if k != "losses")
  if not a.work_dir:
    shutil.rmtree(work, ignore_errors=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
