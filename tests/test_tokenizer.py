"""tfpar.tokenizer: one SentencePiece model trained by the real CLI on stdlib source, used
every way (round trips, a keras-hub preset holding it, bad specs, the CLI's refusals)."""

import os
import sysconfig

import numpy as np
import pytest

from conftest import run_module, run_modules
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


def test_cli_refusals_are_one_line_exit_2(tmp_path):
  out = str(tmp_path / "t.model")
  runs = run_modules([
      ("tfpar.tokenizer", ["train", "--vocab_size=100", f"--out={out}"]),
      ("tfpar.tokenizer", ["train", f"--data={tmp_path}/none*.txt", f"--out={out}"]),
  ])
  for proc, words in zip(runs, ["--vocab_size=100 is below 260", "matches no file"]):
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len([l for l in proc.stderr.splitlines() if l.startswith("tfpar.")]) == 1
  assert not os.path.exists(out)
