"""No process holds the whole state: 4 worker processes as 4 pipeline stages (--layout=pipeline)
or as 4 zero3 data-parallel replicas (--layout=zero3), peak RSS each.

Runs, each worker a process of its own (TF_CONFIG on loopback ports), its peak
resident memory taken from the kernel (`os.wait4`'s ru_maxrss):

  tiny      the same job with a tiny model (d_model 32, --tiny_num_layers blocks: 4,
            or the model's): what a process costs without state;
  train     the model, --train_steps=STEPS, a checkpoint every STEPS/2 steps
            (every process writing its own slices);
  resume    a copy of `train` without its last checkpoint: resumes at STEPS/2
            and must log the same loss per step (1e-5);
  one       one process restores train's checkpoint as one device, one more step;
  back      the 4 workers restore one's checkpoint, one more step;
  one_tiny  one process, tiny model (the bound of `one`).

Bound: each process's peak < the tiny job's peak of the same process + 1.5 x its
share of the state (float32 weights, AdamW m and v, gradients: 16 bytes per
parameter of the stage it holds, or of its rows under zero3; for `one`, the
whole model's).

  nice -n 10 python scripts/sharded_state_rss.py                  # ~400M params, several GiB
  python scripts/sharded_state_rss.py --d_model=256 --num_layers=4 --steps=4
  python scripts/sharded_state_rss.py --d_model=256 --num_layers=4 --steps=4 --layout=zero3
  python scripts/sharded_state_rss.py --d_model=512 --num_layers=4 --steps=4 --train_only

The stages run 1F1B over 4 micro-batches (--schedule; under GPipe a worker may run two
backward units at once, each with its stage's gradients: tfpar.parallel.stage_program).
--train_only runs the tiny and train jobs alone (the step's memory, without the restores).
Prints one JSON object (and --out=FILE writes it); exit status 1 when a bound
or the resume check fails.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 4
TINY = ["--d_model=32", "--num_heads=4", "--d_ff=64"]  # And --tiny_num_layers blocks.


def model_flags(a):
  return [f"--num_layers={a.num_layers}", f"--d_model={a.d_model}",
          f"--num_heads={max(1, a.d_model // 64)}", f"--d_ff={4 * a.d_model}"]


def common(a, steps):
  return ["--dropout=0", "--seq_len=32", "--global_batch_size=8", "--steps_per_call=1", "--log_every=1",
          "--eval_every=0", "--eval_steps=0", "--learning_rate=1e-3", "--warmup_steps=1",
          f"--train_steps={steps}", f"--checkpoint_every={max(1, a.steps // 2)}",
          "--keep_checkpoints=5", "--jit_compile=false", f"--async_checkpoint={a.async_checkpoint}"]


def free_ports(n):
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def run_job(flags, workers, log, layout="pipeline", schedule="1f1b"):
  """Runs `python -m tfpar.train flags` as `workers` processes; ([peak RSS bytes], output)."""
  env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
  procs = []
  if workers > 1:
    hosts = [f"127.0.0.1:{p}" for p in free_ports(workers)]
    flags = flags + ["--strategy=multi_worker_mirrored"] + (
        ["--optimizer_sharding=zero3"] if layout == "zero3" else
        [f"--pipeline_stages={workers}", "--microbatches=4",
         f"--pipeline_schedule={schedule}"])
  else:
    flags = flags + ["--strategy=one_device"]
  for i in range(workers):
    if workers > 1:
      env = dict(env, TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                            "task": {"type": "worker", "index": i}}))
    out = open(f"{log}.{i}", "w+", encoding="utf-8")  # pylint: disable=consider-using-with
    procs.append((subprocess.Popen([sys.executable, "-m", "tfpar.train", *flags], cwd=REPO,
                                   env=env, stdout=out, stderr=subprocess.STDOUT), out))
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


def stage_share(model_dir):
  """[16 bytes x parameters process k holds] (float32 weights, m, v, gradients) from plan.json:
  stage k's, or (zero3) a replica's rows, as measured."""
  with open(os.path.join(model_dir, "plan.json"), encoding="utf-8") as f:
    plan = json.load(f)
  if "stages" in plan:
    return [16 * s["parameters"] for s in plan["stages"]]
  (held,) = plan["measured_bytes_per_device"].values()
  return [4 * held["parameters"]] * WORKERS


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_layers", type=int, default=8)
  parser.add_argument("--d_model", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--layout", choices=("pipeline", "zero3"), default="pipeline")
  parser.add_argument("--async_checkpoint", choices=("true", "false"), default="true",
                      help="false: each save is written before the next step (on a CPU a "
                           "background write overlapping the update holds one more copy of the "
                           "process's weights, m and v)")
  parser.add_argument("--train_only", action="store_true",
                      help="the tiny and train jobs only (module docstring)")
  parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"),
                      help="--layout=pipeline: the stages' schedule (1F1B runs each worker's "
                      "units one at a time; GPipe's may run two backwards at once, each "
                      "with its stage's gradients)")
  parser.add_argument("--tiny_num_layers", type=int, default=4,
                      help="the tiny job's blocks (0: the model's, whose graph and "
                      "per-block collectives the tiny job then pays alike)")
  parser.add_argument("--out", default="")
  parser.add_argument("--work_dir", default="")
  a = parser.parse_args(argv)
  work = a.work_dir or tempfile.mkdtemp(prefix="sharded_state_rss_")
  os.makedirs(work, exist_ok=True)
  d = {name: os.path.join(work, name) for name in
       ("tiny", "train", "resume", "one", "back", "one_tiny")}
  base, model = common(a, a.steps), model_flags(a)
  tiny = TINY + [f"--num_layers={a.tiny_num_layers or a.num_layers}"]
  report = {"model": model, "workers": WORKERS, "steps": a.steps, "layout": a.layout,
            "schedule": a.schedule if a.layout == "pipeline" else None,
            "async_checkpoint": a.async_checkpoint}
  run = lambda flags, workers, log: run_job(flags, workers, log, a.layout, a.schedule)
  peaks = {}
  peaks["tiny"], _ = run(base + tiny + [f"--model_dir={d['tiny']}"], WORKERS, d["tiny"])
  peaks["train"], _ = run(base + model + [f"--model_dir={d['train']}"], WORKERS, d["train"])
  share = stage_share(d["train"])
  if a.train_only:
    return finish(a, report, peaks, share, {"train": [peaks["tiny"][w] + 1.5 * share[w]
                                                      for w in range(WORKERS)]}, {}, work)
  half = max(1, a.steps // 2)
  shutil.copytree(d["train"], d["resume"])
  for name in os.listdir(os.path.join(d["resume"], "checkpoints")):
    if name.startswith(f"ckpt-{a.steps}."):
      os.remove(os.path.join(d["resume"], "checkpoints", name))
  peaks["resume"], out = run(base + model + [f"--model_dir={d['resume']}"], WORKERS,
                                 d["resume"])
  resumed_at = f"resumed from {d['resume']}/checkpoints/ckpt-{half} at step {half}" in out
  want, got = losses(d["train"]), losses(d["resume"])
  steps = [s for s in range(half + 1, a.steps + 1)]
  resume_ok = resumed_at and all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in steps)
  shutil.copytree(d["train"], d["one"])
  peaks["one"], out = run(common(a, a.steps + 1) + model + [f"--model_dir={d['one']}"], 1,
                              d["one"])
  one_ok = f"resumed from {d['one']}/checkpoints/ckpt-{a.steps} at step {a.steps}" in out
  shutil.copytree(d["one"], d["back"])
  peaks["back"], out = run(common(a, a.steps + 2) + model + [f"--model_dir={d['back']}"],
                               WORKERS, d["back"])
  back_ok = f"resumed from {d['back']}/checkpoints/ckpt-{a.steps + 1} at step {a.steps + 1}" in out
  peaks["one_tiny"], _ = run(common(a, a.steps + 1) + tiny + [f"--model_dir={d['one_tiny']}"],
                                 1, d["one_tiny"])
  bounds = {name: [peaks["tiny"][w] + 1.5 * share[w] for w in range(WORKERS)]
            for name in ("train", "resume", "back")}
  bounds["one"] = [peaks["one_tiny"][0] + 1.5 * sum(share)]
  checks = dict(resumed_exactly=resume_ok, losses={"train": want, "resume": got},
                restored_as_one_device=one_ok, restored_back_as_4_stages=back_ok)
  return finish(a, report, peaks, share, bounds, checks, work)


def finish(a, report, peaks, share, bounds, checks, work):
  """Prints (and --out writes) the report; 0 if every bound and check held, else 1."""
  within = {name: all(p < b for p, b in zip(peaks[name], bounds[name])) for name in bounds}
  gib = lambda xs: [round(x / 2**30, 3) for x in xs]
  report.update(
      parameters=sum(share) // 16, state_gib=round(sum(share) / 2**30, 3),
      share_gib=gib(share), peak_rss_gib={k: gib(v) for k, v in peaks.items()},
      peak_rss_mib={k: [round(x / 2**20, 1) for x in v] for k, v in peaks.items()},
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
