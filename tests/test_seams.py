"""The seams new techniques plug into: the pipeline schedule and the gradient exchange.

The twins (tests/test_model_parallel.py, tests/test_compression.py) hold the
math; this checks the choice: which schedule a name builds, which exchange a
compression config builds, and that with one replica the exchange hands
nothing to the collectives.
"""

import pytest


def test_gpipe_is_the_plans_schedule_and_its_bubble():
  from tfpar.config.schema import ConfigError  # pylint: disable=import-outside-toplevel
  from tfpar.layout import schedule  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import schedules  # pylint: disable=import-outside-toplevel
  gpipe = schedules.make("gpipe")
  assert isinstance(gpipe, schedules.GPipe)
  assert schedule.bubble(4, 4, gpipe.virtual) == pytest.approx(3 / 7)
  assert schedule.bubble(1, 8, gpipe.virtual) == 0
  with pytest.raises(ConfigError, match="pipeline schedule 'zigzag' is unknown"):
    schedules.make("zigzag")


@pytest.mark.parametrize("method,kind", [("none", "AllReduce"), ("fp16", "CastExchange"),
                                         ("bf16", "CastExchange"),
                                         ("powersgd", "PowerSGDExchange")])
def test_the_compression_method_picks_the_exchange(method, kind):
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import CompressionConfig  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import compression, exchange, traffic  # pylint: disable=import-outside-toplevel
  variables = [keras.Variable(np.zeros([64, 32], np.float32)),  # What an engine passes.
               keras.Variable(np.zeros([32], np.float32))]
  ex = compression.make_exchange(CompressionConfig(method=method, min_size=16), variables,
                                 num_replicas=1)
  assert type(ex).__name__ == kind and isinstance(ex, exchange.GradientExchange)
  assert ex.stateful == (method == "powersgd")
  grads = [tf.ones([64, 32]), tf.fill([32], 2.0)]
  out = ex.reduce(grads, compressed=ex.compresses_at(10 ** 6))
  # One replica in sync: the identity, nothing handed to the collectives.
  for g, o in zip(grads, out):
    np.testing.assert_array_equal(g.numpy(), o.numpy())
  assert ex.traffic[ex.compresses_at(10 ** 6)] == traffic.NONE
