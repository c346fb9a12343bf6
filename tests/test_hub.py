"""keras-hub presets in and out (tfpar.hub, --init_from, tfpar.export), built here, offline.

The presets are made in this process: a randomly initialised LlamaBackbone
with a SentencePiece tokenizer trained on real text (Python standard library
source), saved as a LlamaCausalLM; a GPT2Backbone alone. tfpar's model
initialised from each gives keras-hub's logits on the same tokens to 1e-5, and
--init_from makes the preset's tokenizer the run's. A Llama fine-tuned from its
preset for 2 steps under a pipeline plan (2 stages, 2 micro-batches) and
exported loads in `LlamaCausalLM.from_preset`, whose logits equal tfpar's own
to 1e-5, with the tokenizer it started from. Presets of a byte-level GPT, a
Llama of bytes and a GPT of SentencePiece ids hold the run's tokenizer as
keras-hub's (bytes: a GPT2Tokenizer of tfpar's ids). Presets that cannot map,
and a --tokenizer other than the preset's, are refused in one line before
TensorFlow starts.
"""

import inspect
import io
import json
import shutil
import textwrap

import keras_hub
import numpy as np
import pytest
import sentencepiece

from conftest import TINY, make_config, run_module
from tfpar.config import rundir
from tfpar import strategies, tokenizer
from tfpar.config.cluster import Cluster
from tfpar.config.schema import ConfigError
from tfpar.data.pipeline import Corpus
from tfpar.engines.model_parallel import ModelParallelEngine
from tfpar.cli.export import export
from tfpar.cli.generate import load_model
from tfpar.hub import preset
from tfpar.models.gpt.model import GPT
from tfpar.models.llama.model import Llama
from tfpar.training import loop

TEXT = inspect.getsource(textwrap)
VOCAB = 320
LLAMA_FLAGS = ["--architecture=llama", "--num_layers=2", "--d_model=32", "--num_heads=4",
               "--num_kv_heads=2", "--d_ff=64", f"--vocab_size={VOCAB}"]
GPT_FLAGS = ["--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64",
             f"--vocab_size={VOCAB}"]
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 32)).astype(np.int32)


def keras_hub_logits(backbone, tokens):
  hidden = backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
  return np.asarray(backbone.token_embedding(hidden, reverse=True))


def tfpar_model(args, tmp_path, weights):
  m = make_config(TINY + args + [f"--model_dir={tmp_path}"]).model
  model = (Llama if m.architecture == "llama" else GPT)(m)
  model.build_all()
  for var in model.weights:
    var.assign(weights[var.path[len(model.name) + 1:] if var.path.startswith(model.name + "/")
                       else var.path])
  return model


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
  root = tmp_path_factory.mktemp("presets")
  proto = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXT.splitlines()), model_writer=proto, vocab_size=VOCAB,
      model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
  tokenizer = keras_hub.models.LlamaTokenizer(proto=proto.getvalue())
  llama = keras_hub.models.LlamaBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
      hidden_dim=32, intermediate_dim=64)
  keras_hub.models.LlamaCausalLM(
      backbone=llama, preprocessor=keras_hub.models.LlamaCausalLMPreprocessor(tokenizer)
  ).save_to_preset(str(root / "llama"))
  gpt2 = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4,
                                       hidden_dim=32, intermediate_dim=64, max_sequence_length=64)
  gpt2.save_to_preset(str(root / "gpt2"))
  return dict(root=root, llama=llama, gpt2=gpt2, tokenizer=tokenizer, proto=proto.getvalue())


@pytest.mark.parametrize("name, flags", [("llama", LLAMA_FLAGS), ("gpt2", GPT_FLAGS)])
def test_tfpar_from_a_preset_gives_keras_hubs_logits(presets, name, flags, tmp_path):
  path = str(presets["root"] / name)
  m = make_config(TINY + flags + [f"--init_from={path}", f"--model_dir={tmp_path}"]).model
  model = tfpar_model(flags, tmp_path, preset.load_weights(path, m))
  want = keras_hub_logits(presets[name], TOKENS)
  got = np.asarray(model(TOKENS))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def exported(presets, tmp_path_factory):
  """A Llama fine-tuned from its preset under pipeline 2 x 2 micro-batches, then exported; its
  tokenizer is the preset's (--init_from's default)."""
  run = tmp_path_factory.mktemp("run")
  cfg = make_config(TINY + LLAMA_FLAGS + [
      f"--init_from={presets['root'] / 'llama'}", f"--model_dir={run}", "--train_steps=2",
      "--eval_every=0", "--jit_compile=false", "--num_cpu_devices=2", "--pipeline_stages=2",
      "--microbatches=2"])
  data = np.frombuffer(TEXT.encode(), np.uint8)
  engine = ModelParallelEngine(cfg, strategies.make_strategy(cfg.dist, Cluster()),
                               Corpus(train=data, eval=data[:1024], files=()))
  loop.run(cfg, engine, on_restored=lambda: rundir.write_config(cfg))
  out = str(tmp_path_factory.mktemp("export") / "preset")
  task = export(str(run), out)
  return dict(run=str(run), out=out, task=task, cfg=cfg)


def test_init_from_defaults_the_tokenizer_to_its_preset_s(presets, tmp_path):
  llama, gpt2 = presets["root"] / "llama", presets["root"] / "gpt2"
  m = make_config(TINY + LLAMA_FLAGS[:-1] + [f"--init_from={llama}",
                                              f"--model_dir={tmp_path}"]).model
  assert (m.tokenizer, m.vocab_size) == (f"keras_hub:{llama}", VOCAB)  # Both from the preset.
  m = make_config(TINY + LLAMA_FLAGS + [f"--init_from={llama}", f"--tokenizer=keras_hub:{llama}/",
                                        f"--model_dir={tmp_path}"]).model
  assert m.tokenizer == f"keras_hub:{llama}/"  # Naming it is no conflict.
  m = make_config(TINY + GPT_FLAGS + [f"--init_from={gpt2}", f"--model_dir={tmp_path}"]).model
  assert m.tokenizer == "bytes"  # A backbone alone: bytes, unless --tokenizer says otherwise.


def test_an_export_after_pipeline_training_gives_tfpars_logits_in_keras_hub(presets, exported):
  assert exported["cfg"].model.tokenizer == f"keras_hub:{presets['root'] / 'llama'}"
  assert exported["task"] == "LlamaCausalLM"
  lm = keras_hub.models.LlamaCausalLM.from_preset(exported["out"])
  model, _ = load_model(exported["run"])
  ours = np.asarray(model(TOKENS))
  theirs = keras_hub_logits(lm.backbone, TOKENS)
  np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())
  # It started from the preset's weights and trained: 2 AdamW steps of at most ~lr each.
  start = {w.path: np.asarray(w) for w in presets["llama"].weights}
  for w in lm.backbone.weights:
    moved = np.abs(np.asarray(w) - start[w.path]).max()
    assert 0 < moved < 3 * 3e-3, (w.path, moved)
  # The round trip keeps the tokenizer.
  assert lm.preprocessor.tokenizer.vocabulary_size() == VOCAB
  sample = "def wrap(text, width=70):"
  np.testing.assert_array_equal(lm.preprocessor.tokenizer(sample), presets["tokenizer"](sample))


def test_bytes_in_keras_hub_are_a_gpt2_tokenizer_of_tfpar_s_ids():
  """On real text, non-ASCII and odd whitespace included, in keras-hub's Python path and in its
  TensorFlow path (what tf.function and tf.data run; here eagerly), and back."""
  bytes_ = tokenizer.ByteTokenizer()
  tok = bytes_.to_keras_hub()
  text = TEXT + "\tété, 東京 😀\r\n  \u00a0x\u3000y \u2009 \u202fz\n\n\n"
  want = bytes_.encode(text)
  np.testing.assert_array_equal(tok(text), want)
  assert tok.detokenize(want) == text
  # keras-hub's TensorFlow path drops U+096C (its splitting marker) from any text: none here.
  graph = type(tok)(vocabulary=tok.vocabulary, merges=tok.merges, _allow_python_workflow=False)
  short = text[:1000] + text[-40:]
  np.testing.assert_array_equal(graph(short), bytes_.encode(short))
  assert (tok.vocabulary_size(), tok.end_token_id, tok.start_token_id) == (256, 0, 0)


@pytest.mark.parametrize("name, flags, spec, task", [
    ("gpt2", GPT_FLAGS, "bytes", "GPT2CausalLM"),
    ("llama", LLAMA_FLAGS, "bytes", "LlamaCausalLM"),
    ("gpt2", GPT_FLAGS, "sentencepiece:sp.model", "GPT2CausalLM")])
def test_either_tokenizer_goes_with_either_architecture(presets, name, flags, spec, task, tmp_path):
  """A preset of a byte-level GPT, a Llama of bytes and a GPT of SentencePiece ids (what
  tfpar.export writes, preset.save): the backbone gives the original's logits, the
  CausalLM's preprocessor holds the run's tokenizer and turns text into a prompt and back (a
  Llama of SentencePiece ids generates in tests/test_tokenizer.py; compiling `generate` costs
  seconds, so once here)."""
  ours = (tokenizer.ByteTokenizer() if spec == "bytes"
          else tokenizer.SentencePieceTokenizer(spec, presets["proto"]))
  m = make_config(TINY + flags + [f"--model_dir={tmp_path}"]).model
  out = str(tmp_path / "preset")
  assert preset.save(m, preset.load_weights(str(presets["root"] / name), m), out,
                     ours.to_keras_hub()) == task
  lm = getattr(keras_hub.models, task).from_preset(out)
  want = keras_hub_logits(presets[name], TOKENS)
  np.testing.assert_allclose(keras_hub_logits(lm.backbone, TOKENS), want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
  sample = "def wrap(text, width=70):  # été"
  np.testing.assert_array_equal(lm.preprocessor.tokenizer(sample), ours.encode(sample))
  if name == "llama":
    assert lm.generate("def ", max_length=8).startswith("def")
  else:
    prompt = lm.preprocessor.generate_preprocess(["def "], sequence_length=8)
    assert lm.preprocessor.generate_postprocess(prompt)[0].startswith("def")


def test_a_sentencepiece_model_keras_hub_cannot_hold_is_refused_in_one_line():
  proto = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXT.splitlines()), model_writer=proto, vocab_size=VOCAB,
      model_type="bpe", bos_id=-1, eos_id=-1, minloglevel=2)  # No <s>, no </s>.
  ours = tokenizer.SentencePieceTokenizer("sentencepiece:no_bos.model", proto.getvalue())
  with pytest.raises(tokenizer.TokenizerError, match="keras-hub's LlamaTokenizer refuses it") as e:
    ours.to_keras_hub()
  assert "\n" not in str(e.value)


def test_presets_that_cannot_map_are_refused_in_one_line(presets, tmp_path):
  root, bad = presets["root"], tmp_path / "bad"
  shutil.copytree(root / "llama", bad)
  config = json.loads((bad / "config.json").read_text())
  config["class_name"] = "GemmaBackbone"
  (tmp_path / "gemma").mkdir()
  (tmp_path / "gemma" / "config.json").write_text(json.dumps(config))
  (bad / "assets" / "tokenizer" / "vocabulary.spm").unlink()
  cases = [
      (LLAMA_FLAGS, tmp_path / "gemma", "holds a GemmaBackbone, which tfpar cannot map"),
      (LLAMA_FLAGS + ["--num_kv_heads=4"], root / "llama",
       "--num_kv_heads=4 disagrees with the LlamaBackbone"),
      (GPT_FLAGS + ["--seq_len=128"], root / "gpt2", "--seq_len=128 is longer than the 64"),
      (LLAMA_FLAGS[:-1] + ["--vocab_size=300"], root / "llama",
       f"--tokenizer=keras_hub:{root / 'llama'} has 320 pieces, more than --vocab_size=300"),
      (LLAMA_FLAGS + ["--tokenizer=bytes"], root / "llama",
       f"--tokenizer=bytes is not the tokenizer of --init_from={root / 'llama'}"),
      (LLAMA_FLAGS, bad, "lacks"),
      (LLAMA_FLAGS, tmp_path / "none", "is not a directory"),
  ]
  for flags, path, says in cases:
    with pytest.raises(ConfigError, match=says) as raised:
      make_config(TINY + flags + [f"--init_from={path}", f"--model_dir={tmp_path / 'run'}"])
    assert "\n" not in str(raised.value)
  # What a user sees: one line, exit 2, the model dir untouched (never created).
  proc = run_module("tfpar.train", TINY + LLAMA_FLAGS + [
      f"--init_from={tmp_path / 'gemma'}", f"--model_dir={tmp_path / 'run'}"], check=False)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.count("\n") == 1 and "GemmaBackbone" in proc.stderr, proc.stderr
  assert not (tmp_path / "run").exists()
