"""Peak resident memory of `python -m tfpar.data prepare --task=classify` as the image set grows.

    nice -n 19 python scripts/image_prepare_peak.py --examples=1000 --size=96

Writes a class folder of --examples PNGs of seeded noise (--size square, RGB: noise does not
compress, so each file is about as big as its pixels) and links its files 4 times into a
folder of 4x the examples. Then, in this one process, runs tfpar.data prepare on the small
folder, on the small folder again (another --out: the two sets must be byte-identical), and
on the 4x folder, and prints the peak RSS (getrusage's ru_maxrss) after each. A peak only
rises, so what the 4x run adds to the second small run's peak is what preparing 3x more
images costs in memory: prepare holds a chunk of images (tfpar.data.images.CHUNK) and one
record, so it should add little, where holding the set would add at least the 4x set's
decoded pixels less the small set's. Also prints the 4x run's rate (images a second, from
its start to its manifest) and CPU time an image (user and system, all threads: less
dependent on other load on the machine than the rate). tests/test_prepared.py runs it at 300 images of 96 pixels.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def noise_folder(root: str, examples: int, size: int, copies: int = 4) -> tuple:
  """(small, big): class folders of `examples` noise PNGs in 2 classes, and of `copies` links
  to each of its files."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  small, big = os.path.join(root, "small"), os.path.join(root, "big")
  for i in range(examples):
    name = os.path.join("ab"[i % 2], f"{i:06d}.png")
    os.makedirs(os.path.dirname(os.path.join(small, name)), exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), np.uint8)).save(
        os.path.join(small, name))
    for c in range(copies):
      link = os.path.join(big, os.path.dirname(name), f"{c}-{os.path.basename(name)}")
      os.makedirs(os.path.dirname(link), exist_ok=True)
      os.link(os.path.join(small, name), link)
  return small, big


def peak() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(root: str, examples: int, size: int) -> dict:
  """{run: peak RSS in bytes after it} for prepare on the small set, again, and the 4x set,
  written to root/{small,again,big}_set; 'pixels': the 4x set's decoded bytes; 'rate': the
  4x run's images a second; 'cpu_ms': its CPU time (user and system, all threads) an image."""
  small, big = noise_folder(root, examples, size)
  sys.path.insert(0, REPO)
  from tfpar.cli import data  # pylint: disable=import-outside-toplevel
  peaks = {}
  for name, folder in (("small", small), ("again", small), ("big", big)):
    start, cpu = time.perf_counter(), os.times()
    data.main(["tfpar.data", "prepare", "--task=classify", f"--data={folder}",
               f"--out={os.path.join(root, name + '_set')}", f"--image_size={size}",
               "--num_channels=3", "--num_classes=2", "--num_shards=2"])
    peaks[name] = peak()
  peaks["rate"] = 4 * examples / (time.perf_counter() - start)
  peaks["cpu_ms"] = (sum(os.times()[:2]) - sum(cpu[:2])) / (4 * examples) * 1e3
  peaks["pixels"] = 4 * examples * size * size * 3
  return peaks


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--examples", type=int, default=1000, help="images in the small set")
  parser.add_argument("--size", type=int, default=96, help="their height and width")
  parser.add_argument("--root", help="where the images and sets go (default: a temporary "
                      "directory, deleted after)")
  parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    peaks = measure(args.root or tmp, args.examples, args.size)
  if args.json:
    print(json.dumps(peaks))
    return
  mib = lambda b: f"{b / 2**20:,.1f} MiB"  # pylint: disable=unnecessary-lambda-assignment
  print(f"peak RSS after prepare of {args.examples:,} images: {mib(peaks['small'])}; again: "
        f"{mib(peaks['again'])}; of {4 * args.examples:,}: {mib(peaks['big'])} "
        f"(+{mib(peaks['big'] - peaks['again'])}; their decoded pixels: {mib(peaks['pixels'])}), "
        f"at {peaks['rate']:,.0f} images/s ({peaks['cpu_ms']:.2f} ms of CPU an image)")


if __name__ == "__main__":
  main()
