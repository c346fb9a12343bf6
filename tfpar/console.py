"""What a person sees: TensorFlow's start-up noise silenced unless asked, and plain sentences.

TensorFlow's C++ side logs on import and at device start-up (oneDNN notices,
"Could not find cuda drivers", an E-level "failed call to cuInit" on a machine
without a GPU). None of it is about the run, and it buries tfpar's first line.
`import_tensorflow_quietly` sets TF_CPP_MIN_LOG_LEVEL (read once, when TF is
imported) and imports TF; `--verbosity` (absl's own flag) brings the lines back.
"""

import ctypes
import importlib
import os
import sys
import tempfile
from typing import Optional


# absl verbosity (-3 fatal .. 0 info, 1 debug) -> TF_CPP_MIN_LOG_LEVEL (3 hides
# errors, 2 warnings, 1 info, 0 nothing).
_QUIET = "3"


# --xla_auto_clustering -> the TF_XLA_FLAGS that turn it on (XLA reads them once per
# process, at its first use). --tf_xla_cpu_global_jit: auto-clustering on CPUs too.
XLA_AUTO_CLUSTERING_FLAGS = {
    "fusible": "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit --tf_xla_ops_to_cluster=FUSIBLE"}


def set_xla_auto_clustering(mode: str) -> None:
  """Puts --xla_auto_clustering's flags into TF_XLA_FLAGS (call before TensorFlow runs a
  function: XLA reads them once). Flags the user set there already come after ours and win."""
  ours = XLA_AUTO_CLUSTERING_FLAGS.get(mode)
  if ours and ours not in os.environ.get("TF_XLA_FLAGS", ""):
    os.environ["TF_XLA_FLAGS"] = f"{ours} {os.environ.get('TF_XLA_FLAGS', '')}".strip()


def xla_auto_clustering_active(mode: str) -> bool:
  """Did this process set --xla_auto_clustering's flags (so XLA reads them)?"""
  ours = XLA_AUTO_CLUSTERING_FLAGS.get(mode)
  return bool(ours) and ours in os.environ.get("TF_XLA_FLAGS", "")


# --host_allocator=system: glibc maps each block of this many bytes or more on its own.
SYSTEM_ALLOCATOR_MMAP_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter.
_mapped = []  # Whether this process set glibc's threshold (set_host_allocator).


def set_host_allocator(mode: str) -> None:
  """--host_allocator=system: TensorFlow's oneDNN CPU allocator hands every tensor to malloc
  (TF_ONEDNN_USE_SYSTEM_ALLOCATOR, read at its first allocation: call this before TensorFlow
  starts), and glibc maps every block of SYSTEM_ALLOCATOR_MMAP_BYTES or more on its own
  (mallopt M_MMAP_THRESHOLD, which also stops glibc raising that threshold as blocks are freed),
  so a freed tensor's pages go back to the OS at once. Without glibc (mallopt) it stays off."""
  if mode != "system" or _mapped:
    return
  mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
  if mallopt is not None and mallopt(_M_MMAP_THRESHOLD, SYSTEM_ALLOCATOR_MMAP_BYTES) == 1:
    os.environ["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] = "1"
    _mapped.append(True)


def host_allocator_active(mode: str) -> bool:
  """Did this process set --host_allocator's system allocator up (set_host_allocator)?"""
  return mode == "system" and bool(_mapped)


def cpp_log_level(verbosity: Optional[int]) -> Optional[str]:
  """TF_CPP_MIN_LOG_LEVEL for absl's --verbosity (None: not passed on the command line)."""
  if verbosity is None:
    return None
  return str(min(3, max(0, -verbosity)))


def import_tensorflow_quietly(verbosity: Optional[int] = None, cpu_devices: int = 1) -> None:
  """Imports TensorFlow with its C++ start-up lines silenced unless asked for.

  Level 3 also hides ERROR lines: errors that stop a run reach Python as
  exceptions, and the one E-line every CPU-only machine prints (cuInit) is not
  an error of the run. A few lines are written before TensorFlow's logging
  reads the level at all ("All log messages before absl::InitializeLog() ...");
  the import therefore runs with file descriptor 2 captured, and the capture is
  replayed if the import fails.

  Args:
    verbosity: absl's --verbosity when the user passed it, else None. An
      explicit TF_CPP_MIN_LOG_LEVEL in the environment is kept when it is None.
    cpu_devices: split the host CPU into this many logical devices as TensorFlow
      is imported, before anything can start its runtime (what --num_cpu_devices
      asks for; a tokenizer read while the flags are validated may start it).
  """
  if "tensorflow" in sys.modules:
    return
  _import_tensorflow(verbosity)
  if cpu_devices > 1:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)


def _import_tensorflow(verbosity: Optional[int]) -> None:
  level = cpp_log_level(verbosity)
  if level is not None:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = level
  else:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", _QUIET)
  if level is not None or os.environ["TF_CPP_MIN_LOG_LEVEL"] != _QUIET:
    importlib.import_module("tensorflow")
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as capture:
    os.dup2(capture.fileno(), 2)
    try:
      importlib.import_module("tensorflow")
    except BaseException:
      os.dup2(saved, 2)
      capture.seek(0)
      sys.stderr.write(capture.read().decode("utf-8", "replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def flagfile_with_bom(argv) -> Optional[str]:
  """One line naming a --flagfile of `argv` that starts with a byte-order mark (absl would read
  its first flag as a stray argument), else None."""
  for arg in argv:
    path = arg.partition("=")[2] if arg.startswith(("--flagfile=", "-flagfile=")) else None
    try:
      with open(path, "rb") as f:
        if f.read(3) == b"\xef\xbb\xbf":
          return (f"--flagfile={path} starts with a UTF-8 byte-order mark (BOM, what some "
                  "editors write): save it as UTF-8 without one")
    except (OSError, TypeError):  # None, or unreadable: absl says so.
      continue
  return None


def not_utf8(flag: str, value) -> Optional[str]:
  """One line where a flag's value (a str, or a list of them) holds bytes that are not UTF-8
  (Python hands them on as lone surrogates, which no file API or tokenizer accepts), else None."""
  for text in value if isinstance(value, (list, tuple)) else [value]:
    if isinstance(text, str):
      try:
        text.encode("utf-8")
      except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        return (f"--{flag}={shown} holds bytes that are not UTF-8: tfpar reads paths and text "
                "as UTF-8; rename the file (or re-encode the text) to UTF-8")
  return None


def count(n: int, noun: str, plural: str = "") -> str:
  """'1 replica', '2 replicas', '1,000 steps'; `plural` where adding an s is wrong ('boxes')."""
  return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"
