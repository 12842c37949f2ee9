"""Which transformations of a custom train_step's gradients kparallax averages as they are, replays on averaged tape
outputs, or refuses (``kparallax/step/gradient_transforms.py``), read from traced graphs in one process. That the
replayed ones train as one process does is checked on 2 workers by ``test_keras_programs.py``
(``clipped_gradients``, ``clipped_by_tf_gradients``, ``clipped_with_table``), the refusals by ``test_launcher.py``."""

import re

import pytest
import tensorflow as tf

from kparallax.step import gradient_transforms



class _Vars:
    """The test model's variables, made when a test first needs them (another test file may change the eager
    context, e.g. by starting an in-process server, before or after this module is imported)."""

    def __getattr__(self, name):
        if name not in ("table", "kernel", "bias", "scale"):  # pytest's collection asks for others: make nothing
            raise AttributeError(name)
        made = {"table": tf.Variable(tf.ones([6, 2]), name="table"),
                "kernel": tf.Variable(tf.ones([2, 3]), name="kernel"),
                "bias": tf.Variable(tf.zeros([3]), name="bias"),
                "scale": tf.Variable(4.0, trainable=False, name="loss_scale")}
        self.__dict__.update(made)
        return made[name]


V = _Vars()


@pytest.fixture(autouse=True)
def _fresh_variables():
    V.__dict__.clear()
    yield
    V.__dict__.clear()  # none left alive: an in-process PS test connecting later refuses live variables


def _dense(clip):
    return lambda grads, loss: grads[:1] + list(clip(grads[1:]))


def _planned(transform, on_ps=None, clipping=False, eager=False, ps_averages=True, stripe_of=None,
             graph_gradients=False):
    """Traces a step whose gradients ``transform(grads, loss)`` changes (or runs it eagerly), then ``plan`` on 2
    workers: the positions it replays (or None). The gradients taken by the step's tape, or by ``tf.gradients`` if
    ``graph_gradients``."""
    result = {}
    on_ps = (V.table,) if on_ps is None else on_ps

    def step(ids):
        with gradient_transforms.recording():
            with tf.GradientTape() as tape:
                hidden = tf.reduce_mean(tf.nn.embedding_lookup(V.table, ids), axis=1)
                loss = tf.reduce_mean(tf.square(tf.matmul(hidden, V.kernel) + V.bias))
            variables = [V.table, V.kernel, V.bias]
            grads = transform(tf.gradients(loss, variables) if graph_gradients else tape.gradient(loss, variables),
                              loss)
            replay = gradient_transforms.plan(list(zip(grads, variables)), lambda v: any(v is p for p in on_ps), 2,
                                              clipping=clipping, ps_averages=ps_averages, stripe_of=stripe_of)
        result["replayed"] = None if replay is None else [j for j, (g, _) in enumerate(replay.local) if g is None]
        return loss

    # an unknown batch size, as Keras' train function traces its step
    traced = step if eager else tf.function(step, autograph=False,
                                            input_signature=[tf.TensorSpec([None, 2], tf.int32)])
    traced(tf.constant([[0, 1], [2, 2]]))
    return result["replayed"]


@pytest.mark.parametrize("name, transform", [
    ("unchanged", lambda grads, loss: grads),
    ("a constant factor", lambda grads, loss: [grads[0]] + [g * 0.5 for g in grads[1:]]),
    ("a loss scale (a variable)", lambda grads, loss: [grads[0]] + [g / V.scale for g in grads[1:]]),
    ("the table's slices scaled", lambda grads, loss: [tf.IndexedSlices(grads[0].values * 2.0, grads[0].indices,
                                                                        grads[0].dense_shape)] + grads[1:]),
    ("the sum of two gradients", lambda grads, loss: [grads[0], grads[1], grads[2] + 0.1 * grads[2]]),
    ("a factor from a variable", _dense(lambda gs: [g * tf.norm(V.table) for g in gs])),
])
def test_affine_transformations_are_averaged_as_they_are(name, transform):
    assert _planned(transform) is None, name


@pytest.mark.parametrize("name, transform, replayed", [
    ("global norm", _dense(lambda gs: tf.clip_by_global_norm(gs, 0.1)[0]), [1, 2]),
    ("by value", lambda grads, loss: grads[:2] + [tf.clip_by_value(grads[2], -0.1, 0.1)], [2]),
    ("normalized", _dense(lambda gs: [g / (tf.norm(g) + 1e-6) for g in gs]), [1, 2]),
    ("divided by its row count", lambda grads, loss: [tf.IndexedSlices(
        grads[0].values / tf.cast(tf.shape(grads[0].values)[0], tf.float32), grads[0].indices,
        grads[0].dense_shape)] + grads[1:], [0]),
    ("a constant picked by its ids", lambda grads, loss: [tf.IndexedSlices(
        tf.gather(tf.ones([6, 2]), grads[0].indices), grads[0].indices, grads[0].dense_shape)] + grads[1:], [0]),
])
def test_other_transformations_of_replicated_gradients_are_replayed(name, transform, replayed):
    assert _planned(transform) == replayed, name


def test_gradients_taken_by_tf_gradients_are_replayed_as_the_tape_s():
    # Before, tf.gradients' outputs were not seen as gradients: a global norm clipped each worker's own gradients and
    # a custom train_step trained apart from one process, silently (keras_programs' clipped_by_tf_gradients: 0.028
    # off after 2 epochs).
    assert _planned(_dense(lambda gs: tf.clip_by_global_norm(gs, 0.1)[0]), graph_gradients=True) == [1, 2]
    assert _planned(lambda grads, loss: tf.clip_by_global_norm(grads, 0.1)[0], graph_gradients=True) == [0, 1, 2]
    assert _planned(lambda grads, loss: [grads[0]] + [g * 0.5 for g in grads[1:]], graph_gradients=True) is None


@pytest.mark.parametrize("table_on_ps", [False, True], ids=["replicated table", "table on the PS"])
def test_a_global_norm_over_every_gradient_is_replayed(table_on_ps):
    on_ps = (V.table,) if table_on_ps else ()
    assert _planned(lambda grads, loss: tf.clip_by_global_norm(grads, 0.1)[0], on_ps=on_ps) == [0, 1, 2]


def test_a_norm_reading_the_table_s_gradient_replays_the_others():
    def transform(grads, loss):
        factor = tf.minimum(1.0, 0.1 / tf.linalg.global_norm([grads[0].values, grads[1]]))
        return grads[:1] + [g * factor for g in grads[1:]]

    assert _planned(transform) == [1, 2]


@pytest.mark.parametrize("transform, message, options", [
    (lambda grads, loss: [grads[0]] + [g / (loss + 1.0) for g in grads[1:]],
     "because it involves a value of this worker's own ('add", {}),
    (lambda grads, loss: tf.clip_by_global_norm(grads, 0.1)[0],
     "transforms the gradient of 'table:0' by a function of its gradients (L2Loss op 'global_norm/L2Loss', e.g. "
     "tf.clip_by_global_norm or tf.clip_by_value) that kparallax cannot compute on the global batch's gradients, "
     "because it involves the optimizer's clipnorm / clipvalue / global_clipnorm too", {"clipping": True}),
    (lambda grads, loss: tf.clip_by_global_norm(grads, 0.1)[0],
     "transforms the gradient of 'table:0' by a function of its gradients (L2Loss op 'global_norm/L2Loss', e.g. "
     "tf.clip_by_global_norm or tf.clip_by_value) that kparallax cannot compute on the global batch's gradients, "
     "because it involves average_sparse=False", {"ps_averages": False}),
])
def test_what_cannot_be_one_process_s_is_refused(transform, message, options):
    with pytest.raises(ValueError, match=re.escape(message)):
        _planned(transform, **options)


def test_a_clip_by_global_norm_reading_variables_is_replayed():
    reading = _dense(lambda gs: tf.clip_by_global_norm(gs + [tf.convert_to_tensor(V.table)], 0.1)[0][:2])
    assert _planned(reading) == [1, 2]


def test_under_run_eagerly_only_the_tape_s_own_gradients_are_taken():
    with pytest.raises(ValueError, match="With run_eagerly=True, kparallax cannot see how a train_step computed"):
        _planned(lambda grads, loss: [grads[0]] + [g * 0.5 for g in grads[1:]], eager=True)
    assert _planned(lambda grads, loss: grads, eager=True) is None


class _Table:
    """A partitioned table as ``plan``'s ``stripe_of`` names it: its path and its stripes."""
    path = "pooled/table"
    shards = (None, None, None)


def _first_of_3_stripes(variable):
    return (_Table, 0) if variable is V.table else None


def _each(axes):
    return lambda grads, loss: [tf.clip_by_norm(g, 0.1, axes=axes) for g in grads]


@pytest.mark.parametrize("name, transform, mixing", [
    ("each by its own norm", _each(None), "Sum op 'clip_by_norm/Sum'"),
    ("a norm over the rows only", _each([0]), "Sum op 'clip_by_norm/Sum'"),
    ("by a global norm of its own", lambda grads, loss: [tf.clip_by_global_norm(grads[:1], 0.1)[0][0]] + grads[1:],
     "L2Loss op 'global_norm/L2Loss'"),
])
def test_a_transformation_combining_the_rows_of_a_stripe_s_gradient_is_refused(name, transform, mixing):
    """The table is 1 of 3 stripes: a norm of its gradient would be the stripe's, where one process's is the whole
    table's."""
    with pytest.raises(ValueError, match=re.escape(
            f"stripe(s) [0] of the 3 stripes of table 'pooled/table', by an op that combines the gradient's rows "
            f"({mixing}")):
        _planned(transform, stripe_of=_first_of_3_stripes)
    assert _planned(transform) is not None, name  # the same with the table in one piece: replayed


@pytest.mark.parametrize("name, transform", [
    ("each row by its own norm", _each([-1])),
    ("by value", lambda grads, loss: [tf.clip_by_value(grads[0], -0.1, 0.1)] + grads[1:]),
])
def test_a_transformation_acting_on_each_row_of_a_stripe_is_replayed(name, transform):
    assert _planned(transform, stripe_of=_first_of_3_stripes) is not None, name
