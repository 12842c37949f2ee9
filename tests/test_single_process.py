"""Tier 1: one process, Horovod size 1, no PS task."""

import numpy as np
import pytest
import tensorflow as tf

import kparallax as kp


@pytest.fixture(scope="module")
def strategy():
    return kp.HybridStrategy(kp.Cluster.local())


def _dense_model():
    inputs = tf.keras.Input(shape=(4,))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Dense(8, activation="relu")(inputs)))


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 4)).astype(np.float32), rng.normal(size=(64, 1)).astype(np.float32)


def test_properties(strategy):
    assert (strategy.num_workers, strategy.worker_index, strategy.is_chief) == (1, 0, True)


@pytest.mark.parametrize("name, fix", [("num_replicas_in_sync", "Use strategy.num_workers."),
                                       ("run", "train with model.fit"),
                                       ("experimental_distribute_dataset", "train with model.fit")])
def test_tf_distribute_names_say_what_to_use(strategy, name, fix):
    # A program ported from tf.distribute looks for these: an AttributeError naming kparallax's way.
    with pytest.raises(AttributeError, match=f"HybridStrategy is not a tf.distribute strategy and has no '{name}'. "
                       f"Received: strategy.{name}. .*{fix}"):
        getattr(strategy, name)


def test_other_missing_names_get_pythons_own_error(strategy):
    assert not hasattr(strategy, "num_replicas_in_sync")
    with pytest.raises(AttributeError, match="^'HybridStrategy' object has no attribute 'no_such_name'$"):
        strategy.no_such_name  # pylint: disable=pointless-statement


def test_dense_model_trains_like_plain_keras(strategy):
    x, y = _data()
    plain = _dense_model()
    init = [np.full(w.shape, 0.1 * (i + 1), np.float32) for i, w in enumerate(plain.get_weights())]
    plain.set_weights(init)
    plain.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    plain_loss = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    with strategy.scope():
        model = _dense_model()
        model.set_weights(init)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    loss = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not strategy.is_ps_variable(model.trainable_variables[0])
    assert model.evaluate(x, y, verbose=0) == pytest.approx(plain.evaluate(x, y, verbose=0), rel=1e-6)
    assert model.predict(x, verbose=0).shape == (64, 1)


def test_a_custom_training_loop_with_one_worker_trains_as_plain_keras(strategy):
    """With one worker, a tf.GradientTape loop applying the compiled model's optimizer (the one kparallax made) or an
    optimizer of its own trains as the same loop in plain Keras (several workers refuse both: test_launcher.py)."""
    x, y = _data()

    def train(model, optimizer):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        for start in range(0, 64, 16):
            step(x[start:start + 16], y[start:start + 16])
        return model.get_weights()

    init = [np.full(w.shape, 0.1 * (i + 1), np.float32) for i, w in enumerate(_dense_model().get_weights())]
    plain = _dense_model()
    plain.set_weights(init)
    expected = train(plain, tf.keras.optimizers.Adam(0.01))
    with strategy.scope():
        compiled, own = _dense_model(), _dense_model()
        compiled.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    for model in (compiled, own):
        model.set_weights(init)
    for got in (train(compiled, compiled.optimizer), train(own, tf.keras.optimizers.Adam(0.01))):
        assert not np.allclose(got[0], init[0])
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_models_outside_the_scope_are_untouched(strategy):
    model = _dense_model()
    model.compile(optimizer="sgd", loss="mse")
    assert "_kparallax_strategy" not in model.__dict__
    assert type(model.optimizer) is tf.keras.optimizers.SGD


def test_embedding_without_ps_is_a_clear_error(strategy):
    with strategy.scope():
        with pytest.raises(ValueError, match=r"must live on a parameter server .*Received: num_ps=0"):
            tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Embedding(100, 4)])


@pytest.mark.parametrize("optimizer, match", [
    ("adamm", r"Unknown optimizer 'adamm'.*Received: optimizer='adamm'"),
    (object(), r"supports tf.keras optimizers .*Received: object"),
])
def test_bad_optimizers(strategy, optimizer, match):
    with strategy.scope():
        model = _dense_model()
        with pytest.raises((ValueError, TypeError), match=match):
            model.compile(optimizer=optimizer, loss="mse")


def test_jit_compile_is_refused(strategy):
    with strategy.scope():
        model = _dense_model()
        with pytest.raises(ValueError, match="jit_compile=True is not supported"):
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)


def test_bad_strategy_arguments():
    with pytest.raises(TypeError, match="cluster must be a kparallax.Cluster"):
        kp.HybridStrategy({"ps": []})
    with pytest.raises(ValueError, match=r"connect_timeout must be > 0 seconds. Received: connect_timeout=0"):
        kp.HybridStrategy(kp.Cluster.local(), connect_timeout=0)


def test_throughput_callback_reports_a_rate(strategy):
    x, y = _data()
    with strategy.scope():
        model = _dense_model()
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                        callbacks=[kp.callbacks.Throughput(global_batch_size=8, skip_steps=2)])
    assert history.history["samples_per_sec"][0] > 0


@pytest.mark.parametrize("make, message", [
    (lambda s: kp.callbacks.Throughput(global_batch_size=0), r"global_batch_size > 0 .*Received: global_batch_size=0"),
    (lambda s: kp.callbacks.StepLogger(0, 32), r"every must be >= 1. Received: every=0."),
    (lambda s: kp.callbacks.TensorBoardScalars("/tmp/unused", every=0), r"every must be >= 1. Received: every=0."),
    (lambda s: kp.callbacks.Checkpoint(s, "/tmp/unused", every_steps=0), r"Received: every_steps=0, keep=3."),
    (lambda s: kp.callbacks.Checkpoint(s, "/tmp/unused", 5, keep=-1), r"keep >= 0 \(0: all\)"),
    (lambda s: kp.callbacks.StopAtStep(-1), r"total_steps must be >= 0. Received: total_steps=-1."),
    (lambda s: kp.callbacks.LearningRateWarmup(0.1, 0), r"Received: target=0.1, warmup_steps=0.")])
def test_callback_arguments_out_of_range_are_named(strategy, make, message):
    """Before, TensorBoardScalars(every=0) failed at the first step (ZeroDivisionError) and StopAtStep(-1) or
    Throughput(global_batch_size=0) ran on with meaningless results."""
    with pytest.raises(ValueError, match=message):
        make(strategy)


def test_assignments_are_hooked_only_while_combining():
    """The hook kparallax's step uses to combine a layer's aggregated variables over the workers: it sees assign,
    assign_add and assign_sub of Keras' and plain variables, eagerly and traced, uses the value it returns, and
    leaves every assignment outside it to TensorFlow."""
    from kparallax._compat import assign_hook  # pylint: disable=import-outside-toplevel
    layer = tf.keras.layers.Layer()
    weight = layer.add_weight("w", [], initializer="zeros", trainable=False, aggregation=tf.VariableAggregation.MEAN)
    plain = tf.Variable(1.0)
    seen = []

    def doubled(variable, method, value):
        seen.append((variable.name, method))
        return value * 2 if variable is weight else value

    @tf.function
    def step():
        weight.assign_sub(1.0)
        return weight.read_value()

    with assign_hook.combining(doubled):
        weight.assign(3.0)
        weight.assign_add(1.0)
        plain.assign(5.0)
        assert float(step()) == 6.0  # (3 * 2 + 1 * 2) - 1 * 2
    weight.assign(1.0)
    assert float(weight.numpy()) == 1.0 and float(plain.numpy()) == 5.0
    assert seen == [("w:0", "assign"), ("w:0", "assign_add"), ("Variable:0", "assign"), ("w:0", "assign_sub")]


def test_the_write_guard_sees_every_write_method_and_can_leave_one_out_or_refuse_it():
    """The hook kparallax checks the user's writes of PS variables with: assign and the scatter writes, eager and
    traced; a write left out returns the variable (or no op for read_value=False in a graph), and the value stays."""
    from kparallax._compat import assign_hook  # pylint: disable=import-outside-toplevel
    guarded, other = tf.Variable([1.0, 2.0]), tf.Variable([1.0, 2.0])
    seen = []

    def guard(variable, method):
        if variable is not guarded:
            return True
        seen.append(method)
        if method == "scatter_nd_update":
            raise ValueError("refused")
        return False

    @tf.function
    def traced():
        left_out = guarded.assign([0.0, 0.0], read_value=False)
        assert isinstance(left_out, tf.Operation) and left_out.type == "NoOp"
        guarded.scatter_add(tf.IndexedSlices(tf.constant([5.0]), tf.constant([0])))

    try:
        assign_hook.guarded(guard)
        assert guarded.assign_sub([1.0, 1.0]) is guarded
        assert guarded.scatter_update(tf.IndexedSlices(tf.constant([9.0]), tf.constant([1]))) is guarded
        traced()
        with pytest.raises(ValueError, match="refused"):
            guarded.scatter_nd_update([[0]], [7.0])
        other.assign_add([1.0, 1.0])
    finally:
        assign_hook.guarded(None)
    assert seen == ["assign_sub", "scatter_update", "assign", "scatter_add", "scatter_nd_update"]
    assert guarded.numpy().tolist() == [1.0, 2.0] and other.numpy().tolist() == [2.0, 3.0]
    guarded.assign_add([1.0, 1.0])  # no guard: TensorFlow's own
    assert guarded.numpy().tolist() == [2.0, 3.0]


def test_an_id_outside_the_table_is_explained():
    strategy = kp.HybridStrategy(kp.Cluster.local(), architecture="allreduce")
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,), dtype=tf.int32), tf.keras.layers.Embedding(10, 2),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(ValueError, match=r"The input holds id 12, outside an embedding table of 10 rows"):
            model.fit(np.array([[1, 2, 12]] * 4), np.zeros((4, 1)), batch_size=2, verbose=0)


class _BatchBudget(tf.keras.callbacks.Callback):
    """Stops this worker's training after a batch (a wall-clock budget, say)."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            self.model.stop_training = True


class _StepTimer(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.last = batch


class _BudgetTimer(_StepTimer):  # the stop in a base class's code of the user's
    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = epoch > 3


def _log_batch(batch, logs):
    return batch


@pytest.mark.parametrize("callbacks, per_batch", [
    ([], False),
    ([tf.keras.callbacks.EarlyStopping(), tf.keras.callbacks.TerminateOnNaN(), tf.keras.callbacks.CSVLogger("x"),
      tf.keras.callbacks.ModelCheckpoint("x"), kp.callbacks.StopAtStep(5), kp.callbacks.Throughput(64),
      tf.keras.callbacks.LambdaCallback(on_epoch_end=print), _StepTimer(),
      tf.keras.callbacks.LambdaCallback(on_batch_end=_log_batch)], False),
    ([_BatchBudget()], True),
    ([_BudgetTimer()], True),
    ([tf.keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batch)], False),
    ([tf.keras.callbacks.LambdaCallback(on_batch_end=print)], True),
], ids=["none", "keras_kparallax_timers_loggers", "own_batch_stop", "stop_in_own_class", "lambda_no_stop",
        "unreadable_hook"])
def test_stops_are_agreed_after_every_batch_only_if_a_users_batch_hook_may_stop(callbacks, per_batch):
    # Keras' and kparallax's callbacks stop from logs and steps that are the same on every worker, a timer or a
    # logger never stops: one allreduce per epoch agrees on stopping. A user's batch hook that may stop one worker
    # only within an epoch (its classes' code sets stop_training, or cannot be read) needs one after every batch.
    from kparallax.core import fit_callbacks  # pylint: disable=import-outside-toplevel
    assert fit_callbacks.may_stop_within_epoch(callbacks) is per_batch


class _Upkeep(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.model.layers[0].embeddings.scatter_update(tf.IndexedSlices(tf.zeros([1, 2]), tf.constant([0])))

    def on_train_batch_end(self, batch, logs=None):
        self.model.set_weights(self.model.get_weights())


class _Shrink(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.layers[0].embeddings.assign(self.model.layers[0].embeddings * 0.5)


def _shrink_weights(model):
    for weight in model.weights:
        weight.assign(weight * 0.5)


@pytest.mark.parametrize("callbacks, phases", [
    ([], set()),
    ([tf.keras.callbacks.EarlyStopping(restore_best_weights=True), tf.keras.callbacks.ReduceLROnPlateau(),
      tf.keras.callbacks.ModelCheckpoint("x"), kp.callbacks.LearningRateWarmup(0.1, 5), _StepTimer()], set()),
    ([_Upkeep()], {"epoch_begin", "batch_end"}),
    ([_Shrink()], set()),
    ([tf.keras.callbacks.LambdaCallback(on_train_begin=lambda logs: _shrink_weights)], set()),
    ([tf.keras.callbacks.LambdaCallback(on_batch_begin=print, on_epoch_begin=lambda epoch, logs: epoch)],
     {"batch_begin"}),
], ids=["none", "keras_kparallax_timers", "own_writes", "epoch_end_only", "lambda_no_write", "unreadable_hook"])
def test_workers_meet_after_the_hooks_whose_code_may_write(callbacks, phases):
    # Worker 0 alone writes PS variables between steps; the others' next step must read it, so fit's workers meet
    # after each user's hook whose code names a write (or cannot be read). Keras' and kparallax's callbacks write
    # only the optimizer's replicated learning rate, or at an epoch's end (EarlyStopping), where they always meet.
    from kparallax.core import fit_callbacks  # pylint: disable=import-outside-toplevel
    assert fit_callbacks.writing_phases(callbacks) == phases
