"""Fused projections (--fused_projections) and the online-softmax core (--causal_attention).

Neither changes a weight, so both must give today's numbers:

- the online-softmax core equals `causal_attention` (values and gradients, at
  1, 2 and 4 blocks, eager and XLA-compiled) to 1e-5;
- a fused shard t computes exactly its own heads' q, k, v (and gate, up): the
  columns of the canonical kernels that are shard t's (Megatron's layout),
  with grouped-query attention too;
- a 2-block GPT and a Llama (4 heads, 2 key/value heads): on one device the
  fused model's loss and every gradient are the unfused one's; on tensor
  parallel 2 x pipeline 2 the fused GPT trains 3 steps with the losses,
  gradient norms, weights and AdamW slots of the unfused GPT on one device
  (the Llama's twin of it is a plan of tests/test_llama.py, which compares
  its first gradients too); all to 1e-5 relative in float32;
- a checkpoint written without fusion (the variables and code path of before
  the change) restores into the fused tensor x pipeline run and gives the
  same next-step loss.
"""

import inspect
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import TINY, assert_same_state, build_engine, canonical_grads, make_config
from tfpar.config import schema
from tfpar import tasks
from tfpar.layers import GatedMLP, SelfAttention, set_compute
from tfpar.layers.attention import (CAUSAL_CORES, causal_attention, causal_fraction,
                                    online_softmax_attention)
from tfpar.layers.fused import fused_columns
from tfpar.training.checkpoint import CanonicalCheckpointer, read_canonical

STEPS = 3
TEXT = np.frombuffer(inspect.getsource(textwrap).encode(), np.uint8)  # Real text, 20 kB.
BASE = TINY + [f"--train_steps={STEPS + 1}", "--eval_every=0", "--checkpoint_every=100",
               "--jit_compile=false"]
FAMILIES = {
    "gpt": ["--seq_len=16"],
    "llama": ["--architecture=llama", "--num_kv_heads=2", "--seq_len=16"],
}
PLANS = {
    "one": ["--strategy=one_device"],
    # Tensor parallel 2 and pipeline 2 at once: each stage's blocks split over 2 shards.
    "fused_tensor_2_x_pipeline_2": ["--num_cpu_devices=4", "--tensor_parallel=2",
                                    "--pipeline_stages=2", "--microbatches=2",
                                    "--fused_projections"],
}
SPLIT = "fused_tensor_2_x_pipeline_2"


# --- the attention core ------------------------------------------------------------------

def test_the_flag_names_every_core():
  assert schema.CAUSAL_ATTENTION == tuple(CAUSAL_CORES)
  assert causal_fraction(256) == 10 / 16 and causal_fraction(32) == 1.0


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_online_softmax_is_causal_attention(blocks):
  q, k, v = (tf.random.stateless_normal([2, 48, 2, 8], seed=[i, 7]) for i in range(3))
  w = tf.random.stateless_normal([2, 48, 2, 8], seed=[3, 7])  # A loss that weighs every output.

  def value_and_grads(core):
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      y = core(q, k, v)
      loss = tf.reduce_sum(y * w)
    return [y] + tape.gradient(loss, [q, k, v])

  want = value_and_grads(lambda q, k, v: causal_attention(q, k, v, 1))  # The whole square.
  online = lambda q, k, v: online_softmax_attention(q, k, v, blocks)
  got = {"query_blocks": value_and_grads(lambda q, k, v: causal_attention(q, k, v, blocks)),
         "online_softmax": value_and_grads(online)}
  if blocks == 2:  # It compiles under XLA too (once: compiling the unrolled blocks is slow).
    got["online_softmax under XLA"] = tf.function(lambda: value_and_grads(online),
                                                  jit_compile=True)()
  for core, values in got.items():
    for name, g, e in zip(("y", "dq", "dk", "dv"), values, want):
      np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * np.abs(e).max(),
                                 err_msg=f"{core}: {name}")


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
def test_the_flags_reach_every_layer(architecture):
  cfg = make_config(TINY + [f"--architecture={architecture}", "--fused_projections",
                            "--causal_attention=online_softmax", "--model_dir=/tmp/unused"])
  model = tasks.make(cfg).build_model()
  layers = [l for l in model._flatten_layers() if isinstance(l, (SelfAttention, GatedMLP))]
  assert len(layers) == (4 if architecture == "llama" else 2)
  assert all(l.fused_projections for l in layers)
  assert {l.causal_attention for l in layers if isinstance(l, SelfAttention)} == {
      "online_softmax"}


# --- a fused shard is its own heads' q, k, v ------------------------------------------------

def test_a_fused_shard_computes_its_own_heads_columns():
  """Shard t of 2 (GQA: 4 heads, 2 KV heads) is columns t of each canonical kernel."""
  keras.utils.set_random_seed(1)
  attn = SelfAttention(num_heads=4, num_kv_heads=2, head_dim=8, d_model=32, tensor_shards=2)
  mlp = GatedMLP(d_ff=64, d_model=32, tensor_shards=2)
  x = tf.random.stateless_normal([2, 5, 32], seed=[0, 1])
  for layer, denses in ((attn, (attn.query, attn.key, attn.value)), (mlp, (mlp.gate, mlp.up))):
    layer.build(x.shape)
    for i, v in enumerate(layer.weights):  # Nonzero biases too, so that a misplaced one shows.
      v.assign(tf.random.stateless_normal(v.shape, seed=[i, 2]))
    for dense in denses:
      # The canonical (checkpoint) kernel: the shards side by side (partitioning: COLUMN).
      kernel = np.concatenate([np.asarray(k) for k in dense.kernels], axis=-1)
      bias = np.concatenate([np.asarray(b) for b in dense.biases]) if dense.use_bias else 0
      width = dense.units // 2
      for t in range(2):
        got = fused_columns(x, denses, t)[denses.index(dense)]
        cols = slice(t * width, (t + 1) * width)  # Shard t's heads (or hidden units).
        want = dense.activation(x @ kernel[:, cols] + (bias[cols] if dense.use_bias else 0))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{dense.name} {t}")
        # Two TensorFlow matmuls of the same columns: a float32 sum of 32 unit-scale products,
        # accumulated in the order each oneDNN kernel picks (machine-dependent), differs by ~1e-6.
        np.testing.assert_allclose(got, dense(x, shard=t), rtol=1e-5, atol=1e-5)


# --- twins: fused projections train like today's model --------------------------------------

def build(plan, model_dir):
  flags = BASE + FAMILIES["gpt"] + PLANS[plan] + [f"--model_dir={model_dir}"]
  return build_engine(flags, TEXT, eval_tokens=1024)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The GPT's engine of each plan trained STEPS steps: losses, gradient norms, final state,
  iterator (the Llama's fused tensor x pipeline twin is a plan of tests/test_llama.py)."""
  out = {}
  for plan in PLANS:
    engine = build(plan, tmp_path_factory.mktemp(plan))
    iterator = engine.train_iterator(0)
    losses, norms = engine.train(iterator, STEPS)
    out[plan] = dict(engine=engine, iterator=iterator, losses=losses, norms=norms,
                     final=read_canonical(engine.layouts[0]))
  return out


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "one"])
def test_fused_projections_train_like_todays_model(runs, plan):
  """Losses and gradient norms per step, weights and AdamW slots after STEPS steps (the slots
  hold every step's gradients, tensor by tensor) against today's model on one device."""
  one, run = runs["one"], runs[plan]
  assert np.all(np.isfinite(one["losses"])) and one["losses"][-1] < one["losses"][0]
  np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-5)
  np.testing.assert_allclose(run["norms"], one["norms"], rtol=1e-5)
  assert sorted(run["final"]) == sorted(one["final"])
  assert_same_state(run["final"], one["final"], plan, skip=("dropout_rng/",))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_on_one_device_fused_gives_the_same_loss_and_gradients(family):
  """One model on one device computed unfused and fused: its loss and every gradient."""
  cfg = make_config(BASE + FAMILIES[family] + ["--model_dir=/tmp/unused"])
  task = tasks.make(cfg)
  model = task.build_model()
  model.build_all()
  windows = TEXT[:8 * 17].reshape(8, 17).astype(np.int32)
  x, y = tf.constant(windows[:, :-1]), tf.constant(windows[:, 1:])
  out = {}
  for fused in (False, True):
    set_compute(model, fused_projections=fused)
    with tf.GradientTape() as tape:
      loss = task.loss(model(x, training=True), y)
    out[fused] = (loss, canonical_grads(model, tape.gradient(loss, model.trainable_variables)))
  (loss, grads), (fused_loss, fused_grads) = out[False], out[True]
  np.testing.assert_allclose(fused_loss, loss, rtol=1e-5)
  assert sorted(fused_grads) == sorted(grads) and len(grads) > 10
  scale = max(np.abs(g).max() for g in grads.values())
  for name, want in grads.items():
    np.testing.assert_allclose(fused_grads[name], want, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=name)


def test_the_fused_layers_are_set_and_the_variables_unchanged(runs):
  fused = runs[SPLIT]["engine"].copies[0].model
  plain = runs["one"]["engine"].model
  layers = [l for l in fused._flatten_layers() if isinstance(l, (SelfAttention, GatedMLP))]
  assert len(layers) == 2 and all(l.fused_projections for l in layers)
  assert not any(getattr(l, "fused_projections", False) for l in plain._flatten_layers())
  assert sorted(runs[SPLIT]["final"]) == sorted(runs["one"]["final"])  # Same canonical names.


def test_a_checkpoint_written_unfused_restores_fused(runs, tmp_path):
  """Today's unfused run saves after STEPS steps; a fused tensor x pipeline run restores it and
  takes the next step with the loss the unfused run takes (each reads the same next batch)."""
  one, fused = runs["one"], runs[SPLIT]
  CanonicalCheckpointer(one["engine"].layouts, str(tmp_path)).save(STEPS)
  want, _ = one["engine"].train(one["iterator"], 1)
  CanonicalCheckpointer(fused["engine"].layouts, str(tmp_path)).restore()
  got, _ = fused["engine"].train(fused["iterator"], 1)
  np.testing.assert_allclose(got, want, rtol=1e-5)
