"""What each task asks of the flags and of its data's layout, without TensorFlow.

The TF-free half of a task (tfpar.tasks.task.Task is the other): tfpar.config.rules
calls `check_model` and `check_data` before TensorFlow starts (tfpar.plan calls
`check_model` with no data); tfpar.console says what is trained in the task's
own words (`model`, `batch`); `tool` names what runs a trained model; and
`read_images` picks the reader that the task's layout of --data needs. Every
rule raises ConfigError with one line naming the flag and the fix.
"""

from tfpar import families
from tfpar.console import count
from tfpar.config.schema import ConfigError

# The built-in data of the vision tasks, scikit-learn's digits: 8x8 greyscale scans of 0-9.
DIGITS_IMAGE_SIZE, DIGITS_CHANNELS, DIGITS_CLASSES = 8, 1, 10
# What the image readers (tf.io.decode_image) decode --data to: grey, RGB, RGBA (not JPEG).
IMAGE_CHANNELS = (1, 3, 4)


def positive(value, flag, fix="pass a positive integer"):
  if value is None or value <= 0:
    raise ConfigError(f"--{flag}={value} must be positive: {fix}")


class TaskSpec:
  """The TF-free half of one --task; a subclass overrides what its task needs."""

  name = ""
  model = ""  # What the start-up line calls the model ("ViT classifier").
  tool = "tfpar.predict"  # What runs a trained model of this task (tfpar.generate, tfpar.predict).
  splits_sequence = False  # Runs under --sequence_parallel (its blocks' sequence is --seq_len).
  labels = ()  # The label fields a prepared image set of this task keeps beside each image.

  def check_model(self, m) -> None:
    """The model flags (a tfpar.config.schema.ModelConfig) this task cannot build."""

  def check_data(self, m, d) -> None:
    """What --data (a DataConfig), or the built-in data where it is None, needs of the model."""

  def model_name(self, m) -> str:
    """What the start-up line calls the model of these flags."""
    del m
    return self.model

  def batch(self, m, global_batch_size: int) -> str:
    """One global batch in words ('16 sequences x 128 tokens')."""
    raise NotImplementedError


class LanguageModelingSpec(TaskSpec):
  name, tool = "lm", "tfpar.generate"
  splits_sequence = True

  def model_name(self, m):
    family = families.get(m.architecture)
    return family.title or family.name

  def batch(self, m, global_batch_size):
    return f"{count(global_batch_size, 'sequence')} x {count(m.seq_len, 'token')}"


class VisionSpec(TaskSpec):
  """A ViT on image patches; the readers of tfpar.data.images and image_records."""

  layout = ""  # The --data layout read besides TFRecord shards, for messages.

  def check_model(self, m):
    for value, flag in ((m.image_size, "image_size"), (m.patch_size, "patch_size"),
                        (m.num_channels, "num_channels"), (m.num_classes, "num_classes")):
      positive(value, flag)
    if m.image_size % m.patch_size:
      raise ConfigError(f"--image_size={m.image_size} is not divisible by --patch_size="
                        f"{m.patch_size}: pick a patch size that divides the image size "
                        f"(e.g. --patch_size=2 for --image_size=8)")
    if m.init_from is not None:
      raise ConfigError(f"--init_from={m.init_from} is for --task=lm (a language model's "
                        "preset): drop the flag")
    if m.architecture != families.default("lm"):
      raise ConfigError(f"--architecture={m.architecture} is for --task=lm: a ViT has its own "
                        "blocks; drop the flag")
    if m.positions != "learned":
      raise ConfigError(f"--positions={m.positions} is for --task=lm: a ViT learns its patch "
                        "positions; drop the flag")

  def check_data(self, m, d):
    if d.max_shift < 0:
      raise ConfigError(f"--max_shift={d.max_shift} must be >= 0 (0: no shifts)")
    if d.data is not None and m.num_channels not in IMAGE_CHANNELS:
      # Else the reader fails on the first image and seems to blame it.
      raise ConfigError(f"--num_channels={m.num_channels} is not a channel count images decode "
                        "to: use 1 (greyscale), 3 (RGB) or 4 (RGBA, PNG only)")
    if d.data is None:
      self.check_builtin(m)

  def check_builtin(self, m) -> None:
    """The model against the built-in digits (no --data)."""
    raise NotImplementedError

  def batch(self, m, global_batch_size):
    return count(global_batch_size, f"{m.image_size}x{m.image_size} image")

  # --- reading --data -------------------------------------------------------------
  def records(self):
    """The tfpar.data.image_records format of this task's TFRecord shards."""
    raise NotImplementedError

  def read_directory(self, data, **kwargs):
    """Examples (tfpar.data.images) from a directory --data, in this task's layout."""
    raise NotImplementedError

  def read_file(self, path, **kwargs):
    """Examples from a single non-TFRecord file --data, or None where the layout has none."""
    del path, kwargs

  def read_images(self, data: str, **kwargs):
    """--data as an ImageSet, with the reader its layout needs (kwargs: image_size, channels,
    num_classes)."""
    from tfpar.data import image_records  # pylint: disable=import-outside-toplevel
    return image_records.read_layout(data, self, **kwargs)


class ClassifySpec(VisionSpec):
  name, model = "classify", "ViT classifier"
  labels = ("label",)
  layout = "a directory with one sub-directory per class"

  def check_builtin(self, m):
    if (m.image_size, m.num_channels) != (DIGITS_IMAGE_SIZE, DIGITS_CHANNELS):
      raise ConfigError(f"--image_size={m.image_size} --num_channels={m.num_channels} do not fit "
                        f"the built-in digits ({DIGITS_IMAGE_SIZE}x{DIGITS_IMAGE_SIZE} "
                        f"greyscale): use --image_size={DIGITS_IMAGE_SIZE} --num_channels="
                        f"{DIGITS_CHANNELS}, or pass --data")
    if m.num_classes < DIGITS_CLASSES:
      raise ConfigError(f"--num_classes={m.num_classes} cannot hold the built-in digits' class "
                        f"ids 0..{DIGITS_CLASSES - 1}: use --num_classes={DIGITS_CLASSES}")

  def records(self):
    from tfpar.data import image_records  # pylint: disable=import-outside-toplevel
    return image_records.CLASSES

  def read_directory(self, data, **kwargs):
    from tfpar.data import images  # pylint: disable=import-outside-toplevel
    return images.image_folder(data, **kwargs)


class CanvasSpec(VisionSpec):
  """Detection and segmentation: canvases of several built-in digits by default."""

  background = 0  # Classes besides the ten digits (segmentation labels the background 0).

  def check_builtin(self, m):
    if m.num_channels != DIGITS_CHANNELS or m.image_size < 2 * DIGITS_IMAGE_SIZE:
      raise ConfigError(f"--image_size={m.image_size} --num_channels={m.num_channels} do not fit "
                        f"the built-in digit canvases (greyscale, several {DIGITS_IMAGE_SIZE}-pixel "
                        f"digits): use --num_channels={DIGITS_CHANNELS} and --image_size of at "
                        "least 16 (e.g. 48), or pass --data")
    needed = DIGITS_CLASSES + self.background
    if m.num_classes != needed:
      raise ConfigError(f"--num_classes={m.num_classes} does not fit the digit canvases' "
                        f"{needed} classes for --task={self.name}: use --num_classes={needed}")


class DetectSpec(CanvasSpec):
  name, model = "detect", "ViT detector"
  labels = ("boxes", "classes")
  layout = "a COCO instances JSON"

  def records(self):
    from tfpar.data import image_records  # pylint: disable=import-outside-toplevel
    return image_records.BOXES

  def read_directory(self, data, **kwargs):
    from tfpar.data.corpus import DataError  # pylint: disable=import-outside-toplevel
    raise DataError(f"--data={data} is a directory, but --task=detect reads a COCO instances "
                    "JSON or TFRecord shards: pass --data=PATH/instances.json")

  def read_file(self, path, **kwargs):
    from tfpar.data import images  # pylint: disable=import-outside-toplevel
    return images.coco_json(path, **kwargs) if path.endswith(".json") else None


class SegmentSpec(CanvasSpec):
  name, model = "segment", "ViT segmenter"
  labels = ("mask",)
  layout = "a directory with images/ and masks/"
  background = 1

  def records(self):
    from tfpar.data import image_records  # pylint: disable=import-outside-toplevel
    return image_records.MASKS

  def read_directory(self, data, **kwargs):
    from tfpar.data import images  # pylint: disable=import-outside-toplevel
    return images.mask_pairs(data, **kwargs)


SPECS = {s.name: s for s in (LanguageModelingSpec(), ClassifySpec(), DetectSpec(),
                             SegmentSpec())}
