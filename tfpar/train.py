"""Train a GPT with tfpar: `python -m tfpar.train --flagfile=configs/gpt_tiny.flags`.

This file only wires: parse flags into a validated config (before TensorFlow
starts), resolve the cluster, make the strategy, build the engine under it,
run the loop. Bad input ends with one line on stderr and exit status 2; a
SIGTERM saves a checkpoint and exits 75 (tfpar.status lists every status).
"""

import json
import os
import sys

from absl import app, flags

from tfpar import cluster as cluster_lib
from tfpar import config as config_lib
from tfpar import flags as tfpar_flags
from tfpar import status
from tfpar.training import preemption

tfpar_flags.define_flags()
FLAGS = flags.FLAGS


def fail(message: str) -> None:
  print(f"tfpar.train: error: {message}", file=sys.stderr, flush=True)
  sys.exit(status.BAD_INPUT)


def check_model_dir(cfg: config_lib.Config, is_chief: bool) -> None:
  """A model_dir holds one model: resuming with other model flags is refused up front."""
  path = os.path.join(cfg.train.model_dir, "config.json")
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f).get("model")
    if saved is not None and saved != cfg.to_dict()["model"]:
      diff = sorted(k for k in saved if saved.get(k) != cfg.to_dict()["model"].get(k))
      fail(f"--model_dir={cfg.train.model_dir} holds a run with other model flags "
           f"({', '.join(diff)}): use the same flags to resume, or a new --model_dir")
  elif is_chief:
    os.makedirs(cfg.train.model_dir, exist_ok=True)
    # Written whole, then renamed: other workers check the file at the same moment
    # and must never read it half-written.
    with open(path + ".tmp", "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
    os.replace(path + ".tmp", path)


def main(argv):
  preemption.watch()  # Before TensorFlow: in a container, python may be PID 1.
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}: flags are written --name=value")
  try:
    cfg = config_lib.from_flags(FLAGS)
    cluster = cluster_lib.from_env()
  except (config_lib.ConfigError, cluster_lib.ClusterError) as e:
    fail(str(e))
  except cluster_lib.PeersNotFound as e:  # Not bad input: a restart may find them.
    print(f"tfpar.train: error: {e}", file=sys.stderr, flush=True)
    sys.exit(status.CRASH)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # Everything that imports TensorFlow comes after validation.
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  try:
    runner.run(cfg, cluster, check_model_dir=check_model_dir)
  except runner.USER_ERRORS as e:
    fail(str(e))
  except preemption.Preempted:
    sys.exit(status.PREEMPTED)
  except cluster_lib.PeerError as e:  # Not bad input: a restart may well succeed.
    print(f"tfpar.train: error: {e}", file=sys.stderr, flush=True)
    sys.exit(status.CRASH)


def parse_flags(argv):
  """absl's own parse errors (unknown flag, bad enum or int) get the same one line and exit 2."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
