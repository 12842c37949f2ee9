"""kp.all_gather / kp.row_offset (in-batch negatives, step/rows.py) and the contract around them.

A retrieval model scoring each query against every candidate of the batch (subclassed, and functional: called on a
Keras tensor, a Lambda layer), on 2 workers + 1 PS with a partial last batch, equals one plain process on the global
batch when it gathers the candidates with kp.all_gather. Without the gather (a recommender library's retrieval
task), each worker scores its own batch, as under Horovod and tf.distribute: it trains, worker 0 logs one warning
naming kp.all_gather, and the replicas agree. Outside kparallax's training step they are the identity and 0; an
asynchronous step refuses them."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import kparallax as kp
from kparallax import testing
from kparallax.step import rows

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "in_batch_negatives.py")
WARNING = "The training step multiplies the batch's rows with each other"


def test_outside_a_training_step_all_gather_is_the_identity_and_the_offset_zero():
    value = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    np.testing.assert_array_equal(kp.all_gather(value).numpy(), value.numpy())
    assert int(kp.row_offset(value)) == 0
    with tf.GradientTape() as tape:
        tape.watch(value)
        total = tf.reduce_sum(tf.function(kp.all_gather)(value) * 2.0)
    np.testing.assert_array_equal(tape.gradient(total, value).numpy(), np.full((3, 2), 2.0))
    assert int(tf.function(kp.row_offset)(value)) == 0


def test_on_a_keras_tensor_they_are_layers_of_the_functional_model():
    q_in, d_in = tf.keras.Input((3,)), tf.keras.Input((3,))
    q, d = tf.keras.layers.Dense(4)(q_in), tf.keras.layers.Dense(4)(d_in)
    model = tf.keras.Model([q_in, d_in], [tf.matmul(q, kp.all_gather(d), transpose_b=True), kp.row_offset(q)])
    assert [type(layer).__name__ for layer in model.layers].count("Lambda") == 2
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    logits, offset = model([x, x])
    assert logits.shape == (5, 5) and int(offset) == 0


def _found(product, rows_static=None):
    """The products ``rows.rows_meeting`` finds in a step computing ``product(q, d, kernel)`` of a batch (q, d) of
    ``rows_static`` rows x 3 (None: unknown)."""
    kernel = tf.Variable(tf.ones([3, 3]))
    step = tf.function(lambda q, d: product(q, d, kernel))
    graph = step.get_concrete_function(tf.TensorSpec([rows_static, 3]), tf.TensorSpec([rows_static, 3])).graph
    return rows.rows_meeting(graph, rows_static)


@pytest.mark.parametrize("rows_static", [None, 4])
def test_the_batch_s_rows_scored_against_each_other_are_found(rows_static):
    assert len(_found(lambda q, d, k: tf.matmul(q, d, transpose_b=True), rows_static)) == 1
    assert len(_found(lambda q, d, k: tf.matmul(q @ k, tf.transpose(d)), rows_static)) == 1


def test_products_that_do_not_score_the_batch_against_itself_are_not_found():
    assert not _found(lambda q, d, k: q @ k)  # a Dense layer: [rows, 3]
    assert not _found(lambda q, d, k: tf.matmul(q, k, transpose_b=True) @ k)  # rows times weights only

    def backprop(q, d, k):  # a Dense layer's backward pass (operands of unknown rows, under the tape's scope)
        with tf.GradientTape() as tape:
            tape.watch(k)
            loss = tf.reduce_sum(q @ k)
        return tape.gradient(loss, k)
    assert not _found(backprop)
    assert not _found(lambda q, d, k: tf.matmul(q, d, transpose_a=True))  # a Gram matrix: [3, 3]
    # Candidates gathered over the workers (kp.all_gather's output, marked in the traced step's graph).
    assert not _found(lambda q, d, k: tf.matmul(q, tf.transpose(rows._gathered(tf.identity(d)) @ k)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("architecture", ["hybrid", "allreduce"])
def test_in_batch_negatives_gathered_over_the_workers_match_one_plain_process(tmp_path, architecture):
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path, ["sync", architecture])
    assert run.returncode == 0, run.report()
    # The shared table is on the PS (replicated under allreduce): the candidates' gradients reach it through the
    # gather's.
    where = "replicated" if architecture == "allreduce" else "ps[0]"
    log = run.logs()["worker-0.log"]
    assert f"placement: retrieval/embedding/embeddings [120, 6] -> {where}" in log
    assert WARNING not in log
    _assert_equal(ref, got)


@pytest.mark.multiprocess
def test_queries_centered_over_the_gathered_batch_match_one_plain_process(tmp_path):
    # The mean over kp.all_gather's rows is one process's mean over the global batch (the last batch's 21 rows too),
    # and gradients flow back to every worker's rows through it.
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path, args=["centered"])
    assert run.returncode == 0, run.report()
    _assert_equal(ref, got)


@pytest.mark.multiprocess
def test_in_batch_negatives_without_a_gather_train_per_worker_with_one_warning(tmp_path):
    # A retrieval task as recommender libraries ship it: the candidates are the worker's own batch. By contract each
    # worker scores its own rows (as under Horovod and tf.distribute): the model trains, the replicas agree, the loss
    # decreases, and worker 0 warns once, naming kp.all_gather.
    run = testing.run_local([sys.executable, PROGRAM, str(tmp_path), "kparallax", "no_gather"],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=1, timeout=240)
    assert run.returncode == 0, run.report()
    logs = run.logs()
    assert logs["worker-0.log"].count(WARNING) == 1 and "kp.all_gather" in logs["worker-0.log"]
    assert WARNING not in logs["worker-1.log"]
    first, second = (np.load(os.path.join(tmp_path, f"subclassed-{i}.npz")) for i in range(2))
    assert first.files == second.files
    for key in first.files:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    losses = first[first.files[-1]]  # both epochs' losses, then the evaluated one
    assert losses[1] < losses[0], losses


def _assert_equal(ref, got, names=("subclassed", "functional")):
    """The models' weights, epoch losses and evaluated loss in ``got`` (``names``.npz) equal one plain process's in
    ``ref``."""
    for name in names:
        a, b = np.load(os.path.join(ref, f"{name}.npz")), np.load(os.path.join(got, f"{name}.npz"))
        assert a.files == b.files, name
        for key in a.files:  # weights, then both epochs' losses and the evaluated loss
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")


@pytest.mark.multiprocess
def test_all_gather_in_an_asynchronous_step_is_refused(tmp_path):
    run = testing.run_local([sys.executable, PROGRAM, str(tmp_path), "kparallax", "async"],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=1, timeout=240)
    run.assert_refused(("kp.all_gather / kp.row_offset in an asynchronous training step (sync=False), where the "
                        "workers do not step together is not supported",))
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".npz")]
