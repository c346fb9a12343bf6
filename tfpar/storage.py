"""Reading and writing tfpar's own files through tf.io.gfile, so that gs:// works.

Checkpoints, summaries and data already go through TensorFlow's filesystems;
tfpar's own files (config.json, metrics.jsonl, plan.json, ps_steps.jsonl) go
through these helpers, so `--model_dir=gs://bucket/run` (or s3://, hdfs://,
or the in-memory ram:// the tests use) holds every file of a run.

Appending: on object stores (GCS, S3) TensorFlow's filesystem implements
append by rewriting the object, which costs one upload of the file per call;
tfpar appends once per logged step, so that stays small.
"""

from typing import Iterable


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


def _gfile():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.io.gfile


def exists(path: str) -> bool:
  return _gfile().exists(path)


def makedirs(path: str) -> None:
  _gfile().makedirs(path)


def glob(pattern: str) -> list:
  return _gfile().glob(pattern)


def remove(path: str) -> None:
  _gfile().remove(path)


def read_text(path: str) -> str:
  with _gfile().GFile(path, "r") as f:
    return f.read()


def write_atomically(path: str, text: str) -> None:
  """Writes `path` whole, then renames it into place: readers never see half a file."""
  gfile = _gfile()
  tmp = path + ".tmp"
  with gfile.GFile(tmp, "w") as f:
    f.write(text)
  gfile.rename(tmp, path, overwrite=True)


def append_lines(path: str, lines: Iterable[str]) -> None:
  """Appends lines (each ending in a newline) to `path`, creating it if needed."""
  with _gfile().GFile(path, "a") as f:
    for line in lines:
      f.write(line)
