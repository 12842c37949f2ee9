"""ResNet-50 v1.5 (the stride-2 convolution of a downsampling block is its 3x3, as in TensorFlow official models and
tf_cnn_benchmarks): conv7x7/2 + max-pool, four stages of bottleneck blocks [3, 4, 6, 3] with widths 64..512
(x4 expansion), global average pooling, a dense classifier. Convolutions have no bias; batch norm momentum 0.9,
epsilon 1e-5. Dense only: under kparallax ``hybrid`` it trains as ``allreduce`` (no PS variable).
"""

import dataclasses
from typing import Tuple

import tensorflow as tf

from kparallax_models import presets


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    image_size: int = 224
    num_classes: int = 1000
    blocks: Tuple[int, ...] = (3, 4, 6, 3)
    base_filters: int = 64
    learning_rate: float = 0.1      # SGD momentum 0.9, for a global batch of 256 (scaled linearly)
    batch_size: int = 32            # per worker

    def __post_init__(self):
        if self.image_size < 32 or self.num_classes < 2 or not self.blocks or self.base_filters < 1:
            raise ValueError(f"Invalid ResNetConfig. Received: {self}.")


def preset(name, **overrides):
    """The preset ``name`` (``configs/<name>.json``, or a path to a JSON config) with ``overrides`` applied."""
    fields = presets.load("resnet", name)
    fields.update(overrides)
    fields["blocks"] = tuple(fields.get("blocks", (3, 4, 6, 3)))
    presets.check_fields(ResNetConfig, name, fields)
    try:
        return ResNetConfig(**fields)
    except TypeError as e:
        raise ValueError(f"Bad ResNet config {name!r}: {e}. Received: {sorted(fields)}.") from None


def _bn(name):
    return tf.keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=name)


def _bottleneck(x, filters, stride, project, name):
    shortcut = x
    if project:
        shortcut = tf.keras.layers.Conv2D(4 * filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
        shortcut = _bn(f"{name}_proj_bn")(shortcut)
    x = tf.keras.layers.Conv2D(filters, 1, use_bias=False, name=f"{name}_conv1")(x)
    x = tf.keras.layers.ReLU()(_bn(f"{name}_bn1")(x))
    x = tf.keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv2")(x)
    x = tf.keras.layers.ReLU()(_bn(f"{name}_bn2")(x))
    x = tf.keras.layers.Conv2D(4 * filters, 1, use_bias=False, name=f"{name}_conv3")(x)
    x = _bn(f"{name}_bn3")(x)
    return tf.keras.layers.ReLU()(tf.keras.layers.Add()([x, shortcut]))


def build(config: ResNetConfig, name="resnet50"):
    """The Keras functional model: images [batch, size, size, 3] (float, normalized) -> logits [batch, classes]."""
    inputs = tf.keras.Input(shape=(config.image_size, config.image_size, 3), name="images")
    x = tf.keras.layers.Conv2D(config.base_filters, 7, strides=2, padding="same", use_bias=False, name="conv1")(inputs)
    x = tf.keras.layers.ReLU()(_bn("conv1_bn")(x))
    x = tf.keras.layers.MaxPool2D(3, strides=2, padding="same")(x)
    for stage, count in enumerate(config.blocks):
        filters = config.base_filters * 2 ** stage
        for block in range(count):
            stride = 2 if block == 0 and stage > 0 else 1
            x = _bottleneck(x, filters, stride, project=block == 0, name=f"stage{stage + 1}_block{block + 1}")
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(config.num_classes, name="logits")(x)
    return tf.keras.Model(inputs, outputs, name=name)


def make_optimizer(config: ResNetConfig, num_workers=1):
    return tf.keras.optimizers.SGD(config.learning_rate * config.batch_size * num_workers / 256, momentum=0.9)
