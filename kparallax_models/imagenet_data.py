"""ImageNet TFRecords in the standard layout, with the usual training preprocessing, and synthetic images.

Layout (as written by TensorFlow's ``build_imagenet_data.py``): ``DATA_DIR/train-00000-of-01024`` ... and
``DATA_DIR/validation-00000-of-00128`` ...; each record is a ``tf.train.Example`` with ``image/encoded`` (JPEG
bytes) and ``image/class/label`` (1..1000; 0 is unused, so labels are shifted down by one).

Training preprocessing (Inception-style, as in TF official models): a random crop covering 8%-100% of the image
with aspect ratio 3/4-4/3, resized to ``image_size``, a random horizontal flip, then per-channel normalization
with the ImageNet mean and standard deviation. Evaluation: central crop (87.5%) and resize. Training files are
split among workers (worker i reads files i, i+N, ...).
"""

import glob
import os
import re

import numpy as np
import tensorflow as tf

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
FEATURES = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64)}


def files(data_dir, split):
    pattern = os.path.join(data_dir, f"{'train' if split == 'train' else 'validation'}-*-of-*")
    found = sorted(glob.glob(pattern))
    if not found:
        raise FileNotFoundError(f"No ImageNet {split} TFRecords match {pattern}. Use --data=synthetic for "
                                f"benchmarks. Received: --data_dir={data_dir}.")
    return found


def _normalize(image):
    return (tf.cast(image, tf.float32) - MEAN) / STD


def preprocess_train(encoded, image_size):
    shape = tf.image.extract_jpeg_shape(encoded)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]), min_object_covered=0.1,
        aspect_ratio_range=(0.75, 1.33), area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
    y, x, _ = tf.unstack(begin)
    h, w, _ = tf.unstack(size)
    image = tf.image.decode_and_crop_jpeg(encoded, tf.stack([y, x, h, w]), channels=3)
    image = tf.image.resize(image, [image_size, image_size], method="bilinear")
    return _normalize(tf.image.random_flip_left_right(image))


def preprocess_eval(encoded, image_size):
    image = tf.image.decode_jpeg(encoded, channels=3)
    image = tf.image.central_crop(image, 0.875)
    return _normalize(tf.image.resize(image, [image_size, image_size], method="bilinear"))


def dataset(paths, image_size, batch_size, training, seed=0):
    """Batched (images, labels) from TFRecord ``paths``; labels shifted to 0..999."""
    def parse(record):
        example = tf.io.parse_single_example(record, FEATURES)
        encoded = example["image/encoded"]
        image = preprocess_train(encoded, image_size) if training else preprocess_eval(encoded, image_size)
        return image, tf.cast(example["image/class/label"] - 1, tf.int32)

    data = tf.data.TFRecordDataset(paths)
    if training:
        data = data.shuffle(1024, seed=seed).repeat()
    return data.map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size, drop_remainder=training).prefetch(2)


def count_records(paths):
    """The records in the TFRecord files ``paths``; a ``ValueError`` naming a file that is not one."""
    total = 0
    for path in paths:
        try:
            total += sum(1 for _ in tf.data.TFRecordDataset(path))
        except tf.errors.DataLossError as e:
            reason = re.sub(r"\{\{function_node [^}]*\}\}|\[Op:.*", "", e.message).strip()
            raise ValueError(f"{path} is not a readable TFRecord file ({reason}). "
                             f"Rewrite it or move it out of --data_dir. Received: {path}.") from None
    return total


def synthetic(batch_size, image_size, num_classes, seed=0):
    """One fixed random batch repeated forever (as tf_cnn_benchmarks' synthetic data): measures compute + comms."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch_size, image_size, image_size, 3)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=(batch_size,)).astype(np.int32)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def write_example(writer, jpeg_bytes, label):
    """Writes one record in the standard layout (used by tests and small local data sets)."""
    example = tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg_bytes])),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}))
    writer.write(example.SerializeToString())
