"""Asynchronous data parallelism with a parameter server: `--strategy=parameter_server`.

What lives where (a job of C=1 chief, W workers, P parameter servers):

  ps i       holds the variables: every weight, every AdamW slot (m, v) and the
             optimizer step, placed round-robin over the P servers; with
             `--ps_shards=S` each variable of rank >= 1 is cut along its first
             axis into up to S shards on different servers (a ShardedVariable),
             so one server need not hold or serve a whole large embedding.
  worker w   holds no state: it runs the closures the chief schedules. One
             closure = one optimizer step: read the current weights from the
             ps tasks, forward + backward on the worker's own batch, send the
             gradients back; the AdamW update runs on the ps that owns each
             variable (`strategy.extended.update` colocates it there).
  chief      the coordinator (`ClusterCoordinator`): builds the model and
             optimizer under `strategy.scope()` (which creates them on the ps
             tasks), traces the step once, schedules steps on whichever worker
             is free, fetches each step's loss, evaluates inline and writes
             checkpoints. It trains nothing itself.

Asynchronous updates and staleness. Workers never wait for each other: each
step applies its own gradient as soon as it is computed. A step that read the
weights at version t (the optimizer step counter) applies its gradient at
version t + tau + 1, where tau is the number of updates the other workers made
in the meantime (its staleness). So the update is

    theta_{t+tau+1} = theta_{t+tau} - lr * AdamW(g(theta_t; batch))

and not g(theta_{t+tau}): with W equally fast workers, tau is about W - 1 on
average. A small, bounded tau acts like noise in the gradient (training still
converges, a little less per step than synchronous training at the same batch);
a large tau (slow or many workers) hurts, which is why lowering the learning
rate or warming up longer helps with many workers. Each closure records the
step counter it read and the one its update produced, so tau is measured, not
guessed: it is in `<model_dir>/ps_steps.jsonl` as `staleness`.

Batches. `--global_batch_size=G` is the batch of ONE update (one worker's step),
so the loss and learning rate mean what they mean under one_device. Worker w
reads its own part of the one data order of tfpar.data.pipeline: its k-th batch
is positions [(k*W + w)*G, (k*W + w + 1)*G), i.e. a `Shard` of W "replicas" of
a G*W batch whose `first_replica` is the worker's index. The index is not known
when the chief traces the dataset function; it comes at run time from
`tf.distribute.coordinator.experimental_get_current_worker_index()`, a value the
coordinator substitutes per worker when the dataset is created there. So the
workers read disjoint windows with nothing sent through the chief. As steps go
to whichever worker is free, the workers need not run equally many steps; a
resumed run restarts every worker at batch `step // W`, so around a resume a few
batches may be read twice or skipped (async training is not step-for-step
reproducible anyway).

Keras 3 and ParameterServerStrategy (keras#18624: no support in `fit`). What we
found, checked on TF 2.21 / Keras 3.15 (details in docs/strategies_ps_tpu.md):
  * A custom loop works: Keras 3 layers and optimizer create their variables
    through `tf.Variable`, so under `strategy.scope()` they land on the ps tasks
    (and become ShardedVariables with a partitioner); the Keras optimizer's
    update goes through `strategy.extended.update`, which runs it on the ps.
  * The hang with servers created inside the coordinator's process is thread
    starvation, not Keras: in-process servers with the default inter-op pool
    (sized by the core count, 2 here) never finished 100 scheduled steps of a
    small Keras model (killed after 90 s); with inter_op_parallelism_threads=3
    (num_workers + 1) the same script ran them in 2 s. TensorFlow's own
    in-process test clusters raise the pool to num_workers + 1 for this reason
    ("The cluster may hang if workers don't have enough inter_op threads",
    b/172296720). We did not trace which ops block. tfpar runs every task in
    its own process, and `serve` still gives each server at least
    num_workers + 1 inter-op threads.
  * Keras 3's `Variable.assign_add` is a read then a write (`assign(self +
    value)`), so the optimizer's step counter loses increments when two
    workers update at once; tfpar makes that one increment atomic (see
    `keras_patches.make_step_counter_atomic`). Slot and weight updates were already atomic.
  * The whole closure cannot be one XLA cluster: XLA reads a resource
    variable only on the device the cluster runs on, and the variables live on
    the ps tasks. tfpar's step compiles the forward+backward
    (`jit_compile`) with the variables as inputs read by ordinary ops; see
    the engine for what runs where.

The code, by concern:

  server.py         the job's strategy (chief) and the worker/ps servers' lifecycle
  keras_patches.py  what Keras 3's optimizer needs to update ps-resident variables

and, above tfpar.training in the layering (docs/design.md), in tfpar.engines:

  ps_step.py           RemoteVariableTrainStep: one step with the weights on the ps
  parameter_server.py  ParameterServerEngine: schedules steps, evaluates, logs staleness
  ps_step_log.py       ps_steps.jsonl: each step's worker, versions and times

Launch (one machine): `python -m tfpar.launch --num_workers=2 --num_ps=1 --
--strategy=parameter_server --model_dir=...`. On a cluster every task runs
`python -m tfpar.train` with the same flags and its own TF_CONFIG; the ps and
worker tasks serve, across restarts of the chief, until the job ends them.

Failures (what ClusterCoordinator does, and what tfpar adds). A worker that
dies costs nothing but its in-flight step: the coordinator runs that closure
again on another worker, and takes the worker back once it serves again. A
ps that dies loses variables: the chief fails, and chief and ps restart from
the latest checkpoint. A chief that restarts reconnects to the servers,
rebuilds the variables and restores the checkpoint. The chief never waits
blindly: if no scheduled step finishes for --collective_timeout seconds, it
fails with one line naming the workers it cannot reach (tfpar.engines.parameter_server).
"""

from tfpar.parallel.parameter_server.server import make_strategy, serve

__all__ = ["make_strategy", "serve"]
