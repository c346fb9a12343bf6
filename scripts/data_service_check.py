"""Does the tf.data service keep tfpar's sample order, and what does it cost?

    nice -n 10 python scripts/data_service_check.py --data=/tmp/prep --steps=200

Starts a tf.data service dispatcher and W workers on 127.0.0.1 in this process
(tf.data.experimental.service.DispatchServer / WorkerServer), then reads the
per-replica batches of one input pipeline (tfpar.data.pipeline.window_dataset
over a prepared set, or the embedded text when --data is empty) for --steps
steps three ways, each in its own round, rounds alternating:

  direct   the dataset iterated in this process (what training does);
  off      the same dataset sent to the service: distribute(processing_mode=
           ShardingPolicy.OFF, job_name=one per iteration), read back;
  dynamic  the same with ShardingPolicy.DYNAMIC (the dispatcher hands out
           splits of the position source);

and prints, for 1 and 2 service workers, whether each round's batches equal
the direct ones in order (the exactness tfpar needs: a sample's position is a
pure function of (seed, step, replica)), and the median batches/s of each.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tfpar import tokenizer
from tfpar.data import pipeline


def batches(ds, steps):
  return [x.numpy() for x, _ in ds.take(steps)]


def timed(make, steps):
  ds = make()
  start = time.perf_counter()
  out = batches(ds, steps)
  return out, steps / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--data", default="")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--batch", type=int, default=16)
  args = parser.parse_args()
  corpus = pipeline.load_corpus(args.data or None, seq_len=args.seq_len, eval_fraction=0.05,
                                tokenizer=tokenizer.load("bytes"))
  shard = pipeline.Shard(args.batch)

  def direct():
    return pipeline.window_dataset(corpus.train, args.seq_len, shard, seed=1)

  dispatcher = tf.data.experimental.service.DispatchServer(
      tf.data.experimental.service.DispatcherConfig(port=0))
  address = dispatcher.target.split("://")[1]
  workers = [tf.data.experimental.service.WorkerServer(
      tf.data.experimental.service.WorkerConfig(dispatcher_address=address))]
  jobs = iter(range(1 << 30))

  def service(policy):
    return lambda: direct().apply(tf.data.experimental.service.distribute(
        processing_mode=policy, service=dispatcher.target, job_name=f"pipeline-0-{next(jobs)}"))

  policies = tf.data.experimental.service.ShardingPolicy
  systems = {"direct": direct, "off": service(policies.OFF), "dynamic": service(policies.DYNAMIC)}

  want = batches(direct(), args.steps)
  for n in (1, 2):
    while len(workers) < n:
      workers.append(tf.data.experimental.service.WorkerServer(
          tf.data.experimental.service.WorkerConfig(dispatcher_address=address)))
      time.sleep(2)  # The dispatcher learns of the worker by its heartbeat.
    rates = {name: [] for name in systems}
    same = {name: [] for name in systems}
    for r in range(args.rounds):
      names = list(systems) if r % 2 == 0 else list(systems)[::-1]
      for name in names:
        got, rate = timed(systems[name], args.steps)
        rates[name].append(rate)
        same[name].append(len(got) == len(want) and all(np.array_equal(a, b)
                                                        for a, b in zip(got, want)))
    d = statistics.median(rates["direct"])
    for name in systems:
      r = statistics.median(rates[name])
      print(f"{n} service worker(s), {name}: equal to direct in order, per round: {same[name]}; "
            f"median {r:.1f} batches/s, ratio to direct {r / d:.2f}", flush=True)


if __name__ == "__main__":
  main()
