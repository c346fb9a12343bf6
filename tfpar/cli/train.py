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
# This file only wires: parse flags into a validated config, hand it to
# tfpar.trainer.Trainer (the Python API's path: the checks before TensorFlow
# starts, the devices, the engine, the loop), and turn its errors into one line
# and an exit status. TensorFlow's C++ start-up lines are silenced; absl's
# --verbosity=0 shows them.

import atexit
import faulthandler
import functools
import gc
import sys

from absl import app, flags

from tfpar.config import cluster as cluster_lib
from tfpar.config import config as config_lib
from tfpar.cli import tool
from tfpar.config import flags as tfpar_flags
from tfpar.config import rundir
from tfpar.config.schema import ConfigError
from tfpar import status
from tfpar import storage
from tfpar import trainer as trainer_lib
from tfpar.training import preemption

tfpar_flags.define_flags()
FLAGS = flags.FLAGS
fail = functools.partial(tool.fail, "train")


def main(argv):
  faulthandler.enable()  # A native crash (SIGSEGV, abort) prints every thread's Python stack.
  preemption.watch(interrupt=True)  # Before TensorFlow: in a container, python may be PID 1.
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}: flags are written --name=value")
  try:  # The flags into a Config, then the same path as from Python (tfpar.trainer).
    cfg = config_lib.from_flags(FLAGS, warn=functools.partial(tool.warn, "train"))
    if not storage.is_remote(cfg.train.model_dir):  # Trainer.fit's check of the run directory,
      rundir.check_run(cfg)  # made here too before TensorFlow is imported (a gs:// one needs it).
    trainer = trainer_lib.Trainer(
        cfg, verbosity=FLAGS.verbosity if FLAGS["verbosity"].present else None)
    trainer.fit()
  except (ConfigError, cluster_lib.ClusterError) as e:
    fail(str(e))
  except cluster_lib.PeersNotFound as e:  # Not bad input: a restart may find them.
    fail(str(e), status.CRASH)
  except storage.Unreachable as e:  # gs:// without network: a later start may well reach it.
    fail(str(e), status.CRASH)
  except _runner().USER_ERRORS as e:
    fail(str(e))
  except _runner().NONFINITE_ERRORS as e:
    fail(str(e), status.NONFINITE)
  except preemption.Preempted:
    preemption.stand_down()  # Saved: no later signal may turn 75 into a kill during teardown.
    sys.exit(status.PREEMPTED)
  except cluster_lib.PeerError as e:  # Not bad input: a restart may well succeed.
    fail(str(e), status.CRASH)
  except _runner().WRITE_ERRORS as e:
    line = storage.disk_full(e)
    if line is None:  # Any other error: the traceback, as for every crash.
      raise
    fail(line, status.DISK_FULL)


def _runner():
  """tfpar.runner (TensorFlow), imported once an error past the checks needs its classes."""
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  return runner


if __name__ == "__main__":
  # Runs after every later-registered exit handler (TensorFlow's): the interpreter's last
  # collection then skips TensorFlow's objects, about a second of CPU per process, with
  # every checkpoint, record and summary already written.
  atexit.register(gc.freeze)
  app.run(main, flags_parser=tool.app_flags_parser(
      fail, lambda: __doc__ + "\n" + FLAGS.module_help(tfpar_flags)))
