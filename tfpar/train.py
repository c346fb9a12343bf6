"""Trains a transformer in parallel: python -m tfpar.train --flagfile=configs/gpt_tiny.flags

Examples:
  python -m tfpar.train --flagfile=configs/gpt_tiny.flags --model_dir=runs/gpt
  python -m tfpar.train --flagfile=configs/gpt_tiny.flags --strategy=mirrored --num_cpu_devices=2
  python -m tfpar.train --flagfile=configs/vit_digits.flags --model_dir=runs/vit

The same command resumes from the newest checkpoint in --model_dir. Exit
status: 0 done; 2 bad input (one line says what to fix); 3 a NaN or infinite
step under --on_nonfinite=stop; 4 the disk filled up during a save (one line
names the path; older checkpoints intact); 75 stopped by SIGTERM or a first
Ctrl-C, after saving (start it again to resume; a second Ctrl-C aborts with
130, unsaved); 1 anything a restart may fix (tfpar/status.py says more).
--helpfull lists absl's own flags too.
"""
# This file only wires: parse flags into a validated config and check it
# against the run directory and the cluster (all before TensorFlow starts),
# make the strategy, build the engine under it, run the loop. TensorFlow's C++
# start-up lines are silenced; absl's --verbosity=0 shows them.

import faulthandler
import sys

from absl import app, flags

from tfpar import cluster as cluster_lib
from tfpar import config as config_lib
from tfpar import console
from tfpar import flags as tfpar_flags
from tfpar import rundir
from tfpar import status
from tfpar import storage
from tfpar.parallel import address_space
from tfpar.training import preemption

tfpar_flags.define_flags()
FLAGS = flags.FLAGS
HELP = ("-h", "--help", "-help", "--helpshort", "-?")


def fail(message: str, code: int = status.BAD_INPUT) -> None:
  print(f"tfpar.train: error: {message}", file=sys.stderr, flush=True)
  sys.exit(code)


def main(argv):
  faulthandler.enable()  # A native crash (SIGSEGV, abort) prints every thread's Python stack.
  preemption.watch(interrupt=True)  # Before TensorFlow: in a container, python may be PID 1.
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}: flags are written --name=value")
  try:
    cfg = config_lib.from_flags(
        FLAGS, warn=lambda text: print(f"tfpar.train: warning: {text}", file=sys.stderr, flush=True))
    cluster = cluster_lib.from_env()
    if cluster.spec:  # TF_CONFIG against --strategy: before TensorFlow starts.
      cluster_lib.check_cluster(cfg, cluster)
  except (config_lib.ConfigError, cluster_lib.ClusterError) as e:
    fail(str(e))
  except cluster_lib.PeersNotFound as e:  # Not bad input: a restart may find them.
    print(f"tfpar.train: error: {e}", file=sys.stderr, flush=True)
    sys.exit(status.CRASH)
  console.set_xla_auto_clustering(cfg.train.xla_auto_clustering)  # Before XLA reads its flags.
  console.import_tensorflow_quietly(FLAGS.verbosity if FLAGS["verbosity"].present else None)
  try:
    rundir.check_run(cfg)  # Reads --model_dir through tf.io.gfile (TF_CONFIG: checked above).
    address_space.check(cfg)  # ulimit -v: TensorFlow would segfault, not fail, below it.
  except config_lib.ConfigError as e:
    fail(str(e))
  except storage.Unreachable as e:  # gs:// without network: a later start may well reach it.
    fail(str(e), status.CRASH)
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  try:
    runner.run(cfg, cluster)
  except runner.USER_ERRORS as e:
    fail(str(e))
  except runner.NONFINITE_ERRORS as e:
    fail(str(e), status.NONFINITE)
  except preemption.Preempted:
    preemption.stand_down()  # Saved: no later signal may turn 75 into a kill during teardown.
    sys.exit(status.PREEMPTED)
  except cluster_lib.PeerError as e:  # Not bad input: a restart may well succeed.
    print(f"tfpar.train: error: {e}", file=sys.stderr, flush=True)
    sys.exit(status.CRASH)
  except runner.WRITE_ERRORS as e:
    line = storage.disk_full(e)
    if line is None:  # Any other error: the traceback, as for every crash.
      raise
    fail(line, status.DISK_FULL)


def parse_flags(argv):
  """absl's own parse errors (unknown flag, bad enum or int) get the same one line and exit 2.

  --help prints how to run it and tfpar's flags, and exits 0 (absl's own
  --help lists only the main module's flags, which are none here, and exits 1).
  """
  if any(a in HELP for a in argv[1:]):
    print(__doc__ + "\n" + FLAGS.module_help(tfpar_flags))
    sys.exit(status.OK)
  bom = console.flagfile_with_bom(argv[1:])
  if bom:
    fail(bom)
  try:
    return FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
