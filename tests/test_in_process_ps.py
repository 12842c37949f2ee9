"""Fast tier: one process holding a real in-process PS server (tf.distribute.Server) and Horovod of size 1.

Exercises placement, the registry, the Keras hooks, step building (push, the update by the last push on the PS)
and the aggregation math without the launcher. Expected values come from plain Keras in this same process.
"""

import collections
import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import weakref
import zipfile

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context as tf_context

import kparallax as kp
from kparallax._compat import optimizers as optimizer_compat
from kparallax.cluster import net
from kparallax.step import ps_sync
from programs.keras_programs import WarmUp  # a schedule class as TensorFlow's transformer tutorial writes one

VOCAB, EMB, LEN = 60, 4, 3


@pytest.fixture(scope="module")
def strategy():
    ps = f"localhost:{net.free_port()}"
    worker = f"localhost:{net.free_port()}"
    server = tf.distribute.Server(tf.train.ClusterSpec({"ps": [ps], "worker": [worker]}), job_name="ps",
                                  task_index=0, start=True)
    strategy = kp.HybridStrategy(kp.Cluster(ps=[ps], workers=[worker], task_index=0, run_id="inprocess"))
    yield strategy
    del server


def _data():
    rng = np.random.default_rng(5)
    ids = np.minimum(rng.zipf(1.5, size=(96, LEN)) - 1, VOCAB - 1).astype(np.int32)
    return ids, rng.normal(size=(96, 1)).astype(np.float32)


def _model(name, regularized=False):
    regularizer = tf.keras.regularizers.l2(1e-2) if regularized else None
    return tf.keras.Sequential([
        tf.keras.Input((LEN,), dtype=tf.int32),
        tf.keras.layers.Embedding(VOCAB, EMB, embeddings_regularizer=regularizer, name=f"{name}_embedding"),
        tf.keras.layers.Flatten(), tf.keras.layers.Dense(1, name=f"{name}_out")], name=name)


def _initial(model):
    rng = np.random.default_rng(11)
    return [rng.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()]


def _train(model, optimizer, epochs=2, **compile_kwargs):
    x, y = _data()
    model.set_weights(_initial(model))
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0).history["loss"]


@pytest.mark.parametrize("regularized", [False, True], ids=["sparse-gradient", "dense-gradient"])
def test_table_on_ps_trains_like_plain_keras(strategy, regularized):
    name = f"fast_{'reg' if regularized else 'plain'}"
    plain = _model("plain", regularized)
    expected_loss = _train(plain, tf.keras.optimizers.Adagrad(0.2))
    with strategy.scope():
        model = _model(name, regularized)
        loss = _train(model, tf.keras.optimizers.Adagrad(0.2))
    table = model.get_layer(f"{name}_embedding").embeddings
    assert strategy.is_ps_variable(table) and "/job:ps/" in table.device
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    entry = strategy.registry.entry(table)
    assert (entry.path, entry.task) == (f"{name}_embedding/embeddings", 0)
    # A regularized table's gradient is dense: added whole, no touched ids to keep.
    helpers = {"kp_accumulator", "kp_pushes", "kp_updates"} | (set() if regularized else {"kp_touched"})
    assert helpers <= set(entry.helpers)
    assert strategy.push_counts()[entry.path] == 12  # 96 / 16 per epoch, 2 epochs, one worker
    assert not entry.helpers["kp_accumulator"].numpy().any(), "each update zeroes the accumulated rows"
    if not regularized:
        assert not entry.helpers["kp_touched"].numpy().any(), "each update clears the touched ids"
    assert not _has_pushed_barrier(model), "the last push applies the update, dense gradients too: no barrier"


def test_push_counter_gives_concurrent_pushes_distinct_counts():
    """The push whose count completes a step applies its update, so two pushes at once must never see the same
    count (read after ``assign_add``, both saw the final one: a double update, seen once in four 2-worker runs).
    Eager threads interleave at every op, which makes that race certain for a non-atomic count (with
    ``assign_add`` then a read, this test saw a few hundred repeated counts). The property is the op's, so a local
    counter shows it (eager ops on a remote handle lack its shape)."""
    counter = tf.Variable(0, dtype=tf.int64)
    seen, lock = [], threading.Lock()

    def push():
        mine = [int(ps_sync.count(counter)) for _ in range(150)]
        with lock:
            seen.extend(mine)

    threads = [threading.Thread(target=push) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen) == list(range(1, 8 * 150 + 1))


def test_partitioned_table_is_whole_in_get_weights_and_shards_on_the_ps(strategy):
    with strategy.scope():
        model = _model("fast_parts")
    layer = model.get_layer("fast_parts_embedding")
    summary = [e for e in strategy.placement_summary() if e["table"] == "fast_parts_embedding/embeddings"]
    assert summary == []  # partitions=1 in this strategy: one whole variable
    assert [w.shape for w in layer.get_weights()] == [(VOCAB, EMB)]


def test_hooks_are_per_model_instance(strategy):
    keras_fit = tf.keras.Model.fit
    assert keras_fit.__module__.startswith("keras"), keras_fit.__module__
    assert tf.keras.layers.Layer.get_weights.__module__.startswith("keras")
    assert tf.keras.layers.Layer.set_weights.__module__.startswith("keras")
    plain = _model("fast_outside")
    plain.compile(optimizer="sgd", loss="mse")
    assert "fit" not in plain.__dict__ and plain.fit.__func__ is tf.keras.Model.fit
    with strategy.scope():
        inside = _model("fast_inside")
        inside.compile(optimizer="sgd", loss="mse")
    assert "fit" in inside.__dict__ and "get_weights" in inside.get_layer("fast_inside_embedding").__dict__


def _wide_deep(table=False):
    """Keras' premade WideDeepModel (a LinearModel and a DNN, over a table with ``table``), built by its first call;
    seeded initializers."""
    seeded = tf.keras.initializers.GlorotUniform
    linear = tf.keras.experimental.LinearModel(units=1, kernel_initializer=seeded(1))
    front = ([tf.keras.layers.Embedding(VOCAB, EMB, embeddings_initializer=tf.keras.initializers.RandomNormal(seed=4)),
              tf.keras.layers.GlobalAveragePooling1D()] if table else [])
    dnn = tf.keras.Sequential([*front, tf.keras.layers.Dense(4, "relu", kernel_initializer=seeded(2)),
                               tf.keras.layers.Dense(1, kernel_initializer=seeded(3))])
    return tf.keras.experimental.WideDeepModel(linear, dnn)


def test_a_wide_deep_model_compiles_outside_the_scope_and_trains_inside_with_one_optimizer(strategy):
    """Keras' WideDeepModel before its first call: compiled outside the scope while a strategy exists, it is plain
    Keras' (before: compile failed, listing the weights of its LinearModel not built yet); inside, one optimizer
    trains it as plain Keras does."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(64, 5)).astype(np.float32), rng.normal(size=(64, 1)).astype(np.float32)
    plain = _wide_deep()
    plain.compile(tf.keras.optimizers.Adam(0.01), "mse")
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = _wide_deep()
        model.compile(tf.keras.optimizers.Adam(0.01), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _wide_deep_optimizers():
    """Keras' documented pair: one optimizer for the linear part, one for the DNN (here over a table)."""
    return [tf.keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01), tf.keras.optimizers.Adagrad(0.2)]


def test_a_wide_deep_model_trains_with_a_list_of_optimizers_like_plain_keras(strategy, tmp_path):
    """compile(optimizer=[linear's, DNN's]), as Keras documents WideDeepModel: the DNN's table moves onto the PS and
    its optimizer (the last of the list) updates it there, the linear part's Ftrl updates the replicated linear
    model; weights, Ftrl's and Adagrad's slots and the logs equal plain Keras' (before: refused at compile).
    save_weights writes both optimizers' state as one process does, strategy.load_model reads model.save's file as
    Keras' load_model does; kparallax's checkpoints refuse a list.
    Asynchronous training and loss scaling are refused at compile."""
    ids, _ = _data()
    rng = np.random.default_rng(3)
    x = [rng.normal(size=(96, 5)).astype(np.float32), ids]
    y = (rng.uniform(size=(96, 1)) > 0.5).astype(np.float32)
    plain = _wide_deep(table=True)
    plain.compile(_wide_deep_optimizers(), "binary_crossentropy", metrics=["accuracy"])
    want = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    with strategy.scope():
        model = _wide_deep(table=True)
        model.compile(_wide_deep_optimizers(), "binary_crossentropy", metrics=["accuracy"])
    board = kp.callbacks.TensorBoardScalars(str(tmp_path / "board"), every=4)  # its step: the last optimizer's
    got = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    callbacks=[board, kp.callbacks.StopAtStep(100)]).history
    assert len(os.listdir(tmp_path / "board")) == 1
    table = model.dnn_model.layers[0].embeddings
    assert strategy.is_ps_variable(table)
    assert [type(o).__name__ for o in model.optimizer] == ["Ftrl", "Adagrad"]
    for got_weight, want_weight in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    linear_slots = [v.numpy() for v in model.optimizer[0].variables]
    assert len(linear_slots) > 1  # iterations, and Ftrl's accumulator and linear slot for the kernel and bias
    for got_slot, want_slot in zip(linear_slots, [v.numpy() for v in plain.optimizer[0].variables]):
        np.testing.assert_allclose(got_slot, want_slot, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer[1].iterations.numpy()) == int(plain.optimizer[1].iterations.numpy()) == 12
    after_fit = plain.get_weights()
    # Compiled again with model.optimizer (the list: each one keeps its state), then train_on_batch.
    with strategy.scope():
        model.compile(model.optimizer, "binary_crossentropy", metrics=["accuracy"])
    plain.compile(plain.optimizer, "binary_crossentropy", metrics=["accuracy"])
    for start in range(0, 48, 16):
        batch, labels = [x[0][start:start + 16], x[1][start:start + 16]], y[start:start + 16]
        np.testing.assert_allclose(model.train_on_batch(batch, labels), plain.train_on_batch(batch, labels), rtol=1e-5)
    for got_weight, want_weight in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6)

    # Keras' savers: the TensorFlow-format checkpoint holds both optimizers' state as one process's file does (the
    # DNN's Adagrad with the table's slots joined from the PS): a plain model loading it trains on as plain Keras
    # does, and one given the weights alone (.h5) does not. kparallax's own checkpoints refuse a list, writing nothing.
    model.save_weights(str(tmp_path / "ck"))
    model.save_weights(str(tmp_path / "w.h5"))
    with pytest.raises(ValueError, match=r"list of optimizers: Keras' savers support it for Keras' WideDeepModel .*"
                                         r"Received: a kparallax checkpoint .*optimizer=\['Ftrl', 'Adagrad'\]"):
        kp.checkpoint.save(strategy, model, str(tmp_path / "kp"))
    with pytest.raises(ValueError, match=r"Received: a kparallax.callbacks.Checkpoint in fit"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[kp.callbacks.Checkpoint(strategy, str(tmp_path / "kp"), every_steps=2)])
    assert not (tmp_path / "kp").exists()
    resumed, weights_only = _wide_deep(table=True), _wide_deep(table=True)
    for fresh, path in ((resumed, "ck"), (weights_only, "w.h5")):
        fresh.compile(_wide_deep_optimizers(), "binary_crossentropy")
        fresh([part[:1] for part in x])
        fresh.load_weights(str(tmp_path / path))
        fresh.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for got_weight, want_weight in zip(resumed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6)
    assert max(np.max(np.abs(a - b)) for a, b in zip(weights_only.get_weights(), plain.get_weights())) > 1e-3
    # model.save writes what plain Keras writes, and strategy.load_model trains on from it as Keras' load_model does
    # (Keras 2.15's .keras loader restores no state into a list of optimizers: both start fresh).
    model.save(str(tmp_path / "m.keras"))
    loaded, reference = strategy.load_model(str(tmp_path / "m.keras")), tf.keras.models.load_model(
        str(tmp_path / "m.keras"))
    assert strategy.is_ps_variable(loaded.dnn_model.layers[0].embeddings)
    for trained in (loaded, reference):
        trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for got_weight, want_weight in zip(loaded.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6)

    # architecture="ps": the linear part's Ftrl would update PS variables; refused at the first step with the rule
    # that keeps them replicated, which then trains like plain Keras.
    on_ps = kp.HybridStrategy(strategy.cluster, architecture="ps")
    with on_ps.scope():
        refused = _wide_deep(table=True)
        refused.compile(_wide_deep_optimizers(), "binary_crossentropy", metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"A second optimizer \(Ftrl\) updates PS variables.*placement="
                                         r"\{'wide_deep_model_\d+/linear_model_\d+/\.\*': 'replicated'\}"):
        refused.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ruled = kp.HybridStrategy(strategy.cluster, architecture="ps",
                              placement={r"wide_deep_model_\d+/linear_model_\d+/.*": "replicated"})
    with ruled.scope():
        model = _wide_deep(table=True)
        model.compile(_wide_deep_optimizers(), "binary_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert ruled.is_ps_variable(model.dnn_model.layers[-1].kernel)
    for got_weight, want_weight in zip(model.get_weights(), after_fit):
        np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6)

    asynchronous = kp.HybridStrategy(strategy.cluster, sync=False)
    with asynchronous.scope():
        with pytest.raises(ValueError, match=r"list of optimizers is not supported with sync=False.*"
                                             r"Received: optimizer=\['Ftrl', 'Adagrad'\]"):
            _wide_deep(table=True).compile(_wide_deep_optimizers(), "mse")
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            scaled = _wide_deep(table=True)
            with pytest.raises(ValueError, match=r"list of optimizers with loss scaling .*'mixed_float16'"):
                scaled.compile(_wide_deep_optimizers(), "mse")
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    with strategy.scope():
        with pytest.raises(ValueError, match=r"empty list of optimizers"):
            _wide_deep(table=True).compile([], "mse")
        shared = tf.keras.optimizers.Adam(0.01)
        with pytest.raises(ValueError, match=r"same optimizer instance appears twice.*Received: optimizer="
                                             r"\['Adam', 'Adam'\]"):
            _wide_deep(table=True).compile([shared, shared], "mse")


@pytest.mark.parametrize("case", ["partitions_3", "steps_per_execution_3", "backward_passes_2", "allreduce"])
def test_a_wide_deep_model_with_a_list_of_optimizers_trains_like_plain_keras_under_other_options(strategy, case):
    """The list of optimizers beside a table in 3 stripes, Keras' multi-step executions, accumulation (2
    micro-batches of 16 per update: one process trains on batches of 32) and the allreduce architecture (the table
    replicated, its rows allgathered)."""
    ids, _ = _data()
    rng = np.random.default_rng(4)
    x = [rng.normal(size=(96, 5)).astype(np.float32), ids]
    y = (rng.uniform(size=(96, 1)) > 0.5).astype(np.float32)
    options = {"partitions_3": {"partitions": 3}, "backward_passes_2": {"backward_passes_per_step": 2},
               "allreduce": {"architecture": "allreduce"}}.get(case, {})
    plain = _wide_deep(table=True)
    plain.compile(_wide_deep_optimizers(), "binary_crossentropy")
    plain.fit(x, y, batch_size=32 if case == "backward_passes_2" else 16, epochs=2, shuffle=False, verbose=0)
    scoped = kp.HybridStrategy(strategy.cluster, **options)
    with scoped.scope():
        model = _wide_deep(table=True)
        model.compile(_wide_deep_optimizers(), "binary_crossentropy",
                      steps_per_execution=3 if case == "steps_per_execution_3" else 1)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    table = model.dnn_model.layers[0].trainable_weights  # the table, or its stripes
    assert [scoped.is_ps_variable(v) for v in table] == [case != "allreduce"] * (3 if case == "partitions_3" else 1)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _stateful_lstm():
    return tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32, batch_size=16),
                                tf.keras.layers.Embedding(VOCAB, EMB), tf.keras.layers.LSTM(3, stateful=True),
                                tf.keras.layers.Dense(1)])


def test_a_stateful_rnn_keeps_its_state_on_each_worker_under_the_ps_architecture(strategy):
    """Under architecture="ps" every trainable variable goes to a PS task; a stateful LSTM's state variables are
    trainable by tf.Variable's default though no optimizer trains them, and they hold each worker's own rows: they
    stay replicated (before, shared on the PS, every worker overwrote the others' state: 2.4e-4 off one process on
    2 workers, silently). Trains like plain Keras."""
    x, y = _data()
    plain = _stateful_lstm()
    plain.set_weights(_initial(plain))
    plain.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    parted = kp.HybridStrategy(strategy.cluster, architecture="ps")
    with parted.scope():
        model = _stateful_lstm()
        model.set_weights(_initial(model))
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    lstm = model.layers[1]
    assert all(parted.is_ps_variable(v) for v in lstm.trainable_weights)
    assert lstm.states and not any(parted.is_ps_variable(v) for v in lstm.states)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_compiling_a_model_with_ps_variables_outside_the_scope_is_refused(strategy):
    with strategy.scope():
        model = _model("fast_refused")
    with pytest.raises(ValueError, match="compiled outside the scope"):
        model.compile(optimizer="sgd", loss="mse")


def _rnn(name):
    """A generic RNN over an LSTMCell: the cell reads its kernels inside the loop over time steps."""
    return tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                tf.keras.layers.RNN(tf.keras.layers.LSTMCell(5), name=f"{name}_rnn"),
                                tf.keras.layers.Dense(1)], name=name)


def _step_graph(model):
    """The graph of the model's traced train step (its own: the update's branches and loops are nested in it)."""
    batches = iter(tf.data.Dataset.from_tensor_slices(_data()).batch(16))
    return model.train_tf_function.get_concrete_function(batches).graph


def _traced_ops(model):
    """(op, inside a while-loop body) for every op of the model's traced train step, nested graphs too."""
    pending = [(_step_graph(model), False)]
    while pending:
        graph, in_loop = pending.pop()
        for op in graph.get_operations():
            yield op, in_loop
            for attr in ("body", "cond", "then_branch", "else_branch"):
                try:
                    nested = graph._get_function(op.get_attr(attr).name).graph  # pylint: disable=protected-access
                except (ValueError, AttributeError, TypeError):
                    continue
                pending.append((nested, in_loop or (op.type in ("While", "StatelessWhile") and attr == "body")))


def _reads_in_loops(model):
    """ReadVariableOps inside the while-loop bodies of the model's traced train step."""
    return sum(in_loop and op.type == "ReadVariableOp" for op, in_loop in _traced_ops(model))


def _has_pushed_barrier(model):
    """Whether the traced train step has the barrier after which worker 0 applies dense gradients of PS variables."""
    return any(op.name.startswith("kp_ps_pushed/") or "/kp_ps_pushed/" in op.name for op, _ in _traced_ops(model))


def test_architecture_ps_reads_each_dense_ps_variable_once_per_step_and_trains_exactly(strategy):
    ps_strategy = kp.HybridStrategy(strategy.cluster, architecture="ps")
    plain = _rnn("plain_rnn")
    expected_loss = _train(plain, tf.keras.optimizers.SGD(0.1), epochs=1)
    with ps_strategy.scope():
        model = _rnn("fast_rnn")
        loss = _train(model, tf.keras.optimizers.SGD(0.1), epochs=1)
    assert ps_strategy.is_ps_variable(model.get_layer("fast_rnn_rnn").cell.kernel)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert _reads_in_loops(plain) > 0, "plain Keras reads the kernels inside the loop: the check is not vacuous"
    assert _reads_in_loops(model) == 0


class _Recomputed(tf.keras.layers.Layer):
    """A Dense layer under ``tf.recompute_grad``: its forward pass runs with the tapes stopped, its gradient
    recomputes it under a tape of its own."""

    def build(self, shape):
        self.dense = tf.keras.layers.Dense(4, activation="tanh")
        self.dense.build(shape)

    def call(self, x):
        return tf.recompute_grad(self.dense)(x)


class _TwoTapes(tf.keras.Model):
    """A step summing the gradients of two losses, each taken by its own tape (the second one opened after the
    first read every weight)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as first:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = first.gradient(loss, self.trainable_variables)
        with tf.GradientTape() as second:
            penalty = 0.5 * tf.reduce_mean(tf.abs(self(x, training=True) - y))
        more = second.gradient(penalty, self.trainable_variables)
        self.optimizer.apply_gradients(zip([tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
                                            for a, b in zip(grads, more)], self.trainable_variables))
        return {"loss": loss}


def _recomputed(name):
    ids = tf.keras.Input((LEN,), dtype=tf.int32)
    pooled = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB)(ids))
    return tf.keras.Model(ids, tf.keras.layers.Dense(1)(_Recomputed()(pooled)), name=name)


def _two_tapes(name):
    ids = tf.keras.Input((LEN,), dtype=tf.int32)
    pooled = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB)(ids))
    return _TwoTapes(ids, tf.keras.layers.Dense(1)(tf.keras.layers.Dense(4, activation="tanh")(pooled)), name=name)


@pytest.mark.parametrize("build", [_recomputed, _two_tapes], ids=["recompute_grad", "two-tapes"])
def test_a_dense_ps_variable_s_one_read_reaches_every_tape_of_the_step(strategy, build):
    """The step's one read of a dense PS variable is recorded on every tape that reads it, whenever the read was
    made. Before: made under ``tf.recompute_grad``'s forward (tapes stopped), or before a second tape was opened, it
    reached no later tape: the recomputed Dense layer's weights got a zero gradient and never moved (0.16 off plain
    Keras after 2 epochs, silently), and a second tape's gradients were None (``ValueError: None values not
    supported``)."""
    ps_strategy = kp.HybridStrategy(strategy.cluster, architecture="ps")
    plain = build(f"plain_{build.__name__}")
    expected_loss = _train(plain, tf.keras.optimizers.SGD(0.1))
    with ps_strategy.scope():
        model = build(f"ps_{build.__name__}")
        loss = _train(model, tf.keras.optimizers.SGD(0.1))
    assert all(ps_strategy.is_ps_variable(v) for v in model.trainable_variables)
    for got, want, start in zip(model.get_weights(), plain.get_weights(), _initial(plain)):
        assert np.abs(want - start).max() > 1e-3, "every weight moves in plain Keras: the check is not vacuous"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def _batch_gathers(model):
    """The traced train step's gathers whose ids are the batch's own (through casts and reshapes): a row fetched
    once per occurrence of its id."""
    def source(tensor):
        while tensor.op.type in ("Cast", "Reshape", "Identity") and tensor.op.inputs:
            tensor = tensor.op.inputs[0]
        return tensor.op.type
    gathers = [op for op, _ in _traced_ops(model) if op.type == "ResourceGather"]
    return [op for op in gathers if source(op.inputs[1]) in ("IteratorGetNext", "Placeholder")]


def test_a_step_fetches_each_distinct_row_once_and_its_update_reads_nothing_from_the_worker(strategy):
    """The batch (Zipf ids: each of 16 rows x 3 ids repeats some) fetches each distinct row of the PS table once;
    the gradient is TensorFlow's gather's (a slice per id, repeats included), so the weights equal plain Keras' with
    ``clipvalue``, which clips each slice. The update on the PS (a branch taken by the step's last push) reads the
    learning rate and step count from copies made on the PS before it: a value of the worker's read in the branch
    would cross only after the branch's predicate had crossed from the PS to the worker."""
    plain = _model("plain_distinct")
    expected_loss = _train(plain, tf.keras.optimizers.Adam(0.05, clipvalue=0.01))
    with strategy.scope():
        model = _model("fast_distinct")
        loss = _train(model, tf.keras.optimizers.Adam(0.05, clipvalue=0.01))
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert len(_batch_gathers(plain)) == 1, "plain Keras gathers by the batch's ids: the check is not vacuous"
    assert _batch_gathers(model) == []
    updates = [op for op, _ in _traced_ops(model) if op.type in ("If", "StatelessIf") and "/job:ps/" in op.device]
    assert updates
    for op in updates:
        assert not [x.op.name for x in op.inputs if "/job:worker/" in x.op.device], op.name


def _crossing(model):
    """The worker's tensors the traced train step's ops on the PS task read (each a message per step)."""
    ops = _step_graph(model).get_operations()
    return {x.name: x for op in ops if "/job:ps/" in op.device for x in op.inputs
            if "/job:ps/" not in x.op.device and x.dtype != tf.resource}


def test_a_table_s_push_sends_the_ids_its_pull_sent_and_the_update_s_scalars_cross_as_one(strategy):
    """One table on the PS, Adam: what crosses to the PS task per step is the batch's distinct ids (once: the pull
    of their rows and the push of their summed gradients send the same tensor), the summed gradient rows, and the
    learning rate with the step count packed into one tensor. Training equals plain Keras (Adam's bias correction
    reads the step count; the rate is the user's)."""
    plain = _model("plain_crossing")
    expected_loss = _train(plain, tf.keras.optimizers.Adam(0.05))
    with strategy.scope():
        model = _model("fast_crossing")
        loss = _train(model, tf.keras.optimizers.Adam(0.05))
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    crossing = _crossing(model)
    assert sorted(x.op.type for x in crossing.values()) == ["Pack", "Unique", "UnsortedSegmentSum"], crossing
    ops = _step_graph(model).get_operations()
    pull = [op for op in ops if op.type == "ResourceGather"]  # (placed by the table's colocation)
    push = [op for op in ops if op.type == "ResourceScatterAdd"]
    assert len(pull) == 1 and len(push) == 1, (pull, push)
    assert pull[0].inputs[1] is push[0].inputs[1]


def test_what_a_traced_step_caches_dies_with_its_graph():
    """The reads and distinct ids ``cached_reads`` keeps per traced graph do not keep that graph (every op of a
    train step) alive once its function is gone: a script training models one after another, or retracing, would
    hold every one (before, a dict keyed weakly by the graph held it through its values)."""
    from kparallax.step import cached_reads  # pylint: disable=import-outside-toplevel
    table = tf.Variable(tf.random.normal([10, 4]))
    graphs = []

    def trace():
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32)])
        def step(ids):
            graphs.append(weakref.ref(tf.compat.v1.get_default_graph()))
            with tf.GradientTape() as tape:
                rows = cached_reads.gather_policy(table, ids, table.sparse_read)
                dense = cached_reads.policy(table, table.read_value)
            grad = tape.gradient(rows, table)
            assert cached_reads.distinct(grad.indices) is not None  # (what the step keeps, so the check is not void)
            return tf.reduce_sum(rows) + tf.reduce_sum(dense)

        step.get_concrete_function()

    trace()
    gc.collect()
    assert graphs and graphs[0]() is None


def _two_tables(name):
    ids = tf.keras.Input((LEN,), dtype=tf.int32)
    both = tf.keras.layers.Add()([tf.keras.layers.Embedding(VOCAB, EMB, name=f"{name}_{k}")(ids) for k in "ab"])
    return tf.keras.Model(ids, tf.keras.layers.Dense(1, name=f"{name}_out")(tf.keras.layers.Flatten()(both)),
                          name=name)


def _sent_to_ps(model):
    """{dtype: count} of the tensors a step of ``model`` sends from the worker to the PS task, as TensorFlow runs it
    (its partitioned graphs, after Grappler's rewrites: the run's metadata)."""
    x, y = _data()
    tf_context.context().enable_run_metadata()
    try:
        model.train_on_batch(x[:16], y[:16])
        metadata = tf_context.context().export_run_metadata()
    finally:
        tf_context.context().disable_run_metadata()
    sent = collections.Counter()
    for function in metadata.function_graphs:
        for partition in function.partition_graphs:
            for node in partition.node:
                if (node.op in ("_Send", "_HostSend") and "/job:ps/" in node.attr["recv_device"].s.decode()
                        and "/job:ps/" not in node.attr["send_device"].s.decode()):
                    sent[tf.dtypes.as_dtype(node.attr["T"].type).name] += 1
    return dict(sent)


def test_two_striped_tables_looked_up_by_the_same_ids_send_them_once_per_stripe(strategy):
    """Two tables in 3 stripes each (one PS task), looked up by the same ids (a sampled softmax's weights and
    biases): per stripe one ids tensor crosses, for both tables' pulls and pushes, beside each table's rows and one
    tensor of learning rate and step count. Training equals plain Keras."""
    plain = _two_tables("plain_same_ids")
    expected_loss = _train(plain, tf.keras.optimizers.Adagrad(0.2))
    with kp.HybridStrategy(strategy.cluster, partitions=3).scope():
        model = _two_tables("fast_same_ids")
        loss = _train(model, tf.keras.optimizers.Adagrad(0.2))
        for got, want in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
        sent = _sent_to_ps(model)  # (a step more)
    assert sent == {"int64": 3, "float32": 6, "float64": 1}, sent


def test_the_step_waits_for_the_updates_of_a_ps_task_through_one_tensor(strategy):
    """Two tables on the one PS task: the step's end (``kp_step_done``) waits for both updates' tokens, combined on
    the PS task, so one tensor crosses from it (a message per crossing), not one per table. Training equals plain
    Keras."""
    plain = _two_tables("plain_two")
    expected_loss = _train(plain, tf.keras.optimizers.Adagrad(0.2))
    with strategy.scope():
        model = _two_tables("fast_two")
        loss = _train(model, tf.keras.optimizers.Adagrad(0.2))
    assert all(strategy.is_ps_variable(model.get_layer(f"fast_two_{k}").embeddings) for k in "ab")
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    crossing = {x.op.name for op, _ in _traced_ops(model) if "kp_step_done" in op.name and "/job:ps/" not in op.device
                for x in op.inputs if "/job:ps/" in x.op.device}  # (the worker's ops have no device set here)
    assert len(crossing) == 1, crossing


@pytest.mark.parametrize("architecture", ["ps", "hybrid"])
def test_steps_per_execution_trains_like_plain_keras(strategy, architecture):
    """compile(steps_per_execution=4), 6 steps per epoch (the second call of each epoch runs 2): kparallax runs N
    one-step calls per execution, so the dense PS variables (ps architecture) are read in every step (Keras' own
    in-graph loop would read them once before it: 0.093 off plain Keras here)."""
    other = kp.HybridStrategy(strategy.cluster, architecture=architecture)
    plain = _model("plain_spe")
    expected_loss = _train(plain, tf.keras.optimizers.SGD(0.1))
    with other.scope():
        model = _model(f"fast_spe_{architecture}")
        loss = _train(model, tf.keras.optimizers.SGD(0.1), steps_per_execution=4)
    assert other.is_ps_variable(model.layers[-1].kernel) == (architecture == "ps")
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def test_fit_after_restore_continues_the_epoch_its_step_and_its_metric_averages(strategy, tmp_path):
    """Checkpoint every 4 steps, stop at step 10 (inside epoch 2 of 6-step epochs), restore step 8 and fit again:
    weights and the epoch logs of epochs 2 and 3 equal plain Keras' unbroken 3-epoch run (epoch 2's averages
    include steps 7-8, which only the restored metric states carry)."""
    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
    plain = _model("plain_resume")
    plain.set_weights(_initial(plain))
    plain.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="mse", metrics=["mae"])
    expected = plain.fit(data, steps_per_epoch=6, epochs=3, verbose=0).history
    with strategy.scope():
        model = _model("fast_resume")
        model.set_weights(_initial(model))
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="mse", metrics=["mae"])
        saver = kp.callbacks.Checkpoint(strategy, str(tmp_path), every_steps=4)
        model.fit(data, steps_per_epoch=6, epochs=3, verbose=0, callbacks=[kp.callbacks.StopAtStep(10), saver])
        assert int(model.optimizer.iterations.numpy()) == 10
        meta = kp.checkpoint.restore(strategy, model, str(tmp_path / "ckpt-8"), continue_fit=True)
        assert meta["step"] == 8 and int(model.optimizer.iterations.numpy()) == 8
        history = model.fit(data.skip(8), steps_per_epoch=6, epochs=3, verbose=0,
                            callbacks=[kp.callbacks.Checkpoint(strategy, str(tmp_path), every_steps=4)])
    assert int(model.optimizer.iterations.numpy()) == 18 and history.epoch == [1, 2]
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], expected[key][1:], rtol=1e-5, err_msg=key)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_damaged_checkpoint_is_named_with_the_one_to_resume_from(strategy, tmp_path):
    """Checkpoints are written atomically, but a disk or a hand can still damage one: each damage is one ValueError
    naming the file and the latest other checkpoint (before: BadZipFile, KeyError or JSONDecodeError tracebacks),
    raised before anything of the model is set, and following the fix resumes from it."""
    x, y = _data()
    with strategy.scope():
        model = _model("fast_damaged")
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[kp.callbacks.Checkpoint(strategy, str(tmp_path), every_steps=2)])
        newest = kp.checkpoint.latest(str(tmp_path))
        steps = sorted(int(p.name[5:]) for p in tmp_path.glob("ckpt-*"))
        assert newest == str(tmp_path / f"ckpt-{steps[-1]}") and len(steps) == 3
        fix = (rf'To resume from ckpt-{steps[-2]}, move {newest} away and write \{{"latest": "ckpt-{steps[-2]}", '
               rf'"step": {steps[-2]}\}} into {tmp_path}/checkpoint.json\. Received: {newest}\.')
        state = tmp_path / f"ckpt-{steps[-1]}" / "state.npz"
        whole = state.read_bytes()
        last = f"weight_{len(model.get_weights()) - 1}"  # read after every other weight
        with zipfile.ZipFile(state) as archive:
            member = archive.getinfo(f"{last}.npy")
        end = member.header_offset + 30 + len(member.filename) + len(member.extra) + member.compress_size
        damages = {"truncated": (whole[:len(whole) // 2], r"its state.npz cannot be read \(BadZipFile: File is not a "
                                                          r"zip file\)"),
                   "overwritten": (whole[:end - 8] + b"\xff" * 8 + whole[end:],
                                   rf"its state.npz \({last}\) cannot be read \(BadZipFile: Bad CRC-32")}
        # The model holds the checkpoint before: a damaged one's error leaves it so (before: the weights read before
        # the damaged array were set).
        kp.checkpoint.restore(strategy, model, str(tmp_path / f"ckpt-{steps[-2]}"))
        held = [v.numpy() for v in model.variables + model.optimizer.variables]
        for name, (damaged, reason) in damages.items():
            state.write_bytes(damaged)
            with pytest.raises(ValueError, match=rf"Checkpoint {newest} is damaged: {reason}.*{fix}"):
                kp.checkpoint.restore(strategy, model, newest)
            for value, variable in zip(held, model.variables + model.optimizer.variables):
                np.testing.assert_array_equal(variable.numpy(), value, err_msg=f"{name}: {variable.name}")
        state.write_bytes(whole)
        meta = tmp_path / f"ckpt-{steps[-1]}" / "meta.json"
        meta.write_text('{"step": ')
        with pytest.raises(ValueError, match=rf"its meta.json cannot be read \(JSONDecodeError: .*{fix}"):
            kp.checkpoint.restore(strategy, model, newest)
        (tmp_path / "checkpoint.json").write_text("[]")
        with pytest.raises(ValueError, match=rf"The checkpoint pointer {tmp_path}/checkpoint.json cannot be read "
                                             rf"\(a JSON list, not an object\)\. To resume from ckpt-{steps[-1]}, write"):
            kp.checkpoint.latest(str(tmp_path))
        os.rename(tmp_path / f"ckpt-{steps[-1]}", tmp_path.parent / f"{tmp_path.name}-moved-away")  # the fix
        (tmp_path / "checkpoint.json").write_text(json.dumps({"latest": f"ckpt-{steps[-2]}", "step": steps[-2]}))
        assert kp.checkpoint.restore(strategy, model, kp.checkpoint.latest(str(tmp_path)))["step"] == steps[-2]
        assert int(model.optimizer.iterations.numpy()) == steps[-2]


def _constrained(name, constraint):
    return tf.keras.Sequential([
        tf.keras.Input((LEN,), dtype=tf.int32),
        tf.keras.layers.Embedding(VOCAB, EMB, embeddings_constraint=constraint, name=f"{name}_embedding"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(1, kernel_constraint=tf.keras.constraints.NonNeg(), name=f"{name}_out")], name=name)


def test_row_wise_constraints_of_a_partitioned_table_train_like_plain_keras(strategy):
    parted = kp.HybridStrategy(strategy.cluster, partitions=3)
    binding = {"MaxNorm": lambda table: np.linalg.norm(table, axis=1).max() == pytest.approx(0.5),  # rows clipped
               "NonNeg": lambda table: table.min() == 0.0}  # entries clipped
    for constraint in (tf.keras.constraints.MaxNorm(0.5, axis=1), tf.keras.constraints.NonNeg()):
        plain = _constrained("plain_constrained", constraint)
        expected_loss = _train(plain, tf.keras.optimizers.Adam(0.05))
        with parted.scope():
            model = _constrained("fast_constrained", constraint)
            loss = _train(model, tf.keras.optimizers.Adam(0.05))
        assert len(model.get_layer("fast_constrained_embedding").weights) == 3  # the table is partitioned
        for got, want in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
        assert binding[type(constraint).__name__](plain.get_layer("plain_constrained_embedding").get_weights()[0])


def test_ids_outside_a_partitioned_table_are_named_as_one_process_names_them(strategy):
    """A shard sees row id // 3 of its 20: without the check, TensorFlow's error named that row and 20 rows."""
    x, y = _data()
    bad = x.copy()
    bad[37, 1] = 70
    plain = _model("plain_ids")
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"= 70 is not in \[0, 60\)"):
        plain.fit(bad, y, batch_size=16, verbose=0)
    with kp.HybridStrategy(strategy.cluster, partitions=3).scope():
        model = _model("fast_ids")
        model.compile(optimizer="sgd", loss="mse")
    assert len(model.get_layer("fast_ids_embedding").weights) == 3
    for value in (70, -3, 60):
        bad[37, 1] = value
        for run in (lambda: model.fit(bad, y, batch_size=16, verbose=0), lambda: model.evaluate(bad, y, verbose=0),
                    lambda: model.predict(bad, verbose=0)):
            with pytest.raises(ValueError, match=rf"holds id {value}, outside an embedding table of 60 rows"):
                run()
    model.fit(x, y, batch_size=16, verbose=0)  # ids in [0, 60) train


class _SafeLookup(tf.keras.Model):
    """Averages the rows of each example's ids with tf.nn.safe_embedding_lookup_sparse, which drops negative ids."""

    def __init__(self, name):
        super().__init__(name=name)
        self.embedding = tf.keras.layers.Embedding(VOCAB, EMB, name=f"{name}_embedding")
        self.out = tf.keras.layers.Dense(1, name=f"{name}_out")

    def build(self, input_shape):
        self.embedding.build(input_shape)
        super().build(input_shape)

    def call(self, ids):
        ids = tf.cast(ids, tf.int64)
        sparse = tf.SparseTensor(tf.where(tf.ones_like(ids, tf.bool)), tf.reshape(ids, [-1]), tf.shape(ids, tf.int64))
        return self.out(tf.nn.safe_embedding_lookup_sparse(self.embedding.embeddings, sparse, combiner="mean"))


def test_safe_sparse_lookups_of_a_partitioned_table_drop_negative_ids_as_one_process(strategy):
    x, y = _data()
    x = np.where(x % 4 == 3, -1, x)  # -1: no id here
    results = []
    for name, scope in (("plain_safe", contextlib.nullcontext()),
                        ("fast_safe", kp.HybridStrategy(strategy.cluster, partitions=3).scope())):
        with scope:
            model = _SafeLookup(name)
            model.build((None, LEN))
            model.set_weights(_initial(model))
            model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="mse")
        loss = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
        results.append((model, loss))
    (plain, expected), (model, loss) = results
    assert len(model.embedding.weights) == 3 and (x == -1).sum() > 20
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("constraint", [tf.keras.constraints.MaxNorm(0.5), tf.keras.constraints.UnitNorm(axis=0),
                                        lambda table: table / tf.reduce_max(table)], ids=["maxnorm", "unitnorm", "lambda"])
def test_a_constraint_across_rows_of_a_partitioned_table_is_refused(strategy, constraint):
    parted = kp.HybridStrategy(strategy.cluster, partitions=3)
    with parted.scope(), pytest.raises(ValueError, match="may read across rows.*'ps:1'"):
        _constrained("fast_spanning", constraint)
    with kp.HybridStrategy(strategy.cluster, partitions=3,
                           placement={"fast_whole_embedding/embeddings": "ps:1"}).scope():
        model = _constrained("fast_whole", constraint)  # one piece: the constraint sees the whole table
    assert len(model.get_layer("fast_whole_embedding").weights) == 1


@pytest.mark.parametrize("options", [{"architecture": "allreduce"}, {"partitions": 1}, {"partitions": 3}],
                         ids=["replicated", "table-on-ps", "table-in-3-shards"])
def test_use_ema_trains_like_plain_keras(strategy, options):
    """Moving averages of replicated and PS variables, overwritten every 3 steps and at the end of fit."""
    optimizer = lambda: tf.keras.optimizers.Adam(0.05, use_ema=True, ema_overwrite_frequency=3)  # noqa: E731
    plain = _model("plain_ema")
    expected_loss = _train(plain, optimizer())
    with kp.HybridStrategy(strategy.cluster, **options).scope():
        model = _model(f"fast_ema_{'_'.join(f'{k}{v}' for k, v in options.items())}")
        loss = _train(model, optimizer())
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    unaveraged = _model("plain_no_ema")
    _train(unaveraged, tf.keras.optimizers.Adam(0.05))
    assert not np.allclose(unaveraged.get_weights()[0], plain.get_weights()[0], atol=1e-3)  # the averages matter


def test_eager_training_of_ps_variables_is_refused_before_any_update(strategy):
    """run_eagerly (a compile argument or the model's property) and tf.config.run_functions_eagerly: one clear
    error (before, TensorFlow's 'Handle has no shape/type information' from the push counter), weights untouched."""
    x, y = _data()
    with strategy.scope():
        model = _model("eager")
        model.set_weights(_initial(model))
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
        with pytest.raises(ValueError, match=r"cannot train eagerly under HybridStrategy.*Received: run_eagerly=True"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        for a, b in zip(model.get_weights(), _initial(model)):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="cannot train eagerly"):
            model.train_on_batch(x[:16], y[:16])
        model.run_eagerly = False
        tf.config.run_functions_eagerly(True)
        try:
            with pytest.raises(ValueError, match="cannot train eagerly"):
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        finally:
            tf.config.run_functions_eagerly(False)
        assert np.isfinite(model.fit(x, y, batch_size=16, epochs=1, verbose=0).history["loss"][0])


class _SecondOptimizerOnTable(tf.keras.Model):
    """A custom train_step whose second optimizer updates the PS table."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.head = tf.keras.layers.Dense(1)
        self.second = tf.keras.optimizers.SGD(0.1)

    def call(self, ids):
        return self.head(tf.reduce_sum(self.table(ids), axis=1))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - y))
        self.second.apply_gradients(zip(tape.gradient(loss, self.table.trainable_variables),
                                        self.table.trainable_variables))
        return {"loss": loss}


def test_a_second_optimizer_updating_ps_variables_is_refused(strategy):
    x, y = _data()
    with strategy.scope():
        model = _SecondOptimizerOnTable()
        model(x[:1])
        model.compile(optimizer="sgd")
        with pytest.raises(ValueError, match=r"A second optimizer \(SGD\) updates PS variables.*Received: "
                                             r"SGD.apply_gradients with PS variable\(s\)"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)


class _DecayedInStep(tf.keras.Sequential):
    """A decay of the table written by hand after the optimizer's update, in the training step."""

    def train_step(self, data):
        logs = super().train_step(data)
        table = self.layers[0].embeddings
        table.assign_sub(0.01 * table)
        return logs


class _PaddingRowZeroed(tf.keras.layers.Embedding):
    """A layer's call writing its own table: the padding row zeroed before each lookup."""

    def call(self, inputs):
        self.embeddings.scatter_update(tf.IndexedSlices(tf.zeros([1, self.output_dim]), tf.constant([0])))
        return super().call(inputs)


@pytest.mark.parametrize("case", ["train_step", "layer_call"])
def test_a_ps_variable_written_in_the_training_step_is_refused_before_any_update(strategy, case):
    """Every worker's step would write the one copy on the PS (and apart from the update the step's last push
    applies): refused when the step is traced, naming the variable, the write and the fixes (with its path)."""
    x, y = _data()
    name = f"written_{case}"
    with strategy.scope():
        if case == "train_step":
            model = _DecayedInStep(_model(name).layers, name=name)
        else:
            model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32),
                                         _PaddingRowZeroed(VOCAB, EMB, name=f"{name}_embedding"),
                                         tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)], name=name)
        model.compile(optimizer="sgd", loss="mse")
        before = model.get_weights()
        method = "assign_sub" if case == "train_step" else "scatter_update"
        with pytest.raises(ValueError, match=rf"PS variable '{name}_embedding/embeddings:0' is written in the "
                                             rf"training step \({method} .*Received: {method} of a PS variable in the "
                                             rf"step.*placement=\{{'{name}_embedding/embeddings': 'replicated'\}}"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    for was, now in zip(before, model.get_weights()):
        np.testing.assert_array_equal(was, now)


class _HalvedEachEpoch(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        table = self.model.layers[0].embeddings
        table.assign(table * 0.5)


def _fits_like_plain_keras(strategy, name, callback, batch_size, epochs):
    """Fits the test model with ``callback()`` in plain Keras and under ``strategy``; asserts equal weights."""
    x, y = _data()
    models = []
    for scope, prefix in ((contextlib.nullcontext(), "plain"), (strategy.scope(), "kp")):
        with scope:
            model = _model(f"{prefix}_{name}")
            model.set_weights(_initial(model))
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
            model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback()])
        models.append(model)
    for want, got in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_callback_writing_a_table_between_steps_trains_like_plain_keras(strategy):
    """One worker: the user's write between steps is made as in one process (with several, by worker 0 alone, the
    workers meeting after it: test_keras_programs' callback_writes)."""
    _fits_like_plain_keras(strategy, "halved", _HalvedEachEpoch, batch_size=16, epochs=2)


class _ScaledEachBatch(tf.keras.callbacks.Callback):
    """Scales the table by 2 or 0.5 after each batch: with ``assign``, or the whole model with ``set_weights``."""

    def __init__(self, write):
        super().__init__()
        self.calls, self.write = 0, write

    def on_train_batch_end(self, batch, logs=None):
        factor = 0.5 if self.calls % 2 else 2.0
        self.calls += 1
        if self.write == "set_weights":
            self.model.set_weights([w * factor for w in self.model.get_weights()])
        else:
            table = self.model.layers[0].embeddings
            table.assign(table * factor)


@pytest.mark.parametrize("write", ["assign", "set_weights"])
def test_eager_writes_between_steps_land_before_the_next_step_reads(strategy, write):
    """A remote eager write is only dispatched in TF 2.15: without waiting for it, a step of fit could read the
    table before it landed. Here a callback scales the weights by 2 or 0.5 after each of 120 batches (before: 0.007
    to 0.022 off one process with ``assign``, 3 runs of 3, 0.0032 with ``set_weights``; the test above failed once
    in CI, 0.0024 off)."""
    _fits_like_plain_keras(strategy, f"scaled_{write}", lambda: _ScaledEachBatch(write), batch_size=8, epochs=10)


def test_legacy_gradient_transformers_are_refused_for_ps_variables(strategy):
    optimizer = tf.keras.optimizers.legacy.SGD(0.1, gradient_transformers=[lambda grads_and_vars: grads_and_vars])
    with strategy.scope():
        model = _model("fast_transformers")
        with pytest.raises(ValueError, match="gradient_transformers cannot update PS variables"):
            _train(model, optimizer)


@pytest.mark.parametrize("partitions", [1, 3])
def test_weight_decay_exclusions_reach_the_ps_and_the_dense_path(strategy, partitions):
    def optimizer(model):
        adamw = tf.keras.optimizers.AdamW(0.05, weight_decay=0.3)
        adamw.exclude_from_weight_decay(var_list=[model.layers[-1].kernel], var_names=["embedding"])
        return adamw

    plain = _model("plain_decay")
    expected_loss = _train(plain, optimizer(plain))
    with kp.HybridStrategy(strategy.cluster, partitions=partitions).scope():
        model = _model(f"fast_decay_{partitions}")
        loss = _train(model, optimizer(model))
    assert len(model.layers[0].weights) == partitions
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    decayed = _model("plain_decayed")
    _train(decayed, tf.keras.optimizers.AdamW(0.05, weight_decay=0.3))
    for i in (0, 1):  # the exclusions matter on this model, or the test would be vacuous
        assert not np.allclose(decayed.get_weights()[i], plain.get_weights()[i], atol=1e-3), i


@pytest.mark.parametrize("family", ["legacy", "new"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_learning_rate_callbacks_reach_the_ps(strategy, partitions, family):
    """The PS updates read the rate a callback assigns on the worker (read once per step, outside the update)."""
    optimizers = {"legacy": tf.keras.optimizers.legacy.SGD, "new": tf.keras.optimizers.SGD}

    def fit(model):
        model.set_weights(_initial(model))
        model.compile(optimizer=optimizers[family](0.1, momentum=0.5), loss="mse")
        x, y = _data()
        return model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                         callbacks=[tf.keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.3)])

    plain = _model(f"plain_{family}_rate")
    expected_loss = fit(plain).history["loss"]
    with kp.HybridStrategy(strategy.cluster, partitions=partitions).scope():
        model = _model(f"fast_{family}_rate_{partitions}")
        loss = fit(model).history["loss"]
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert float(model.optimizer.lr) == pytest.approx(0.1 * 0.3 ** 3)
    if family == "legacy":  # its own variables keep Keras' creation order (checkpoints store them by position)
        assert [w.name.split("/")[-1] for w in model.optimizer.weights[:3]] == \
            [w.name.split("/")[-1] for w in plain.optimizer.weights[:3]]



@pytest.mark.parametrize("case", ["new_schedule", "legacy_schedule", "legacy_callable"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_learning_rate_objects_of_the_user_reach_every_variable(strategy, partitions, case):
    """A schedule class of the user's (refused at compile before: kparallax copied the optimizer through Keras'
    serialization, which needs get_config and registration) and a legacy optimizer's callable rate reading a
    variable a callback changes (before: frozen at its value at compile, for every variable, silently) train the
    PS and replicated variables as plain Keras does."""
    rate = tf.Variable(0.1, trainable=False)
    makers = {"new_schedule": lambda: tf.keras.optimizers.Adam(WarmUp(0.05, 4.0)),
              "legacy_schedule": lambda: tf.keras.optimizers.legacy.Adam(WarmUp(0.05, 4.0)),
              "legacy_callable": lambda: tf.keras.optimizers.legacy.SGD(lambda: rate * 1.0, momentum=0.5)}
    halve = tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: rate.assign(rate * 0.5))

    def fit(model):
        rate.assign(0.1)
        model.set_weights(_initial(model))
        model.compile(optimizer=makers[case](), loss="mse")
        x, y = _data()
        return model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[halve]).history["loss"]

    plain = _model(f"plain_{case}_objects")
    expected_loss = fit(plain)
    with kp.HybridStrategy(strategy.cluster, partitions=partitions).scope():
        model = _model(f"fast_{case}_objects_{partitions}")
        loss = fit(model)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    if case == "legacy_callable":  # the rate's changes matter on this model, or the test would be vacuous
        fixed = _model("plain_fixed_rate")
        rate.assign(0.1)
        _train(fixed, tf.keras.optimizers.legacy.SGD(0.1, momentum=0.5), epochs=3)
        assert not np.allclose(fixed.get_weights()[0], plain.get_weights()[0], atol=1e-3)


def test_clipping_with_sparse_as_dense_is_refused(strategy):
    with kp.HybridStrategy(strategy.cluster, architecture="allreduce", sparse_as_dense=True).scope():
        model = _model("fast_dense_clipped")
        with pytest.raises(ValueError, match="sparse_as_dense=True cannot be combined with clipnorm"):
            _train(model, tf.keras.optimizers.SGD(0.1, clipnorm=0.05))


OPTIMIZERS = {
    "adamw": lambda: tf.keras.optimizers.AdamW(0.05, weight_decay=0.1),
    "rmsprop_centered": lambda: tf.keras.optimizers.RMSprop(0.05, momentum=0.5, centered=True),
    "adadelta": lambda: tf.keras.optimizers.Adadelta(1.0),
    "adamax": lambda: tf.keras.optimizers.Adamax(0.05),
    "adam_amsgrad": lambda: tf.keras.optimizers.Adam(0.05, amsgrad=True),
    "sgd_nesterov": lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "legacy_adam_amsgrad": lambda: tf.keras.optimizers.legacy.Adam(0.05, amsgrad=True),
    "ftrl": lambda: tf.keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "lion": lambda: tf.keras.optimizers.Lion(0.01),
    "adam_schedule": lambda: tf.keras.optimizers.Adam(tf.keras.optimizers.schedules.ExponentialDecay(0.05, 3, 0.5)),
    "legacy_nadam": lambda: tf.keras.optimizers.legacy.Nadam(0.05),
    "legacy_rmsprop": lambda: tf.keras.optimizers.legacy.RMSprop(0.05, momentum=0.5, centered=True),
    "legacy_ftrl": lambda: tf.keras.optimizers.legacy.Ftrl(0.3, l2_regularization_strength=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_trains_a_partitioned_table_like_plain_keras(strategy, name):
    plain = _model(f"plain_{name}")
    expected_loss = _train(plain, OPTIMIZERS[name]())
    with kp.HybridStrategy(strategy.cluster, partitions=3).scope():
        model = _model(f"fast_{name}")
        loss = _train(model, OPTIMIZERS[name]())
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def test_keras_nadam_is_refused_with_ps_variables(strategy):
    with strategy.scope():
        model = _model("fast_nadam")
        with pytest.raises(ValueError, match="Use tf.keras.optimizers.legacy.Nadam"):
            _train(model, tf.keras.optimizers.Nadam(0.05))


@pytest.mark.parametrize("partitions", [3, "auto"])
def test_adafactor_on_a_partitioned_table_is_refused(strategy, partitions):
    # Adafactor's update reads statistics of the whole variable; per shard it trained 0.04 off one process, silently.
    with kp.HybridStrategy(strategy.cluster, partitions=partitions).scope():
        model = _model(f"fast_adafactor_{partitions}")
        with pytest.raises(ValueError, match=r"Table 'fast_adafactor_\w+/embeddings' is split into row shards .*"
                                             r"Adafactor scales each update by statistics of the whole variable.*"
                                             r"placement=\{'fast_adafactor_\w+/embeddings': 'ps:1'\}"):
            _train(model, tf.keras.optimizers.Adafactor(0.05))
        for got, want in zip(model.get_weights(), _initial(model)):  # refused before any update
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rule", [False, True], ids=["unpartitioned", "ps1_rule"])
def test_adafactor_trains_a_table_in_one_piece_like_plain_keras(strategy, rule):
    plain = _model(f"plain_adafactor_{rule}")
    expected_loss = _train(plain, tf.keras.optimizers.Adafactor(0.05))
    name = f"fast_adafactor_whole_{rule}"
    options = {"partitions": 3, "placement": {f"{name}_embedding/embeddings": "ps:1"}} if rule else {}
    with kp.HybridStrategy(strategy.cluster, **options).scope():
        model = _model(name)
        loss = _train(model, tf.keras.optimizers.Adafactor(0.05))
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


@pytest.mark.parametrize("again", ["same_instance", "model_optimizer"])
def test_recompiling_with_the_same_optimizer_keeps_its_state(strategy, again):
    def fit_twice(model):
        model.set_weights(_initial(model))
        optimizer = tf.keras.optimizers.Adam(tf.keras.optimizers.schedules.ExponentialDecay(0.05, 3, 0.5))
        model.compile(optimizer=optimizer, loss="mse")
        x, y = _data()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.compile(optimizer=optimizer if again == "same_instance" else model.optimizer, loss="mae")
        return model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"]

    plain = _model(f"plain_recompiled_{again}")
    expected_loss = fit_twice(plain)
    with kp.HybridStrategy(strategy.cluster, partitions=3).scope():
        model = _model(f"fast_recompiled_{again}")
        loss = fit_twice(model)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 12
    # Keras' LossScaleOptimizer builds its inner optimizer over every variable: no slots of PS variables there
    # (they live in the PS-side clones; before, each worker made dead copies of them on the PS).
    on_ps = [v.name for v in optimizer_compat.optimizer_variables(model.optimizer) if "/job:ps/" in v.device]
    assert on_ps == [] and len(optimizer_compat.optimizer_variables(model.optimizer)) == 1 + 2 * 2, on_ps
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


@pytest.mark.parametrize("regularized", [False, True], ids=["sparse-gradient", "dense-gradient"])
@pytest.mark.parametrize("clipped", ["clipnorm", "legacy_clipvalue_and_clipnorm", "global_clipnorm",
                                     "legacy_clipvalue_and_global_clipnorm"])
def test_clipping_of_a_partitioned_table_matches_plain_keras(strategy, clipped, regularized):
    # SGD, not Adam: Adam's update is nearly invariant to a gradient's scale, so a wrong norm would hardly show.
    # global_clipnorm's norm spans the table's shards and the replicated output layer.
    optimizer = {"clipnorm": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.02),
                 "legacy_clipvalue_and_clipnorm": lambda: tf.keras.optimizers.legacy.SGD(
                     0.1, momentum=0.9, clipnorm=0.02, clipvalue=0.002),
                 "global_clipnorm": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05),
                 "legacy_clipvalue_and_global_clipnorm": lambda: tf.keras.optimizers.legacy.SGD(
                     0.1, momentum=0.9, global_clipnorm=0.05, clipvalue=0.02)}[clipped]
    name = f"{clipped}_{regularized}"
    plain = _model(f"plain_{name}", regularized)
    expected_loss = _train(plain, optimizer())
    with kp.HybridStrategy(strategy.cluster, partitions=3).scope():
        model = _model(f"fast_{name}", regularized)
        loss = _train(model, optimizer())
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    # A dense gradient's norm spans the table's 3 shards: its update waits for every push (barrier, worker 0).
    assert _has_pushed_barrier(model) == regularized


@pytest.mark.parametrize("architecture", ["ps", "allreduce"])
def test_global_clipnorm_under_other_architectures_matches_plain_keras(strategy, architecture):
    """ps: the output layer is a dense PS variable too (its summed gradient is read by worker 0 after a barrier,
    its sum of squares passed to every worker); allreduce: no PS variable, Keras clips the averaged gradients."""
    other = kp.HybridStrategy(strategy.cluster, architecture=architecture)
    optimizer = lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05)  # noqa: E731
    plain = _model("plain_global")
    expected_loss = _train(plain, optimizer())
    with other.scope():
        model = _model(f"fast_global_{architecture}")
        loss = _train(model, optimizer())
    assert other.is_ps_variable(model.layers[-1].kernel) == (architecture == "ps")
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert _has_pushed_barrier(model) == (architecture == "ps")


@pytest.mark.parametrize("legacy", [False, True], ids=["keras", "legacy"])
def test_global_clipnorm_under_mixed_precision_matches_plain_keras(strategy, legacy):
    """Keras' LossScaleOptimizer unscales the gradients, then the routing optimizer clips them by the whole step's
    norm (Keras would clip the replicated ones by theirs alone, or NaN when a scaled step overflows)."""
    family = tf.keras.optimizers.legacy if legacy else tf.keras.optimizers
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = _model(f"plain_mixed_global_{legacy}")
        expected_loss = _train(plain, family.SGD(0.1, momentum=0.9, global_clipnorm=0.05))
        with kp.HybridStrategy(strategy.cluster, partitions=3).scope():
            model = _model(f"fast_mixed_global_{legacy}")
            loss = _train(model, family.SGD(0.1, momentum=0.9, global_clipnorm=0.05))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def test_global_clipnorm_with_async_ps_is_refused(strategy):
    with kp.HybridStrategy(strategy.cluster, sync=False).scope():
        model = _model("fast_global_async")
        with pytest.raises(ValueError, match=r"global_clipnorm cannot be combined with sync=False .*Received: "
                                             r"global_clipnorm=0.5, sync=False, 1 PS variable"):
            _train(model, tf.keras.optimizers.SGD(0.1, global_clipnorm=0.5))


def test_mixed_precision_recompile_keeps_the_optimizer(strategy):
    def fit_twice(model):
        model.set_weights(_initial(model))
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
        x, y = _data()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.compile(optimizer=model.optimizer, loss="mse")  # a LossScaleOptimizer wrapping the first one
        return model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"]

    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = _model("plain_mixed")
        expected_loss = fit_twice(plain)
        with strategy.scope():
            model = _model("fast_mixed")
            loss = fit_twice(model)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 12
    # Keras' LossScaleOptimizer builds its inner optimizer over every variable: no slots of PS variables there
    # (they live in the PS-side clones; before, each worker made dead copies of them on the PS).
    on_ps = [v.name for v in optimizer_compat.optimizer_variables(model.optimizer) if "/job:ps/" in v.device]
    assert on_ps == [] and len(optimizer_compat.optimizer_variables(model.optimizer)) == 1 + 2 * 2, on_ps
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)



@pytest.mark.parametrize("case", ["keras_dynamic", "legacy_dynamic", "keras_fixed", "float32_policy",
                                  "keras_wrapped", "legacy_wrapped"])
def test_loss_scale_optimizers_train_as_in_plain_keras(strategy, case):
    """A LossScaleOptimizer passed to compile (refused before): its settings hold. The dynamic ones start at 2**10
    and double every 2 finite steps until float16 gradients overflow, so steps are skipped and the scale halves,
    as in plain Keras; the fixed one never changes; under the float32 policy Keras keeps it too. The wrapped ones
    are Keras' own (the mixed_float16 policy) with a loss 1000 times larger: their first steps overflow at the
    default scale, 2**15, and are skipped. A skipped step counts in the optimizer's step but updates no variable:
    before, the PS-side copies of Adam missed those steps in their bias correction (3e-3 off plain Keras,
    silently)."""
    scaled = tf.keras.mixed_precision.LossScaleOptimizer
    makers = {"keras_dynamic": lambda: scaled(tf.keras.optimizers.Adam(0.05), initial_scale=2.0 ** 10,
                                              dynamic_growth_steps=2),
              "legacy_dynamic": lambda: scaled(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.5),
                                               initial_scale=2.0 ** 10, dynamic_growth_steps=2),
              "keras_fixed": lambda: scaled(tf.keras.optimizers.SGD(0.1, momentum=0.5), dynamic=False,
                                            initial_scale=64.0),
              "float32_policy": lambda: scaled(tf.keras.optimizers.Adam(0.05), initial_scale=2.0 ** 10,
                                               dynamic_growth_steps=2),
              "keras_wrapped": lambda: tf.keras.optimizers.Adam(0.05),
              "legacy_wrapped": lambda: tf.keras.optimizers.legacy.Adam(0.05)}
    weights = {"loss_weights": [1000.0]} if case.endswith("wrapped") else {}

    def fit(model):
        loss = _train(model, makers[case](), epochs=3, **weights)
        return loss, float(model.optimizer.loss_scale), int(model.optimizer.iterations)

    tf.keras.mixed_precision.set_global_policy("float32" if case == "float32_policy" else "mixed_float16")
    try:
        plain = _model(f"plain_explicit_{case}")
        expected = fit(plain)
        with kp.HybridStrategy(strategy.cluster, partitions=3).scope():
            model = _model(f"fast_explicit_{case}")
            got = fit(model)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert type(model.optimizer) is type(plain.optimizer)
    assert got[1:] == expected[1:], (got, expected)  # the loss scale and step count after 18 steps
    if case.endswith("dynamic"):  # the scale grew and was halved: some steps were skipped
        assert expected[1] not in (2.0 ** 10, 2.0 ** 19), expected
    if case.endswith("wrapped"):  # halved from 2**15: steps were skipped
        assert expected[1] < 2.0 ** 15, expected
    for got_weight, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got_weight, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)


SAVED = {  # optimizer, strategy options, per-worker batch
    "adam_partitioned": (lambda: tf.keras.optimizers.Adam(0.05), {"partitions": 3}, 16),
    "legacy_adam": (lambda: tf.keras.optimizers.legacy.Adam(0.05), {"partitions": 2}, 16),
    "sgd_momentum_ps_architecture": (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                     {"architecture": "ps", "partitions": 2}, 16),
    "adagrad_async": (lambda: tf.keras.optimizers.Adagrad(0.2), {"sync": False, "partitions": 2}, 16),
    "rmsprop_accumulated": (lambda: tf.keras.optimizers.RMSprop(0.05, momentum=0.5),
                            {"backward_passes_per_step": 2, "partitions": 2}, 8),
    "adam_mixed_precision": (lambda: tf.keras.optimizers.Adam(0.05), {"partitions": 2}, 16),
    "sgd_without_slots": (lambda: tf.keras.optimizers.SGD(0.1), {"partitions": 2}, 16),
    "sgd_ema": (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.5, use_ema=True, ema_momentum=0.9),
                {"partitions": 2}, 16),
}


@contextlib.contextmanager
def _policy_of(name):
    """The case's global dtype policy (``*_mixed_precision``: mixed_float16) inside; float32 again after."""
    if name.endswith("mixed_precision"):
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def _trained(name, make_optimizer, batch=16, strategy=None):
    """A model named ``name`` from ``_initial`` weights, compiled (in ``strategy``'s scope if given) and trained one
    epoch of ``_data`` unshuffled."""
    x, y = _data()
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = _model(name)
        model.set_weights(_initial(model))
        model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


def _optimizer_state(model):
    optimizer = model.optimizer
    optimizer_compat.build_optimizer(getattr(optimizer, "inner_optimizer", optimizer), model.trainable_variables)
    return [v.numpy() for v in optimizer_compat.optimizer_variables(optimizer)]


@pytest.mark.parametrize("name", sorted(SAVED))
def test_model_save_holds_the_optimizer_state_one_process_saves(strategy, tmp_path, name):
    """model.save in every format: a plain process loads the optimizer state (tables' slots joined over shards, in
    Keras' order) that plain Keras saves and loads for the same training, and goes on training exactly as it."""
    make_optimizer, options, batch = SAVED[name]
    x, y = _data()
    with _policy_of(name):
        plain = _trained(f"plain_saved_{name}", make_optimizer)
        model = _trained(f"fast_saved_{name}", make_optimizer, batch, kp.HybridStrategy(strategy.cluster, **options))
        plain_state, resumed = _optimizer_state(plain), None
        for path in ("model.keras", "model.h5", "saved_model"):
            model.save(str(tmp_path / f"fast_{path}"))
            plain.save(str(tmp_path / f"plain_{path}"))
            got = tf.keras.models.load_model(str(tmp_path / f"fast_{path}"))
            want = tf.keras.models.load_model(str(tmp_path / f"plain_{path}"))
            got_state, want_state = _optimizer_state(got), _optimizer_state(want)
            assert len(got_state) == len(want_state) == len(plain_state), path
            for a, b in zip(got_state, want_state):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=path)
            holds_all = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(want_state, plain_state))
            if resumed is None and holds_all:
                resumed = got  # a format that holds the whole state (Keras keeps less in some, e.g. legacy in .keras)
        assert resumed is not None, "no format held the trained optimizer state"
        resumed.fit(x, y, batch_size=16, shuffle=False, verbose=0)  # goes on in a plain process
        plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        for a, b in zip(resumed.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)  # saving left kparallax's optimizer in place
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adam_partitioned", "legacy_adam", "adagrad_async", "adam_mixed_precision"])
def test_tf_format_weights_carry_the_optimizer_state_both_ways(strategy, tmp_path, name):
    """save_weights / load_weights in TensorFlow's format (what ModelCheckpoint(save_weights_only=True) writes and
    a resumed program loads): kparallax -> plain Keras and plain Keras -> a fresh kparallax model both go on
    training exactly as the plain model that wrote or read the state."""
    make_optimizer, options, batch = SAVED[name]
    x, y = _data()
    with _policy_of(name):
        plain = _trained(f"plain_weights_{name}", make_optimizer)
        plain.save_weights(str(tmp_path / "plain" / "ckpt"))
        kp_strategy = kp.HybridStrategy(strategy.cluster, **options)
        model = _trained(f"fast_weights_{name}", make_optimizer, batch, kp_strategy)
        model.save_weights(str(tmp_path / "fast" / "ckpt"))
        with kp_strategy.scope():
            loaded = _model(f"fast_loaded_{name}")
            loaded.compile(optimizer=make_optimizer(), loss="mse")
        loaded.load_weights(str(tmp_path / "plain" / "ckpt"))
        reader = _model(f"plain_reader_{name}")
        reader.compile(optimizer=make_optimizer(), loss="mse")
        reader.load_weights(str(tmp_path / "fast" / "ckpt"))
        for other in (loaded, reader):
            other.fit(x, y, batch_size=batch if other is loaded else 16, shuffle=False, verbose=0)
        plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for other in (loaded, reader):
        for a, b in zip(other.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=other.name)
        assert int(other.optimizer.iterations) == int(plain.optimizer.iterations)


@pytest.mark.parametrize("path", ["model.keras", "model.h5", "saved_model"])
@pytest.mark.parametrize("name", ["adam_partitioned", "legacy_adam", "adam_mixed_precision"])
def test_strategy_load_model_goes_on_training_as_the_plain_loaded_model(strategy, tmp_path, name, path):
    """strategy.load_model of a file plain Keras saved: the model trains on under kparallax exactly as the model
    tf.keras.models.load_model gives a plain process (weights, optimizer state, step); and kparallax's own file
    of that run loads the same way. Keras' load_model inside the scope is refused with the fix."""
    make_optimizer, options, _ = SAVED[name]
    x, y = _data()
    with _policy_of(name):
        plain = _trained(f"plain_load_{name}_{path.replace('.', '_')}", make_optimizer)
        plain.save(str(tmp_path / path))
        reference = tf.keras.models.load_model(str(tmp_path / path))
        kp_strategy = kp.HybridStrategy(strategy.cluster, **options)
        with kp_strategy.scope():
            with pytest.raises(ValueError, match=r"Use `model = strategy.load_model\(path\)`"):
                tf.keras.models.load_model(str(tmp_path / path))
        model = kp_strategy.load_model(str(tmp_path / path))
        assert model.get_layer(f"{plain.name}_embedding").embeddings.name.startswith(plain.name)
        assert kp_strategy.is_ps_variable(model.get_layer(f"{plain.name}_embedding").weights[0])
        assert len(model.get_layer(f"{plain.name}_embedding").weights) == options["partitions"]
        model.save(str(tmp_path / f"again_{path}"))
        again = kp_strategy.load_model(str(tmp_path / f"again_{path}"))
        for trained in (reference, model, again):
            trained.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for got in (model, again):
        assert int(got.optimizer.iterations) == int(reference.optimizer.iterations)
        for a, b in zip(got.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _tower(name):
    """A tower of a two-tower model: ids -> table -> mean -> Dense(3)."""
    ids = tf.keras.Input((LEN,), dtype=tf.int32)
    pooled = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB, name=f"{name}_emb")(ids))
    return tf.keras.Model(ids, tf.keras.layers.Dense(3, name=f"{name}_proj")(pooled), name=name)


@pytest.mark.parametrize("partitions", [1, 3])
def test_an_uncompiled_tower_saves_and_loads_its_tables_whole(strategy, tmp_path, partitions):
    """The tower of a two-tower model (compiled and trained as part of the pair, never itself): save (.keras, .h5,
    SavedModel), save_weights (.h5, TensorFlow format) and export write its table whole, so a plain model loads each
    file and predicts as the trained tower; load_weights reads the table back into its stripes. Before, with 3
    stripes, the files held them as three weights that plain Keras refused to load, and the SavedModel was
    refused."""
    x, other = _data()[0], np.flip(_data()[0], axis=0).copy()
    parted = kp.HybridStrategy(strategy.cluster, partitions=partitions)
    with parted.scope():
        tower = _tower(f"fast_tower{partitions}")
        pair = tf.keras.Model(
            [tower.input, ids := tf.keras.Input((LEN,), dtype=tf.int32)],
            tf.keras.layers.Dot(axes=1)([tower.output, tower(ids)]))
        pair.compile(optimizer="adam", loss="mse")
        pair.fit([x, other], np.linspace(0, 1, len(x), dtype=np.float32), batch_size=16, verbose=0)
    table = tower.get_layer(f"fast_tower{partitions}_emb").embeddings
    assert parted.is_ps_variable(table.variables[0] if partitions > 1 else table)
    want = tower.predict(x, verbose=0)
    plain = _tower(f"fast_tower{partitions}")  # outside the scope: a plain model
    for path in ("tower.keras", "tower.h5", "tower_saved_model"):
        tower.save(str(tmp_path / path))
        loaded = tf.keras.models.load_model(str(tmp_path / path), compile=False)
        assert [w.shape for w in loaded.get_weights()] == [w.shape for w in plain.get_weights()], path
        np.testing.assert_allclose(loaded.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6, err_msg=path)
    tower.export(str(tmp_path / "exported"))
    exported = tf.saved_model.load(str(tmp_path / "exported"))  # held: its variables live as long as it does
    np.testing.assert_allclose(exported.serve(tf.constant(x)).numpy(), want, rtol=1e-5, atol=1e-6)
    for path in ("weights.h5", "weights_tf"):
        tower.save_weights(str(tmp_path / path))
        plain.load_weights(str(tmp_path / path))
        np.testing.assert_allclose(plain.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6, err_msg=path)
        table.assign(np.zeros((VOCAB, EMB), np.float32))
        tower.load_weights(str(tmp_path / path))
        np.testing.assert_allclose(tower.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6, err_msg=path)


def test_strategy_load_model_without_compiling_gives_the_weights_on_the_ps(strategy, tmp_path):
    plain = _model("plain_uncompiled_load")
    plain.set_weights(_initial(plain))
    plain.save(str(tmp_path / "model.keras"))
    kp_strategy = kp.HybridStrategy(strategy.cluster, partitions=2)
    with kp_strategy.scope():  # inside the scope too
        model = kp_strategy.load_model(str(tmp_path / "model.keras"), compile=False)
    assert model.optimizer is None and len(model.get_layer("plain_uncompiled_load_embedding").weights) == 2
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    with kp_strategy.scope():
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="mse")
    plain.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="mse")
    x, y = _data()
    for trained in (model, plain):
        trained.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Interrupted(Exception):
    pass


class _InterruptAtStep(tf.keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self._step = step

    def on_train_batch_begin(self, batch, logs=None):
        if int(optimizer_compat.step_optimizer(self.model).iterations) == self._step:  # of a list: the last one's
            raise _Interrupted()


@pytest.mark.parametrize("save_freq", ["epoch", 4])
def test_backup_and_restore_resumes_as_plain_keras_does(strategy, tmp_path, save_freq):
    """BackupAndRestore around a fit interrupted at step 15 (epoch 3 of 6-step epochs), then a new model resuming
    from the backup: kparallax ends where plain Keras' own interrupted-and-resumed run ends (a 2-shard table under
    Adam: its slots are in the backup)."""
    x, y = _data()
    kp_strategy = kp.HybridStrategy(strategy.cluster, partitions=2)

    def interrupted_then_resumed(label, scope):
        backup = tf.keras.callbacks.BackupAndRestore(str(tmp_path / label), save_freq=save_freq)
        for attempt, callbacks in enumerate(([_InterruptAtStep(15)], [])):
            with scope():
                model = _model(f"{label}_{attempt}")
                model.set_weights(_initial(model))
                model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
            try:
                model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[backup] + callbacks)
            except _Interrupted:
                assert attempt == 0
        return model

    want = interrupted_then_resumed(f"plain_backup_{save_freq}", contextlib.nullcontext)
    got = interrupted_then_resumed(f"fast_backup_{save_freq}", kp_strategy.scope)
    assert int(got.optimizer.iterations) == int(want.optimizer.iterations) == 24
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizers", ["one", "list"])
def test_backup_and_restore_into_a_wide_deep_model_not_built_is_refused_and_built_resumes(strategy, tmp_path,
                                                                                         optimizers):
    """A WideDeepModel whose LinearModel is built by its first call, resumed by BackupAndRestore: a new model not
    built yet is refused with the fix (before: Keras' 'Weights for model ... have not yet been created' from inside
    kparallax's restore), and built by a call on one batch it ends where plain Keras' own interrupted-and-resumed run
    ends (a table on the PS under Adam; under Ftrl for the linear part and Adagrad for the DNN, whose table's slots
    the backup holds joined from the PS; before, a list of optimizers was refused)."""
    ids, _ = _data()
    rng = np.random.default_rng(6)
    x = [rng.normal(size=(96, 5)).astype(np.float32), ids]
    y = rng.normal(size=(96, 1)).astype(np.float32)

    def interrupted_then_resumed(label, scope, build=True):
        backup = tf.keras.callbacks.BackupAndRestore(str(tmp_path / label))
        for attempt, callbacks in enumerate(([_InterruptAtStep(15)], [])):
            with scope():
                model = _wide_deep(table=True)
                model.compile(optimizer=tf.keras.optimizers.Adam(0.05) if optimizers == "one" else
                              _wide_deep_optimizers(), loss="mse")
            if build or attempt == 0:
                model([part[:1] for part in x])
            try:
                model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[backup] + callbacks)
            except _Interrupted:
                assert attempt == 0
        return model

    with pytest.raises(ValueError, match=r"BackupAndRestore found a backup .*not created all its weights yet.*"
                                         r"Received: backup_dir=.*Build it before fit: call it on one batch"):
        interrupted_then_resumed("fast_wide_deep_unbuilt", strategy.scope, build=False)
    want = interrupted_then_resumed("plain_wide_deep_backup", contextlib.nullcontext)
    got = interrupted_then_resumed("fast_wide_deep_backup", strategy.scope)
    assert strategy.is_ps_variable(got.dnn_model.layers[0].embeddings)
    for optimizer in (got.optimizer, want.optimizer):
        assert [int(o.iterations) for o in optimizer_compat.optimizer_list(optimizer) or [optimizer]] == [24] * (
            1 if optimizers == "one" else 2)
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoints_that_would_miss_the_ps_side_optimizer_state_are_refused(strategy, tmp_path):
    """A tf.train.Checkpoint of a model with PS variables (it would hold model.optimizer without the tables' slots)
    is refused with the fix; tf.saved_model.save, a serving export, writes the weights and loads in a plain process
    (its output is the model's); a partitioned table there is refused, naming model.export; kparallax's savers and a
    model without PS variables are not affected."""
    x, y = _data()
    model = _trained("fast_direct_checkpoint", lambda: tf.keras.optimizers.Adam(0.05),
                     strategy=kp.HybridStrategy(strategy.cluster, partitions=2))
    with pytest.raises(ValueError, match=r"would miss the optimizer state of its PS variables.*save_weights"):
        tf.train.Checkpoint(model=model).save(str(tmp_path / "direct" / "ckpt"))
    with pytest.raises(NotImplementedError, match="tf.saved_model.save cannot write kparallax's partitioned table"):
        tf.saved_model.save(model, str(tmp_path / "direct_saved_model"))
    model.save_weights(str(tmp_path / "weights" / "ckpt"))
    model.export(str(tmp_path / "exported"))
    whole = _trained("fast_serving_export", lambda: tf.keras.optimizers.Adam(0.05), strategy=strategy)
    tf.saved_model.save(whole, str(tmp_path / "serving"))
    np.save(tmp_path / "x.npy", x[:8])
    served = subprocess.run(
        [sys.executable, "-c", "import sys, numpy as np, tensorflow as tf; "
         "f = tf.saved_model.load(sys.argv[1]).signatures['serving_default']; "
         "np.save(sys.argv[3], list(f(tf.constant(np.load(sys.argv[2]))).values())[0].numpy())",
         str(tmp_path / "serving"), str(tmp_path / "x.npy"), str(tmp_path / "served.npy")],
        capture_output=True, text=True, timeout=120, check=False)
    assert served.returncode == 0, served.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "served.npy"), whole.predict(x[:8], verbose=0), rtol=1e-6)
    with strategy.scope():
        dense = tf.keras.Sequential([tf.keras.Input((LEN,)), tf.keras.layers.Dense(1)])
        dense.compile(optimizer="sgd", loss="mse")
    dense.fit(x.astype(np.float32), y, batch_size=16, verbose=0)
    tf.train.Checkpoint(model=dense).save(str(tmp_path / "dense" / "ckpt"))


class _OwnLookup(tf.keras.layers.Layer):
    """A user's own embedding layer: a table and a per-id bias made with add_weight, read with
    tf.nn.embedding_lookup and tf.gather (their gradients are tf.IndexedSlices), the table also kept in a list of
    the layer's own (a reference kparallax never sees)."""

    def build(self, input_shape):
        self.table = self.add_weight("table", [VOCAB, EMB], initializer="glorot_uniform")
        self.bias = self.add_weight("bias", [VOCAB], initializer="zeros")
        self.mine = [self.table]

    def call(self, ids):
        return tf.nn.embedding_lookup(self.mine[0], ids) + tf.gather(self.bias, ids)[..., None]


def _own_lookup_model(name):
    inputs = tf.keras.Input((LEN,), dtype=tf.int32)
    x = tf.keras.layers.Flatten()(_OwnLookup(name=f"{name}_lookup")(inputs))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(1, name=f"{name}_out")(x), name=name)


def _fit_own_lookup(model, x, y):
    model.set_weights(_initial(model))
    model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
    before = model.evaluate(x, y, batch_size=32, verbose=0)  # traced with the variables where they were made
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    return before, history, model.evaluate(x, y, batch_size=32, verbose=0)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_variables_with_sparse_gradients_move_to_the_ps_and_train_like_plain_keras(strategy, policy):
    x, y = _data()
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        plain = _own_lookup_model("plain_own")
        expected = _fit_own_lookup(plain, x, y)
        with strategy.scope():
            model = _own_lookup_model(f"fast_own_{policy}")
            layer = model.get_layer(f"fast_own_{policy}_lookup")
            table, bias = layer.table, layer.bias
            assert not strategy.is_ps_variable(table), "replicated until a traced step shows its gradient"
            stale = tf.function(lambda: tf.gather(layer.table, [1, 2]))  # a function of the user's, traced before
            stale()
            got = _fit_own_lookup(model, x, y)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert layer.table is table and layer.mine[0] is table, "the same objects, moved"
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"is not in \[0, 0\)"):
        stale()  # the old copy is emptied: no silent read of stale rows
    for variable in (table, bias):
        assert strategy.is_ps_variable(variable) and "/job:ps/" in variable.device, variable.name
        path = strategy.ps_info(variable)[0]
        assert strategy.push_counts()[path] == 12  # 96 / 16 per epoch, 2 epochs, one worker
    dense = model.get_layer(f"fast_own_{policy}_out").kernel
    assert not strategy.is_ps_variable(dense) and "/job:ps/" not in dense.device
    for a, b in zip(model.get_weights(), plain.get_weights()):  # one worker: the same math, float16 or not
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)
    np.testing.assert_allclose([got[0], got[2]], [expected[0], expected[2]], rtol=1e-5)


def test_a_placement_rule_keeps_a_sparse_gradient_variable_replicated(strategy):
    x, y = _data()
    plain = _own_lookup_model("plain_kept")
    expected = _fit_own_lookup(plain, x, y)
    with kp.HybridStrategy(strategy.cluster, placement={r"fast_kept_lookup/table": "replicated"}).scope() as scope:
        model = _own_lookup_model("fast_kept")
        got = _fit_own_lookup(model, x, y)
    del scope
    layer = model.get_layer("fast_kept_lookup")
    assert "/job:ps/" not in layer.table.device  # the rule holds: its rows are allgathered
    assert "/job:ps/" in layer.bias.device  # no rule names it: moved
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)


def test_with_partitions_a_sparse_gradient_variable_moves_whole_and_a_rule_splits_it(strategy):
    """partitions=2 splits Keras' Embedding tables when they are made; a variable found sparse later moves whole,
    with a warning naming the rule that splits it, and that rule ("ps:3") gives a table of 3 stripes."""
    x, y = _data()
    plain = _own_lookup_model("plain_parted")
    expected = _fit_own_lookup(plain, x, y)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("kparallax").addHandler(handler)
    try:
        with kp.HybridStrategy(strategy.cluster, partitions=2,
                               placement={"fast_parted_lookup/table": "ps:3"}).scope() as parted:
            model = _own_lookup_model("fast_parted")
            got = _fit_own_lookup(model, x, y)
    finally:
        logging.getLogger("kparallax").removeHandler(handler)
    layer = model.get_layer("fast_parted_lookup")
    assert len(layer.table.variables) == 3 and parted.registry.table_of(layer.table.variables[0]) is not None
    assert parted.is_ps_variable(layer.bias) and parted.registry.table_of(layer.bias) is None
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fast_parted_lookup/bias moved onto ps[0] whole" in warnings[0], warnings
    assert "placement={'fast_parted_lookup/bias': 'ps:2'}" in warnings[0]
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)


def test_architecture_allreduce_keeps_sparse_gradient_variables_replicated(strategy):
    with kp.HybridStrategy(strategy.cluster, architecture="allreduce").scope():
        model = _own_lookup_model("fast_allreduce_own")
        _fit_own_lookup(model, *_data())
    assert not any("/job:ps/" in v.device for v in model.trainable_variables)


@pytest.mark.parametrize("family", ["new", "legacy"])
def test_moved_variables_save_the_optimizer_state_one_process_saves(strategy, tmp_path, family):
    """model.save of a model whose own add_weight table moved onto the PS: the file holds the optimizer state plain
    Keras saves for the same training, and a plain process goes on training from it exactly. A save before the
    first step (which builds the optimizer over the still-replicated table) changes nothing."""
    x, y = _data()
    adam = tf.keras.optimizers.Adam if family == "new" else tf.keras.optimizers.legacy.Adam
    models = []
    for name, scope in ((f"plain_moved_saved_{family}", contextlib.nullcontext()),
                        (f"fast_moved_saved_{family}", strategy.scope())):
        with scope:
            model = _own_lookup_model(name)
            model.set_weights(_initial(model))
            model.compile(optimizer=adam(0.05), loss="mse")
            model.save(str(tmp_path / f"{name}_initial.keras"))
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        model.save(str(tmp_path / f"{name}.keras"))
        models.append(tf.keras.models.load_model(str(tmp_path / f"{name}.keras"),
                                                 custom_objects={"_OwnLookup": _OwnLookup}))
    assert strategy.is_ps_variable(model.get_layer(f"fast_moved_saved_{family}_lookup").table)
    want, got = (_optimizer_state(m) for m in models)
    assert len(got) == len(want) >= 1 + 2 * len(model.trainable_variables)  # iterations (+ legacy's hypers), m, v
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for loaded in models:
        loaded.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for a, b in zip(*(m.get_weights() for m in models)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_sparse_gradient_variable_in_a_step_traced_outside_fit_is_refused(strategy):
    """Only fit / train_on_batch can move a variable before their first step: a step traced elsewhere would
    otherwise train it where it is not meant to be. One error names it and the fix."""
    x, y = _data()
    with strategy.scope():
        model = _own_lookup_model("fast_outside_fit")
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    step = tf.function(lambda: model.train_step((tf.constant(x[:16]), tf.constant(y[:16]))))
    with pytest.raises(ValueError, match=r"traced outside the model's fit / train_on_batch.*"
                                         r"placement=\{'fast_outside_fit_lookup/table': 'ps'\}"):
        step()
    model.train_on_batch(x[:16], y[:16])  # which moves them
    assert strategy.is_ps_variable(model.get_layer("fast_outside_fit_lookup").table)


def test_lm1b_with_softmax_weights_of_its_own_moves_them_and_trains_like_plain_keras(strategy):
    """The LM1B model with softmax="weights" (add_weight variables passed to its sampled softmax, as a plain
    TensorFlow program writes it): they move onto the PS and the model trains as in plain Keras."""
    from kparallax_models import lm1b  # pylint: disable=import-outside-toplevel
    config = lm1b.preset("lm1b_tiny", softmax="weights", batch_size=4)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, config.vocab_size, size=(24, config.num_steps + 1)).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((ids[:, :-1], ids[:, 1:])).batch(config.batch_size)
    models = []
    for scope in (contextlib.nullcontext(), strategy.scope()):
        with scope:
            model = lm1b.LM1B(config, seed=1)
            model.set_weights([np.random.default_rng(8).normal(scale=0.1, size=w.shape).astype(np.float32)
                               for w in model.get_weights()])
            model.compile(optimizer=lm1b.make_optimizer(config))
            model.fit(data, epochs=1, verbose=0)
        models.append(model)
    assert [w.name for w in models[1].trainable_weights][-2:] == ["lm1b/softmax_w:0", "lm1b/softmax_b:0"]
    assert all(strategy.is_ps_variable(v) for v in models[1].softmax_tables())
    for a, b in zip(*(m.get_weights() for m in models)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_moved_variables_resume_from_a_checkpoint_and_loaded_state_is_not_lost(strategy, tmp_path):
    """A kparallax checkpoint records which variables moved onto the PS: a fresh model restoring it moves them
    before setting their state and goes on as plain Keras' unbroken run. Optimizer state that Keras' own loaders
    gave the still-replicated variables before the first step would be lost by the move: refused, naming the rule."""
    x, y = _data()
    plain = _own_lookup_model("plain_moved_resume")
    plain.set_weights(_initial(plain))
    plain.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        first = _own_lookup_model("fast_moved_resume")
        first.set_weights(_initial(first))
        first.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
        first.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        written = kp.checkpoint.save(strategy, first, str(tmp_path / "ckpt"))
        first.save_weights(str(tmp_path / "weights" / "w"))  # TensorFlow's format: with the optimizer state
        again = _own_lookup_model("fast_moved_resume")  # the same program, run again
        again.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
        kp.checkpoint.restore(strategy, again, written)
        assert strategy.is_ps_variable(again.get_layer("fast_moved_resume_lookup").table)
        again.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        loaded = _own_lookup_model("fast_moved_resume")
        loaded.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
        loaded.load_weights(str(tmp_path / "weights" / "w"))
        with pytest.raises(ValueError, match=r"the optimizer already holds their trained state here.*"
                                             r"placement=\{'fast_moved_resume_lookup/table': 'ps'\}"):
            loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    rules = {"fast_moved_resume_lookup/table": "ps", "fast_moved_resume_lookup/bias": "ps"}
    with kp.HybridStrategy(strategy.cluster, placement=rules).scope():  # the fix the error names
        ruled = _own_lookup_model("fast_moved_resume")
        ruled.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
        ruled.load_weights(str(tmp_path / "weights" / "w"))
        ruled.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for model in (again, ruled):
        for a, b in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
