"""Checkpoints in one canonical layout, written and read in slices by the processes that hold them.

A run's weights may be one variable each (one device), mirrored (data
parallel), sharded (tensor parallel: `.../attn/query/kernel_shard_1` holds a
column slice of the full query kernel), spread over pipeline stages and worker
processes, or copied once per model replica (hybrid). The checkpoint stores
none of that: it is one TensorFlow checkpoint holding each weight and each
AdamW slot under its canonical name, its path inside the model without the
shard suffix (`block_0/attn/query/kernel`, `...@m`, `...@v`), at its full
shape, plus the optimizer step. tf.train.load_checkpoint and
tf.train.list_variables read it whole; the data position follows from the step
(see tfpar.data.pipeline).

Slices. Every layout is described the same way, per process: a list of
`Slice(canonical name, full shape, begin, size, variable)`, a hyper-rectangle
of the full tensor (`layout_slices` cuts a model copy's shards along the
partitioning rule's axis; ZeRO's row shards are rectangles too). TensorFlow's
bundle format stores such slices itself (SaveV2/RestoreV2 `shape_and_slices`
'4 6 0,2:-'), so:

  save      each process copies its slices on the host of the process that
            holds them (`host_of`: a parameter server's slices stay on its
            task) and writes them there with SaveV2 into its own bundle,
            `ckpt-N.tmp/w<worker>-<host>`, then a `w<worker>.done` marker;
            the chief waits for every writer's marker, joins the bundles
            with MergeV2Checkpoints (it reads only their indexes) and
            publishes ckpt-N: data files renamed into place first, the index
            last. The chief never holds a tensor of another process.
  restore   each host reads exactly the slices its variables hold (RestoreV2
            with their slice specs; TensorFlow reads a slice of a tensor
            stored whole, or stored as other slices, alike), at most
            `chunk_bytes` at a time, so a checkpoint written under any plan,
            worker count or sharding restores under any other.

A checkpoint of the earlier format (tf.train.Checkpoint of full-shape host
variables) uses the same keys (`state/<name>/.ATTRIBUTES/VARIABLE_VALUE`) and
restores the same way.

Background writes (`background=True`, --async_checkpoint): `save` waits for
the write before it, copies the slices (a consistent state at the step), and
returns; a thread writes and publishes while training goes on. Until the
index is renamed into place nothing in the directory names ckpt-N, so a
process killed mid-write leaves a `ckpt-N.tmp/` that no restore picks (the
chief removes it at the next start). A preemption, the end of training, or an
error waits for the write in flight (tfpar.training.loop).

Integrity. Which checkpoints exist is read from their files (`ckpt-N.index`),
not from the `checkpoint` state file, so a lost or corrupt state file never
restarts a run at step 0. Restoring tries the newest first; one that cannot be
read (a truncated data file, a broken index: the pod died mid-copy) is
reported in one line and the next older one is restored. Only when every
checkpoint is unreadable does the run stop (exit 2). Retention counts the
same files: after each save the chief keeps the newest `keep` checkpoints on
disk and deletes the rest.

A failed save (a full disk, most often) removes its `ckpt-N.tmp/`; the older
checkpoints are untouched, so the newest of them is the one the next start
restores; on a full disk, the save raises tfpar.storage.DiskFullError, whose
one line names the directory, that newest checkpoint and the fix.
"""

import os
import re
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import keras
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


def relative_path(model, variable) -> str:
  """`variable`'s path inside `model`. Keras prefixes the model's name when weights are built
  inside its call and not when built directly: the canonical name is relative to the model."""
  prefix = model.name + "/"
  return variable.path[len(prefix):] if variable.path.startswith(prefix) else variable.path


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
  seed_states = 0
  for var in model.variables:
    path = relative_path(model, var)
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


class Slice(NamedTuple):
  """A hyper-rectangle of one canonical tensor and the variable (or view) holding it.

  The one interface every layout feeds the checkpoint: model-parallel shards,
  pipeline stages, ZeRO row shards, whole tensors (begin all 0, size = shape).
  """
  name: str
  shape: Tuple[int, ...]
  begin: Tuple[int, ...]
  size: Tuple[int, ...]
  variable: object

  @property
  def key(self) -> str:
    return _checkpoint_key(self.name)

  def spec(self) -> str:
    """SaveV2/RestoreV2's shape_and_slices: '' for the whole tensor, else
    'full dims start,length:start,length...'."""
    if tuple(self.size) == tuple(self.shape):
      return ""
    return (" ".join(str(n) for n in self.shape) + " "
            + ":".join(f"{b},{n}" for b, n in zip(self.begin, self.size)))

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.size, dtype=np.int64)) * tf.as_dtype(self.variable.dtype).size


def layout_slices(layout: Layout) -> List[Slice]:
  """The Slices of one model copy's layout (its shards cut along the layout's axis)."""
  out = []
  for name, (axis, shards) in layout.items():
    shape = [int(n) for n in shards[0].shape]
    if axis is not None:
      shape[axis] *= len(shards)
    offset = 0
    for var in shards:
      size = tuple(int(n) for n in var.shape)
      begin = [0] * len(shape)
      if axis is not None:
        begin[axis], offset = offset, offset + size[axis]
      out.append(Slice(name, tuple(shape), tuple(begin), size, var))
  return out


def host_of(variable) -> str:
  """The CPU of the process (task) that holds `variable`: where its slice is copied,
  written and read, so no other process ever holds it."""
  if isinstance(variable, keras.Variable):
    variable = variable.value
  if isinstance(variable, tf.Variable):
    spec = tf.DeviceSpec.from_string(variable.device)
    if spec.job:
      return f"/job:{spec.job}/replica:{spec.replica or 0}/task:{spec.task or 0}/device:CPU:0"
  return "/device:CPU:0"


def _by_host(slices: Sequence[Slice]) -> Dict[str, List[Slice]]:
  groups: Dict[str, List[Slice]] = {}
  for piece in slices:
    groups.setdefault(host_of(piece.variable), []).append(piece)
  return groups


def _chunks(slices: Sequence[Slice], limit: int):
  """Runs of slices of at most `limit` bytes (one slice alone when larger)."""
  run, size = [], 0
  for piece in slices:
    if run and size + piece.nbytes > limit:
      yield run
      run, size = [], 0
    run.append(piece)
    size += piece.nbytes
  if run:
    yield run


def _absolute(path: str) -> str:
  """A local path made absolute: other processes (the job's other tasks) write under it too."""
  return path if "://" in path else os.path.abspath(path)


@tf.function
def _save_bundle(host: str, prefix, names, specs, values):
  """SaveV2 on `host`; True once written (an op on another worker runs asynchronously in
  eager mode: waiting for this result is waiting for the write)."""
  with tf.device(host):
    with tf.control_dependencies([tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                                                    shape_and_slices=specs, tensors=values)]):
      return tf.constant(True)


TMP_SUFFIX = ".tmp"  # ckpt-N.tmp/: the parts of a checkpoint being written (never restored).


class CanonicalCheckpointer:
  """Saves and restores model + optimizer state in the canonical layout, slice by slice.

  Args:
    layouts: one Layout per model copy in this process (several for hybrid data
      x model parallel): every copy is restored; `write` defaults to copy 0's.
    directory: where checkpoints go (`<model_dir>/checkpoints`).
    keep: how many checkpoints to keep: the newest on disk.
    is_chief: the chief joins the parts into the checkpoint and publishes it.
    worker_index: names this process's parts.
    held: the Slices this process restores (default: every copy's, from `layouts`;
      ZeRO-3 gives its row shards, so a restore reads only those rows).
    write: the Slices this process writes (default: copy 0's on the chief,
      none elsewhere: data-parallel replicas hold copies of the chief's state).
    writers: how many processes write parts (the chief waits for each).
    joined: Slices this process reads at each save without writing them (views whose
      reading runs collectives that every worker joins, as the writer's reading does);
      default: copy 0's on a process that writes none of it (`write` not given).
    background: write in a background thread (`save` returns once the slices
      are copied; `wait` joins).
    log: called with "saved <path>" once the chief has published a checkpoint.
  """

  def __init__(self, layouts: Sequence[Layout], directory: str, *, keep: int = 3,
               is_chief: bool = True, worker_index: int = 0, held: Optional[List[Slice]] = None,
               write: Optional[List[Slice]] = None, writers: int = 1, background: bool = False,
               log=None, joined: Optional[List[Slice]] = None):
    self.layouts = list(layouts)
    self.directory = _absolute(directory)
    self.keep = keep
    self.is_chief = is_chief
    self.worker_index = worker_index
    self.writers = writers
    self.background = background
    self.log = log
    self.restored_slices = held if held is not None else [
        p for layout in self.layouts for p in layout_slices(layout)]
    # Copy 0's state may be a view that gathers shards (ZeRO) with collectives, which every
    # worker must run in the same order: a worker that writes none of it still reads it.
    if joined is None:
      joined = layout_slices(self.layouts[0]) if write is None and not is_chief else []
    self.read_only_slices = joined
    if write is None:
      write = layout_slices(self.layouts[0]) if is_chief else []
    self.written_slices = write
    self.shapes = {p.name: p.shape for p in self.restored_slices + list(write)}
    self.chunk_bytes = 64 << 20  # A restore reads at most this much at once (per host).
    self._thread: Optional[threading.Thread] = None
    self._error: Optional[BaseException] = None

  @property
  def latest(self) -> Optional[str]:
    """The newest checkpoint on disk (readable or not), or None."""
    found = list_checkpoints(self.directory)
    return found[0][1] if found else None

  # --- saving -----------------------------------------------------------------
  def save(self, step: int) -> Optional[str]:
    """Writes the state at `step`; returns the chief's checkpoint path.

    Waits for the write before (its error is raised here), copies this
    process's slices to its hosts' memory, then writes them: here, or in the
    background (`background`), while training goes on.

    Raises:
      NonFiniteStateError: a weight or slot holds a NaN or infinity; nothing
        is written (so no good checkpoint is rotated out for it).
      tfpar.storage.DiskFullError: no room for it; its partial files are removed.
    """
    self.wait()
    for p in self.read_only_slices:  # The same collectives as the chief's copy (see __init__).
      tf.convert_to_tensor(_tf_var(p.variable))
    groups = self._snapshot(step)
    if self.worker_index >= self.writers:
      return None  # The chief waits for parts w0..w{writers-1} only: none from this process.
    if not self.background:
      self._finish(step, groups)
    else:
      self._thread = threading.Thread(target=self._finish_quietly, args=(step, groups),
                                      name=f"tfpar-save-{step}", daemon=True)
      self._thread.start()
    return os.path.join(self.directory, f"ckpt-{step}") if self.is_chief else None

  @property
  def writing(self) -> bool:
    """Whether a background write is in flight."""
    return self._thread is not None and self._thread.is_alive()

  def wait(self, quietly: bool = False) -> None:
    """Returns once the write in flight (if any) is finished; raises its error (unless
    `quietly`: on the way out of another error)."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    error, self._error = self._error, None
    if error is not None and not quietly:
      raise error

  def _snapshot(self, step: int):
    """[(host, slices, host copies)]: this process's slices copied on their own hosts."""
    groups = []
    for host, slices in _by_host(self.written_slices).items():
      with tf.device(host):
        values = [tf.identity(tf.convert_to_tensor(_tf_var(p.variable))) for p in slices]
        finite = [tf.reduce_all(tf.math.is_finite(v)) for v in values if v.dtype.is_floating]
        if finite and not bool(tf.reduce_all(tf.stack(finite))):
          bad = [p.name for p, v in zip(slices, values)
                 if v.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(v)))]
          raise NonFiniteStateError(
              f"step {step}: {bad[0]} (and {len(bad) - 1} more) holds NaN or infinite values: "
              f"not saved; the newest checkpoint in {self.directory} is the last good state")
      groups.append((host, slices, values))
    return groups

  def _finish_quietly(self, step, groups):
    try:
      self._finish(step, groups)
    except BaseException as e:  # pylint: disable=broad-except  # Raised by the next wait().
      self._error = e

  def _finish(self, step: int, groups) -> None:
    """Writes this process's parts into ckpt-N.tmp/; the chief then publishes ckpt-N."""
    tmp = os.path.join(self.directory, f"ckpt-{step}{TMP_SUFFIX}")
    try:
      storage.makedirs(tmp)
      for g in range(len(groups)):
        host, slices, values = groups[g]
        groups[g] = None  # Each copy freed once written, not after the chief's publish.
        _save_bundle(host, tf.constant(os.path.join(tmp, f"w{self.worker_index}-{g}")),
                     tf.constant([p.key for p in slices]),
                     tf.constant([p.spec() for p in slices]), values).numpy()
        del values
      storage.write_atomically(os.path.join(tmp, f"w{self.worker_index}.done"), "")
      if self.is_chief:
        self._publish(step, tmp)
    except Exception as e:
      storage.discard(tmp)
      why = storage.no_room(e)
      if why is None:
        raise
      newest = self.latest
      kept = (f"the newest checkpoint, {os.path.basename(newest)}, is intact" if newest
              else "no checkpoint was saved before")
      raise storage.DiskFullError(
          f"no room to save the checkpoint of step {step} in {self.directory} ({why}): its "
          f"partial files are removed and {kept}; {storage.full_disk_advice(why)}") from None

  def _publish(self, step: int, tmp: str, timeout: float = 600.0) -> None:
    """Joins every writer's parts into ckpt-N (its index renamed into place last).

    Until then ckpt-N has no index, so a process killed in between leaves
    nothing a restore would pick (list_checkpoints reads the index files).
    """
    deadline = time.monotonic() + timeout
    for w in range(self.writers):
      while not storage.exists(os.path.join(tmp, f"w{w}.done")):
        if time.monotonic() > deadline:
          raise RuntimeError(f"worker {w} wrote no part of the checkpoint of step {step} in "
                             f"{timeout:.0f} s")
        time.sleep(0.05)
    parts = sorted(path[:-len(".index")] for path in storage.glob(os.path.join(tmp, "w*.index")))
    merged = os.path.join(tmp, f"ckpt-{step}")
    with tf.device("/device:CPU:0"):
      tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=merged,
                                    delete_old_dirs=False)
    final = os.path.join(self.directory, f"ckpt-{step}")
    for old in [final + ".index"] + storage.glob(final + ".data-*"):  # An older ckpt-N.
      storage.discard(old)
    for data in storage.glob(merged + ".data-*"):
      storage.rename(data, final + data[len(merged):])
    storage.rename(merged + ".index", final + ".index")
    storage.discard(tmp)
    self._prune(final)
    self._rewrite_state(final)
    if self.log is not None:
      self.log(f"saved {final}")

  def remove_unfinished(self) -> None:
    """Removes what writes cut short left (ckpt-N.tmp/, data files without an index).

    The chief, at start-up, before any process writes.
    """
    for path in storage.glob(os.path.join(self.directory, f"ckpt-*{TMP_SUFFIX}")):
      storage.discard(path)
    indexed = {prefix for _, prefix in list_checkpoints(self.directory)}
    for data in storage.glob(os.path.join(self.directory, "ckpt-*.data-*")):
      if data[:data.rindex(".data-")] not in indexed:
        storage.discard(data)

  def _prune(self, saved: str) -> None:
    """Keeps the newest `keep` checkpoints on disk, deleting the rest (the chief only).

    Data files go before the index: a deletion cut short leaves an index the
    next save still finds, never an orphaned data file. The checkpoint just
    written always stays, even below a newer one left on disk (an unreadable
    ckpt-N the run fell back from).
    """
    old = [(step, prefix) for step, prefix in list_checkpoints(self.directory)[self.keep:]
           if os.path.basename(prefix) != os.path.basename(saved)]
    for _, prefix in old:
      for path in storage.glob(prefix + ".data-*") + [prefix + ".index"]:
        try:
          storage.remove(path)
        except tf.errors.NotFoundError:
          pass

  # --- restoring --------------------------------------------------------------
  def _restore_one(self, prefix: str) -> List[str]:
    """Reads this process's slices of one checkpoint into its variables; returns the
    state names left fresh.

    Each host reads only the slices its variables hold (RestoreV2 with
    shape_and_slices), a bounded run of them at a time. Gradient-compression
    state (tfpar.parallel.compression) is optional: a checkpoint written
    without it, or for another replica count, restores the model and optimizer
    and leaves that state at its start (residuals zero).
    """
    stored = _reader(prefix).get_variable_to_shape_map()
    differ = {name: stored.get(_checkpoint_key(name)) for name, shape in self.shapes.items()
              if stored.get(_checkpoint_key(name)) != list(shape)}
    fresh = [name for name in differ if name.startswith(OPTIONAL_PREFIX)]
    for name, shape in differ.items():
      if name not in fresh:
        there = "is missing" if shape is None else f"has shape {shape}"
        raise ValueError(f"{name} {there} there, shape {list(self.shapes[name])} here")
    wanted = [p for p in self.restored_slices if p.name not in fresh]
    for host, slices in _by_host(wanted).items():
      for run in _chunks(slices, self.chunk_bytes):
        with tf.device(host):
          values = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[p.key for p in run],
                                        shape_and_slices=[p.spec() for p in run],
                                        dtypes=[tf.as_dtype(p.variable.dtype) for p in run])
        for piece, value in zip(run, values):
          piece.variable.assign(value)
        del values
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
    if self.is_chief and not path:  # Once named above: what no restore can read goes.
      self.remove_unfinished()
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

    tf.train.latest_checkpoint and other tools read it. The file is the text
    form of tf's CheckpointState proto; the function TF has for writing it
    (update_checkpoint_state) is deprecated and warns.
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
  stored = _reader(path).get_variable_to_shape_map()
  missing = sorted(name for name in layout if _checkpoint_key(name) not in stored)
  if missing:
    raise CheckpointMismatchError(
        f"the checkpoint {path} has no {missing[0]}: it was written by another version of "
        "the model; retrain into a new --model_dir")
  reader = CanonicalCheckpointer([layout], os.path.dirname(path), is_chief=False)
  reader.chunk_bytes = 0  # One tensor at a time.
  reader.restore(path)
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
