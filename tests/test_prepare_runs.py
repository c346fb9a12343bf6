"""tfpar.data prepare as real processes on a text of one huge line (issue 33): its memory is
bounded by a piece, and a prepare killed mid-way leaves --out as it was.

SentencePiece needs about 55 times the text it is given at once, and prepare once gave it a
whole document: a single 200 MB line peaked at 10.5 GiB. scripts/prepare_peak.py measures
the 200 MB case (docs/failures.md); this is its scaled-down twin: a 20 MB line, which
encoded whole with this test's SentencePiece model adds 646 MiB to a process's peak RSS
(measured here), against the budget of 256 MiB over the peak (os.wait4's ru_maxrss) of
`python -m tfpar.data prepare` on a 1 kB line.
"""

import concurrent.futures
import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, load_file

LINE_BYTES = 20 * 10 ** 6
BUDGET = 256 << 20  # What the 20 MB line may add: a few pieces' worth, far below 55 x 20 MB.


def prepare_peak():
  return load_file("scripts", "prepare_peak.py")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  """The script's measurement: (its module, tokenizer spec, root, small peak, huge peak)."""
  tmp_path = tmp_path_factory.mktemp("prepare_runs")
  script = prepare_peak()
  tok = "sentencepiece:" + script.sentencepiece_model(str(tmp_path / "sp.model"))
  small = script.one_line_file(str(tmp_path / "small.txt"), 1000)
  huge = script.one_line_file(str(tmp_path / "huge.txt"), LINE_BYTES)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:  # Each peak is its own process's.
    runs = list(pool.map(lambda a: script.prepare_peak(a[0], tok, str(tmp_path / a[1])),
                         [(small, "small_set"), (huge, "huge_set")]))
  for code, _, err in runs:
    assert code == 0, err[-3000:]
  return script, tok, tmp_path, runs[0][1], runs[1][1]


def test_prepare_of_one_huge_line_peaks_a_piece_above_a_small_one(measured):
  _, _, root, small_peak, huge_peak = measured
  assert huge_peak - small_peak < BUDGET, (small_peak >> 20, huge_peak >> 20)
  with open(root / "huge_set" / "manifest.json") as f:
    assert '"documents": 1,' in f.read()  # One document, tokenized whole (in pieces).


def checksums(directory):
  return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
          for name in sorted(os.listdir(directory))}


def test_a_prepare_killed_mid_way_leaves_the_set_it_replaces_as_it_was(measured):
  """Once prepare wrote in place: a re-prepare killed part-way left shards of two runs under
  one name. Now the new set is written aside: --overwrite of the small set with the huge
  line, SIGKILLed once it has written ids, leaves the small set whole and readable."""
  _, tok, root, _, _ = measured
  out = root / "small_set"
  before = checksums(out)
  huge = root / "huge.txt"  # The measured line: a few seconds of SentencePiece.
  proc = subprocess.Popen([sys.executable, "-m", "tfpar.data", "prepare", f"--data={huge}",
                           f"--tokenizer={tok}", f"--out={out}", "--overwrite"], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  part = root / f".small_set.partial-{proc.pid}" / "parts" / "part-000000.bin"
  while proc.poll() is None and not (part.exists() and part.stat().st_size):
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL, "prepare ended before it was killed mid-way"
  assert checksums(out) == before
  from tfpar import tokenizer  # pylint: disable=import-outside-toplevel
  from tfpar.data import prepared  # pylint: disable=import-outside-toplevel
  prepared.open_set(str(out), tokenizer.load(tok))  # Whole: its manifest's sizes and sha256s.
