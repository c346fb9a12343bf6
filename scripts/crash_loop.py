"""Runs one tfpar command N times and keeps what every native crash left (issue 33).

    nice -n 15 python scripts/crash_loop.py --repeats=50 --out=/tmp/crash_loop
    nice -n 15 python scripts/crash_loop.py --mode=gpipe4 --repeats=20 --out=/tmp/crash_loop4

--mode=xla_pipeline (default): configs/gpt_tiny.flags with --num_cpu_devices=2
--pipeline_stages=2 --microbatches=4 --jit_compile=true, 5 steps, in one process
(--small swaps in a 2-layer, d_model 64 model for a loaded machine).
--mode=gpipe4: the same model as a 4-worker GPipe launch (python -m tfpar.launch
--num_workers=4, one stage per worker).

Each run has its own --model_dir and PYTHONFAULTHANDLER=1, so a SIGSEGV or an
abort prints the Python stack of every thread to stderr; a run that ends by a
signal (or prints "Fatal Python error") keeps its whole stderr and stdout as
OUT/run_K.stderr. A run still going after --timeout seconds (a hang, or a
machine too loaded to finish it) is sent SIGABRT, so faulthandler prints where
every thread was, then killed: kept the same way, counted apart as "timeout",
with the CPU seconds it had used (a starved run has used few). The summary
counts exit statuses and names each crash's innermost Python frame of the
crashing thread.
"""

import argparse
import collections
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--num_layers=2", "--d_model=64", "--num_heads=4", "--seq_len=64",
         "--global_batch_size=8"]


def command(mode: str, small: bool, model_dir: str):
  model = ["--flagfile=configs/gpt_tiny.flags"] + (SMALL if small else [])
  run = ["--train_steps=5", "--steps_per_call=1", "--log_every=1", "--eval_every=0",
         "--checkpoint_every=5", f"--model_dir={model_dir}"]
  if mode == "xla_pipeline":
    return [sys.executable, "-m", "tfpar.train", *model, *run, "--num_cpu_devices=2",
            "--pipeline_stages=2", "--microbatches=4", "--jit_compile=true"]
  return [sys.executable, "-m", "tfpar.launch", "--num_workers=4", "--", *model, *run,
          "--strategy=multi_worker_mirrored", "--pipeline_stages=4", "--microbatches=4",
          "--pipeline_schedule=gpipe", "--num_layers=4", "--jit_compile=false"]


def crash_frame(stderr: str) -> str:
  """The innermost frame of the thread faulthandler names as crashing ('Current thread')."""
  block = stderr.split("Current thread", 1)[-1] if "Current thread" in stderr else stderr
  frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
  return f"{frames[0][0]}:{frames[0][1]} in {frames[0][2]}" if frames else "(no Python frame)"


def run_once(cmd, env, timeout):
  """(exit status or 'timeout', stdout, stderr, CPU seconds of the command and its children)."""
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err,
                            start_new_session=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
      code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      code = "timeout"
      os.killpg(proc.pid, signal.SIGABRT)  # faulthandler prints every thread's stack.
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    out.seek(0)
    err.seek(0)
    return code, out.read(), err.read(), cpu


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", choices=["xla_pipeline", "gpipe4"], default="xla_pipeline")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--out", default="/tmp/crash_loop")
  parser.add_argument("--timeout", type=int, default=900)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=REPO)
  statuses, crashes = collections.Counter(), []
  for k in range(args.repeats):
    model_dir = os.path.join(args.out, f"run_{k}")
    shutil.rmtree(model_dir, ignore_errors=True)
    start = time.monotonic()
    code, stdout, stderr, cpu = run_once(command(args.mode, args.small, model_dir), env,
                                         args.timeout)
    shutil.rmtree(model_dir, ignore_errors=True)
    crashed = (isinstance(code, int) and (code < 0 or code > 128)) or \
        "Fatal Python error" in stderr or code == "timeout"
    name = signal.Signals(-code).name if isinstance(code, int) and code < 0 else str(code)
    statuses[name] += 1
    if crashed:
      with open(os.path.join(args.out, f"run_{k}.stderr"), "w") as f:
        f.write(stderr + "\n--- stdout ---\n" + stdout)
      crashes.append((k, name, crash_frame(stderr)))
    print(f"run {k + 1}/{args.repeats}: exit {name} in {time.monotonic() - start:.0f} s "
          f"({cpu:.0f} CPU s)" + (f"  CRASH at {crashes[-1][2]}" if crashed else ""), flush=True)
  print(f"{args.mode}{' --small' if args.small else ''}: {args.repeats} runs, exit statuses "
        f"{dict(statuses)}; {len(crashes)} crash(es)")
  for k, name, frame in crashes:
    print(f"  run {k}: {name} at {frame} (stderr: {args.out}/run_{k}.stderr)")
  return 1 if crashes else 0


if __name__ == "__main__":
  sys.exit(main())
