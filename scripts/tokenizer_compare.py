"""Byte-level vs a trained SentencePiece tokenizer at equal compute: held-out loss per byte.

    python scripts/tokenizer_compare.py                       # gpt_tiny's model, 300 byte steps
    python scripts/tokenizer_compare.py --steps=600 --vocab_size=4000

Trains a SentencePiece model on the embedded corpus (python -m tfpar.tokenizer
train), then trains configs/gpt_tiny.flags's GPT twice, each in its own
process: once on bytes, once on the SentencePiece ids. Equal compute means
equal training FLOPs (tfpar.planner.cost.step_flops: the blocks' matmuls and
attention plus the output projection, forward and backward): the same model
body, batch and seq_len, and the SentencePiece run gets fewer steps, because
its larger vocabulary makes every step's output projection dearer. Equal
FLOPs, not equal tokens, because what a user pays for is compute; the
SentencePiece run still reads ~3x more text, which is the point of a tokenizer.

Prints, per run, steps, FLOPs, bytes per token and the final held-out loss per
token and per byte (nats). Both held-out sets are the tail of the corpus
(--eval_fraction of its tokens), so they cover nearly the same text.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tfpar.planner import cost  # pylint: disable=wrong-import-position
from tfpar.config.schema import ModelConfig  # pylint: disable=wrong-import-position

MODEL = dict(num_layers=4, d_model=128, num_heads=4, d_ff=512, seq_len=128)  # gpt_tiny's
BATCH = 16


def run(module, args):
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True)
  if proc.returncode:
    sys.exit(f"{module} failed:\n{proc.stderr[-3000:]}")
  return proc.stdout


def final_eval(model_dir):
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f if '"eval"' in l][-1]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300, help="Steps of the byte-level run.")
  parser.add_argument("--vocab_size", type=int, default=2000)
  parser.add_argument("--eval_steps", type=int, default=16)
  args = parser.parse_args()
  work = tempfile.mkdtemp(prefix="tokenizer_compare_")
  model_file = os.path.join(work, "sp.model")
  print(run("tfpar.tokenizer", ["train", f"--vocab_size={args.vocab_size}",
                                f"--out={model_file}"]).strip().splitlines()[-1])
  flags = [f"--{k}={v}" for k, v in MODEL.items()] + [
      f"--global_batch_size={BATCH}", "--learning_rate=2e-3", "--steps_per_call=20",
      "--log_every=20", f"--eval_steps={args.eval_steps}", "--checkpoint_every=100000"]
  budget = cost.step_flops(ModelConfig(**MODEL, vocab_size=256), BATCH, False) * args.steps
  print(f"budget: {budget / 1e12:.2f} TFLOPs of training (equal FLOPs, "
        "tfpar.planner.cost.step_flops)")
  print(f"{'tokenizer':<16} {'vocab':>6} {'steps':>6} {'TFLOPs':>7} {'bytes/token':>11} "
        f"{'loss/token':>10} {'loss/byte':>9}")
  for name, spec, vocab in (("bytes", "bytes", 256),
                            ("sentencepiece", f"sentencepiece:{model_file}", args.vocab_size)):
    steps = round(budget / cost.step_flops(ModelConfig(**MODEL, vocab_size=vocab), BATCH, False))
    model_dir = os.path.join(work, name)
    run("tfpar.train", [*flags, f"--tokenizer={spec}", f"--train_steps={steps}",
                        f"--eval_every={steps}", f"--model_dir={model_dir}"])
    ev = final_eval(model_dir)
    flops = steps * cost.step_flops(ModelConfig(**MODEL, vocab_size=vocab), BATCH, False)
    print(f"{name:<16} {vocab:>6} {steps:>6} {flops / 1e12:>7.2f} "
          f"{ev['loss'] / ev['loss_per_byte']:>11.2f} {ev['loss']:>10.4f} "
          f"{ev['loss_per_byte']:>9.4f}", flush=True)


if __name__ == "__main__":
  main()
