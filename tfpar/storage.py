"""Reading and writing tfpar's own files through tf.io.gfile, so that gs:// works.

Checkpoints, summaries and data already go through TensorFlow's filesystems;
tfpar's own files (config.json, metrics.jsonl, plan.json, ps_steps.jsonl) go
through these helpers, so `--model_dir=gs://bucket/run` (or s3://, hdfs://,
or the in-memory ram:// the tests use) holds every file of a run.

Questions and reads of a local path (no "://": exists, isdir, listdir, glob,
read_text, read_bytes) go through Python's os and open, which answer alike
(glob matches dot files, as TensorFlow's does); so the tools check their input
before TensorFlow is imported, which costs seconds. A remote path imports it
(quietly, tfpar.console) and goes through tf.io.gfile; so do writes and
removals, which happen once TensorFlow runs.

Appending: on object stores (GCS, S3) TensorFlow's filesystem implements
append by rewriting the object, which costs one upload of the file per call;
tfpar appends once per logged step, so that stays small.

A full disk. A write that finds no room (ENOSPC; EDQUOT, over a quota; EFBIG,
past a file size limit) is not a crash a blind restart fixes: the next save
would meet the same disk. `disk_full` turns such an error, as TensorFlow's
filesystems or Python raise it, into one line that names the path and the fix
(tfpar.train exits with tfpar.status.DISK_FULL); the helpers here raise
DiskFullError naming the file they write, and `write_atomically` removes its
temporary file when the write fails, so a failed write takes no space.
"""

import contextlib
import errno
import glob as glob_lib
import os
import re
import sys
import tempfile
from typing import Iterable, List, Optional

from tfpar import console

# Why a write found no room, in libc's words (TensorFlow's messages quote them), and the fix.
_NO_ROOM = {
    os.strerror(errno.ENOSPC): "free space there",
    os.strerror(errno.EDQUOT): "free space there or raise the quota",
    os.strerror(errno.EFBIG): "raise the file size limit (ulimit -f)",
}


class DiskFullError(Exception):
  """A write of the run found no room; the message is the one line tfpar.train prints."""


def no_room(error: BaseException) -> Optional[str]:
  """'No space left on device' (or the quota's, or the file size limit's words), else None."""
  if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
    return os.strerror(error.errno)
  text = str(error)
  return next((why for why in _NO_ROOM if why in text), None)


def full_disk_advice(why: str) -> str:
  """What to do about `no_room`'s answer, as the end of one line."""
  return (f"{_NO_ROOM[why]}, or move the run to a disk with room and point --model_dir at it; "
          "then start the same command again: it resumes from the newest checkpoint")


def _no_room_line(path: str, why: str) -> str:
  return f"no room to write {path} ({why}): {full_disk_advice(why)}"


def disk_full(error: BaseException) -> Optional[str]:
  """The one line for a write that found no room, naming the file; None for any other error.

  For errors raised outside these helpers too (TensorFlow's summary writer).
  """
  if isinstance(error, DiskFullError):
    return str(error)
  why = no_room(error)
  if why is None:
    return None
  path = getattr(error, "filename", None)
  if not path:  # TensorFlow writes '<path>; No space left on device'.
    match = re.search(r"(\S+); " + re.escape(why), str(error))
    path = match.group(1) if match else "a file of --model_dir"
  return _no_room_line(path, why)


@contextlib.contextmanager
def _writing(path: str):
  """Turns a write of `path` that found no room into DiskFullError naming `path`."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  # Re-raised unless no room.
    why = no_room(e)
    if why is None:
      raise
    raise DiskFullError(_no_room_line(path, why)) from None


class Unreachable(OSError):
  """A filesystem that cannot be reached now (gs:// without network or credentials).

  Not bad input: the same command may well work once the network is back, so
  tfpar.train exits 1 (tfpar.status.CRASH), which restart policies retry.
  """


def describe_unreachable(path: str, error) -> Unreachable:
  """tf.errors.OpError on `path` as one line: what TensorFlow said, and what to check."""
  text = " ".join(str(getattr(error, "message", error)).split())
  return Unreachable(f"{path} cannot be reached ({type(error).__name__}: {text[:240]}): check "
                     "the network, the bucket name and the credentials "
                     "(GOOGLE_APPLICATION_CREDENTIALS), then start the same command again")


class NotWritable(ValueError):
  """An output path that cannot take what is to be written there: bad input (one line, exit 2)."""


def check_output(path: str, flag: str, *, directory: bool) -> None:
  """--flag=path can take a new file (directory=False) or a directory of files (True), checked
  before the work that makes it, which writes nothing here.

  Local paths: the parent that exists must be a directory where this process can make an
  entry, tried by making (and removing) one, since access() says yes to root anywhere, /proc
  and an immutable directory included. A remote path (gs://): its store must answer.

  Raises:
    NotWritable: the path cannot work (the message names --flag and the fix).
    Unreachable: a remote store that does not answer now.
  """
  what = "a directory (new or a run's)" if directory else "the path of a new file"
  if is_remote(path):
    gfile = _gfile()
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
      if gfile.exists(path) and not directory and gfile.isdir(path):  # exists() asks the store.
        raise NotWritable(f"--{flag}={path} is a directory: pass {what}")
    except tf.errors.OpError as e:
      raise describe_unreachable(f"--{flag}={path}", e) from None
    return
  if os.path.isdir(path) and not directory:
    raise NotWritable(f"--{flag}={path} is a directory: pass {what}, e.g. "
                      f"--{flag}={os.path.join(path, 'out')}")
  if os.path.exists(path) and not os.path.isdir(path) and directory:
    raise NotWritable(f"--{flag}={path} is a file: pass {what}")
  existing = os.path.dirname(os.path.abspath(path)) if not directory else os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise NotWritable(f"--{flag}={path}: {existing} is a file, not a directory: pass {what} "
                      "in a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise NotWritable(f"--{flag}={path} is not writable ({existing} refuses this user): "
                      "pass a directory you can write to")
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".tfpar_probe_", dir=existing))
  except OSError as e:
    raise NotWritable(f"--{flag}={path} cannot be created in {existing} ({e.strerror}): pass a "
                      "path on a filesystem that holds files") from None


def _gfile():
  console.import_tensorflow_quietly()
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.io.gfile


def is_remote(path: str) -> bool:
  """A path of a filesystem TensorFlow provides (gs://, s3://, ram://), not a local one."""
  return "://" in path


def read_errors() -> tuple:
  """What a failed question or read raises: OSError (a local path), and tf.errors.OpError once
  TensorFlow is imported (a remote path imports it)."""
  tf = sys.modules.get("tensorflow")
  return (OSError,) if tf is None else (OSError, tf.errors.OpError)


def exists(path: str) -> bool:
  return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def listdir(path: str) -> List[str]:
  return _gfile().listdir(path) if is_remote(path) else os.listdir(path)


def walk(path: str):
  """(directory, subdirectories, file names) under `path`, as os.walk."""
  return _gfile().walk(path) if is_remote(path) else os.walk(path)


def glob(pattern: str) -> list:
  if is_remote(pattern):
    return _gfile().glob(pattern)
  return glob_lib.glob(pattern, include_hidden=True)


def makedirs(path: str) -> None:
  _gfile().makedirs(path)


def remove(path: str) -> None:
  _gfile().remove(path)


def rename(source: str, destination: str) -> None:
  _gfile().rename(source, destination, overwrite=True)


def discard(path: str) -> None:
  """Removes a file or a whole directory if there; for cleaning up after a failure.

  Never raises: a cleanup that fails too must not hide the failure it cleans up after.
  """
  gfile = _gfile()
  try:
    if gfile.isdir(path):
      gfile.rmtree(path)
    elif gfile.exists(path):
      gfile.remove(path)
  except Exception:  # pylint: disable=broad-except
    pass


def open_file(path: str, mode: str = "rb"):
  """`path` opened for reading or writing: the OS's own file for a local path (no TensorFlow
  import, so a spawned prepare worker starts in a fraction of a second), tf.io.gfile's for a
  remote one. Failures raise `read_errors()`."""
  return _gfile().GFile(path, mode) if is_remote(path) else open(path, mode)  # pylint: disable=unspecified-encoding


def size(path: str) -> int:
  """The file's length in bytes."""
  return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def error_line(error: BaseException) -> str:
  """The first line of what a failed read says: an OpError's message or an OSError's reason."""
  text = getattr(error, "message", None) or getattr(error, "strerror", None) or str(error)
  return str(text).splitlines()[0]


def read_text(path: str) -> str:
  """The file as UTF-8 text, its line ends as written."""
  if is_remote(path):
    with _gfile().GFile(path, "r") as f:
      return f.read()
  with open(path, encoding="utf-8", newline="") as f:
    return f.read()


def read_bytes(path: str) -> bytes:
  with open_file(path, "rb") as f:
    return f.read()


def write_atomically(path: str, text) -> None:
  """Writes `path` whole (`text`: str or bytes), then renames it into place: readers never
  see half a file.

  A failed write (a full disk) removes the temporary file and raises.
  """
  gfile = _gfile()
  tmp = path + ".tmp"
  with _writing(path):
    try:
      with gfile.GFile(tmp, "wb") as f:
        f.write(text)
      gfile.rename(tmp, path, overwrite=True)
    except Exception:
      discard(tmp)
      raise


def append_lines(path: str, lines: Iterable[str]) -> None:
  """Appends lines (each ending in a newline) to `path`, creating it if needed.

  On a full disk the last line may be cut short: the next start sets it aside
  (tfpar.training.metrics).
  """
  with _writing(path), _gfile().GFile(path, "a") as f:
    for line in lines:
      f.write(line)
