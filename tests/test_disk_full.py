"""A full disk: one line naming the path and the fix, exit 4, no partial checkpoint left.

On a real filesystem that fills up: a 25 MiB tmpfs (the tests run as root
here), filled with a ballast file. Where mount is refused (a CI without root),
a real limit instead that needs no root: the child's RLIMIT_FSIZE, with
SIGXFSZ ignored, so that its writes past the limit fail with EFBIG ('File too
large') as they would on a full disk. Either way the first checkpoint is
written with room to spare, and the next one finds none.
"""

import concurrent.futures
import errno
import os
import re
import resource
import signal
import subprocess

import pytest

from conftest import (TINY, in_background, read_metrics, run_module, selected_tests_use,
                      train_in_process)
from tfpar import status

ARGS = TINY + ["--jit_compile=false", "--eval_steps=0", "--seed=11"]
WHY = r"\((No space left on device|File too large)\)"
ROOM = 100 * 1024  # Room left: the step records fit, a checkpoint (~330 KB) does not.


class SmallDisk:
  """A directory whose writes run out of room when `fill`ed, and have room again when `free`d."""

  def __init__(self, root):
    self.root = str(root)
    try:
      mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=25m", "tmpfs", self.root],
                             capture_output=True, check=False)
      self.mounted = mount.returncode == 0
    except OSError:  # No mount command.
      self.mounted = False
    self.ballast = os.path.join(self.root, "ballast")
    self.limit = None

  def fill(self, room):
    """Leaves `room` bytes free (a tmpfs) or limits each file the child writes to `room` bytes."""
    if not self.mounted:
      self.limit = max(room, 512)  # A config.json (~1.5 KB) does not fit in 512 bytes.
      return
    stat = os.statvfs(self.root)
    try:
      with open(self.ballast, "ab") as f:
        f.truncate(0)
        f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - room))
        while room == 0:  # Page by page, to the very last one.
          f.write(b"\0" * 4096)
          f.flush()
    except OSError as e:
      assert e.errno == errno.ENOSPC, e

  def free(self):
    self.limit = None
    if os.path.exists(self.ballast):
      os.remove(self.ballast)

  def train(self, args):
    """`python -m tfpar.train args`, under the file size limit if there is one."""
    limit = self.limit

    def limited():
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return run_module("tfpar.train", args, check=False, preexec_fn=limited if limit else None)

  def close(self):
    if self.mounted:
      subprocess.run(["umount", self.root], check=False)


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
  small = SmallDisk(tmp_path_factory.mktemp("small_disk"))
  try:
    yield small
  finally:
    small.free()
    small.close()


def assert_one_line(proc, *patterns):
  assert proc.returncode == status.DISK_FULL, (proc.returncode, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr + proc.stdout
  assert proc.stderr.count("\n") == 1, proc.stderr
  line = proc.stderr.strip()
  assert line.startswith("tfpar.train: error: no room to "), line
  assert "point --model_dir at it" in line and "start the same command again" in line, line
  for pattern in patterns:
    assert re.search(pattern, line), (pattern, line)


def files(directory):
  return sorted(os.listdir(directory))


@pytest.fixture(scope="module")
def failed_save(disk):
  """A run saves ckpt-2 with room to spare; its resume fills the disk at the save of step 4."""
  model_dir = os.path.join(disk.root, "run")
  args = ARGS + ["--checkpoint_every=2", f"--model_dir={model_dir}"]
  train_in_process(args + ["--train_steps=2"])
  disk.fill(ROOM)
  try:
    proc = disk.train(args + ["--train_steps=6", "--checkpoint_every=4"])
  finally:
    disk.free()
  return model_dir, args, proc


def test_a_save_on_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(failed_save):
  model_dir, _, proc = failed_save
  checkpoints = os.path.join(model_dir, "checkpoints")
  assert_one_line(proc, re.escape(f"save the checkpoint of step 4 in {checkpoints} ") + WHY,
                  "its partial files are removed and the newest checkpoint, ckpt-2, is intact")
  assert re.search(r"^step +4/6 ", proc.stdout, re.M), proc.stdout[-2000:]
  assert files(checkpoints) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]


def test_the_next_start_resumes_from_the_newest_checkpoint_left(failed_save, capsys):
  model_dir, args, _ = failed_save
  train_in_process(args + ["--train_steps=6", "--checkpoint_every=4"])
  out = capsys.readouterr().out
  assert re.search(r"^resumed from \S+/ckpt-2 at step 2$", out, re.M), out[-2000:]
  assert [r["step"] for r in read_metrics(model_dir)] == [1, 2, 3, 4, 5, 6]  # each step once
  assert "ckpt-6.index" in files(os.path.join(model_dir, "checkpoints"))


def new_run_on_a_full_disk(disk):
  """A new run on a disk filled to the last page: (its model_dir, its CompletedProcess)."""
  model_dir = os.path.join(disk.root, "new_run")
  disk.fill(0)
  try:
    return model_dir, disk.train(ARGS + ["--train_steps=2", f"--model_dir={model_dir}"])
  finally:
    disk.free()


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
  """The new run's process, on a small disk of its own, started with this module's first
  test: it runs beside failed_save's in-process run (as its own python -m, as before)."""
  if not selected_tests_use(request, "full_new_run"):
    yield None
    return
  small = SmallDisk(tmp_path_factory.mktemp("small_disk_new_run"))
  future = in_background(new_run_on_a_full_disk, small)
  try:
    yield future
  finally:
    concurrent.futures.wait([future])  # Unmounted only once its process has ended.
    small.free()
    small.close()


@pytest.fixture(scope="module")
def full_new_run(started):
  return started.result()


def test_a_new_run_on_a_full_disk_is_one_line_and_leaves_no_config_behind(full_new_run):
  """The first write of a new run (its config.json) finds no room: the same one line."""
  model_dir, proc = full_new_run
  assert_one_line(proc, re.escape(f"write {model_dir}/config.json ") + WHY)
  assert not os.path.exists(model_dir) or files(model_dir) == []
