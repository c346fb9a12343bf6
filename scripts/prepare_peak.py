"""Peak resident memory of `python -m tfpar.data prepare` on a text of one huge line.

    nice -n 10 python scripts/prepare_peak.py --mb=200

Writes a file of one line of --mb megabytes (the standard library's source with its
line breaks turned into spaces, repeated), trains a small SentencePiece model on
other text, and runs `python -m tfpar.data prepare --tokenizer=sentencepiece:...`
on that file and on a file of one 1 kB line, each in its own process, one after
the other; prints each run's peak RSS (os.wait4's ru_maxrss) and what the huge
line adds per MB of its input. SentencePiece needs about 55 times the text it
is given at once; prepare gives it one piece (tfpar.data.corpus.PIECE_BYTES) at
a time, so the huge line should add a few MB, whatever its length.
tests/test_prepared.py runs the same measurement on a 20 MB line.
"""

import argparse
import inspect
import io
import os
import subprocess
import sys
import tempfile
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_line_file(path: str, n_bytes: int) -> str:
  """A text file of one line of n_bytes: the standard library's source, newlines as spaces."""
  block = inspect.getsource(textwrap).encode().replace(b"\n", b" ")
  block = block * (-(-min(n_bytes, 1 << 24) // len(block)))
  with open(path, "wb") as f:
    left = n_bytes
    while left:
      f.write(block[:min(left, len(block))])
      left -= min(left, len(block))
  return path


def sentencepiece_model(path: str) -> str:
  """A 320-piece BPE model of textwrap's source (trained in this process: about a second)."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  proto = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(inspect.getsource(textwrap).splitlines()), model_writer=proto,
      vocab_size=320, model_type="bpe", minloglevel=2)
  with open(path, "wb") as f:
    f.write(proto.getvalue())
  return path


def prepare_peak(data: str, tokenizer: str, out: str):
  """python -m tfpar.data prepare on `data` into `out`: (exit status, peak RSS bytes, stderr)."""
  env = dict(os.environ, PYTHONPATH=REPO)
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen([sys.executable, "-m", "tfpar.data", "prepare", f"--data={data}",
                             f"--tokenizer={tokenizer}", f"--out={out}", "--num_shards=1"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    _, status, usage = os.wait4(proc.pid, 0)
    err.seek(0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, err.read()


def measure(root: str, n_bytes: int) -> dict:
  """{'small': peak, 'huge': peak} in bytes of prepare on a 1 kB line and an n_bytes line."""
  spec = "sentencepiece:" + sentencepiece_model(os.path.join(root, "sp.model"))
  peaks = {}
  for name, size in (("small", 1000), ("huge", n_bytes)):
    data = one_line_file(os.path.join(root, f"{name}.txt"), size)
    code, peaks[name], err = prepare_peak(data, spec, os.path.join(root, f"{name}_set"))
    if code:
      raise RuntimeError(f"prepare of the {name} line exited {code}: {err[-3000:]}")
    os.remove(data)
  return peaks


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mb", type=int, default=200, help="MB (10**6 bytes) in the one line")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as root:
    peaks = measure(root, args.mb * 10 ** 6)
  added = peaks["huge"] - peaks["small"]
  print(f"prepare peak RSS: 1 kB line {peaks['small'] / 2**20:,.0f} MiB, {args.mb} MB line "
        f"{peaks['huge'] / 2**20:,.0f} MiB: the line adds {added / 2**20:,.0f} MiB, "
        f"{added / (args.mb * 10 ** 6):.2f} bytes per byte of input")


if __name__ == "__main__":
  main()
