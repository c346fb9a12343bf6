"""Training from Python: a validated config from keyword arguments, and a Trainer that runs it.

    import tfpar
    cfg = tfpar.make_config(num_layers=4, d_model=128, strategy="mirrored",
                            num_cpu_devices=2, train_steps=100, model_dir="runs/mine")
    tfpar.Trainer(cfg).fit()

`python -m tfpar.train` is this path behind flags: it parses them into the same
Config (tfpar.config.from_flags) and calls `Trainer(cfg).fit()`. Every check
runs before TensorFlow's runtime starts: the settings (tfpar.config.rules), the job's
TF_CONFIG, then the host CPU is split into --num_cpu_devices logical devices
in the Trainer's constructor. Make the Trainer before running any TensorFlow
op in the process (importing TensorFlow or Keras, and defining layers and
models, are fine): once the runtime has started, the devices cannot be split
and the constructor says so.
"""

import difflib
import types
from typing import Optional, Union

from tfpar import console, families
from tfpar.config import cluster as cluster_lib
from tfpar.config import config as config_lib
from tfpar.config import rundir, rules, schema


def make_config(**settings) -> schema.Config:
  """A frozen, validated Config from keyword arguments, each a flag's name without `--`.

  Every setting not given takes its default, resolved as the command line
  resolves it (d_ff = 4 d_model, warmup 5% of train_steps, the family's
  positions, the tokenizer's vocabulary, ...); docs/flags.md lists them all.
  List settings (stage_layers, profile_steps) take a sequence of integers.

  Raises:
    ConfigError: an unknown setting, a value of the wrong kind or not one of
      its choices, or a combination that cannot work; one line naming it and
      the fix.
  """
  known = {s.flag: s for s in schema.settings()}
  for name in settings:
    if name not in known:
      close = difflib.get_close_matches(name, known, n=1)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise schema.ConfigError(f"unknown setting {name}={settings[name]!r}{hint}: the settings "
                               "are the flags of docs/flags.md, without --")
  values = {}
  for flag, s in known.items():
    value = settings.get(flag, s.default)
    if flag in settings and value is not None:
      value = _checked(s, value)
    values[flag] = value
  return config_lib.from_flags(types.SimpleNamespace(**values))


def _checked(s: schema.Setting, value):
  """`value` of setting `s` as from_flags reads a flag's, or ConfigError."""
  if s.boolean and isinstance(value, bool):
    value = s.boolean[value]  # (off, on): e.g. remat=True means "full".
  if s.kind is tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
      raise schema.ConfigError(f"{s.flag}={value!r} must be a sequence of integers, e.g. (3, 3, 2)")
    return [str(v) for v in value]
  kinds = (int, float) if s.kind is float else (s.kind,)
  if not isinstance(value, kinds) or (s.kind is not bool and isinstance(value, bool)):
    raise schema.ConfigError(f"{s.flag}={value!r} must be of type {s.kind.__name__}")
  if s.choices and value not in s.choices:
    raise schema.ConfigError(f"{s.flag}={value!r} is not one of {', '.join(s.choices)}")
  return value


def _with_family(cfg: schema.Config, model: Union[str, families.Family]) -> schema.Config:
  """cfg training `model` (a registered family's name, or a Family, registered now)."""
  if isinstance(model, families.Family):
    families.register(model)
    model = model.name
  m = cfg.model
  if m.architecture == model:
    return cfg
  positions = m.positions
  if model in families.names():  # Else validation names the families there are.
    old, new = families.get(m.architecture), families.get(model)
    if new.positions and positions == (old.positions or (positions,))[0]:  # The old default.
      positions = new.positions[0]
  return cfg.replace(model={"architecture": model, "positions": positions})


class Trainer:
  """Trains one model under one config: `fit()` runs the whole job, `build()` makes its engine.

  Args:
    config: a Config (make_config, or tfpar.config.from_flags).
    model: the model family to train, a registered name or a `tfpar.Family`
      (registered now); default config's `architecture`.
    cluster: the job's cluster (tfpar.config.cluster.Cluster); default TF_CONFIG's.
    verbosity: TensorFlow's C++ log level while it starts (None: errors only).

  Raises:
    ConfigError, ClusterError: the config cannot work, alone or in this
      cluster, or TensorFlow's runtime already started with too few devices.
  """

  def __init__(self, config: schema.Config, *, model=None, cluster=None,
               verbosity: Optional[int] = None):
    if model is not None:
      config = _with_family(config, model)
    # A resumed run from a preset that has moved since: its checkpoint holds the weights.
    rules.validate(config, resumed=config_lib.resumed_preset(config.train.model_dir) is not None)
    self.config = config
    self.cluster = cluster if cluster is not None else cluster_lib.from_env()
    if self.cluster.spec:  # TF_CONFIG against the strategy: before TensorFlow starts.
      cluster_lib.check_cluster(config, self.cluster)
    console.set_xla_auto_clustering(config.train.xla_auto_clustering)  # Before XLA reads flags.
    console.set_host_allocator(config.train.host_allocator)  # Before TF allocates.
    console.import_tensorflow_quietly(verbosity)
    from tfpar import strategies  # pylint: disable=import-outside-toplevel  # TensorFlow.
    strategies.setup_devices(config.dist.num_cpu_devices)

  def fit(self) -> dict:
    """Trains to train_steps (resuming from model_dir's newest checkpoint); returns the last
    records (tfpar.training.loop). Raises what tfpar.runner.run raises."""
    rundir.check_run(self.config)  # What model_dir already holds (tf.io.gfile).
    from tfpar.parallel import address_space  # pylint: disable=import-outside-toplevel
    address_space.check(self.config)  # ulimit -v: TensorFlow would segfault, not fail, below it.
    from tfpar import runner  # pylint: disable=import-outside-toplevel
    return runner.run(self.config, self.cluster)

  def build(self):
    """The engine of this process (model, optimizer, step, data), built as `fit` builds it,
    for a caller that drives steps itself: `engine.train(engine.train_iterator(0), n)`."""
    from tfpar import runner  # pylint: disable=import-outside-toplevel
    return runner.build(self.config, self.cluster).engine


def fit(config: Optional[schema.Config] = None, *, model=None, **settings) -> dict:
  """Trains `config`, or `make_config(**settings)`: `Trainer(...).fit()`; returns its records."""
  if config is not None and settings:
    raise TypeError("tfpar.fit takes a config or settings, not both: pass "
                    "config.replace(section={...}) or make_config(**settings)")
  return Trainer(config if config is not None else make_config(**settings), model=model).fit()
