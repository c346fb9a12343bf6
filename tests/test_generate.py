"""tfpar.generate: sampling from a trained run, and its CLI."""

import json
import os
import shutil

import numpy as np
import pytest

from conftest import TINY, make_config, run_modules
from tfpar.cli import generate
from tfpar.data import corpus

SEQ_LEN = 32  # TINY's --seq_len


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A run trained the way the CLI trains (config.json included), in this process."""
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
  path = str(tmp_path_factory.mktemp("run"))
  cfg = make_config(TINY + ["--jit_compile=false", "--train_steps=4", "--dropout=0.1",
                            f"--model_dir={path}"])
  runner.run(cfg, Cluster())
  return path


@pytest.fixture(scope="module")
def loaded(model_dir):
  return generate.load_model(model_dir)  # (model, next_logits)


@pytest.fixture
def next_logits(loaded):
  return loaded[1]


def test_generates_the_requested_number_of_bytes(next_logits):
  for n in (0, 1, 45):  # 45 > seq_len: the context is cropped
    tokens = generate.sample(next_logits, corpus.encode("def "), n, seq_len=SEQ_LEN, seed=0)
    assert len(tokens) == n
    assert all(isinstance(t, int) and 0 <= t < 256 for t in tokens)


def test_a_fixed_seed_gives_the_same_text(next_logits):
  run = lambda seed: generate.sample(next_logits, corpus.encode("import "), 30, seq_len=SEQ_LEN,
                                     temperature=1.0, seed=seed)
  assert run(7) == run(7)
  assert run(7) != run(8)


def test_greedy_ignores_the_seed_and_equals_top_1(next_logits):
  prompt = corpus.encode("x" * 50)  # longer than seq_len
  greedy = [generate.sample(next_logits, prompt, 20, seq_len=SEQ_LEN, temperature=0.0, seed=s)
            for s in (1, 2)]
  assert greedy[0] == greedy[1]
  top_1 = generate.sample(next_logits, prompt, 20, seq_len=SEQ_LEN, temperature=1.0, top_k=1,
                          seed=3)
  assert top_1 == greedy[0]
  # Greedy really is the argmax of the model's next-byte logits.
  assert greedy[0][0] == int(np.argmax(next_logits(prompt[-SEQ_LEN:])))


def test_padded_context_gives_the_unpadded_logits(loaded):
  """next_logits pads short contexts to seq_len: causality must keep the padding out."""
  model, next_logits = loaded
  short = corpus.encode("ab")
  direct = np.asarray(model(np.array([short], "int32")))[0, -1]
  np.testing.assert_allclose(next_logits(short), direct, rtol=1e-5, atol=1e-5)
  assert not np.allclose(next_logits(short + [0]), direct, atol=1e-3)


def test_top_k_keeps_only_the_k_likeliest():
  rng = np.random.default_rng(0)
  logits = np.linspace(0.0, 1.0, 256)
  picks = {generate.pick(logits, 5.0, 3, rng) for _ in range(300)}
  assert picks == {253, 254, 255}
  assert generate.pick(logits, 0.0, 0, rng) == 255


CLI_BAD_INPUT = [
    ("no-checkpoint", "model_dir"),  # Found by check.
    ("--temperature=nan", "temperature"),  # Found by check, a float flag absl parses.
    ("--top_k=many", "top_k"),  # Found by absl's parser.
]


@pytest.fixture(scope="module")
def cli(model_dir, tmp_path_factory):
  """Every CLI process of this file, started side by side once: {name: CompletedProcess}.

  Each is its own `python -m` process (its own TensorFlow start), as a user runs it.
  """
  scratch = {case: tmp_path_factory.mktemp("cli_bad") for case, _ in CLI_BAD_INPUT}
  missing = tmp_path_factory.mktemp("cli_predict") / "missing.png"
  calls = {
      "prompt": ("tfpar.generate", [f"--model_dir={model_dir}", "--prompt=def f(",
                                    "--max_new_tokens=24", "--temperature=0.9", "--top_k=40",
                                    "--seed=5"]),
      "predict": ("tfpar.predict", [f"--model_dir={model_dir}", f"--image={missing}"]),
      **{case: ("tfpar.generate", bad_args(case, scratch[case], model_dir))
         for case, _ in CLI_BAD_INPUT},
  }
  return dict(zip(calls, run_modules(list(calls.values()))))


def test_cli_prints_the_prompt_and_its_continuation(cli, next_logits):
  proc = cli["prompt"]
  assert proc.returncode == 0, proc.stderr[-3000:]
  expected = generate.sample(next_logits, corpus.encode("def f("), 24, seq_len=SEQ_LEN,
                             temperature=0.9, top_k=40, seed=5)
  assert proc.stdout == "def f(" + corpus.decode(expected) + "\n"


def bad_args(case, tmp_path, model_dir):
  """generate's arguments for one bad-input case (a flag, or a run directory that is not one)."""
  args = [f"--model_dir={model_dir}", "--prompt=hi", "--max_new_tokens=5"]
  if case == "missing":
    args[0] = f"--model_dir={tmp_path / 'nowhere'}"
  elif case == "not-a-run":
    args[0] = f"--model_dir={tmp_path}"
  elif case == "no-checkpoint":  # a run directory whose training never saved
    with open(os.path.join(model_dir, "config.json")) as f:
      (tmp_path / "config.json").write_text(f.read())
    args[0] = f"--model_dir={tmp_path}"
  else:
    args.append(case)
  return args


@pytest.mark.parametrize("case,flag", [
    ("missing", "model_dir"),
    ("not-a-run", "model_dir"),
    ("--max_new_tokens=-1", "max_new_tokens"),
    ("--top_k=257", "top_k"),
    ("--top_k=-1", "top_k"),
    ("--temperature=-0.5", "temperature"),
    ("--seed=-1", "seed"),
])
def test_bad_input_is_refused_by_the_check_in_one_line(tmp_path, model_dir, case, flag):
  """The check the CLI runs before loading anything (the CLI cases below show its one line)."""
  fv = generate.define_flags()
  fv(["generate"] + bad_args(case, tmp_path, model_dir))
  with pytest.raises(generate.GenerateError) as info:
    generate.check(fv)
  assert f"--{flag}" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("case,flag", CLI_BAD_INPUT)
def test_cli_bad_input_is_one_line(cli, case, flag):
  proc = cli[case]
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout
  assert proc.stdout == ""
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfpar.generate: error:"), proc.stderr
  assert f"--{flag}" in lines[0]


def test_a_config_field_this_version_does_not_know_is_ignored(model_dir, tmp_path):
  """As tfpar.predict reads config.json (one reader, tfpar.config): once a TypeError."""
  copy = tmp_path / "run"
  shutil.copytree(model_dir, copy)
  saved = json.loads((copy / "config.json").read_text())
  saved["model"]["a_field_of_a_later_version"] = 1
  del saved["model"]["pooling"]  # and one of an earlier version that had no such field
  (copy / "config.json").write_text(json.dumps(saved))
  model, _ = generate.load_model(str(copy))
  assert model.config == make_config(TINY + [f"--model_dir={copy}"]).model


def test_cli_predict_on_a_language_model_says_what_each_tool_needs(cli):
  """Whatever --image says (here: nothing there), the run is the wrong kind: say so first."""
  proc = cli["predict"]
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfpar.predict: error:"), proc.stderr
  for words in ("(--task=lm)", "a vision run (--task=classify, detect or segment)",
                "python -m tfpar.generate"):
    assert words in lines[0], lines[0]
