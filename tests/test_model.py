"""The GPT: output shapes, causality (learned and rotary positions), tied embeddings."""

import keras
import numpy as np
import pytest

from tfpar.config.schema import ModelConfig
from tfpar.models.gpt.model import GPT

SMALL = dict(seq_len=16, num_layers=2, d_model=32, num_heads=4, d_ff=64)


@pytest.fixture(autouse=True)
def float32_policy():
  previous = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("float32")
  yield
  keras.mixed_precision.set_global_policy(previous)


def make_model(seed=0, **overrides):
  keras.utils.set_random_seed(seed)
  model = GPT(ModelConfig(**{**SMALL, **overrides}), seed=seed)
  model.build_all()
  return model


def random_tokens(shape, seed=0):
  return np.random.default_rng(seed).integers(0, 256, size=shape).astype("int32")


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_logits_shape_and_dtype(positions):
  model = make_model(positions=positions)
  for t in (16, 5):  # a full window, and a shorter prompt
    logits = model(random_tokens((3, t)))
    assert tuple(logits.shape) == (3, t, 256)
    assert logits.dtype == "float32"
    assert np.all(np.isfinite(np.asarray(logits)))


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_a_future_token_never_changes_an_earlier_logit(positions):
  model = make_model(positions=positions)
  tokens = random_tokens((2, 16))
  base = np.asarray(model(tokens))
  for k in (0, 7, 15):
    changed = tokens.copy()
    changed[:, k] = (changed[:, k] + 1) % 256
    out = np.asarray(model(changed))
    np.testing.assert_allclose(out[:, :k], base[:, :k], rtol=0, atol=1e-6,
                               err_msg=f"changing token {k} moved an earlier logit")
    assert np.abs(out[:, k:] - base[:, k:]).max() > 1e-4  # ...and it does reach later ones


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_order_of_the_context_matters(positions):
  """Attention alone is blind to order: swapping two earlier tokens would not change a logit."""
  model = make_model(positions=positions)
  ab = np.asarray(model(np.array([[10, 20, 30, 40]], "int32")))[0, -1]
  ba = np.asarray(model(np.array([[20, 10, 30, 40]], "int32")))[0, -1]
  assert np.abs(ab - ba).max() > 1e-5


def test_embeddings_are_tied():
  model = make_model()
  d, v, t, f, layers = SMALL["d_model"], 256, SMALL["seq_len"], SMALL["d_ff"], SMALL["num_layers"]
  with_vocab = [w.path for w in model.trainable_variables if v in tuple(w.shape)]
  assert len(with_vocab) == 1 and with_vocab[0].endswith("wte/embeddings"), with_vocab
  per_block = 4 * d * d + 3 * d + 2 * d * f + f + 2 * d + 4 * d  # attn, MLP, 2 biases, 2 LNs
  expected = v * d + t * d + layers * per_block + 2 * d  # no separate output matrix
  assert sum(int(np.prod(w.shape)) for w in model.trainable_variables) == expected
  # The output projection *is* the token table: zeroing one row silences that token's logit.
  table = model.token_embedding.embeddings
  table.assign(np.asarray(table) * (np.arange(v) != 42)[:, None])
  np.testing.assert_allclose(np.asarray(model(random_tokens((1, 8))))[..., 42], 0.0, atol=1e-6)


def test_seed_fixes_the_initial_weights():
  a, b, c = make_model(seed=1), make_model(seed=1), make_model(seed=2)
  for wa, wb in zip(a.trainable_variables, b.trainable_variables):
    np.testing.assert_array_equal(np.asarray(wa), np.asarray(wb))
  assert not np.array_equal(np.asarray(a.token_embedding.embeddings),
                            np.asarray(c.token_embedding.embeddings))


def test_dropout_only_in_training():
  model = make_model(dropout=0.5)
  tokens = random_tokens((2, 16))
  np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(model(tokens)))
  assert not np.allclose(np.asarray(model(tokens, training=True)), np.asarray(model(tokens)))
