"""The LM1B language model (Jozefowicz et al. 2016, "Exploring the Limits of Language Modeling") as Parallax
trained it: word embedding [V, E] -> dropout -> one LSTM with H units and a projection to P -> dropout ->
sampled softmax over a [V, P] softmax matrix (plus a [V] bias). Both the embedding and the softmax matrix get
sparse gradients, so both are ``tf.keras.layers.Embedding`` tables (kparallax puts them on PS tasks, in row shards
with ``partitions``); ``softmax="weights"`` makes the softmax matrix and bias the model's own ``add_weight``
variables instead, which kparallax moves onto PS tasks whole at the first step. Gradients
of the LSTM are clipped to a global norm of ``clip_norm``. Evaluation uses the full softmax and reports perplexity.
"""

import dataclasses
import math
from typing import Any, Dict, Optional

import tensorflow as tf

from kparallax_models import presets


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Hyper-parameters of the LM1B model and its training (the presets below)."""
    vocab_size: int = 793471
    embedding_dim: int = 512
    lstm_units: int = 2048
    projection_dim: int = 512
    num_sampled: int = 8192
    dropout: float = 0.1
    clip_norm: float = 10.0
    learning_rate: float = 0.2      # Adagrad
    num_steps: int = 20             # unrolled LSTM steps per window
    batch_size: int = 128           # per worker
    # How the softmax matrix and bias are made: "embedding" (tf.keras.layers.Embedding tables) or "weights" (the
    # model's own add_weight variables, as a plain TensorFlow program passes them to a sampled softmax; kparallax
    # finds their sparse gradients at the first step and moves them onto PS tasks whole).
    softmax: str = "embedding"
    # The optimizer's own ``global_clipnorm`` over every gradient, tables included (None: off; the LSTM's clip to
    # ``clip_norm`` above stays either way).
    global_clipnorm: Optional[float] = None

    def __post_init__(self):
        for name in ("vocab_size", "embedding_dim", "lstm_units", "projection_dim", "num_sampled", "num_steps",
                     "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LMConfig.{name} must be an integer >= 1. Received: {name}={value!r}.")
        if self.num_sampled >= self.vocab_size:
            raise ValueError(f"num_sampled must be smaller than vocab_size. Received: num_sampled={self.num_sampled}, "
                             f"vocab_size={self.vocab_size}.")
        if self.softmax not in ("embedding", "weights"):
            raise ValueError(f"softmax must be 'embedding' or 'weights'. Received: softmax={self.softmax!r}.")
        if self.global_clipnorm is not None and not (isinstance(self.global_clipnorm, (int, float))
                                                     and self.global_clipnorm > 0):
            raise ValueError("global_clipnorm must be a number > 0, or null for none. Received: "
                             f"global_clipnorm={self.global_clipnorm!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1). Received: dropout={self.dropout!r}.")


def preset(name, **overrides):
    """The preset ``name`` (``configs/<name>.json``, or a path to a JSON config) with ``overrides`` applied."""
    fields = presets.load("lm1b", name)
    fields.update(overrides)
    presets.check_fields(LMConfig, name, fields)
    try:
        return LMConfig(**fields)
    except TypeError as e:
        raise ValueError(f"Bad LM1B config {name!r}: {e}. Received: {sorted(fields)}.") from None


class LSTMProjectionCell(tf.keras.layers.Layer):
    """LSTM cell with a projection of the output (LSTMP): state (h [P], c [H]); forget-gate bias 1."""

    def __init__(self, units, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.units, self.projection_dim = units, projection_dim
        self.state_size = [projection_dim, units]
        self.output_size = projection_dim

    def build(self, input_shape):
        input_dim = int(input_shape[-1])
        self.kernel = self.add_weight("kernel", [input_dim + self.projection_dim, 4 * self.units],
                                      initializer="glorot_uniform")
        self.bias = self.add_weight("bias", [4 * self.units], initializer=tf.keras.initializers.Constant(
            [0.0] * (2 * self.units) + [1.0] * self.units + [0.0] * self.units))  # gates i, j, f(+1), o
        self.projection = self.add_weight("projection", [self.units, self.projection_dim],
                                          initializer="glorot_uniform")
        super().build(input_shape)

    def call(self, inputs, states):
        h, c = states
        gates = tf.matmul(tf.concat([inputs, h], axis=1), self.kernel) + self.bias
        i, j, f, o = tf.split(gates, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(j)
        h = tf.matmul(tf.sigmoid(o) * tf.tanh(c), self.projection)
        return h, [h, c]

    def get_config(self):
        return {**super().get_config(), "units": self.units, "projection_dim": self.projection_dim}


def log_uniform_candidates(labels, num_sampled, vocab_size, seed):
    """``num_sampled`` distinct ids drawn from the log-uniform (Zipf) distribution, as a function of ``seed`` only.

    The same draws and expected counts as ``tf.random.log_uniform_candidate_sampler(..., unique=True)``: ids are
    drawn with replacement (``floor(exp(u * log(V + 1))) - 1``) until ``num_sampled`` distinct ones are found, and
    the expected count of an id of probability ``p`` after ``T`` draws is ``1 - (1 - p)^T`` (``p * T`` when no draw
    repeated). TensorFlow's sampler is a stateful op whose position is lost when a process restarts; this one is
    stateless, so a run resumed from a checkpoint draws exactly the candidates of the uninterrupted run.

    Args:
      labels: int64 [batch, 1] true ids.
      num_sampled: distinct ids to draw (< ``vocab_size``).
      vocab_size: ids are in ``[0, vocab_size)``.
      seed: int64 [2] stateless seed.

    Returns:
      (sampled ids [num_sampled] int64, expected counts of ``labels`` [batch, 1], of the sampled ids [num_sampled]).
    """
    log_range = tf.math.log1p(tf.cast(vocab_size, tf.float64))
    chunk = max(2 * num_sampled, 1024)

    def draw(k):
        u = tf.random.stateless_uniform([chunk], tf.random.experimental.stateless_fold_in(seed, k), dtype=tf.float64)
        return tf.math.floormod(tf.cast(tf.exp(u * log_range), tf.int64) - 1, vocab_size)

    def enough(k, draws):
        del k
        return tf.size(tf.unique(draws)[0]) < num_sampled

    _, draws = tf.while_loop(enough, lambda k, d: (k + 1, tf.concat([d, draw(k)], 0)),
                             (tf.constant(1, tf.int64), draw(tf.constant(0, tf.int64))),
                             shape_invariants=(tf.TensorShape([]), tf.TensorShape([None])))
    distinct, position = tf.unique(draws)  # distinct ids in the order of their first draw
    sampled = distinct[:num_sampled]
    # Draws needed: up to the first draw of the num_sampled-th distinct id. Read from where it occurs, never from
    # the size of ``draws``: in a step partitioned over the PS devices, Grappler folded ``tf.size(draws)`` to the
    # first chunk's size although the loop had drawn two chunks (seen with lm1b_sparse: 16384 vs 32768).
    tries = tf.cast(tf.where(tf.equal(position, num_sampled - 1))[0, 0] + 1, tf.float64)

    def expected(ids):
        ids = tf.cast(ids, tf.float64)
        p = tf.math.log((ids + 2.0) / (ids + 1.0)) / log_range
        count = tf.where(tries == num_sampled, p * tries, -tf.math.expm1(tries * tf.math.log1p(-p)))
        return tf.cast(count, tf.float32)

    return sampled, expected(labels), expected(sampled)


def sampled_softmax_loss(weights, biases, targets, hidden, candidates):
    """Mean sampled-softmax loss with accidental hits removed.

    Only the rows of the true and sampled words are gathered from ``weights`` [V, P] and ``biases`` [V, 1], so
    their gradients are sparse. ``candidates`` is ``(sampled ids, true expected counts, sampled expected counts)``
    as ``log_uniform_candidates`` (or TensorFlow's candidate samplers) return them.
    """
    labels = tf.reshape(tf.cast(targets, tf.int64), [-1, 1])
    hidden = tf.reshape(hidden, [-1, hidden.shape[-1]])
    sampled, true_expected, sampled_expected = candidates
    ids = tf.concat([labels[:, 0], sampled], axis=0)
    rows = tf.nn.embedding_lookup(weights, ids)
    bias = tf.nn.embedding_lookup(biases, ids)[:, 0]
    batch = tf.shape(labels)[0]
    # tf.split, not rows[:batch] / rows[batch:]: the gradient of a split is one concat, where two slices' gradients
    # are two zero-padded [batch + num_sampled, P] tensors and their sum (measured: 10% of a worker's op time).
    sizes = tf.stack([batch, tf.shape(sampled)[0]])
    true_w, sampled_w = tf.split(rows, sizes, num=2)
    true_b, sampled_b = tf.split(bias, sizes, num=2)
    true_logits = tf.reduce_sum(hidden * true_w, axis=1) + true_b - tf.math.log(true_expected[:, 0])
    sampled_logits = (tf.matmul(hidden, sampled_w, transpose_b=True) + sampled_b
                      - tf.math.log(sampled_expected))
    hits = tf.cast(tf.equal(labels, sampled[tf.newaxis, :]), sampled_logits.dtype)
    sampled_logits -= hits * 1e9   # a sampled word equal to the target is not a negative
    logits = tf.concat([true_logits[:, tf.newaxis], sampled_logits], axis=1)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.zeros([batch], tf.int32), logits))


class LM1B(tf.keras.Model):
    """The LM1B model. ``fit`` data: (ids [batch, num_steps], next ids [batch, num_steps]); logs ``loss`` and
    ``perplexity`` (sampled softmax while training, full softmax in ``evaluate``).

    Training randomness (the dropout masks and the sampled words) is stateless: a function of ``seed``, ``stream``
    (pass the worker index, so that workers draw differently) and the optimizer's step only. A run resumed from a
    checkpoint therefore repeats the uninterrupted run bit for bit.
    """

    def __init__(self, config: LMConfig, seed: int = 0, stream: int = 0, **kwargs):
        super().__init__(name=kwargs.pop("name", "lm1b"), **kwargs)
        self.config, self.seed, self.stream = config, int(seed), int(stream)
        self.word_embedding = tf.keras.layers.Embedding(config.vocab_size, config.embedding_dim,
                                                        name="word_embedding")
        self.lstm = tf.keras.layers.RNN(LSTMProjectionCell(config.lstm_units, config.projection_dim),
                                        return_sequences=True, name="lstm")
        if config.softmax == "embedding":
            self.softmax_w = tf.keras.layers.Embedding(config.vocab_size, config.projection_dim, name="softmax_w")
            self.softmax_b = tf.keras.layers.Embedding(config.vocab_size, 1, embeddings_initializer="zeros",
                                                       name="softmax_b")
        self.loss_tracker = tf.keras.metrics.Mean(name="loss")
        self.build_all()

    def build_all(self):
        self(tf.zeros([1, 1], tf.int32))
        if self.config.softmax == "weights":
            with tf.name_scope(self.name):
                self.softmax_weights = self.add_weight(
                    "softmax_w", [self.config.vocab_size, self.config.projection_dim],
                    initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05))  # Embedding's default
                self.softmax_biases = self.add_weight("softmax_b", [self.config.vocab_size, 1], initializer="zeros")
            return
        for layer in (self.softmax_w, self.softmax_b):  # used through their tables only, never called
            with tf.name_scope(f"{self.name}/{layer.name}"):
                layer.build((None,))

    def softmax_tables(self):
        """The softmax matrix [V, P] and bias [V, 1] (variables, or a partitioned table's container)."""
        if self.config.softmax == "weights":
            return self.softmax_weights, self.softmax_biases
        return self.softmax_w.embeddings, self.softmax_b.embeddings

    def step_seed(self, use):
        """The stateless seed of random ``use`` (1: input dropout, 2: output dropout, 3: sampler) at this step."""
        base = tf.constant([self.seed, self.stream], tf.int64)
        fold = tf.random.experimental.stateless_fold_in
        optimizer = getattr(self, "optimizer", None)
        step = tf.cast(optimizer.iterations, tf.int64) if optimizer is not None else tf.constant(0, tf.int64)
        return fold(fold(base, step), use)

    def _dropout(self, x, use, training):
        if not training or not self.config.dropout:
            return x
        return tf.nn.experimental.stateless_dropout(x, self.config.dropout, self.step_seed(use))

    def call(self, ids, training=False):
        """Ids -> LSTM outputs [batch, steps, P]; with ``training=True`` the dropout masks follow ``step_seed``
        (step 0 before ``compile``)."""
        x = self._dropout(self.word_embedding(ids), 1, training)
        return self._dropout(self.lstm(x), 2, training)

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        ids, targets = data[0], data[1]
        with tf.GradientTape() as tape:
            hidden = self(ids, training=True)
            candidates = log_uniform_candidates(tf.reshape(tf.cast(targets, tf.int64), [-1, 1]),
                                                self.config.num_sampled, self.config.vocab_size, self.step_seed(3))
            loss = sampled_softmax_loss(*self.softmax_tables(), targets, hidden, candidates)
        variables = self.trainable_variables
        # compute_gradients (not tape.gradient) so that an optimizer wrapper that reduces gradients there, like
        # horovod's DistributedOptimizer, sees them; for plain Keras optimizers it is tape.gradient.
        grads = [g for g, _ in self.optimizer.compute_gradients(loss, variables, tape=tape)]
        lstm = [i for i, v in enumerate(variables) if any(v is w for w in self.lstm.trainable_weights)]
        clipped, _ = tf.clip_by_global_norm([grads[i] for i in lstm], self.config.clip_norm)
        for i, g in zip(lstm, clipped):
            grads[i] = g
        self.optimizer.apply_gradients(zip(grads, variables))
        self.loss_tracker.update_state(loss)
        return self._logs()

    def test_step(self, data):
        ids, targets = data[0], data[1]
        hidden = tf.reshape(self(ids, training=False), [-1, self.config.projection_dim])
        weights, biases = self.softmax_tables()
        logits = tf.matmul(hidden, tf.convert_to_tensor(weights), transpose_b=True) + tf.reshape(
            tf.convert_to_tensor(biases), [-1])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.reshape(targets, [-1]), logits))
        self.loss_tracker.update_state(loss)
        return self._logs()

    def _logs(self):
        loss = self.loss_tracker.result()
        return {"loss": loss, "perplexity": tf.exp(loss)}

    def get_config(self):
        return {"config": dataclasses.asdict(self.config), "seed": self.seed, "stream": self.stream}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return cls(LMConfig(**config["config"]), seed=config.get("seed", 0), stream=config.get("stream", 0))


def make_optimizer(config: LMConfig, learning_rate=None):
    """Adagrad at the preset's learning rate, as Parallax trained LM1B (with the config's ``global_clipnorm``)."""
    return tf.keras.optimizers.Adagrad(learning_rate or config.learning_rate, global_clipnorm=config.global_clipnorm)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def config_dict(config: LMConfig) -> Dict[str, Any]:
    return dataclasses.asdict(config)
