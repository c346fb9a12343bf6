"""What one micro-batch's activation costs to cross from one worker process to another, on loopback.

    python scripts/cross_worker_transfer.py [--shapes=4x128x128,2x512x1024] [--n=50]

Starts two local processes (task 0 and 1 of a 2-worker TF_CONFIG on free
loopback ports) per mechanism and prints, per activation shape, the median
milliseconds per transfer over 3 timed loops of --n transfers each (one loop
untimed first), minus the same loop without the transfer:

  placement    one client, the producer's op on /job:worker/task:0, the
               consumer's on task 1; TensorFlow's graph send/recv over gRPC
               (the chief's one program tfpar ran until commit 1b6121c).
  collective   tfpar's design (tfpar.parallel.p2p): each process runs its own
               program and the activation goes by a TF collective broadcast
               between the two (CollectiveBcastSendV2/RecvV2, group_size=2,
               explicit group and instance keys), the ring implementation on CPUs.

Each transfer is a data dependence the consumer waits for (the loop sums one
element of what arrived). Numbers depend on the machine's load: say so beside them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar.cli.launch import free_ports  # pylint: disable=wrong-import-position


def timed(fn, n):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  fn(tf.constant(2)).numpy()
  runs = []
  for _ in range(3):
    start = time.perf_counter()
    fn(tf.constant(n)).numpy()
    runs.append((time.perf_counter() - start) / n * 1e3)
  return statistics.median(runs)


def placement(role, spec, shapes, n):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if role == 1:
    tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker", task_index=1)
    time.sleep(3600)
  tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec), job_name="worker",
                                            task_index=0)
  here, there = ("/job:worker/replica:0/task:0/device:CPU:0",
                 "/job:worker/replica:0/task:1/device:CPU:0")
  out = {}
  for shape in shapes:
    with tf.device(here):
      a = tf.Variable(tf.random.normal(shape))

    def loop(consumer):
      @tf.function
      def fn(n):
        acc = tf.zeros([])
        for i in tf.range(n):
          with tf.device(here):
            h = a + tf.cast(i, tf.float32)
          with tf.device(consumer):
            acc += tf.reduce_sum(h[:1, :1, :1])
        return acc
      return fn

    out[str(shape)] = timed(loop(there), n) - timed(loop(here), n)
  return out


def collective(role, spec, shapes, n):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  os.environ["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": "worker", "index": role}})
  tf.distribute.MultiWorkerMirroredStrategy()  # Starts the server, enables collectives.
  out = {}
  for key, shape in enumerate(shapes):
    a = tf.Variable(tf.random.normal(shape))

    def loop(send):
      @tf.function
      def fn(n):
        acc = tf.zeros([])
        for i in tf.range(n):
          h = a + tf.cast(i, tf.float32)
          if send is None:
            acc += tf.reduce_sum(h[:1, :1, :1])
            continue
          instance = tf.cast(i, tf.int32) + 1000 * (key + 1)
          if send:
            r = tf.raw_ops.CollectiveBcastSendV2(input=h, group_size=2, group_key=7,
                                                  instance_key=instance)
          else:
            r = tf.raw_ops.CollectiveBcastRecvV2(group_size=2, group_key=7, instance_key=instance,
                                                  shape=shape, T=tf.float32)
          acc += tf.reduce_sum(r[:1, :1, :1])
        return acc
      return fn

    moved = timed(loop(role == 0), n)
    out[str(shape)] = moved - timed(loop(None), n)
  return out if role == 0 else None


def child(args):
  spec = json.loads(args.spec)
  shapes = [[int(x) for x in s.split("x")] for s in args.shapes.split(",")]
  out = {"placement": placement, "collective": collective}[args.mechanism](
      args.role, spec, shapes, args.n)
  if out is not None:
    print("RESULT " + json.dumps(out), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="4x128x128,2x512x1024")
  parser.add_argument("--n", type=int, default=50)
  parser.add_argument("--mechanism", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--role", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.mechanism:
    return child(args)
  print("| mechanism | activation [B/M, S, d] | MiB | ms per transfer (median of 3) |")
  print("|---|---|---|---|")
  for mechanism in ("placement", "collective"):
    spec = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    cmd = lambda role: [sys.executable, __file__, f"--mechanism={mechanism}", f"--role={role}",
                        f"--spec={json.dumps(spec)}", f"--shapes={args.shapes}", f"--n={args.n}"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    peer = subprocess.Popen(cmd(1), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
      proc = subprocess.run(cmd(0), env=env, capture_output=True, text=True, timeout=900)
    finally:
      peer.kill()
      peer.wait()
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
      print(f"| {mechanism} | failed: {proc.stderr.strip().splitlines()[-1:]} | | |")
      continue
    for shape, ms in json.loads(lines[0][7:]).items():
      dims = json.loads(shape)
      mib = 4 * dims[0] * dims[1] * dims[2] / 2 ** 20
      print(f"| {mechanism} | {'x'.join(map(str, dims))} | {mib:.2f} | {ms:.2f} |", flush=True)


if __name__ == "__main__":
  main()
