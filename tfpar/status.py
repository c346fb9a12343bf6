"""Exit statuses of `python -m tfpar.train`, as tfpar.launch and Kubernetes read them.

Read without TensorFlow (the launcher imports it).

  0   OK         training reached --train_steps (or had nothing left to do).
  1   CRASH      an unexpected error, e.g. a peer that stopped answering: a
                 restart (tfpar.launch --max_restarts, a Kubernetes restart
                 policy) resumes from the latest checkpoint.
  2   BAD_INPUT  flags, data, TF_CONFIG or a model_dir of another model: one
                 line says what to fix; restarting would fail the same way.
  3   NONFINITE  a NaN or infinite loss or gradient norm under --on_nonfinite=stop:
                 nothing was saved after the last good checkpoint; restarting
                 would meet the same numbers (lower --learning_rate, or skip).
  4   DISK_FULL  a write of the run found no room (no space left, over a quota,
                 past a file size limit): one line names the path and the fix;
                 a failed checkpoint save removed its partial files and the
                 older checkpoints are intact. Not bad input (the flags were
                 fine) and not a crash (restarting would meet the same full
                 disk at the next save): free space, or move the run and point
                 --model_dir at it, then start the same command again.
  75  PREEMPTED  SIGTERM (eviction, maintenance, Ctrl-C to the launcher) or a
                 first Ctrl-C (SIGINT) to tfpar.train: every worker saved a
                 checkpoint at the same step; start the same command again to
                 resume exactly there. 75 is EX_TEMPFAIL of sysexits.h
                 ("temporary failure; the user is invited to retry").
  130 ABORTED    a second Ctrl-C to tfpar.train: it stopped at once without
                 saving; the checkpoints already written are intact, the steps
                 since the newest are lost. 130 is 128 + SIGINT, what a shell
                 reports for a process Ctrl-C ended.
"""

OK = 0
CRASH = 1
BAD_INPUT = 2
NONFINITE = 3
DISK_FULL = 4
PREEMPTED = 75
ABORTED = 130

# No restart helps: the launcher does not restart them, Kubernetes manifests fail the job.
NOT_RESTARTABLE = (BAD_INPUT, NONFINITE, DISK_FULL)
