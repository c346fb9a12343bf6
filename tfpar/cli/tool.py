"""What every command-line tool shares: one way to fail, to print help and to load a run.

A tool's bad input (a flag, a path, a run directory) ends with one line on
stderr, `tfpar.TOOL: error: what is wrong and the fix`, and exit status 2
(tfpar.status.BAD_INPUT), before anything is written and with no traceback.
Each tool binds its name once: `fail = functools.partial(tool.fail, "generate")`.
"""

import sys
from typing import Callable, NoReturn, Optional

from tfpar import console, status
from tfpar.config import rundir


class RunError(ValueError):
  """A run directory a tool cannot use; the message names the flag and the fix."""


def error(name: str, message: str, code: int = status.BAD_INPUT) -> int:
  """Prints `tfpar.NAME: error: message` on stderr; returns `code`, for a main that returns it."""
  print(f"tfpar.{name}: error: {message}", file=sys.stderr, flush=True)
  return code


def fail(name: str, message: str, code: int = status.BAD_INPUT) -> NoReturn:
  """Prints `tfpar.NAME: error: message` on stderr and exits with `code`."""
  sys.exit(error(name, message, code))


def warn(name: str, message: str) -> None:
  """Prints `tfpar.NAME: warning: message` on stderr: something adjusted, not refused."""
  print(f"tfpar.{name}: warning: {message}", file=sys.stderr, flush=True)


HELP = ("-h", "--help", "-help", "--helpshort", "-?")  # What asks a tool for help.


def parse_args(fv, argv, fail, *, doc: Optional[str] = None,
               command: Optional[str] = None, usage: str = "") -> bool:
  """Parses a tool's command line into the absl FlagValues `fv`; True where it asked for help.

  doc: the tool's docstring, printed with the flags' help for any of HELP (None:
    the tool has no help flag). command: the one positional word the tool takes
    (`train`, `prepare`; anything else goes to `fail` as `usage`), or None for
    none at all. A flag absl refuses and a stray argument go to `fail` (which
    prints one line and exits 2).
  """
  if doc is not None and any(a in HELP for a in argv[1:]):
    print(doc + "\n" + fv.get_help())
    return True
  bom = console.flagfile_with_bom(argv[1:])
  if bom:
    fail(bom)
  from absl import flags  # pylint: disable=import-outside-toplevel
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    fail(str(e))
  if command is not None:
    if rest[1:] != [command]:
      fail(usage)
  elif len(rest) > 1:
    fail(f"unexpected arguments {rest[1:]}: flags are written --name=value")
  return False


def app_flags_parser(fail, help_text: Optional[Callable[[], str]] = None):
  """A `flags_parser` for absl.app.run over absl's FLAGS: absl's own parse errors (an unknown
  flag, a bad enum or int) go to `fail`; any of HELP prints `help_text()` and exits 0 (absl's
  own --help lists only the main module's flags, and exits 1)."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  def parse(argv):
    if help_text is not None and any(a in HELP for a in argv[1:]):
      print(help_text())
      sys.exit(status.OK)
    bom = console.flagfile_with_bom(argv[1:])
    if bom:
      fail(bom)
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      fail(str(e))
  return parse


def load_run(model_dir: str):
  """(task, model) of the run in model_dir, its weights restored from the latest checkpoint.

  The model is rebuilt from the run's config.json (any parallel plan may have
  written the checkpoint: it is canonical), with dropout off and the float32
  policy: nothing random, and no mixed precision, at inference.

  Raises:
    RunError: model_dir has no readable checkpoint.
  """
  import keras  # pylint: disable=import-outside-toplevel
  from tfpar import tasks  # pylint: disable=import-outside-toplevel
  from tfpar.training import checkpoint  # pylint: disable=import-outside-toplevel
  cfg = rundir.load(model_dir).replace(model={"dropout": 0.0})
  keras.mixed_precision.set_global_policy("float32")
  task = tasks.make(cfg)
  model = task.build_model()
  model.build_all()
  if checkpoint.load_weights(model, model_dir) is None:
    raise RunError(f"--model_dir={model_dir} has no readable checkpoint: train into it first")
  return task, model
