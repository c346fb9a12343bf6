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
from tfpar.training.metrics import MetricsWriter


def _count(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


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

  The engine's task names the throughput unit (`<unit>_per_sec`, e.g.
  tokens_per_sec) and the held-out metrics. Returns the last train and eval
  records. Raises preemption.Preempted after saving, when SIGTERM reached any worker.
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
  task = engine.task
  rate_key = f"{task.unit}_per_sec"
  window_losses, window_norms, window_time = [], [], 0.0
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
                rate_key: task.units_per_step * k / window_time,
                "step_time": window_time / k, "replicas": engine.num_replicas,
                "workers": num_workers}
      metrics.write(record)
      metrics.progress(step, t.train_steps, record["loss"], record[rate_key], task.unit,
                       record["step_time"],
                       f" | {_count(engine.num_replicas, 'replica')} on {_count(num_workers, 'worker')}")
      last["train"] = record
      window_losses, window_norms, window_time = [], [], 0.0
    if preempted:  # Before eval: the grace period is for saving.
      path = checkpointer.save(step)
      who = "" if is_chief else f"worker {worker_index}: "
      print(f"tfpar: {who}preempted (SIGTERM), saved {path or 'its part'} at step {step}; "
            f"the next start resumes at step {step + 1}", flush=True)
      raise preemption.Preempted(step)
    if t.eval_steps and ((t.eval_every and step % t.eval_every == 0) or done):
      values = engine.eval_metrics(engine.eval_iterator(), t.eval_steps)
      record = {"kind": "eval", "step": step, **values}
      metrics.write(record)
      metrics.say(f"eval   {step:>6}/{t.train_steps} | " +
                  " | ".join(f"{name} {value:.4f}" for name, value in values.items()))
      last["eval"] = record
    if step % t.checkpoint_every == 0 or done:
      path = checkpointer.save(step)
      if path:
        metrics.say(f"saved {path}")
  preemption.disarm()
  return last
