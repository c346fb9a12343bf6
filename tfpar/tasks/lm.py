"""--task=lm (the default): next-token prediction on packed text windows, with the model of
--architecture's family (tfpar.families).

Tokens are --tokenizer's (tfpar.tokenizer; bytes by default). The held-out
loss is also reported per byte of text (loss per token / bytes per token of the
held-out stream), the number that compares runs with different tokenizers.
"""

from typing import Dict, List

import numpy as np

from tfpar import console, families
from tfpar import tokenizer as tokenizer_lib
from tfpar.data import corpus as corpus_lib
from tfpar.data import pipeline
from tfpar.data import prepared
from tfpar.tasks.task import Task, cross_entropy
from tfpar.training.metrics import perplexity


class LanguageModeling(Task):
  """Language modelling: inputs and targets are [B, seq_len] token windows.

  The loss is the next-token cross-entropy averaged over the tokens of the
  global batch; the held-out metrics are that loss, its perplexity and the
  loss per byte; throughput counts tokens.
  """

  eval_bytes_per_token = 1.0  # Of the held-out stream; load_data measures it.

  unit = "tokens"

  @classmethod
  def family_of(cls, m) -> str:
    return m.architecture  # The family's name, and its partitioning table's.

  @property
  def units_per_step(self) -> int:
    return self.cfg.train.global_batch_size * self.cfg.model.seq_len

  @property
  def global_count(self) -> int:
    return self.units_per_step  # Every token is labelled (by the next one).

  def build_model(self, *, tensor_shards: int = 1, seed: int = 0):
    return self.computing(families.get(self.family).build(
        self.cfg.model, tensor_shards=tensor_shards, seed=seed))

  def load_data(self, *, worker_index: int = 0, num_workers: int = 1):
    d = self.cfg.data
    files = corpus_lib.list_files(d.data)
    sharding = pipeline.choose_sharding(d.input_sharding, len(files), num_workers,
                                        streamed=prepared.locate(d.data) is not None)
    tokenizer = tokenizer_lib.load(self.cfg.model.tokenizer, self.cfg.train.model_dir)
    corpus = pipeline.load_corpus(d.data, seq_len=self.cfg.model.seq_len,
                                  eval_fraction=d.eval_fraction, tfrecord_key=d.tfrecord_key,
                                  worker_index=worker_index, num_workers=num_workers,
                                  sharding=sharding, tokenizer=tokenizer)
    self.eval_bytes_per_token = tokenizer.stream_bytes_per_token(pipeline.head(corpus.eval))
    return corpus, sharding

  def describe_data(self, data) -> str:
    total = len(data.files) if isinstance(data.train, prepared.TokenStream) else len(
        corpus_lib.list_files(self.cfg.data.data))
    share = "" if len(data.files) == total else f" of {total} (this worker's share)"
    return (f"{console.count(len(data.files), 'file')}{share}, {len(data.train):,} train / "
            f"{len(data.eval):,} held-out tokens ({self.cfg.model.tokenizer}, "
            f"{self.eval_bytes_per_token:.2f} bytes per token)")

  def dataset(self, split, shard, *, start_step: int = 0, shuffle: bool = True,
              inputs: bool = True):
    del inputs  # A window holds both: the inputs and, shifted by one, the targets.
    return pipeline.window_dataset(split, self.cfg.model.seq_len, shard, seed=self.cfg.train.seed,
                                   start_step=start_step, shuffle=shuffle,
                                   host_reads=self.cfg.dist.strategy != "parameter_server")

  def loss(self, outputs, targets):
    return cross_entropy(outputs, targets, self.global_count)

  def eval_metrics(self, batches: List[Dict[str, np.ndarray]]) -> Dict[str, float]:
    loss = float(np.mean([b["loss"] for b in batches]))
    return {"loss": loss, "perplexity": perplexity(loss),
            "loss_per_byte": loss / self.eval_bytes_per_token}


TASK = LanguageModeling
