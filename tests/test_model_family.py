"""A new model family in one file: a gated-MLP block, its partitioning rules, and its twin.

The family (defined here, registered through tfpar.families.register; no
tfpar module is edited for it) is the GPT with its block replaced by

  x + Attn(LN(x)),  then  x + s * (silu(x W_gate) * (x W_up)) W_down

(a SwiGLU MLP, Shazeer 2020, with a LayerScale s, Touvron et al. 2021): gate
and up are column-parallel, down row-parallel. Trained for 3 steps under
tensor parallel 2 x pipeline 2 (4 logical CPUs, in this process) it matches
one device per step (loss), in its first gradient and in its weights after
the steps, at relative 1e-5 in float32; its checkpoint names, bytes per
device and no-decay set come from its rules.
"""

import keras
from keras import ops
import numpy as np
import pytest
import tensorflow as tf

from conftest import TINY, canonical_grads, make_config
from tfpar import families, partitioning, strategies
from tfpar.config.cluster import Cluster
from tfpar.data.pipeline import Corpus
from tfpar.layers import ColumnParallelDense, RowParallelDense, SelfAttention, TensorParallel
from tfpar.models.base import ParallelModel
from tfpar.models.gpt import rules as gpt_rules
from tfpar.models.gpt.model import GPT
from tfpar.engines.model_parallel import ModelParallelEngine
from tfpar.partitioning import COLUMN, REPLICATED, ROW, VOCAB, Rule
from tfpar.tasks.lm import LanguageModeling
from tfpar.training.checkpoint import model_layout, read_canonical
from tfpar.engines.data_parallel import DataParallelEngine
from tfpar.training.optimizer import inner_optimizer

STEPS = 3
ARGS = TINY + [f"--train_steps={STEPS}", "--eval_every=0", "--checkpoint_every=100",
               "--jit_compile=false"]
SPLIT = ["--num_cpu_devices=4", "--pipeline_stages=2", "--tensor_parallel=2",
         "--microbatches=2"]


class GatedMLP(TensorParallel, keras.layers.Layer):
  """silu(x W_gate) * (x W_up) W_down over T shards: shard t's partial is exact (elementwise)."""

  def __init__(self, *, d_ff, d_model, tensor_shards, **kwargs):
    super().__init__(**kwargs)
    self.d_ff, self.tensor_shards = d_ff, tensor_shards
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.gate = ColumnParallelDense(d_ff, shards=tensor_shards, activation="silu",
                                    use_bias=False, kernel_initializer=init, name="gate")
    self.up = ColumnParallelDense(d_ff, shards=tensor_shards, use_bias=False,
                                  kernel_initializer=init, name="up")
    self.down = RowParallelDense(d_model, shards=tensor_shards, kernel_initializer=init,
                                 name="down")

  def build(self, input_shape):
    self.gate.build(input_shape)
    self.up.build(input_shape)
    self.down.build((*input_shape[:-1], self.d_ff))

  def partial(self, x, t):
    return self.down(self.gate(x, shard=t) * self.up(x, shard=t), shard=t)

  def call(self, x):
    return self.sum_of_shards(x)


class GatedBlock(keras.layers.Layer):
  """x + Attn(LN(x)), then x + layer_scale * GatedMLP(LN(x))."""

  def __init__(self, *, d_model, num_heads, d_ff, tensor_shards, **kwargs):
    super().__init__(**kwargs)
    self.d_model, self.tensor_shards = d_model, tensor_shards
    self.ln_1 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_1")
    self.ln_2 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_2")
    self.attn = SelfAttention(num_heads=num_heads, head_dim=d_model // num_heads,
                              d_model=d_model, tensor_shards=tensor_shards, name="attn")
    self.mlp = GatedMLP(d_ff=d_ff, d_model=d_model, tensor_shards=tensor_shards, name="mlp")

  def place(self, placement):
    self.attn.place(placement)
    self.mlp.place(placement)

  def build(self, input_shape):
    for layer in (self.ln_1, self.ln_2, self.attn, self.mlp):
      layer.build(input_shape)
    self.layer_scale = self.add_weight(shape=(self.d_model,), initializer="ones",
                                       name="layer_scale")

  def call(self, x, training=False):
    x = x + self.attn(self.ln_1(x))
    return x + ops.cast(self.layer_scale, x.dtype) * self.mlp(self.ln_2(x))


def toy_block_shapes(m):
  d, f = m.d_model, m.d_ff
  shapes = {f"{ln}/{p}": (d,) for ln in ("ln_1", "ln_2") for p in ("gamma", "beta")}
  for name in ("query", "key", "value"):
    shapes.update({f"attn/{name}/kernel": (d, d), f"attn/{name}/bias": (d,)})
  shapes.update({"attn/output/kernel": (d, d), "mlp/gate/kernel": (d, f),
                 "mlp/up/kernel": (d, f), "mlp/down/kernel": (f, d), "layer_scale": (d,)})
  return shapes


TOY = partitioning.Rules("toy", (
    Rule(r"wte/embeddings", VOCAB, decay=True),
    Rule(r"wpe/embeddings", decay=True),
    Rule(r"block_\d+/ln_(1|2)/(gamma|beta)"),
    Rule(r"block_\d+/attn/(query|key|value)/kernel", COLUMN, decay=True),
    Rule(r"block_\d+/attn/(query|key|value)/bias", COLUMN),
    Rule(r"block_\d+/attn/output/kernel", ROW, decay=True),
    Rule(r"block_\d+/mlp/(gate|up)/kernel", COLUMN, decay=True),
    Rule(r"block_\d+/mlp/down/kernel", ROW, decay=True),
    Rule(r"block_\d+/layer_scale", REPLICATED),
    Rule(r"ln_f/(gamma|beta)"),
    Rule(r"dropout_rng/\d+"),
), toy_block_shapes, gpt_rules.embed_shapes, partitioning.final_norm_shapes)


class ToyLM(GPT):
  rules = TOY

  def make_block(self, i, *, tensor_shards, seed):
    c = self.config
    return GatedBlock(d_model=c.d_model, num_heads=c.num_heads, d_ff=c.d_ff,
                      tensor_shards=tensor_shards, name=f"block_{i}")


families.register(families.Family(name="toy", model=ToyLM, rules=TOY))


class ToyTask(LanguageModeling):
  family = "toy"

  def build_model(self, *, tensor_shards=1, seed=0):
    return ToyLM(self.cfg.model, tensor_shards=tensor_shards, seed=seed, name="toy")


def build(args, tmp_path):
  cfg = make_config(ARGS + args + [f"--model_dir={tmp_path}"])
  tokens = np.arange(4096, dtype=np.uint8)
  corpus = Corpus(train=tokens, eval=tokens[:512], files=())
  strategy = strategies.make_strategy(cfg.dist, Cluster())
  engine_class = ModelParallelEngine if cfg.parallel.model_parallel else DataParallelEngine
  return engine_class(cfg, strategy, corpus, task=ToyTask(cfg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tokens = tf.constant(np.random.default_rng(0).integers(0, 256, (8, 33)), tf.int32)
  x, y = tokens[:, :-1], tokens[:, 1:]
  out = {}
  for name, args in (("one", ["--strategy=one_device"]), ("split", SPLIT)):
    engine = build(args, tmp_path_factory.mktemp(name))
    model = engine.model if name == "one" else engine.copies[0].model
    initial = read_canonical(model_layout(model))
    if name == "one":
      with tf.GradientTape() as tape:
        loss = engine.task.loss(model(x, training=True), y)
      grads = tape.gradient(loss, model.trainable_variables)
    else:
      _, grads = tf.function(engine.copies[0].pipeline.loss_and_grads)(x, y)
    first_grads = canonical_grads(model, grads)
    losses, _ = engine.train(engine.train_iterator(0), STEPS)
    out[name] = dict(engine=engine, model=model, initial=initial, grads=first_grads,
                     losses=np.asarray(losses), final=read_canonical(engine.layouts[0]))
  return out


def test_the_toy_trains_under_tensor_2_x_pipeline_2_like_one_device(runs):
  one, split = runs["one"], runs["split"]
  assert isinstance(split["model"], ParallelModel)
  assert split["model"].blocks[0].tensor_shards == 2
  for key in ("initial", "grads"):
    assert sorted(one[key]) == sorted(split[key])
  for name, want in one["initial"].items():
    np.testing.assert_array_equal(split["initial"][name], want, err_msg=name)
  # Relative 1e-5, the absolute floor 1e-5 of the largest gradient: some are exactly 0 in
  # exact arithmetic (a key bias shifts every score of a query alike) and rounding noise here.
  scale = max(np.abs(g).max() for g in one["grads"].values())
  for name, want in one["grads"].items():
    np.testing.assert_allclose(split["grads"][name], want, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=name)
  assert len(one["losses"]) == STEPS and np.all(np.isfinite(one["losses"]))
  np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-5)
  assert one["losses"][-1] < one["losses"][0]  # It learns.
  # The weights and AdamW slots after the steps. The key bias is left out: its gradient is 0
  # in exact arithmetic (checked above), and AdamW's m / sqrt(v) turns the rounding noise in
  # its place into steps of +-lr whichever way the sums are ordered (one device included).
  kind = lambda name: name[-2:] if name.endswith(("@m", "@v")) else "weight"
  scale = {}  # The largest weight, first moment, second moment.
  for name, value in one["final"].items():
    scale[kind(name)] = max(scale.get(kind(name), 0), np.abs(value).max())
  assert split["final"]["optimizer/iterations"] == one["final"]["optimizer/iterations"] == STEPS
  for name, want in one["final"].items():
    if not name.startswith(("compression/", "dropout_rng/")) and "/key/bias" not in name:
      np.testing.assert_allclose(split["final"][name], want, rtol=1e-5,
                                 atol=1e-5 * scale[kind(name)], err_msg=name)


def test_its_checkpoint_names_and_splits_come_from_its_rules(runs):
  layout = model_layout(runs["split"]["model"])
  names = sorted(layout)
  assert "block_1/mlp/gate/kernel" in names and "block_0/layer_scale" in names
  assert partitioning.check_disjoint(TOY, names) == {}
  full = toy_block_shapes(runs["split"]["engine"].cfg.model)
  for name, (axis, shards) in layout.items():
    assert axis == TOY.axis(name, len(shards[0].shape)), name
    assert len(shards) == (1 if axis is None else 2), name
    block_name = name.split("/", 1)[1] if name.startswith("block_") else None
    if block_name in full:  # Each shard is its rule's slice of the full shape.
      want = partitioning.shard_shapes(TOY, {name: full[block_name]}, 2)[name]
      assert all(tuple(v.shape) == want for v in shards), name


def test_its_bytes_per_device_come_from_its_rules(runs):
  engine = runs["split"]["engine"]
  m = engine.cfg.model
  unsplit, shard = TOY.block_counts(m, 2)
  embedding, head = TOY.embed_head_counts(m)
  measured = engine.measured_bytes()
  row = engine.plan.devices[0]
  from tfpar.layout.placement import device_key  # pylint: disable=import-outside-toplevel
  want = {device_key(row[0][0]): embedding + unsplit + shard, device_key(row[0][1]): shard,
          device_key(row[1][0]): head + unsplit + shard, device_key(row[1][1]): shard}
  assert {d: b["parameters"] for d, b in measured.items()} == {d: 4 * n for d, n in want.items()}


def test_its_plan_counts_its_own_parameters(runs):
  """The plan the engine prints and writes (plan.json) is the toy's, not --task's (GPT's)."""
  engine = runs["split"]["engine"]
  predicted = engine.plan.bytes_per_device()
  measured = engine.measured_bytes()  # The built variables' bytes on each device.
  assert {d: b["parameters"] for d, b in predicted.items()} == \
      {d: b["parameters"] for d, b in measured.items()}
  m = engine.cfg.model
  from tfpar.layout import placement as plan_lib  # pylint: disable=import-outside-toplevel
  assert engine.plan.counts == plan_lib.count_params(m, 2, family="toy")
  assert engine.plan.counts != plan_lib.count_params(m, 2)  # GPT's block differs.
  total = sum(int(np.prod(v.shape)) for v in engine.copies[0].model.trainable_variables)
  assert sum(s.parameters for s in engine.plan.stages) == total


def test_its_no_decay_set_comes_from_its_rules(runs):
  assert "layer_scale" in partitioning.no_decay_names([TOY])
  assert "layer_scale" not in partitioning.no_decay_names([families.rules("gpt"), families.rules("vit")])
  for run in runs.values():
    model, opt = run["model"], inner_optimizer(run["engine"].optimizer)
    decided = {}
    prefix = model.name + "/"
    for v in model.trainable_variables:
      path = v.path[len(prefix):] if v.path.startswith(prefix) else v.path
      name = path.split("_shard_")[0]
      decided[name] = opt._use_weight_decay(v)  # pylint: disable=protected-access
    assert decided == {name: TOY.decays(name) for name in decided}
    assert not decided["block_0/layer_scale"] and decided["block_0/mlp/up/kernel"]
