"""Measure what a multi_worker_mirrored worker does when its peer dies or hangs.

    python scripts/lose_a_peer.py --signal=KILL                           # a dead peer
    python scripts/lose_a_peer.py --signal=STOP --collective_timeout=30   # a frozen peer

Starts two `python -m tfpar.train` workers on 127.0.0.1 by hand (each its own
TF_CONFIG, no launcher: nobody stops the survivor), waits until worker 0 has
logged step 5, sends the signal to worker 1, and prints how long worker 0 took
to end, its exit status and its error line. docs/failures.md reports a run.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64", "--seq_len=32",
        "--global_batch_size=8", "--eval_steps=0", "--steps_per_call=1", "--log_every=1",
        "--jit_compile=false", "--train_steps=100000", "--checkpoint_every=100000",
        "--strategy=multi_worker_mirrored"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--signal", default="KILL", choices=["KILL", "STOP"])
  parser.add_argument("--collective_timeout", type=int, default=300)
  parser.add_argument("--give_up", type=float, default=600, help="seconds to wait for worker 0")
  args = parser.parse_args()
  ports = []
  for _ in range(2):
    with socket.socket() as s:
      s.bind(("", 0))
      ports.append(s.getsockname()[1])
  spec = {"worker": [f"127.0.0.1:{p}" for p in ports]}
  model_dir = tempfile.mkdtemp(prefix="lose_a_peer_")
  procs, logs = [], []
  for index in range(2):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CONFIG=json.dumps(
        {"cluster": spec, "task": {"type": "worker", "index": index}}))
    log = open(os.path.join(model_dir, f"worker_{index}.log"), "w+")
    logs.append(log)
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "tfpar.train", *TINY, f"--model_dir={model_dir}",
         f"--collective_timeout={args.collective_timeout}"], env=env, cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT))
  try:
    while not re.search(r"^step +5/", open(logs[0].name).read(), re.M):
      if procs[0].poll() is not None:
        sys.exit(f"worker 0 ended before step 5; see {logs[0].name}")
      time.sleep(0.2)
    os.kill(procs[1].pid, getattr(signal, f"SIG{args.signal}"))
    start = time.monotonic()
    try:
      code = procs[0].wait(args.give_up)
    except subprocess.TimeoutExpired:
      code = None
    elapsed = time.monotonic() - start
    error = [line for line in open(logs[0].name) if line.startswith("tfpar.train: error")]
    print(f"SIG{args.signal} to worker 1: worker 0 "
          + (f"exited {code} after {elapsed:.0f} s" if code is not None
             else f"still running after {args.give_up:.0f} s"))
    print(error[-1].strip() if error else f"(no tfpar error line; log: {logs[0].name})")
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
  main()
