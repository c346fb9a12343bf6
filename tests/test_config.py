"""Config validation: every rule names its flag; the CLI turns bad input into one line, exit 2."""

import os

import pytest

from conftest import TINY, make_config, read_metrics, run_module, run_modules, train_in_process
from tfpar.config import rules, rundir
from tfpar.config.schema import ConfigError

MODEL_DIR = "--model_dir=/tmp/tfpar-config-test"  # validate() never touches it

# (extra flags on top of TINY, the flag the error message must name)
BAD = [
    # from_flags
    (["--stage_layers=a,b", "--pipeline_stages=2"], "stage_layers"),
    (["--profile_steps=5"], "profile_steps"),
    (["--profile_steps=a,b"], "profile_steps"),
    (["--profile_steps=4,2", "--train_steps=10"], "profile_steps"),
    (["--profile_steps=5,20", "--train_steps=10"], "profile_steps"),
    # Each positive-integer flag, at 0 and below.
    (["--seq_len=0"], "seq_len"),
    (["--num_layers=0"], "num_layers"),
    (["--d_model=-32"], "d_model"),
    (["--num_heads=0"], "num_heads"),
    (["--d_ff=0"], "d_ff"),
    (["--train_steps=0"], "train_steps"),
    (["--global_batch_size=-8"], "global_batch_size"),
    (["--log_every=0"], "log_every"),
    (["--checkpoint_every=0"], "checkpoint_every"),
    (["--keep_checkpoints=0"], "keep_checkpoints"),
    (["--steps_per_call=0"], "steps_per_call"),
    (["--num_cpu_devices=0"], "num_cpu_devices"),
    (["--ps_shards=0"], "ps_shards"),
    (["--pipeline_stages=0"], "pipeline_stages"),
    (["--microbatches=0"], "microbatches"),
    (["--tensor_parallel=0"], "tensor_parallel"),
    # The other single-flag rules.
    (["--eval_every=-1"], "eval_every"),
    (["--eval_steps=-1"], "eval_steps"),
    (["--d_model=32", "--num_heads=3"], "num_heads"),
    (["--positions=rotary", "--d_model=12", "--num_heads=4"], "positions"),  # head size 3
    (["--dropout=1.0"], "dropout"),
    (["--dropout=-0.1"], "dropout"),
    (["--eval_fraction=0"], "eval_fraction"),
    (["--eval_fraction=0.5"], "eval_fraction"),
    (["--data=/nonexistent/tfpar/*.txt"], "data"),
    (["--learning_rate=0"], "learning_rate"),
    (["--warmup_steps=-1"], "warmup_steps"),
    (["--min_lr_ratio=1.5"], "min_lr_ratio"),
    (["--weight_decay=-0.1"], "weight_decay"),
    (["--clip_norm=-1"], "clip_norm"),
    (["--collective_timeout=-1"], "collective_timeout"),
    (["--strategy=one_device", "--num_cpu_devices=4"], "num_cpu_devices"),
    (["--strategy=tpu", "--precision=mixed_float16"], "precision"),
    # Model-parallel plans (_validate_parallel).
    (["--strategy=parameter_server", "--pipeline_stages=2"], "strategy"),
    (["--strategy=tpu", "--tensor_parallel=2"], "strategy"),
    (["--data_parallel=0"], "data_parallel"),
    (["--num_layers=2", "--pipeline_stages=3"], "pipeline_stages"),
    (["--num_layers=2", "--pipeline_stages=2", "--stage_layers=2"], "stage_layers"),
    (["--num_layers=2", "--pipeline_stages=2", "--stage_layers=2,1"], "stage_layers"),
    (["--num_layers=2", "--pipeline_stages=2", "--stage_layers=2,0"], "stage_layers"),
    (["--num_heads=4", "--tensor_parallel=3"], "tensor_parallel"),
    (["--num_heads=4", "--d_ff=70", "--tensor_parallel=4"], "d_ff"),
    (["--global_batch_size=8", "--data_parallel=3"], "global_batch_size"),
    (["--global_batch_size=8", "--microbatches=3"], "microbatches"),
    (["--strategy=mirrored", "--num_cpu_devices=4", "--pipeline_stages=2", "--data_parallel=1"],
     "num_cpu_devices"),
    # Gradient compression (_validate_compression).
    (["--strategy=mirrored", "--grad_compression=powersgd", "--powersgd_rank=0"], "powersgd_rank"),
    (["--grad_compression=fp16"], "grad_compression"),  # one_device: nothing to all-reduce
    (["--strategy=parameter_server", "--grad_compression=bf16"], "grad_compression"),
    (["--strategy=tpu", "--grad_compression=powersgd"], "grad_compression"),
    (["--num_cpu_devices=2", "--pipeline_stages=2", "--grad_compression=powersgd"],
     "grad_compression"),  # D = 1
    (["--strategy=mirrored", "--all_reduce_pack_mb=4"], "all_reduce_pack_mb"),
    # Optimizer sharding (_validate_optimizer_sharding).
    (["--optimizer_sharding=zero3"], "optimizer_sharding"),  # one_device
    (["--strategy=mirrored", "--num_cpu_devices=4", "--tensor_parallel=2", "--data_parallel=2",
      "--optimizer_sharding=zero3"], "optimizer_sharding"),  # Not on tensor-parallel stages,
    (["--strategy=multi_worker_mirrored", "--pipeline_stages=2", "--optimizer_sharding=zero3"],
     "optimizer_sharding"),  # nor across workers,
    (["--strategy=mirrored", "--num_cpu_devices=4", "--pipeline_stages=2", "--data_parallel=2",
      "--pipeline_schedule=1f1b", "--optimizer_sharding=zero3"], "optimizer_sharding"),  # nor 1f1b.
    (["--strategy=mirrored", "--num_cpu_devices=2", "--optimizer_sharding=zero3", "--remat"],
     "remat"),
    (["--strategy=mirrored", "--num_cpu_devices=2", "--optimizer_sharding=zero3",
      "--dropout=0.1"], "dropout"),
    (["--strategy=mirrored", "--num_cpu_devices=2", "--optimizer_sharding=zero3",
      "--grad_compression=bf16"], "grad_compression"),
    (["--strategy=mirrored", "--num_cpu_devices=2", "--optimizer_sharding=zero3",
      "--precision=mixed_float16"], "precision"),
    (["--optimizer_sharding=zero1"], "optimizer_sharding"),  # one_device
    (["--strategy=parameter_server", "--optimizer_sharding=zero1"], "optimizer_sharding"),
    (["--strategy=tpu", "--optimizer_sharding=zero2"], "optimizer_sharding"),
    (["--strategy=mirrored", "--optimizer_sharding=zero1", "--precision=mixed_float16"],
     "optimizer_sharding"),
    (["--strategy=mirrored", "--optimizer_sharding=zero2", "--grad_compression=bf16"],
     "optimizer_sharding"),
]


@pytest.mark.parametrize("extra,flag", BAD, ids=[" ".join(e) for e, _ in BAD])
def test_each_rule_names_its_flag(extra, flag):
  with pytest.raises(ConfigError) as info:
    make_config(TINY + [MODEL_DIR] + extra)
  message = str(info.value)
  assert f"--{flag}" in message
  assert "\n" not in message


def test_zero3_on_one_replica_is_refused_once_the_devices_are_counted():
  """(A GPU host's mirrored replicas are its GPUs: the engine checks, with the count.)"""
  rules.check_zero3_replicas(2)
  with pytest.raises(ConfigError, match="--optimizer_sharding=zero3 .* has one") as info:
    rules.check_zero3_replicas(1)
  assert "\n" not in str(info.value)


def test_missing_model_dir_is_named():
  with pytest.raises(ConfigError, match="--model_dir"):
    make_config(TINY)


@pytest.mark.parametrize("extra", [
    [],
    ["--positions=rotary"],
    ["--strategy=mirrored", "--num_cpu_devices=4"],
    ["--strategy=mirrored", "--num_cpu_devices=4", "--pipeline_stages=2", "--data_parallel=2",
     "--microbatches=2"],
    ["--strategy=mirrored", "--num_cpu_devices=2", "--tensor_parallel=2"],
    ["--num_layers=2", "--pipeline_stages=2", "--stage_layers=1,1"],
    ["--eval_every=0", "--eval_steps=0", "--clip_norm=0", "--warmup_steps=0"],
    ["--strategy=mirrored", "--num_cpu_devices=2", "--grad_compression=fp16",
     "--precision=mixed_float16"],
    ["--strategy=multi_worker_mirrored", "--grad_compression=powersgd", "--powersgd_rank=1",
     "--all_reduce_pack_mb=4"],
    ["--strategy=mirrored", "--num_cpu_devices=4", "--pipeline_stages=2", "--data_parallel=2",
     "--grad_compression=bf16"],
    ["--remat=selective", "--dropout=0.1"],  # The attention core has no dropout to redraw.
    ["--strategy=mirrored", "--num_cpu_devices=4", "--optimizer_sharding=zero1",
     "--grad_compression=powersgd", "--precision=mixed_bfloat16"],
    ["--strategy=multi_worker_mirrored", "--optimizer_sharding=zero2"],
    ["--strategy=mirrored", "--num_cpu_devices=4", "--optimizer_sharding=zero3"],
    ["--strategy=multi_worker_mirrored", "--optimizer_sharding=zero3"],
    ["--strategy=mirrored", "--num_cpu_devices=4", "--pipeline_stages=2", "--data_parallel=2",
     "--optimizer_sharding=zero1"],  # On the hybrid plan's D copies.
    ["--strategy=mirrored", "--num_cpu_devices=4", "--pipeline_stages=2", "--data_parallel=2",
     "--microbatches=2", "--optimizer_sharding=zero3"],  # A one-host pipeline plan's copies.
], ids=lambda e: " ".join(e) or "tiny")
def test_valid_configs_pass(extra):
  make_config(TINY + [MODEL_DIR] + extra)  # raises ConfigError if a rule over-reaches


@pytest.mark.parametrize("extra,mode", [
    ([], "none"), (["--remat"], "full"), (["--noremat"], "none"), (["--remat=full"], "full"),
    (["--remat=selective"], "selective"), (["--remat=none"], "none"),
    (["--remat=true"], "full"), (["--remat=false"], "none"),  # What an old flagfile may say.
    (["--remat=selective", "--noremat"], "none"),  # The last one wins, as for any flag.
])
def test_remat_takes_its_old_boolean_spellings_and_three_modes(extra, mode):
  cfg = make_config(TINY + [MODEL_DIR] + extra)
  assert cfg.parallel.remat == mode
  assert cfg.parallel.model_parallel == (mode != "none")  # Remat runs on the pipeline engine.


def test_remat_in_a_flagfile_and_a_config_json_of_the_boolean_days(tmp_path):
  from tfpar.config import rundir  # pylint: disable=import-outside-toplevel
  flagfile = tmp_path / "old.flags"
  flagfile.write_text("--remat\n")
  assert make_config(TINY + [MODEL_DIR, f"--flagfile={flagfile}"]).parallel.remat == "full"
  flagfile.write_text("--noremat\n")
  assert make_config(TINY + [MODEL_DIR, f"--flagfile={flagfile}"]).parallel.remat == "none"
  saved = make_config(TINY + [MODEL_DIR]).to_dict()
  for old, mode in ((True, "full"), (False, "none")):
    saved["parallel"]["remat"] = old
    assert rundir.from_saved(saved).parallel.remat == mode


def test_defaults_are_derived():
  cfg = make_config([MODEL_DIR, "--d_model=64", "--train_steps=200"])
  assert cfg.model.d_ff == 256  # 4 * d_model
  assert cfg.optim.warmup_steps == 10  # 5% of train_steps


@pytest.mark.parametrize("extra, xla, clustering", [
    ([], True, "none"),
    # oneDNN's bf16 matmuls, XLA for the elementwise ops (config.jit_compile_default,
    # config.auto_clustering_default).
    (["--precision=mixed_bfloat16"], False, "fusible"),
    (["--precision=mixed_bfloat16", "--xla_auto_clustering=none"], False, "none"),
    (["--precision=mixed_bfloat16", "--jit_compile"], True, "none"),
    (["--precision=mixed_bfloat16", "--strategy=tpu"], True, "none"),
    (["--precision=mixed_bfloat16", "--strategy=mirrored"], False, "fusible"),
    # Across processes not by default (stages on other workers refuse it: rules.check_worker_job).
    (["--precision=mixed_bfloat16", "--strategy=multi_worker_mirrored"], False, "none"),
    (["--precision=mixed_bfloat16", "--strategy=parameter_server"], False, "none"),
    (["--precision=mixed_float16"], True, "none"),
    (["--nojit_compile"], False, "none"),
    (["--nojit_compile", "--xla_auto_clustering=fusible"], False, "fusible"),
])
def test_jit_compile_defaults_off_for_bfloat16_only(extra, xla, clustering):
  train = make_config([MODEL_DIR] + extra).train
  assert train.jit_compile is xla and train.xla_auto_clustering == clustering


def test_auto_clustering_with_a_step_compiled_whole_is_refused():
  from tfpar.config.schema import ConfigError  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match="--xla_auto_clustering=fusible is for a step not "
                     "compiled whole.*pass --nojit_compile"):
    make_config([MODEL_DIR, "--jit_compile", "--xla_auto_clustering=fusible"])


def test_every_task_of_a_model_parallel_job_checks_its_layout_before_servers_start():
  """rules.check_worker_job: what tfpar.runner asks on every task before any server starts."""
  from tfpar.config import rules  # pylint: disable=import-outside-toplevel
  across = [MODEL_DIR, "--strategy=multi_worker_mirrored", "--pipeline_stages=2",
            "--precision=mixed_bfloat16", "--num_cpu_devices=1"]
  cfg = make_config(across + ["--xla_auto_clustering=fusible"])
  with pytest.raises(rules.ConfigError, match="--xla_auto_clustering=fusible does not work with "
                     "pipeline stages on different workers.*use --xla_auto_clustering=none"):
    rules.check_worker_job(cfg, num_workers=2, devices_per_worker=1)
  assert rules.check_worker_job(make_config(across), 2, 1) is True  # Off by default there.
  assert rules.check_worker_job(cfg, 2, 2) is False  # A replica per worker: allowed.
  with pytest.raises(rules.ConfigError, match="do not split into replicas"):
    rules.check_worker_job(make_config(across), 3, 1)  # worker_layout's rules, as early.
  assert rules.check_worker_job(make_config([MODEL_DIR, "--strategy=multi_worker_mirrored"]),
                                3, 1) is False  # Not model parallel: nothing to lay out.


def test_auto_clustering_sets_tf_xla_flags_before_the_users_own(monkeypatch):
  """The user's own TF_XLA_FLAGS come after tfpar's and win; 'none' adds nothing."""
  from tfpar import console  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=1")
  console.set_xla_auto_clustering("none")
  assert os.environ["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=1"
  assert not console.xla_auto_clustering_active("fusible")
  console.set_xla_auto_clustering("fusible")
  console.set_xla_auto_clustering("fusible")  # Once only.
  assert os.environ["TF_XLA_FLAGS"] == (console.XLA_AUTO_CLUSTERING_FLAGS["fusible"] +
                                        " --tf_xla_auto_jit=1")
  assert console.xla_auto_clustering_active("fusible")


def test_a_warmup_past_the_end_is_clamped_with_a_warning():
  """A flagfile shortened to a quick try (vit_digits' warmup of 50, 3 steps) runs, and says so."""
  from tfpar.config import config, flags  # pylint: disable=import-outside-toplevel
  heard = []
  cfg = config.from_flags(flags.parse(["--flagfile=configs/vit_digits.flags", MODEL_DIR,
                                       "--train_steps=3"]), warn=heard.append)
  assert cfg.optim.warmup_steps == 2
  assert heard == ["--warmup_steps=50 is not below --train_steps=3: warming up for 2 step(s) "
                   "instead"]
  one_step = make_config(TINY + [MODEL_DIR, "--train_steps=1", "--warmup_steps=5"])
  assert one_step.optim.warmup_steps == 0
  # Left to its default (5% of the steps), one step used to be refused for its own warmup.
  assert config.from_flags(flags.parse([MODEL_DIR, "--train_steps=1"])).optim.warmup_steps == 0


# --- the CLI ----------------------------------------------------------------------------------


def assert_one_line_error(proc, flag):
  """What a user relies on: exit 2, one line naming the flag, no traceback."""
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout
  errors = [line for line in proc.stderr.splitlines() if line.startswith("tfpar.train: error:")]
  assert len(errors) == 1, proc.stderr
  assert f"--{flag}" in errors[0]
  return errors[0]


@pytest.mark.parametrize("extra,flag", [
    (["--num_heads=3"], "num_heads"),
    (["--global_batch_size=-8"], "global_batch_size"),
    (["--data=/nonexistent/tfpar/corpus.txt"], "data"),
    (["--strategy=bogus"], "strategy"),
    (["--num_heads=four"], "num_heads"),
    (["--strategy=mirrored", "--grad_compression=gzip"], "grad_compression"),
    (["--strategy=parameter_server", "--grad_compression=powersgd"], "grad_compression"),
    (["--remat=partial"], "remat"),
], ids=["heads", "negative-batch", "missing-data", "unknown-strategy", "not-an-int",
        "unknown-compression", "compression-with-ps", "unknown-remat"])
def test_cli_bad_flag_is_one_line(tmp_path, extra, flag):
  proc = run_module("tfpar.train", TINY + [f"--model_dir={tmp_path / 'run'}"] + extra,
                    check=False)
  assert_one_line_error(proc, flag)
  assert proc.stderr.strip().count("\n") == 0, proc.stderr  # nothing else either
  assert not (tmp_path / "run").exists()  # failed before creating anything


def _snapshot(model_dir):
  out = {}
  for root, _, names in os.walk(model_dir):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, model_dir)] = f.read()
  return out


def test_cli_bad_input_leaves_existing_run_untouched(tmp_path):
  model_dir = str(tmp_path / "run")
  args = TINY + ["--train_steps=2", "--jit_compile=false", f"--model_dir={model_dir}"]
  train_in_process(args)  # Writes config.json, as the CLI does.
  before = _snapshot(model_dir)
  assert any(name.startswith("checkpoints/ckpt-2") for name in before)
  assert [r["step"] for r in read_metrics(model_dir)] == [1, 2]

  # A resume with other model flags, found when the run directory is read: the check train.main
  # makes once TensorFlow can read it, here in-process (its exit 2 and one line from the CLI:
  # test_bad_input's test_cli_resume_with_another_batch_leaves_the_run_untouched).
  with pytest.raises(ConfigError) as info:
    rundir.check_run(make_config(args + ["--train_steps=4", "--d_model=48"]))
  assert "--model_dir" in str(info.value) and "d_model" in str(info.value), str(info.value)
  assert "\n" not in str(info.value)
  assert _snapshot(model_dir) == before
  # With config.json lost, the checkpoint refuses the other model: config.json and event files
  # used to be written first, so that the run's own flags were refused afterwards. Beside it, a
  # config error found before TensorFlow starts.
  os.remove(os.path.join(model_dir, "config.json"))
  before = _snapshot(model_dir)
  heads, proc = run_modules([("tfpar.train", args + ["--train_steps=4", "--num_heads=3"]),
                             ("tfpar.train", args + ["--train_steps=4", "--d_model=48"])])
  assert_one_line_error(heads, "num_heads")
  line = assert_one_line_error(proc, "model_dir")
  assert "does not fit this model" in line
  assert "wte/embeddings has shape [256, 32] there, shape [256, 48] here" in line
  assert _snapshot(model_dir) == before
