"""Checkpoints in one canonical layout, whatever the parallel plan that wrote them.

A run's weights may be one variable each (one device), mirrored (data
parallel), sharded (tensor parallel: `.../attn/query/kernel_shard_1` holds a
column slice of the full query kernel), spread over pipeline stages, or copied
once per model replica (hybrid). The checkpoint stores none of that: it stores
each weight and each AdamW slot under its canonical name, its path inside the
model without the shard suffix (`block_0/attn/query/kernel`, `...@m`, `...@v`),
at its full shape, plus the optimizer step. Saving gathers shards (concatenate
along the axis the model family's tfpar.partitioning rule gives); restoring
splits and assigns to every copy. So a checkpoint
written under any plan restores under any other, and the data position follows
from the step (see tfpar.data.pipeline).

The canonical tensors live in host-memory variables that tf.train.Checkpoint
and CheckpointManager write; that costs one host copy of the state at save.

Integrity. Which checkpoints exist is read from their files (`ckpt-N.index`),
not from the `checkpoint` state file, so a lost or corrupt state file never
restarts a run at step 0. Restoring tries the newest first; one that cannot be
read (a truncated data file, a broken index: the pod died mid-write, a copy
was cut short) is reported in one line and the next older one is restored.
Only when every checkpoint is unreadable does the run stop (exit 2).
Retention counts the same files: after each save the chief keeps the newest
`keep` checkpoints on disk, whichever process wrote them, and deletes the rest.

A failed save (a full disk, most often) removes what it had written: TensorFlow
writes `ckpt-N_temp/` and then moves its files to `ckpt-N.*`, and leaves the
temporary directory behind when a write fails, taking the space. The older
checkpoints are untouched, so the newest of them is the one the next start
restores; on a full disk, `save` raises tfpar.storage.DiskFullError, whose one
line names the directory, that newest checkpoint and the fix.
"""

import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfpar import partitioning, storage
from tfpar.training.optimizer import inner_optimizer

_SHARD = re.compile(r"_shard_(\d+)$")  # tfpar.layers.parallel's name of shard t's weight.
# Keras names each dropout layer's SeedGenerator from a process-wide counter
# ('seed_generator_7/seed_generator_state'), so the name depends on what was
# built before: the canonical name is the state's rank within the model instead.
_SEED_STATE = re.compile(r"(^|/)seed_generator(_\d+)?/seed_generator_state$")


# Entries a checkpoint may lack (see CanonicalCheckpointer.restore).
OPTIONAL_PREFIX = "compression/"


def _checkpoint_key(name: str) -> str:
  """The key tf.train.Checkpoint stores host variable `state[name]` under."""
  return f"state/{name.replace('.', '..').replace('/', '.S')}/.ATTRIBUTES/VARIABLE_VALUE"


class CheckpointMismatchError(ValueError):
  """The checkpoint in --model_dir was written for another model."""


class NonFiniteStateError(RuntimeError):
  """The state to save holds NaN or infinite values."""


class CheckpointUnreadableError(ValueError):
  """Checkpoints exist in --model_dir but none of them can be read."""


_CKPT_INDEX = re.compile(r"ckpt-(\d+)\.index$")


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
  """[(step, path prefix)] of every checkpoint in `directory`, newest first, from its files."""
  found = {}
  for path in tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index")):
    match = _CKPT_INDEX.search(path)
    if match:
      found[int(match.group(1))] = path[:-len(".index")]
  return sorted(found.items(), reverse=True)


_CKPT_DATA = re.compile(r"ckpt-(\d+)\.data-\d+-of-\d+$")


def without_index(directory: str) -> List[int]:
  """Steps of the checkpoints in `directory` with data files but no index, newest first:
  list_checkpoints cannot see them (a save cut short, an index lost or deleted)."""
  indexed = {step for step, _ in list_checkpoints(directory)}
  steps = {int(m.group(1)) for m in map(_CKPT_DATA.search,
                                          tf.io.gfile.glob(os.path.join(directory, "ckpt-*.data-*")))
           if m}
  return sorted(steps - indexed, reverse=True)


def _reader(prefix: str):
  """A reader of the checkpoint at `prefix`.

  Not tf.train.load_checkpoint: it takes a path that is a directory for a
  directory of checkpoints, and on ram:// (whose directories are name
  prefixes) 'ckpt-2' is one, since 'ckpt-2.index' exists.
  """
  return tf.compat.v1.train.NewCheckpointReader(prefix)


def is_readable(prefix: str) -> bool:
  """True when every tensor of the checkpoint can be read back."""
  try:
    reader = _reader(prefix)
    for key in reader.get_variable_to_shape_map():
      reader.get_tensor(key)
  except Exception:  # pylint: disable=broad-except  # Truncation fails in many ways (IndexError, OpError).
    return False
  return True


def _first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def canonical_name(path: str, rules: partitioning.Rules, rank: int
                   ) -> Tuple[str, Optional[int], int]:
  """('block_0/attn/query/kernel_shard_1', GPT rules, 2) -> ('block_0/attn/query/kernel', 1, 1).

  (name, axis its shards concatenate along or None, shard index).
  """
  match = _SHARD.search(path)
  name = path[:match.start()] if match else path
  return name, rules.axis(name, rank), int(match.group(1)) if match else 0


# name -> (axis or None, [shard variables in shard order]) for one model copy.
Layout = Dict[str, Tuple[Optional[int], List]]


def _add(layout: Layout, name: str, axis, shard: int, var):
  entry = layout.setdefault(name, (axis, {}))
  entry[1][shard] = var


def model_layout(model, optimizer=None, slots=None) -> Layout:
  """The canonical layout of one model copy and (optionally) its optimizer's slots.

  `slots(variable)` -> (m, v) where the optimizer does not hold them itself
  (tfpar.parallel.zero's shards, seen at full shape); default the Keras
  AdamW's own.
  """
  raw: Dict[str, Tuple[Optional[int], Dict[int, object]]] = {}
  opt = inner_optimizer(optimizer) if optimizer is not None else None
  if slots is None and opt is not None and opt.built:
    def slots(var):
      index = opt._get_variable_index(var)  # pylint: disable=protected-access
      return opt._momentums[index], opt._velocities[index]  # pylint: disable=protected-access
  prefix = model.name + "/"
  seed_states = 0
  for var in model.variables:
    # Keras prefixes the model's name when weights are built inside its call
    # and not when built directly: the canonical name is relative to the model.
    path = var.path[len(prefix):] if var.path.startswith(prefix) else var.path
    if _SEED_STATE.search(path):  # Dropout RNG state: saved so that a resumed run continues it.
      path, seed_states = f"dropout_rng/{seed_states}", seed_states + 1
    name, axis, shard = canonical_name(path, model.rules, len(var.shape))
    _add(raw, name, axis, shard, var)
    if slots is not None and var.trainable:
      m, v = slots(var)
      _add(raw, name + "@m", axis, shard, m)
      _add(raw, name + "@v", axis, shard, v)
  if opt is not None:
    raw["optimizer/iterations"] = (None, {0: opt.iterations})
  return {name: (axis, [shards[i] for i in sorted(shards)]) for name, (axis, shards) in raw.items()}


def read_canonical(layout: Layout) -> Dict[str, np.ndarray]:
  """Gathers every entry to its full shape (host numpy)."""
  out = {}
  for name, (axis, shards) in layout.items():
    values = [np.asarray(tf.convert_to_tensor(_tf_var(v))) for v in shards]
    out[name] = values[0] if len(values) == 1 else np.concatenate(values, axis=axis)
  return out


def assign_canonical(layout: Layout, values: Dict[str, np.ndarray]) -> None:
  """Splits full values into this layout's shards and assigns them."""
  for name, (axis, shards) in layout.items():
    full = values[name]
    parts = [full] if len(shards) == 1 else np.split(full, len(shards), axis=axis)
    for var, part in zip(shards, parts):
      if tuple(var.shape) != part.shape:
        raise CheckpointMismatchError(
            f"checkpoint weight {name} has shape {full.shape}, the model needs "
            f"{tuple(var.shape)} per shard: use the model flags the run was started with, "
            "or a new --model_dir")
      var.assign(part)


def _tf_var(var):
  return getattr(var, "value", var) if not isinstance(var, tf.Variable) else var


class CanonicalCheckpointer:
  """Saves and restores model + optimizer state in the canonical layout.

  Args:
    layouts: one Layout per model copy (several for hybrid data x model
      parallel; copy 0 is read at save, every copy is assigned at restore).
    directory: where checkpoints go (`<model_dir>/checkpoints`).
    keep: how many checkpoints to keep: the newest on disk, whichever process wrote them.
    is_chief: only the chief writes into `directory`; other workers still take
      part in every save (as multi-worker saving requires) but write into their
      own temporary directory, which is removed afterwards.
    worker_index: names the temporary directory of a non-chief worker.
  """

  def __init__(self, layouts: Sequence[Layout], directory: str, *, keep: int = 3,
               is_chief: bool = True, worker_index: int = 0):
    self.layouts = list(layouts)
    self.directory = directory
    self.keep = keep
    self.is_chief = is_chief
    self.worker_index = worker_index
    with tf.device("/cpu:0"):
      self._host = {}
      for name, (axis, shards) in self.layouts[0].items():
        shape = list(shards[0].shape)
        if axis is not None:
          shape[axis] *= len(shards)
        self._host[name] = tf.Variable(tf.zeros(shape, shards[0].dtype), trainable=False,
                                       name=name.replace("/", "."))
    self._checkpoint = tf.train.Checkpoint(state=self._host)

  def _manager(self, directory):
    return tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep=self.keep,
                                      checkpoint_name="ckpt")

  @property
  def latest(self) -> Optional[str]:
    """The newest checkpoint on disk (readable or not), or None."""
    found = list_checkpoints(self.directory)
    return found[0][1] if found else None

  def save(self, step: int) -> Optional[str]:
    """Writes the state at `step`; returns the chief's checkpoint path.

    Raises:
      NonFiniteStateError: a weight or slot holds a NaN or infinity; nothing
        is written (so no good checkpoint is rotated out for it).
      tfpar.storage.DiskFullError: no room for it; its partial files are removed.
    """
    values = read_canonical(self.layouts[0])
    bad = [name for name, value in values.items()
           if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value))]
    if bad:
      raise NonFiniteStateError(
          f"step {step}: {bad[0]} (and {len(bad) - 1} more) holds NaN or infinite values: not "
          f"saved; the newest checkpoint in {self.directory} is the last good state")
    for name, value in values.items():
      self._host[name].assign(value)
    if self.is_chief:
      path = self._write(step)
      self._prune(path)
      return path
    tmp = os.path.join(self.directory, f".worker_{self.worker_index}_tmp")
    try:
      self._manager(tmp).save(checkpoint_number=step)
    finally:
      storage.discard(tmp)  # Through gfile: a gs:// model dir is cleaned up too.
    return None

  def _write(self, step: int) -> str:
    """Writes ckpt-<step>; on failure removes its partial files first (module docstring).

    Raises:
      tfpar.storage.DiskFullError: the disk (or quota, or file size limit) had no room.
    """
    prefix = os.path.join(self.directory, f"ckpt-{step}")
    before = set(self._files_of(prefix))
    try:
      return self._manager(self.directory).save(checkpoint_number=step)
    except Exception as e:
      self._remove_partial(prefix, before)
      why = storage.no_room(e)
      if why is None:
        raise
      newest = self.latest
      kept = (f"the newest checkpoint, {os.path.basename(newest)}, is intact" if newest
              else "no checkpoint was saved before")
      raise storage.DiskFullError(
          f"no room to save the checkpoint of step {step} in {self.directory} ({why}): its "
          f"partial files are removed and {kept}; {storage.full_disk_advice(why)}") from None

  def _files_of(self, prefix: str) -> List[str]:
    """What a save of `prefix` writes: ckpt-N_temp/, ckpt-N.index, ckpt-N.data-*, state temps."""
    return (storage.glob(prefix + "_temp") + storage.glob(prefix + ".*")
            + storage.glob(os.path.join(self.directory, "checkpoint.tmp*")))

  def _remove_partial(self, prefix: str, before) -> None:
    """Removes what a failed save of `prefix` left, keeping a ckpt-N it did write whole.

    The checkpoint itself may be complete when only the state file that follows
    it failed: it stays, since it restores (and is newer than the rest).
    """
    whole = storage.exists(prefix + ".index") and is_readable(prefix)
    for path in self._files_of(prefix):
      if path not in before and not (whole and path.startswith(prefix + ".")):
        storage.discard(path)

  def _prune(self, saved: str) -> None:
    """Keeps the newest `keep` checkpoints on disk, deleting the rest (the chief only).

    CheckpointManager deletes only what this process wrote or what the state
    file lists with a timestamp, so each restart used to keep every older
    checkpoint for good. Data files go before the index: a deletion cut short
    leaves an index the next save still finds, never an orphaned data file.
    The checkpoint just written always stays, even below a newer one left on
    disk (an unreadable ckpt-N the run fell back from).
    """
    old = [(step, prefix) for step, prefix in list_checkpoints(self.directory)[self.keep:]
           if os.path.basename(prefix) != os.path.basename(saved)]
    for _, prefix in old:
      for path in storage.glob(prefix + ".data-*") + [prefix + ".index"]:
        try:
          storage.remove(path)
        except tf.errors.NotFoundError:  # Already gone (CheckpointManager's own sweep).
          pass
    if old:
      self._rewrite_state(saved)

  def _restore_one(self, prefix: str) -> List[str]:
    """Restores one checkpoint into the host variables; returns the state names left fresh.

    Gradient-compression state (tfpar.parallel.compression) is optional: a
    checkpoint written without it, or for another replica count, restores the
    model and optimizer and leaves that state at its start (residuals zero).
    """
    stored = _reader(prefix).get_variable_to_shape_map()
    differ = {name: stored.get(_checkpoint_key(name)) for name, var in self._host.items()
              if stored.get(_checkpoint_key(name)) != list(var.shape)}
    fresh = [name for name in differ if name.startswith(OPTIONAL_PREFIX)]
    # Compared here, not left to restore(): its error comes with a page of absl warnings.
    for name, shape in differ.items():
      if name not in fresh:
        there = "is missing" if shape is None else f"has shape {shape}"
        raise ValueError(f"{name} {there} there, shape {list(self._host[name].shape)} here")
    checkpoint = self._checkpoint if not fresh else tf.train.Checkpoint(
        state={name: var for name, var in self._host.items() if name not in fresh})
    checkpoint.restore(prefix).assert_existing_objects_matched()
    return fresh

  def restore(self, path: Optional[str] = None, log=print) -> Optional[str]:
    """Restores `path`, or the newest readable checkpoint, into every copy.

    Returns the path restored, or None when the directory holds no checkpoint.
    An unreadable checkpoint is reported through `log` in one line and the
    next older one is tried.

    Raises:
      CheckpointMismatchError: the checkpoint was written for another model.
      CheckpointUnreadableError: checkpoints exist and none can be read.
    """
    candidates = [path] if path else [p for _, p in list_checkpoints(self.directory)]
    problems = []
    if not path:  # Newer than any indexed one: else passed over without a word.
      newest = list_checkpoints(self.directory)[0][0] if candidates else -1
      problems += [f"ckpt-{step} (its ckpt-{step}.index is missing: a save cut short, or the "
                   "index lost)" for step in without_index(self.directory) if step > newest]
    for prefix in candidates:
      try:
        fresh = self._restore_one(prefix)
      except Exception as e:  # pylint: disable=broad-except
        if is_readable(prefix):  # It reads fine: it was written for another model.
          raise CheckpointMismatchError(
              f"the checkpoint {prefix} does not fit this model ({_first_line(e)[:200]}): use "
              "the model flags the run was started with, or a new --model_dir") from None
        problems.append(f"{os.path.basename(prefix)} ({_first_line(e)})")
        continue
      if problems:
        log(f"warning: checkpoint {'; '.join(problems)} is unreadable: skipped, restored "
            f"{os.path.basename(prefix)} instead")
      values = {name: var.numpy() for name, var in self._host.items() if name not in fresh}
      for layout in self.layouts:
        assign_canonical({k: v for k, v in layout.items() if k not in fresh}, values)
      if fresh and self.is_chief:
        print(f"tfpar: {prefix} holds no gradient-compression state for this run "
              f"({', '.join(fresh)}): it starts afresh", flush=True)
      if self.is_chief and not path:
        self._rewrite_state(prefix)
      return prefix
    if problems:
      raise CheckpointUnreadableError(
          f"no checkpoint in {self.directory} can be read ({'; '.join(problems)}): move the "
          "directory aside to start again, or restore it from a copy")
    return None

  def _rewrite_state(self, restored: str) -> None:
    """Rewrites the `checkpoint` state file from the files on disk (it may be lost or corrupt).

    CheckpointManager reads it to know which old checkpoints to delete. The
    file is the text form of tf's CheckpointState proto; the function TF has
    for writing it (update_checkpoint_state) is deprecated and warns.
    """
    lines = [f'model_checkpoint_path: "{os.path.basename(restored)}"']
    lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"'
              for _, p in reversed(list_checkpoints(self.directory))]
    storage.write_atomically(os.path.join(self.directory, "checkpoint"), "\n".join(lines) + "\n")


def load_weights(model, model_dir: str) -> Optional[str]:
  """Assigns `model` the weights of the newest readable checkpoint in model_dir/checkpoints.

  For inference (tfpar.generate, tfpar.predict). The checkpoints are found from
  their files, never from the `checkpoint` state file (lost or corrupt, it
  changes nothing); a truncated checkpoint is passed over. Returns its path, or
  None where there is no readable checkpoint; raises CheckpointMismatchError
  where it lacks one of the model's weights.
  """
  path = next((p for _, p in list_checkpoints(os.path.join(model_dir, "checkpoints"))
               if is_readable(p)), None)
  if path is None:
    return None
  layout = model_layout(model)
  values = read_checkpoint(path)
  missing = sorted(set(layout) - set(values))
  if missing:
    raise CheckpointMismatchError(
        f"the checkpoint {path} has no {missing[0]}: it was written by another version of "
        "the model; retrain into a new --model_dir")
  assign_canonical(layout, values)
  return path


def read_checkpoint(path: str) -> Dict[str, np.ndarray]:
  """Reads every canonical tensor of a checkpoint file (for tests and tools)."""
  reader = tf.train.load_checkpoint(path)
  out = {}
  for key in reader.get_variable_to_shape_map():
    if key.startswith("state/") and key.endswith("/.ATTRIBUTES/VARIABLE_VALUE"):
      name = key[len("state/"):-len("/.ATTRIBUTES/VARIABLE_VALUE")]
      out[name.replace(".S", "/")] = reader.get_tensor(key)
  return out
