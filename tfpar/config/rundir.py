"""A run directory's config.json: the one reader and writer, and a resume's checks.

The chief of `python -m tfpar.train` writes config.json once (`write_config`,
whole then renamed); a resume (`check_run`), tfpar.generate and tfpar.predict
read it back with `load` (or `read_saved` and `from_saved`), so a field one
tfpar version knows and another does not is handled alike everywhere: a
missing one takes its default, an unknown one is dropped. Every file goes
through tfpar.storage (gs:// too; a local path is checked without importing
TensorFlow); a file that cannot be read is one ConfigError line naming
--model_dir and the fix.
"""

import dataclasses
import json
import os
from typing import Sequence, Tuple

from tfpar import storage
from tfpar.config.schema import Config, ConfigError, ModelConfig, remat_mode

RUN_CONFIG = "config.json"  # In --model_dir: the run's flags (write_config).
# The files a run writes in --model_dir beside its checkpoints (a directory there is refused).
RUN_FILES = (RUN_CONFIG, "metrics.jsonl", "metrics.jsonl.superseded", "plan.json",
             "tokenizer.model")
CLASS_NAMES = "class_names"  # Beside the sections in config.json, where the data names classes.
# Flags a resumed run must keep: the model, and what fixes the data order
# (tfpar.data.pipeline reads position step * global_batch_size under seed).
RESUME_FIXED = ("global_batch_size", "seed")


def write_config(cfg: Config, class_names: Sequence[str] = ()) -> None:
  """The chief records the run's flags in <model_dir>/config.json, once.

  `check_run` compares a resume against it; tfpar.generate and tfpar.predict
  rebuild the model from it. `class_names` (when the data names its classes:
  class folders, COCO categories) go with them, so that predict prints a name,
  not an index the user would have to look up. Written whole, then renamed:
  other workers may read it at the same moment.
  """
  path = os.path.join(cfg.train.model_dir, RUN_CONFIG)
  if not storage.exists(path):
    record = cfg.to_dict()
    if class_names:
      record[CLASS_NAMES] = list(class_names)
    storage.makedirs(cfg.train.model_dir)
    storage.write_atomically(path, json.dumps(record, indent=2))


def load(model_dir: str) -> Config:
  """The Config of the run in model_dir (read_saved, then from_saved)."""
  return from_saved(read_saved(model_dir))


def find_run(model_dir: str, error=ConfigError, warn=None) -> Config:
  """The Config of the tfpar.train run a tool (generate, predict) was pointed at with --model_dir.

  Raises `error` (the tool's own kind), in one line, where --model_dir is unset
  or holds no config.json; ConfigError where its config.json cannot be read.
  `warn(line)`, when given, hears of a config.json of another tfpar version.
  """
  if not model_dir:
    raise error("--model_dir is not set: pass the --model_dir of a tfpar.train run")
  if not storage.exists(os.path.join(model_dir, RUN_CONFIG)):
    where = "" if storage.exists(model_dir) else " (it does not exist)"
    raise error(f"--model_dir={model_dir} has no config.json{where}: pass the --model_dir of a "
                "tfpar.train run (train into it first)")
  saved = read_saved(model_dir)
  differs = other_version(saved) if warn is not None else ""
  if differs:
    warn(f"--model_dir={model_dir}: {differs}")
  return from_saved(saved)


def read_saved(model_dir: str) -> dict:
  """A run's config.json, parsed: tfpar.train (a resume), tfpar.generate and tfpar.predict.

  Read through tfpar.storage (gs:// too; a local path without TensorFlow). Raises
  ConfigError, in one line, where the file cannot be read or is not an object of sections.
  """
  try:
    saved = json.loads(storage.read_text(os.path.join(model_dir, RUN_CONFIG)))
    if not isinstance(saved, dict) or not all(
        isinstance(saved.get(field.name, {}), dict) for field in dataclasses.fields(Config)):
      raise ValueError("not an object of sections model, data, train, ...")
  except (ValueError, *storage.read_errors()) as e:
    raise ConfigError(f"--model_dir={model_dir} has a config.json that cannot be read "
                      f"({str(e).splitlines()[0]}): restore it from the run's first flags, or "
                      "use a new --model_dir") from None
  return saved


def from_saved(saved: dict) -> Config:
  """The Config a config.json (read_saved) records, from any tfpar version's file.

  A field added since the run was written takes its default; one this version
  no longer knows is dropped (inference must not fail on it; `other_version`
  names both); JSON lists become the tuples the dataclasses hold.
  """
  sections = {}
  for section in dataclasses.fields(Config):
    kind = section.default.__class__
    known = {f.name for f in dataclasses.fields(kind)}
    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in saved.get(section.name, {}).items() if k in known}
    if "remat" in values:  # A boolean before --remat=none|full|selective.
      values["remat"] = remat_mode(values["remat"])
    sections[section.name] = kind(**values)
  return Config(**sections)


def other_version(saved: dict) -> str:
  """One line naming the fields of a config.json (read_saved) that this tfpar does not know,
  and those it lacks; "" when it matches this version's fields."""
  ours = Config().to_dict()
  unknown = sorted(k for k in saved if k not in ours and k != CLASS_NAMES)
  missing = []
  for name, fields in ours.items():
    theirs = saved.get(name, {})
    unknown += sorted(f"{name}.{k}" for k in theirs if k not in fields)
    missing += sorted(f"{name}.{k}" for k in fields if k not in theirs)
  parts = ([f"ignored what this tfpar does not know ({', '.join(unknown)})"] if unknown else []) + (
      [f"defaults for what it lacks ({', '.join(missing)})"] if missing else [])
  return f"config.json is of another tfpar version: {'; '.join(parts)}" if parts else ""


def saved_class_names(saved: dict) -> Tuple[str, ...]:
  """The class names a config.json (read_saved) records, in id order; () where it has none."""
  names = saved.get(CLASS_NAMES)
  return tuple(str(n) for n in names) if isinstance(names, list) else ()


def check_run(cfg: Config, cluster=None) -> None:
  """The run directory and the job (tfpar.config.cluster.Cluster), before TensorFlow starts.

  Reads (never writes) --model_dir: the chief writes config.json only once
  the data has been read, so bad input leaves the directory as it was.
  """
  _check_model_dir(cfg)
  if cluster is not None and cluster.spec:
    from tfpar.config import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
    cluster_lib.check_cluster(cfg, cluster)


def _check_local_model_dir(path: str) -> None:
  """A local --model_dir: a directory, or one that this user can create, and its checkpoints/
  (a link, a mount) one where checkpoints can be written: a save or restore that fails there
  would fail again after any restart."""
  try:
    storage.check_output(path, "model_dir", directory=True)
    checkpoints = os.path.join(path, "checkpoints")
    if os.path.isdir(checkpoints):
      storage.check_output(checkpoints, "model_dir", directory=True)
  except storage.NotWritable as e:
    raise ConfigError(str(e)) from None
  for name in RUN_FILES:
    if os.path.isdir(os.path.join(path, name)):
      raise ConfigError(f"--model_dir={path} holds a directory {name}, where the run writes its "
                        f"file: move {os.path.join(path, name)} away, or use a new --model_dir")


def _check_model_dir(cfg: Config) -> None:
  """--model_dir: writable, and (on resume) holding a run of the same model and data order.

  Raises:
    ConfigError: the directory cannot work or holds another run.
    tfpar.storage.Unreachable: a remote filesystem (gs://) cannot be reached now.
  """
  path = cfg.train.model_dir
  if not storage.is_remote(path):
    _check_local_model_dir(path)
  try:
    if not storage.exists(os.path.join(path, RUN_CONFIG)):
      return
  except storage.read_errors() as e:  # Never for a local path: a remote store that does not answer.
    raise storage.describe_unreachable(f"--model_dir={path}", e) from None
  saved = read_saved(path)
  saved_model, saved_train = saved.get("model"), saved.get("train", {})
  ours = cfg.to_dict()
  if saved_model is not None:  # A model field added since the run started has its default.
    saved_model = {**dataclasses.asdict(ModelConfig()), **saved_model}
  if saved_model is not None and saved_model != ours["model"]:
    diff = sorted(k for k in saved_model if saved_model[k] != ours["model"].get(k))
    raise ConfigError(f"--model_dir={path} holds a run with other model flags "
                      f"({', '.join(diff)}): use the same flags to resume, or a new --model_dir")
  for flag in RESUME_FIXED:
    if flag in saved_train and saved_train[flag] != ours["train"][flag]:
      raise ConfigError(f"--{flag}={ours['train'][flag]}, but the run in --model_dir={path} was "
                        f"started with {saved_train[flag]}: a resume with another would read "
                        f"other data than the run left off at; pass --{flag}="
                        f"{saved_train[flag]}, or a new --model_dir")
