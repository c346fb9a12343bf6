"""The outer loop: cadence of logs, evals and checkpoints around the engine's steps.

The loop never touches tensors or strategies; it asks the engine to run N
steps (N chosen so that each call ends exactly on the next log, eval or
checkpoint boundary) and records what came back. Between two calls it checks
for a preemption notice (tfpar.training.preemption): then every worker saves
at the same step and the loop raises `Preempted`.
"""

import os
import time

import numpy as np

from tfpar.config import Config
from tfpar.training import preemption
from tfpar.training.checkpoint import CanonicalCheckpointer
from tfpar.training.metrics import MetricsWriter, perplexity


def _count(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


def _comm(record: dict) -> str:
  """' | comm 12.3 of 394.0 KiB/step (32.0x)': gradient bytes per replica, sent of float32."""
  sent, full = record["comm_bytes"], record["comm_bytes_uncompressed"]
  if not full:
    return ""
  return f" | comm {sent / 1024:,.1f} of {full / 1024:,.1f} KiB/step ({full / sent:.1f}x)"


def _next_boundary(step: int, cfg: Config) -> int:
  t = cfg.train
  nexts = [t.train_steps, (step // t.log_every + 1) * t.log_every,
           (step // t.checkpoint_every + 1) * t.checkpoint_every]
  if t.eval_every:
    nexts.append((step // t.eval_every + 1) * t.eval_every)
  return min(nexts)


def run(cfg: Config, engine, *, is_chief: bool = True, worker_index: int = 0,
        num_workers: int = 1) -> dict:
  """Trains until cfg.train.train_steps, resuming from the latest checkpoint.

  Returns the last train and eval records. Raises preemption.Preempted after
  saving, when SIGTERM reached any worker.
  """
  t = cfg.train
  metrics = MetricsWriter(t.model_dir, enabled=is_chief)
  checkpointer = CanonicalCheckpointer(engine.layouts, os.path.join(t.model_dir, "checkpoints"),
                                       keep=t.keep_checkpoints, is_chief=is_chief,
                                       worker_index=worker_index)
  if checkpointer.restore():
    metrics.say(f"resumed from {checkpointer.latest} at step {engine.step}")
  step = engine.step
  metrics.drop_after(step)
  if step >= t.train_steps:
    metrics.say(f"already trained to step {step} (--train_steps={t.train_steps}): nothing to do")
    return {}
  iterator = engine.train_iterator(step)
  tokens_per_step = t.global_batch_size * cfg.model.seq_len
  window_losses, window_norms, window_traffic, window_time = [], [], [], 0.0
  last = {}
  agreement = preemption.Agreement(getattr(engine, "strategy", None))
  preemption.arm()
  while step < t.train_steps:
    n = min(t.steps_per_call, _next_boundary(step, cfg) - step)
    start = time.perf_counter()
    losses, norms = engine.train(iterator, n)
    elapsed = time.perf_counter() - start
    step += n
    window_losses.extend(losses.tolist())
    window_norms.extend(norms.tolist())
    window_traffic.extend(engine.traffic(s) for s in range(step - n + 1, step + 1))
    window_time += elapsed
    if not np.all(np.isfinite(losses)):
      metrics.say(f"warning: non-finite loss at step {step}")
    done = step >= t.train_steps
    # Every worker asks after every chunk (a collective when multi-worker), so all agree.
    preempted = not done and agreement.stop()
    if step % t.log_every == 0 or done or preempted:
      k = len(window_losses)
      record = {"kind": "train", "step": step, "loss": float(np.mean(window_losses)),
                "learning_rate": engine.learning_rate(), "grad_norm": float(np.mean(window_norms)),
                "tokens_per_sec": tokens_per_step * k / window_time,
                "step_time": window_time / k, "replicas": engine.num_replicas,
                "workers": num_workers,
                # Per replica per step, handed to the gradient collectives.
                "comm_bytes": float(np.mean([x.bytes for x in window_traffic])),
                "comm_bytes_uncompressed": float(np.mean([x.uncompressed for x in window_traffic]))}
      metrics.write(record)
      metrics.progress(step, t.train_steps, record["loss"], record["tokens_per_sec"],
                       record["step_time"],
                       _comm(record) + f" | {_count(engine.num_replicas, 'replica')} on "
                       f"{_count(num_workers, 'worker')}")
      last["train"] = record
      window_losses, window_norms, window_traffic, window_time = [], [], [], 0.0
    if preempted:  # Before eval: the grace period is for saving.
      path = checkpointer.save(step)
      who = "" if is_chief else f"worker {worker_index}: "
      print(f"tfpar: {who}preempted (SIGTERM), saved {path or 'its part'} at step {step}; "
            f"the next start resumes at step {step + 1}", flush=True)
      raise preemption.Preempted(step)
    if t.eval_steps and ((t.eval_every and step % t.eval_every == 0) or done):
      loss = engine.evaluate(engine.eval_iterator(), t.eval_steps)
      record = {"kind": "eval", "step": step, "loss": loss, "perplexity": perplexity(loss)}
      metrics.write(record)
      metrics.say(f"eval   {step:>6}/{t.train_steps} | loss {loss:.4f} | "
                  f"perplexity {record['perplexity']:.2f}")
      last["eval"] = record
    if step % t.checkpoint_every == 0 or done:
      path = checkpointer.save(step)
      if path:
        metrics.say(f"saved {path}")
  preemption.disarm()
  return last
