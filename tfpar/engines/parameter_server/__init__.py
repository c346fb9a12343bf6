"""Asynchronous data parallelism with a parameter server: `--strategy=parameter_server`.

What lives where (a job of one chief, W workers, P parameter servers):

  ps i       the variables: every weight, AdamW slot and the optimizer step,
             round-robin over the P servers; `--ps_shards=S` cuts each variable
             of rank >= 1 along its first axis over up to S servers.
  worker w   no state: it runs the closures the chief schedules, one optimizer
             step each (read the weights, forward + backward on its own batch,
             send the gradients; the update runs on the ps owning each variable).
  chief      the coordinator (`ClusterCoordinator`): builds model and optimizer
             under `strategy.scope()`, schedules steps on whichever worker is
             free, evaluates inline and writes checkpoints.

Updates are asynchronous: a step that read the weights at version t applies
its gradient at version t + tau + 1, tau (its staleness) being the updates the
other workers made meanwhile; each step logs tau in `ps_steps.jsonl`.
`--global_batch_size=G` is the batch of one update; worker w reads batches
k W + w of the one data order, with its index substituted at run time, so the
workers read disjoint windows and nothing goes through the chief.

The modules:

  server.py         the chief's strategy and the worker/ps tasks' serving
  keras_patches.py  what Keras 3's optimizer needs to update ps-resident variables
  step.py           RemoteVariableTrainStep: one step with the weights on the ps
  engine.py         ParameterServerEngine: schedules steps, evaluates, logs staleness
  step_log.py       ps_steps.jsonl: each step's worker, versions and times

Why each Keras 3 workaround is needed, the failures the coordinator handles and
what was run: docs/strategies_ps_tpu.md.
"""
