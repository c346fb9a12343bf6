"""Bad input to the tools and the new paths (issue 33): one line, exit 2, no traceback, nothing written.

Real processes on real files, started side by side once (`cli`): tokenizer
training's --out (under /proc, under a file, on a directory, on an immutable
directory) checked before it trains, prepare's --out and --data, an unreachable gs:// --out
of the three tools that write one (exit 2), its --vocab_size
bounds and message, --help of the subcommand CLIs, a truncated preset's weights,
export's --out under /proc, a run whose metrics.jsonl is a directory or whose
checkpoints/ cannot be written, non-UTF-8 bytes in --data and --prompt, a
flagfile with a byte-order mark. Beside them (`preset_runs`), a run from a
keras-hub preset (its tokenizer read while the flags are validated) under
--num_cpu_devices=2 with 2 pipeline stages, resumed after the preset moved,
with --init_from and without; and a --tokenizer=keras_hub:DIR run under
mirrored. The cases that end before any process would differ (a preset's
config.json, --image) run in this process through the CLI's own calls.
"""

import inspect
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import TINY, in_background, make_config, read_metrics, run_module, run_modules
from test_bad_input import OFFLINE, snapshot
from tfpar.config import rundir
from tfpar.config.schema import ConfigError

TEXT = inspect.getsource(textwrap)  # Needs a vocabulary of >= 346 pieces (its characters).
VOCAB = 320
LLAMA = ["--architecture=llama", "--num_layers=2", "--d_model=32", "--num_heads=4",
         "--num_kv_heads=2", "--d_ff=64", "--seq_len=32", "--global_batch_size=8",
         "--jit_compile=false", "--eval_steps=1", "--log_every=1", "--steps_per_call=1",
         "--warmup_steps=1"]


def make_preset(path):
  """A LlamaCausalLM preset (random weights, a SentencePiece tokenizer of real text)."""
  import keras_hub  # pylint: disable=import-outside-toplevel
  import sentencepiece  # pylint: disable=import-outside-toplevel
  proto = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXT.splitlines()), model_writer=proto, vocab_size=VOCAB,
      model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
      hidden_dim=32, intermediate_dim=64)
  keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=(
      keras_hub.models.LlamaCausalLMPreprocessor(
          keras_hub.models.LlamaTokenizer(proto=proto.getvalue())))).save_to_preset(str(path))


def fake_run(root):
  """What export's and generate's checks look for: config.json and a checkpoint index."""
  run = root / "fake_run"
  run.mkdir()
  (run / "config.json").write_text(json.dumps(
      make_config(TINY + [f"--model_dir={run}"]).to_dict()))
  (run / "checkpoints").mkdir()
  (run / "checkpoints" / "ckpt-1.index").write_bytes(b"")
  return run


def preset_chain(root, preset, text):
  """Start from the preset under 2 pipeline stages, move the preset, resume with --init_from
  and then without it. Returns the three CompletedProcesses and the run's directory."""
  run = root / "preset_run"
  args = LLAMA + [f"--data={text}", "--num_cpu_devices=2", "--pipeline_stages=2",
                  "--microbatches=2", f"--model_dir={run}"]
  first = run_module("tfpar.train", args + [f"--init_from={preset}", "--train_steps=2"],
                     check=False)
  shutil.move(str(preset), str(root / "moved_preset"))
  again = run_module("tfpar.train", args + [f"--init_from={preset}", "--train_steps=3"],
                     check=False)
  plain = run_module("tfpar.train", args + ["--train_steps=4"], check=False)
  return first, again, plain, run


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  d = tmp_path_factory.mktemp("tools")
  (d / "text.txt").write_text(TEXT)
  (d / "chars.txt").write_text("".join(chr(0x4E00 + i) for i in range(400)) * 3 + "\n")
  (d / "a_file").write_text("keep me")
  (d / "a_dir").mkdir()
  make_preset(d / "llama")
  shutil.copytree(d / "llama", d / "hub_tokenizer")  # --tokenizer=keras_hub:DIR, never moved.
  return d


@pytest.fixture(scope="module")
def preset_runs(root):
  """The preset chain, started at once (the `cli` cases fill the cores beside it)."""
  chain = in_background(preset_chain, root, root / "llama", root / "text.txt")
  mirrored = in_background(run_module, "tfpar.train", TINY + [
      "--architecture=gpt", f"--tokenizer=keras_hub:{root / 'hub_tokenizer'}",
      f"--data={root / 'text.txt'}", "--strategy=mirrored", "--num_cpu_devices=2",
      "--train_steps=1", "--jit_compile=false", f"--model_dir={root / 'mirrored_run'}"],
      check=False)
  return chain, mirrored


@pytest.fixture(scope="module")
def cli(root, preset_runs):  # pylint: disable=unused-argument  # Started first.
  """{case: (CompletedProcess, what the test compares after)}."""
  immutable = root / "immutable"
  immutable.mkdir()
  subprocess.run(["chattr", "+i", str(immutable)], check=True)  # Even root cannot add to it.
  trunc = root / "truncated_preset"
  shutil.copytree(root / "llama", trunc)
  weights = trunc / "model.weights.h5"
  weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
  metrics_run = root / "metrics_run"
  (metrics_run / "metrics.jsonl").mkdir(parents=True)
  (metrics_run / "config.json").write_text(json.dumps(
      make_config(TINY + [f"--model_dir={metrics_run}"]).to_dict()))
  ckpt_run = root / "ckpt_run"
  ckpt_run.mkdir()
  os.symlink("/proc/1", ckpt_run / "checkpoints")  # A directory no one can write to.
  fake = fake_run(root)
  (root / "bom.flags").write_bytes(b"\xef\xbb\xbf--num_layers=2\n--d_model=32\n")
  not_utf8 = os.fsdecode(b"\xff\xfe")  # What Python makes of such bytes on the command line.
  tok = ["train", f"--data={root / 'text.txt'}", "--vocab_size=400"]
  prep = ["prepare", f"--data={root / 'text.txt'}"]
  calls = {
      "tok_proc": ("tfpar.tokenizer", tok + ["--out=/proc/sp.model"]),
      "tok_file": ("tfpar.tokenizer", tok + [f"--out={root / 'a_file'}/sp.model"]),
      "tok_dir": ("tfpar.tokenizer", tok + [f"--out={root / 'a_dir'}"]),
      "tok_immutable": ("tfpar.tokenizer", tok + [f"--out={immutable}/sp.model"]),
      "tok_huge": ("tfpar.tokenizer", ["train", "--vocab_size=4000000000",
                                       f"--out={root / 'huge.model'}"]),
      "tok_help": ("tfpar.tokenizer", ["train", "--help"]),
      "prepare_help": ("tfpar.data", ["prepare", "--help"]),
      "bom": ("tfpar.train", [f"--flagfile={root / 'bom.flags'}",
                              f"--model_dir={root / 'bom_run'}"]),
      "tok_gs": ("tfpar.tokenizer", tok + ["--out=gs://tfpar-no-such-bucket/sp.model"],
                 {"env": OFFLINE}),
      "prepare_gs": ("tfpar.data", prep + ["--out=gs://tfpar-no-such-bucket/prep"],
                     {"env": OFFLINE}),
      "export_gs": ("tfpar.export", [f"--model_dir={fake}",
                                     "--out=gs://tfpar-no-such-bucket/preset"], {"env": OFFLINE}),
      "prepare_under_file": ("tfpar.data", prep + [f"--out={root / 'a_file'}/prep"]),
      "prepare_utf8": ("tfpar.data", ["prepare", f"--data={root}/{not_utf8}*.txt",
                                      f"--out={root / 'utf8_prep'}"]),
      "tok_small": ("tfpar.tokenizer", ["train", f"--data={root / 'chars.txt'}",
                                        "--vocab_size=300", f"--out={root / 'small.model'}"]),
      "trunc": ("tfpar.train", LLAMA + [f"--init_from={trunc}", f"--model_dir={root / 'tr'}"]),
      "export_proc": ("tfpar.export", [f"--model_dir={fake}", "--out=/proc/tfpar_preset"]),
      "metrics_dir": ("tfpar.train", TINY + [f"--model_dir={metrics_run}"]),
      "ckpt_proc": ("tfpar.train", TINY + [f"--model_dir={ckpt_run}"]),
      "data_utf8": ("tfpar.train", TINY + [f"--data={root}/{not_utf8}*.txt",
                                           f"--model_dir={root / 'utf8_run'}"]),
      "prompt_utf8": ("tfpar.generate", [f"--model_dir={fake}", f"--prompt={not_utf8}def"]),
  }
  kept = {"metrics_dir": snapshot(metrics_run), "export_proc": snapshot(fake)}
  try:
    procs = dict(zip(calls, run_modules(list(calls.values()))))
  finally:
    subprocess.run(["chattr", "-i", str(immutable)], check=True)
  kept["tok_immutable"] = os.listdir(immutable)
  return {case: (procs[case], kept.get(case)) for case in calls}


def one_line(proc, tool, *words, code=2):
  assert proc.returncode == code, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout
  assert proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stderr.startswith(f"{tool}: error: "), proc.stderr
  for word in words:
    assert word in proc.stderr, proc.stderr


@pytest.mark.parametrize("case, words", [
    ("tok_proc", ["--out=/proc/sp.model cannot be created in /proc"]),
    ("tok_file", ["a_file is a file, not a directory"]),
    ("tok_dir", ["a_dir is a directory: pass the path of a new file"]),
    ("tok_immutable", ["immutable/sp.model", "pass a directory you can write to"]),
    ("tok_huge", ["--vocab_size=4000000000 is more than SentencePiece can count"]),
    ("tok_small", ["--vocab_size=300 is smaller than the", "pass a larger --vocab_size (>= "]),
])
def test_tokenizer_train_refuses_in_one_line_before_training(cli, root, case, words):
  proc, kept = cli[case]
  one_line(proc, "tfpar.tokenizer", *words)
  assert "smaller --vocab_size" not in proc.stderr
  assert not list(root.glob("*.model")) and (root / "a_file").read_text() == "keep me"
  assert os.listdir(root / "a_dir") == [] and kept in (None, [])
  if case != "tok_small":  # Refused before reading the text: no progress bar.
    assert proc.stdout == ""


@pytest.mark.parametrize("case, tool, out", [
    ("tok_gs", "tfpar.tokenizer", "gs://tfpar-no-such-bucket/sp.model"),
    ("prepare_gs", "tfpar.data", "gs://tfpar-no-such-bucket/prep"),
    ("export_gs", "tfpar.export", "gs://tfpar-no-such-bucket/preset")])
def test_a_tool_to_an_unreachable_bucket_is_one_line_exit_2_before_its_work(cli, case, tool, out):
  """A tool's --out on a store out of reach: bad input (exit 2), since a person runs the tool
  and nothing retries it; once tokenizer train said so only after training, export with
  TensorFlow's traceback (exit 1)."""
  proc, _ = cli[case]
  one_line(proc, tool, f"--out={out} cannot be reached", "check the network")
  assert proc.stdout == ""  # Before the work (tokenizer train's and prepare's progress lines).


@pytest.mark.parametrize("case, words", [
    ("prepare_under_file", ["a_file is a file, not a directory"]),
    ("prepare_utf8", ["--data=", "\\xff\\xfe", "not UTF-8"]),
])
def test_data_prepare_refuses_in_one_line_before_reading_text(cli, root, case, words):
  proc, _ = cli[case]
  one_line(proc, "tfpar.data", *words)
  assert proc.stdout == "" and "prepare:" not in proc.stderr  # No progress line: no text read.
  assert (root / "a_file").read_text() == "keep me" and not (root / "utf8_prep").exists()
  assert not [p for p in os.listdir(root) if p.startswith(".")]  # No partial set left aside.


@pytest.mark.parametrize("case, words", [("tok_help", ["--vocab_size", "--out", "train"]),
                                         ("prepare_help", ["--num_shards", "--out", "prepare"])])
def test_subcommand_clis_answer_help(cli, case, words):
  proc, _ = cli[case]
  assert proc.returncode == 0, proc.stderr
  assert "Unknown command line flag" not in proc.stderr + proc.stdout
  for word in words:
    assert word in proc.stdout


def test_a_flagfile_with_a_byte_order_mark_is_named(cli, root):
  proc, _ = cli["bom"]
  one_line(proc, "tfpar.train", f"--flagfile={root / 'bom.flags'}", "byte-order mark",
           "without one")
  assert not (root / "bom_run").exists()


def test_a_truncated_preset_is_one_line_and_no_run_dir(cli, root):
  proc, _ = cli["trunc"]
  one_line(proc, "tfpar.train", "truncated_preset: its model.weights.h5 cannot be read",
           "truncated file")
  assert not (root / "tr").exists()


def test_export_out_under_proc_is_one_line(cli):
  proc, kept = cli["export_proc"]
  one_line(proc, "tfpar.export", "--out=/proc/tfpar_preset cannot be created in /proc")


def test_a_run_whose_metrics_jsonl_is_a_directory_is_refused_untouched(cli, root):
  proc, kept = cli["metrics_dir"]
  one_line(proc, "tfpar.train", "holds a directory metrics.jsonl", "move")
  assert snapshot(root / "metrics_run") == kept and (root / "metrics_run" / "metrics.jsonl").is_dir()


def test_a_run_whose_checkpoints_cannot_be_written_is_exit_2_not_a_restart(cli, root):
  proc, _ = cli["ckpt_proc"]
  one_line(proc, "tfpar.train", f"--model_dir={root / 'ckpt_run' / 'checkpoints'}")
  assert os.listdir(root / "ckpt_run") == ["checkpoints"]


def test_non_utf8_bytes_in_data_and_prompt_are_one_line(cli, root):
  proc, _ = cli["data_utf8"]
  one_line(proc, "tfpar.train", "--data=", "\\xff\\xfe", "not UTF-8")
  assert not (root / "utf8_run").exists()
  proc, _ = cli["prompt_utf8"]
  one_line(proc, "tfpar.generate", "--prompt=\\xff\\xfedef", "not UTF-8")


# --- presets: in this process, through from_flags (what the CLI calls first) -------------------


@pytest.mark.parametrize("case, says", [
    ("no_key", "its config.json lacks 'num_layers' of a LlamaBackbone"),
    ("config_list", 'its config.json holds "config": a list, not an object'),
    ("tokenizer_list", "its tokenizer.json holds a list, not an object"),
    ("no_weights", "has no model.weights.h5"),
])
def test_a_damaged_preset_is_one_config_error(root, tmp_path, case, says):
  bad = tmp_path / case
  shutil.copytree(root / "moved_preset" if (root / "moved_preset").exists() else root / "llama",
                  bad)
  config = json.loads((bad / "config.json").read_text())
  if case == "no_key":
    del config["config"]["num_layers"]
  elif case == "config_list":
    config["config"] = []
  elif case == "tokenizer_list":
    (bad / "tokenizer.json").write_text("[1, 2]")
  else:
    (bad / "model.weights.h5").unlink()
  (bad / "config.json").write_text(json.dumps(config))
  with pytest.raises(ConfigError) as info:
    make_config(LLAMA + [f"--init_from={bad}", f"--model_dir={tmp_path / 'run'}"])
  assert says in str(info.value) and "\n" not in str(info.value), str(info.value)
  assert not (tmp_path / "run").exists()


def test_a_run_from_a_preset_under_two_cpu_devices_resumes_after_the_preset_moved(preset_runs):
  """Once "TensorFlow already started with 1 CPU device(s)" (the preset's tokenizer read while
  validating); then a resume with --init_from or without found neither preset nor tokenizer."""
  first, again, plain, run = preset_runs[0].result()
  for proc in (first, again, plain):
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert "initialised the model from the keras-hub preset" in first.stdout
  for proc in (again, plain):
    assert "initialised the model" not in proc.stdout  # Its checkpoint, as the flag's help says.
  assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
  assert (run / "tokenizer_preset" / "tokenizer.json").exists()


def test_a_keras_hub_tokenizer_trains_under_mirrored_on_two_cpu_devices(preset_runs, root):
  proc = preset_runs[1].result()
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "on 2 replicas" in proc.stdout, proc.stdout


# --- checks that end before any process would differ: in this process ----------------------------


def test_a_run_whose_checkpoints_are_unwritable_is_refused_by_the_run_check(tmp_path):
  (tmp_path / "run").mkdir()
  os.symlink("/proc/1", tmp_path / "run" / "checkpoints")
  with pytest.raises(ConfigError, match=r"run/checkpoints is not writable \(.*refuses this user\)"):
    rundir.check_run(make_config(TINY + [f"--model_dir={tmp_path / 'run'}"]))


@pytest.mark.parametrize("image", ["Bad Image:tag!", "", "tfpar:tag!", "tfpar@sha256:short"])
def test_k8s_render_refuses_an_image_that_is_no_image_reference(image):
  from tfpar.cli import k8s as k8s_cli  # pylint: disable=import-outside-toplevel
  with pytest.raises(k8s_cli.RenderError, match="is not a container image reference") as info:
    k8s_cli.parse(["render", "--kind=jobset", "--name=gpt", "--workers=2", f"--image={image}",
                   "--", "--flagfile=configs/gpt_tiny.flags", "--strategy=multi_worker_mirrored",
                   "--model_dir=gs://bucket/runs/gpt"])
  assert "\n" not in str(info.value)


def test_zero1_on_a_plan_of_one_data_parallel_copy_is_refused_like_one_device():
  for extra in (["--strategy=one_device"], ["--pipeline_stages=2", "--num_cpu_devices=2"]):
    with pytest.raises(ConfigError, match="--optimizer_sharding=zero1 shards over") as info:
      make_config(TINY + ["--model_dir=/tmp/unused", "--optimizer_sharding=zero1"] + extra)
    assert "nothing to share" in str(info.value) or "one device" in str(info.value)


def test_a_corrupt_run_copy_of_the_tokenizer_is_named_not_the_original(tmp_path):
  """generate and export decode with the run's copy (tokenizer.for_run): once a corrupt copy was
  reported as "--tokenizer=sentencepiece:ORIGINAL: the file is not a SentencePiece model"."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  from tfpar import tokenizer  # pylint: disable=import-outside-toplevel
  original = tmp_path / "sp.model"
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXT.splitlines()), model_prefix=str(tmp_path / "sp"),
      vocab_size=VOCAB, model_type="bpe", minloglevel=2)
  run = tmp_path / "run"
  run.mkdir()
  (run / tokenizer.RUN_COPY).write_bytes(b"cut short")
  with pytest.raises(tokenizer.TokenizerError) as info:
    tokenizer.for_run(f"sentencepiece:{original}", str(run))
  message = str(info.value)
  assert f"the run's own copy of its tokenizer, {run / tokenizer.RUN_COPY}, is not" in message
  assert f"copy {original}" in message and "\n" not in message
  assert tokenizer.load(f"sentencepiece:{original}").vocab_size == VOCAB  # The original is fine.


REFUSE_WITHOUT_TENSORFLOW = r'''
import json, os, runpy, sys, tempfile
found = []
for module, argv in json.loads(sys.argv[1]):
  sys.argv, saved = [module] + argv, os.dup(2)
  with tempfile.TemporaryFile("w+") as err:
    os.dup2(err.fileno(), 2)  # What the tool prints on stderr (fd 2: faulthandler wants one).
    try:
      runpy.run_module(module, run_name="__main__", alter_sys=True)
      code = 0
    except SystemExit as e:
      code = e.code
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
    err.seek(0)
    found.append([code, err.read(), "tensorflow" in sys.modules])
print(json.dumps(found))
'''


def test_a_refused_local_path_answers_before_tensorflow_is_imported(tmp_path):
  """The tools check a local --model_dir, --out, --image and --data through tfpar.storage (os
  and open), so refusing one costs ~0.3 s of CPU, not the ~5.5 s of importing TensorFlow. One
  process runs each tool's main in turn, as `python -m` does, and asks sys.modules after each
  (train once: it defines absl's global flags)."""
  from conftest import REPO  # pylint: disable=import-outside-toplevel
  fake = fake_run(tmp_path)
  (tmp_path / "a_file").write_text("keep me")
  cases = [
      ("tfpar.cli.generate", ["--model_dir=/nonexistent/run"], "has no config.json"),
      ("tfpar.cli.generate", [f"--model_dir={fake}", "--top_k=-1"], "--top_k=-1"),
      ("tfpar.cli.export", [f"--model_dir={fake}", f"--out={tmp_path / 'a_file'}"], "is a file"),
      ("tfpar.cli.predict", [f"--model_dir={fake}", "--image=x.png"], "holds a language model"),
      ("tfpar.cli.train", TINY + [f"--model_dir={fake}", "--seed=7"], "--seed=7, but the run"),
      ("tfpar.cli.data", ["prepare", "--data=/nonexistent/*.txt", f"--out={tmp_path / 'set'}"],
       "--data=/nonexistent/*.txt matches no file"),
      ("tfpar.cli.tokenizer", ["train", f"--data={tmp_path / 'empty'}", "--vocab_size=300",
                               f"--out={tmp_path / 'tok.model'}"], "matches no file"),
  ]
  (tmp_path / "empty").mkdir()
  proc = subprocess.run(
      [sys.executable, "-c", REFUSE_WITHOUT_TENSORFLOW,
       json.dumps([[module, argv] for module, argv, _ in cases])],
      capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for (module, _, words), (code, stderr, imported) in zip(cases, json.loads(proc.stdout)):
    assert code == 2 and stderr.count("\n") == 1 and words in stderr, (module, stderr)
    assert not imported, (module, stderr)
  assert (tmp_path / "a_file").read_text() == "keep me"
