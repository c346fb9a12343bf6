"""The outer loop: cadence of logs, evals and checkpoints around the engine's steps.

The loop never touches tensors or strategies; it asks the engine to run N
steps (N chosen so that each call ends exactly on the next log, eval or
checkpoint boundary) and records what came back. Between two calls it checks
for a preemption notice (tfpar.training.preemption): then every worker saves
at the same step and the loop raises `Preempted`.

Non-finite steps (a NaN or infinite loss, or gradient norm). Under
`--on_nonfinite=stop` (the default) the loop names the first such step and
raises NonFiniteError before anything more is saved: the newest checkpoint is
the last good state, and CheckpointManager deletes old checkpoints only when it
writes a new one, so nothing good is lost (tfpar.train exits with status 3).
Under `--on_nonfinite=skip` the step itself dropped those updates
(tfpar.training.step.apply_or_skip); the loop counts them in metrics.jsonl
(`skipped_steps` in the window, `skipped_total`) and on the console. Either
way no checkpoint with a non-finite weight is ever written (the saver checks).
Under mixed_float16 a non-finite gradient is the loss scaler's business (it
skips the update and lowers the scale): only the loss counts there.
"""

import os
import time

import numpy as np
import tensorflow as tf

from tfpar.config.schema import Config
from tfpar.console import count as _count
from tfpar.training import memory, preemption
from tfpar.training.checkpoint import assign_canonical
from tfpar.training.metrics import MetricsWriter


class NonFiniteError(RuntimeError):
  """A step's loss or gradient norm was NaN or infinite under --on_nonfinite=stop."""


def nonfinite_steps(cfg: Config, losses: np.ndarray, norms: np.ndarray) -> np.ndarray:
  """Which of these steps count as non-finite (see the module docstring)."""
  bad = ~np.isfinite(losses)
  if cfg.train.precision != "mixed_float16":
    bad |= ~np.isfinite(norms)
  return bad


def _check_numerics(cfg: Config, step: int, losses, norms, metrics, directory: str) -> int:
  """Steps step+1.. just ran: raises NonFiniteError (stop) or returns how many were skipped."""
  bad = nonfinite_steps(cfg, losses, norms)
  if not bad.any():
    return 0
  first = int(np.argmax(bad))
  where = f"step {step + first + 1}: loss {losses[first]:.4g}, gradient norm {norms[first]:.4g}"
  if cfg.train.on_nonfinite == "stop":
    metrics.write({"kind": "nonfinite", "step": step + first + 1, "loss": float(losses[first]),
                   "grad_norm": float(norms[first])})
    raise NonFiniteError(
        f"{where} (--on_nonfinite=stop): stopped without saving; the newest checkpoint in "
        f"{directory} is the last good state. Lower --learning_rate or --clip_norm, check the "
        "data, or pass --on_nonfinite=skip to drop such steps")
  metrics.say(f"warning: skipped {_count(int(bad.sum()), 'non-finite step')} (first {where}): "
              "their updates were dropped")
  return int(bad.sum())


def _finite_mean(values) -> float:
  finite = [v for v in values if np.isfinite(v)]
  return float(np.mean(finite)) if finite else float("nan")


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
  if t.profile_steps:  # A call starts at the first traced step and ends at the last.
    nexts += [x for x in (t.profile_steps[0] - 1, t.profile_steps[1]) if x > step]
  return min(nexts)


def _init_from_preset(m, layouts) -> None:
  """Assigns every model copy the weights of the keras-hub preset --init_from (tfpar.hub)."""
  from tfpar.hub import preset  # pylint: disable=import-outside-toplevel  # keras-hub is slow.
  values = preset.load_weights(m.init_from, m)
  for layout in layouts:
    assign_canonical({name: layout[name] for name in values}, values)


def run(cfg: Config, engine, *, is_chief: bool = True, worker_index: int = 0,
        num_workers: int = 1, on_restored=None) -> dict:
  """Trains until cfg.train.train_steps, resuming from the latest checkpoint.

  The engine's task names the throughput unit (`<unit>_per_sec`, e.g.
  tokens_per_sec) and the held-out metrics. Returns the last train and eval
  records. Raises preemption.Preempted after saving, when SIGTERM or SIGINT reached
  any worker. Nothing is written to --model_dir before the restore has
  succeeded; then `on_restored()` runs (the runner records config.json there).
  """
  t = cfg.train
  metrics = MetricsWriter(t.model_dir, enabled=is_chief)
  checkpointer = engine.checkpointer(os.path.join(t.model_dir, "checkpoints"),
                                     keep=t.keep_checkpoints, is_chief=is_chief,
                                     worker_index=worker_index, background=t.async_checkpoint, log=metrics.say)
  try:
    return _train(cfg, engine, checkpointer, metrics, is_chief=is_chief,
                  worker_index=worker_index, num_workers=num_workers, on_restored=on_restored)
  except BaseException:
    checkpointer.wait(quietly=True)  # The write in flight finishes (a SIGTERM's exit 75 too).
    raise


def _train(cfg: Config, engine, checkpointer, metrics, *, is_chief, worker_index, num_workers,
           on_restored) -> dict:
  t = cfg.train
  restored = checkpointer.restore(log=metrics.say)
  if restored is None and cfg.model.init_from is not None:
    _init_from_preset(cfg.model, engine.layouts)
    metrics.say(f"initialised the model from the keras-hub preset {cfg.model.init_from}")
  if on_restored is not None:
    on_restored()
  step = engine.step
  engine.check_same_step(step)
  if restored:
    metrics.say(f"resumed from {restored} at step {step}")
  metrics.say(memory.record_process(t.model_dir, "at start-up", worker_index,
                                    engine.predicted_memory(), write=is_chief))
  metrics.drop_after(step)
  if step >= t.train_steps:
    metrics.say(f"already trained to step {step} (--train_steps={t.train_steps}): nothing to do")
    return {}
  iterator = engine.train_iterator(step)
  task = engine.task
  rate_key = f"{task.unit}_per_sec"
  window_losses, window_norms, window_traffic, window_time = [], [], [], 0.0
  window_skipped, skipped_total = 0, 0
  # The first call of a process traces and compiles (seconds to minutes): the ETA leaves it out.
  steady_time, steady_steps, first_call = 0.0, 0, True
  last = {}
  agreement = preemption.Agreement(getattr(engine, "strategy", None))
  preemption.arm()
  profiling = False
  # The allocators' peak over the first call after the one that traced (tfpar.training.memory).
  allocators = memory.allocators(engine.memory_devices()) if is_chief else {}
  while step < t.train_steps:
    n = min(t.steps_per_call, _next_boundary(step, cfg) - step)
    measuring = allocators and not first_call
    if measuring:
      held = memory.reset(allocators)
    if is_chief and t.profile_steps and step + 1 == t.profile_steps[0]:
      tf.profiler.experimental.start(  # Its calls end at the last traced step; ops named.
          t.model_dir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
      profiling = True
    start = time.perf_counter()
    losses, norms = engine.train(iterator, n)
    elapsed = time.perf_counter() - start
    profiled = profiling and step + n >= t.profile_steps[1]
    if profiled:
      tf.profiler.experimental.stop()
      profiling = False
    if measuring:
      metrics.say(memory.record(t.model_dir, (step + 1, step + n), allocators, held,
                                memory.peaks(allocators), engine.predicted_memory()))
      allocators = {}
    skipped = _check_numerics(cfg, step, losses, norms, metrics, checkpointer.directory)
    window_skipped += skipped
    skipped_total += skipped
    step += n
    window_losses.extend(losses.tolist())
    window_norms.extend(norms.tolist())
    window_traffic.extend(engine.traffic(s) for s in range(step - n + 1, step + 1))
    window_time += elapsed
    if not first_call:
      steady_time, steady_steps = steady_time + elapsed, steady_steps + n
    first_call = False
    done = step >= t.train_steps
    # Every worker asks after every chunk (a collective when multi-worker), so all agree.
    preempted = not done and agreement.stop()
    if step % t.log_every == 0 or done or preempted:
      k = len(window_losses)
      record = {"kind": "train", "step": step, "loss": _finite_mean(window_losses),
                "learning_rate": engine.learning_rate(), "grad_norm": _finite_mean(window_norms),
                rate_key: task.units_per_step * k / window_time,
                "step_time": window_time / k, "replicas": engine.num_replicas,
                "workers": num_workers,
                # Per replica per step, handed to the gradient collectives.
                "comm_bytes": float(np.mean([x.bytes for x in window_traffic])),
                "comm_bytes_uncompressed": float(np.mean([x.uncompressed for x in window_traffic]))}
      if t.on_nonfinite == "skip":
        record.update(skipped_steps=window_skipped, skipped_total=skipped_total)
      metrics.write(record)
      note = f" | skipped {skipped_total}" if skipped_total else ""
      metrics.progress(step, t.train_steps, record["loss"], record[rate_key], task.unit,
                       record["step_time"],
                       _comm(record) + f" | {_count(engine.num_replicas, 'replica')} on "
                       f"{_count(num_workers, 'worker')}{note}",
                       eta_step_time=steady_time / steady_steps if steady_steps else None)
      last["train"] = record
      window_losses, window_norms, window_traffic, window_time = [], [], [], 0.0
      window_skipped = 0
    if profiled:
      metrics.say(f"profiled steps {t.profile_steps[0]}-{t.profile_steps[1]} into "
                  f"{t.model_dir}/plugins/profile (TensorBoard --logdir={t.model_dir}, Profile)")
    if preempted:  # Before eval: the grace period is for saving.
      path = checkpointer.save(step)
      checkpointer.wait()
      who = "" if is_chief else f"worker {worker_index}: "
      print(f"tfpar: {who}preempted ({preemption.notice()}), saved {path or 'its part'} at step "
            f"{step}; the next start resumes at step {step + 1}", flush=True)
      raise preemption.Preempted(step)
    if t.eval_steps and ((t.eval_every and step % t.eval_every == 0) or done):
      values = engine.eval_metrics(engine.eval_iterator(), t.eval_steps)
      record = {"kind": "eval", "step": step, **values}
      metrics.write(record)
      metrics.say(f"eval   {step:>6}/{t.train_steps} | " +
                  " | ".join(f"{name} {value:.4f}" for name, value in values.items()))
      last["eval"] = record
    if step % t.checkpoint_every == 0 or done:
      checkpointer.save(step)  # Says "saved <path>" once written (the chief).
  checkpointer.wait()
  metrics.say(memory.record_process(t.model_dir, f"after step {step}", worker_index,
                                    engine.predicted_memory(), write=is_chief))
  preemption.disarm()
  return last
