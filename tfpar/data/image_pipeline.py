"""tf.data pipelines over an ImageSet in memory or a prepared set streamed from disk
(tfpar.data.image_prepared): order, augmentation, per-replica batches.

Order and sharding are the text pipeline's (tfpar.data.pipeline): global
sample position p reads example `index_at(p)`, a seeded permutation per
epoch, and replica g of R takes positions t*G + g*B + [0, B) of global batch
t. So R replicas see exactly one device's global batch, and a run resumed at
step t rebuilds the same batches with nothing stored.

Each example becomes `(image, target)` by a task's `transform(example, seed)`,
where `example` is a dict of one image's tensors (`image` float32 [S, S, C] in
[0, 1]; `label`, or `boxes` + `classes`, or `mask`; `index`, which example of
`data` it is) and `seed` [2] =
(run seed, p) seeds its augmentation, so it too is a pure function of p.
"""

from typing import Callable, Dict, Union

import tensorflow as tf

from tfpar.data import pipeline
from tfpar.data.image_prepared import ImageStream
from tfpar.data.images import ImageSet


def _tensors(data: ImageSet) -> Dict[str, tf.Tensor]:
  """The set's arrays under a prepared set's field names (tfpar.data.image_prepared)."""
  fields = {"image": data.images, "label": data.labels, "boxes": data.boxes,
            "classes": data.classes, "mask": data.masks}
  return {k: tf.constant(v) for k, v in fields.items() if v is not None}


def image_dataset(data: Union[ImageSet, ImageStream], shard: pipeline.Shard, transform: Callable,
                  *, seed: int, start_step: int = 0, shuffle: bool = True,
                  images: bool = True) -> tf.data.Dataset:
  """Endless per-replica batches `(images [B, S, S, C], targets [B, ...])` of `data`: an
  ImageSet in memory, or a prepared set's ImageStream (each example one ranged read).
  Without `images` (a pipeline's last stage on a worker of its own: it needs the targets
  alone) no image is gathered or decoded: the transform gets zeros of the image's shape,
  and the targets, augmentation included, are those of the images."""
  n = len(data)
  b = shard.per_replica_batch

  def indexed(position):
    return position, pipeline.index_at(position, n, seed=seed, shuffle=shuffle)

  ds = (pipeline.sample_positions(shard, start_step=start_step).unbatch()
        .map(indexed, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True))
  if isinstance(data, ImageStream):
    ds = ds.interleave(lambda p, i: data.read(i, images).map(lambda e: (p, i, e)), cycle_length=8,
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  else:
    tensors = _tensors(data)
    blank = {} if images else {"image": tf.zeros(data.images.shape[1:], data.images.dtype)}
    ds = ds.map(lambda p, i: (p, i, {**{k: tf.gather(v, i) for k, v in tensors.items()
                                        if images or k != "image"}, **blank}),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  def example(position, index, e):
    e = dict(e, image=tf.cast(e["image"], tf.float32) / 255.0, index=index)
    return transform(e, tf.stack([tf.constant(seed, tf.int64), position]))

  ds = ds.map(example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(
      b, drop_remainder=True)
  options = tf.data.Options()
  options.deterministic = True
  # Sharded by construction (above): tf.distribute must not shard again.
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
