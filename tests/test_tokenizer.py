"""tfpar.tokenizer: one SentencePiece model trained by the real CLI on stdlib source, used
every way (round trips, a keras-hub preset holding it, bad specs, the CLI's refusals), and one
tiny Llama trained by tfpar.train on its ids, sampled from with tfpar.generate after its
directory moved and exported to keras-hub, both with the run's own copy of the model."""

import contextlib
import json
import os
import shutil
import sysconfig

import numpy as np
import pytest

from conftest import TINY, read_metrics, run_module, run_modules, train_in_process
from tfpar import tokenizer

STDLIB = sysconfig.get_paths()["stdlib"]
TEXT = "def f(x):\n    return x  # été, 東京\n\n\tz = 1\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("tok") / "sub" / "sp.model")  # The CLI makes sub/.
  proc = run_module("tfpar.tokenizer", ["train", f"--data={STDLIB}/[a-c]*.py",
                                        "--vocab_size=500", f"--out={out}"])
  return out, proc


def test_cli_writes_a_model_and_reports_bytes_per_token(trained):
  out, proc = trained
  assert os.path.getsize(out) > 0 and not os.path.exists(out + ".tmp")
  line = proc.stdout.strip().splitlines()[-1]
  assert line.startswith(f"wrote {out}: 500 pieces, ") and "bytes per token" in line
  assert float(line.split(" pieces, ")[1].split()[0]) > 1.5  # Fewer tokens than bytes.


def test_sentencepiece_round_trips_code_exactly(trained):
  tok = tokenizer.load(f"sentencepiece:{trained[0]}")
  assert (tok.spec, tok.vocab_size) == (f"sentencepiece:{trained[0]}", 500)
  ids = tok.encode(TEXT)
  assert ids.dtype == np.int32 and ids.max() < 500
  assert tok.decode(ids) == TEXT  # Indentation, tabs, blank lines and non-ASCII survive.
  assert tok.decode([*ids, tok.separator_id]) == TEXT
  assert tok.bytes_per_token([TEXT]) == len(TEXT.encode()) / len(ids)


def test_bytes_is_the_default_and_an_old_config_s_none():
  for spec in ("bytes", None, ""):
    tok = tokenizer.load(spec)
    assert (tok.spec, tok.vocab_size, tok.separator_id) == ("bytes", 256, 0)
  ids = tokenizer.load("bytes").encode(TEXT)
  assert ids.dtype == np.int32 and list(ids) == list(TEXT.encode())
  assert tokenizer.load("bytes").decode(ids) == TEXT


def test_keras_hub_preset_holding_the_same_model(trained, tmp_path):
  import keras_hub  # pylint: disable=import-outside-toplevel
  with open(trained[0], "rb") as f:
    proto = f.read()
  keras_hub.models.LlamaBackbone(vocabulary_size=500, num_layers=1, num_query_heads=2,
                                 num_key_value_heads=1, hidden_dim=8,
                                 intermediate_dim=16).save_to_preset(str(tmp_path))
  keras_hub.tokenizers.LlamaTokenizer(proto=proto).save_to_preset(str(tmp_path))
  hub = tokenizer.load(f"keras_hub:{tmp_path}")
  sp = tokenizer.load(f"sentencepiece:{trained[0]}")
  assert hub.vocab_size == 500 and hub.separator_id == sp.separator_id
  assert list(hub.encode(TEXT)) == list(sp.encode(TEXT))
  assert hub.decode(hub.encode(TEXT)) == TEXT


@pytest.mark.parametrize("spec, words", [
    ("sentencepiece:/nonexistent/x.model", "does not exist"),
    ("keras_hub:/nonexistent/preset", "does not exist"),
    ("wordpiece:x", "is not a tokenizer"),
    ("sentencepiece:", "is not a tokenizer"),
])
def test_bad_specs_name_the_problem(spec, words):
  with pytest.raises(tokenizer.TokenizerError, match=words):
    tokenizer.load(spec)


def test_a_file_that_is_not_a_model(tmp_path):
  path = tmp_path / "x.model"
  path.write_bytes(b"not a model")
  with pytest.raises(tokenizer.TokenizerError, match="not a SentencePiece model"):
    tokenizer.load(f"sentencepiece:{path}")


@pytest.fixture(scope="module")
def sp_run(trained, tmp_path_factory):
  """A Llama, 4 steps on the tokenizer's ids (vocab_size from the tokenizer), then the dir moved.

  Trained in this process (conftest.train_in_process: the flags, checks and runner of
  tfpar.train): what is under test is what the run writes, not a process start."""
  root = tmp_path_factory.mktemp("run")
  train_in_process([*TINY, f"--data={STDLIB}/[a-c]*.py", f"--model_dir={root}/a",
                    f"--tokenizer=sentencepiece:{trained[0]}", "--train_steps=4",
                    "--architecture=llama", "--num_kv_heads=2", "--eval_every=4",
                    "--checkpoint_every=4", "--nojit_compile"])
  shutil.move(f"{root}/a", f"{root}/b")
  return str(root / "b")


@contextlib.contextmanager
def only_the_run_s_copy(trained):
  """The tokenizer's file moved away for a while: only the run's own copy is left."""
  os.rename(trained[0], trained[0] + ".gone")
  try:
    yield
  finally:
    os.rename(trained[0] + ".gone", trained[0])


def test_a_run_records_its_tokenizer_and_reports_loss_per_byte(trained, sp_run):
  with open(os.path.join(sp_run, "config.json")) as f:
    model = json.load(f)["model"]
  assert (model["tokenizer"], model["vocab_size"]) == (f"sentencepiece:{trained[0]}", 500)
  with open(os.path.join(sp_run, "tokenizer.model"), "rb") as f, open(trained[0], "rb") as g:
    assert f.read() == g.read()
  (ev,) = read_metrics(sp_run, "eval")
  assert 1.5 < ev["loss"] / ev["loss_per_byte"] < 6  # Bytes per held-out token.


def test_generate_decodes_with_the_run_s_copy(trained, sp_run, capsys):
  """tfpar.generate's main in this process (its command line: tests/test_generate.py)."""
  from tfpar.cli import generate  # pylint: disable=import-outside-toplevel
  with only_the_run_s_copy(trained):
    generate.main(["generate", f"--model_dir={sp_run}", "--prompt=def ", "--max_new_tokens=5",
                   "--temperature=0"])
  out = capsys.readouterr().out
  assert out.startswith("def ") and len(out) > len("def \n")


def test_export_writes_the_run_s_tokenizer_into_the_preset(trained, sp_run, tmp_path):
  """A preset of the Llama trained on SentencePiece ids holds its tokenizer (from the run's own
  copy): LlamaCausalLM.from_preset gives tfpar's ids, tfpar's logits, and generates."""
  import keras_hub  # pylint: disable=import-outside-toplevel
  from tfpar.cli.export import export  # pylint: disable=import-outside-toplevel
  from tfpar.cli.generate import load_model  # pylint: disable=import-outside-toplevel
  with only_the_run_s_copy(trained):
    assert export(sp_run, str(tmp_path / "preset")) == "LlamaCausalLM"
  lm = keras_hub.models.LlamaCausalLM.from_preset(str(tmp_path / "preset"))
  sp = tokenizer.load(f"sentencepiece:{trained[0]}")
  ids = sp.encode(TEXT)
  np.testing.assert_array_equal(lm.preprocessor.tokenizer(TEXT), ids)  # Same ids, same text.
  tokens = ids[None, :16]
  model, _ = load_model(sp_run)
  ours = np.asarray(model(tokens))
  hidden = lm.backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
  theirs = np.asarray(lm.backbone.token_embedding(hidden, reverse=True))
  np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())
  assert lm.generate("def ", max_length=8).startswith("def")


def test_bad_input_is_one_line_exit_2_and_leaves_no_file(trained, tmp_path):
  model_dir, out = str(tmp_path / "run"), str(tmp_path / "t.model")
  runs = run_modules([
      ("tfpar.train", [*TINY, f"--model_dir={model_dir}", f"--tokenizer=sentencepiece:{trained[0]}",
                       "--vocab_size=300"]),
      ("tfpar.train", [*TINY, f"--model_dir={model_dir}", "--tokenizer=sentencepiece:/no/t.model"]),
      ("tfpar.tokenizer", ["train", "--vocab_size=100", f"--out={out}"]),
  ], at_once=3)
  for proc, words in zip(runs, ["has 500 pieces, more than --vocab_size=300", "does not exist",
                                "--vocab_size=100 is below 260"]):
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert not os.path.exists(model_dir) and not os.path.exists(out)


def test_a_prepared_set_gives_the_text_s_stream_and_refuses_another_tokenizer(trained, tmp_path):
  from tfpar.data import corpus, pipeline, prepare  # pylint: disable=import-outside-toplevel
  tok = tokenizer.load(f"sentencepiece:{trained[0]}")
  text = f"{STDLIB}/[a-b]*.py"
  manifest = prepare.prepare(corpus.list_files(text), tok, str(tmp_path / "prep"), num_shards=3)
  assert manifest["tokenizer"] == tok.spec and manifest["dtype"] == "uint16"
  read = lambda data, t: pipeline.load_corpus(data, seq_len=32, eval_fraction=0.05, tokenizer=t)
  a, b = read(text, tok), read(str(tmp_path / "prep"), tok)
  assert np.array_equal(a.train, b.train.read()) and np.array_equal(a.eval, b.eval.read())
  with pytest.raises(corpus.DataError, match="was written by --tokenizer=sentencepiece:.*, not "
                     "by --tokenizer=bytes .*: pass the tokenizer it was prepared with"):
    read(str(tmp_path / "prep"), tokenizer.load("bytes"))