"""step/row_axes.py: which axis of a traced tensor holds the batch's rows, followed through the ops a step makes
(element-wise, reductions, shape ops, slices, gathers, products; a reshape splitting each row's values into entries
and joining them back; into the functions it calls and a cond's branches), with the batch's size unknown and
static; which functions of a statistic of the batch are ``nonlinear`` meetings. Meetings are tested through their
refusal in ``test_rows.py``."""

import numpy as np
import tensorflow as tf

from kparallax.step import row_axes

STATISTIC, UNKNOWN, ROW = row_axes.STATISTIC, row_axes.UNKNOWN, row_axes.ROW

# Each expression of the batch x [B, 3] and its ids [B] (w: a [3, 3] weight, no rows), and its rows' axis.
EXPRESSIONS = {
    "element-wise with a weight": (lambda x, ids, w: tf.nn.relu(x * w[0] + 1.0), 0),
    "a dense layer": (lambda x, ids, w: x @ w, 0),
    "the rows on the other side": (lambda x, ids, w: tf.matmul(w, x, transpose_b=True), 1),
    "a product over the rows": (lambda x, ids, w: tf.matmul(x, x, transpose_a=True), STATISTIC),
    "a product over the rows of a transpose": (lambda x, ids, w: tf.transpose(x) @ (x * 2.0), STATISTIC),
    "column sums by a product": (lambda x, ids, w: tf.matmul(tf.ones_like(x[:, :1]), x, transpose_a=True), STATISTIC),
    "an einsum keeping them": (lambda x, ids, w: tf.einsum("bi,ij->jb", x, w), 1),
    "an einsum summing them": (lambda x, ids, w: tf.einsum("bi,bj->ij", x, x), STATISTIC),
    "a sum per row": (lambda x, ids, w: tf.reduce_sum(x, axis=1), 0),
    "a sum per row, kept": (lambda x, ids, w: tf.reduce_sum(x, axis=-1, keepdims=True), 0),
    "a sum of everything": (lambda x, ids, w: tf.reduce_sum(x), STATISTIC),
    "a mean over the rows": (lambda x, ids, w: tf.reduce_mean(x, axis=0), STATISTIC),
    "a statistic's function": (lambda x, ids, w: tf.reduce_mean(x, axis=0) * 2.0 + w, STATISTIC),
    "a statistic filled in": (lambda x, ids, w: tf.fill([2, 3], tf.reduce_max(x)), STATISTIC),
    "zeros shaped as a statistic": (lambda x, ids, w: x + tf.zeros_like(tf.reduce_mean(x, axis=0)), 0),
    "an argmax per row": (lambda x, ids, w: tf.argmax(x, axis=1), 0),
    "a transpose": (lambda x, ids, w: tf.transpose(x), 1),
    "an axis before": (lambda x, ids, w: tf.expand_dims(x, 0), 1),
    "an axis after": (lambda x, ids, w: x[:, None], 0),
    "a slice of the columns": (lambda x, ids, w: x[..., :2], 0),
    "a column": (lambda x, ids, w: x[:, 1], 0),
    "a new axis first": (lambda x, ids, w: x[None, :, 1:], 1),
    "some rows": (lambda x, ids, w: x[:2], UNKNOWN),
    "one row": (lambda x, ids, w: x[0], UNKNOWN),
    "flattened per row": (lambda x, ids, w: tf.keras.layers.Flatten()(x[:, :, None]), 0),
    "each row's values as entries": (lambda x, ids, w: tf.reshape(x, [-1]), 0),
    "entries joined back into rows": (lambda x, ids, w: tf.reshape(tf.reshape(x, [-1, 1]) * 2.0, [-1, 3]), 0),
    "entries split by a shape read": (lambda x, ids, w: tf.reshape(x[:, None] + w, [-1, tf.shape(w)[-1]]), 0),
    "two whole rows joined into one entry": (lambda x, ids, w: tf.reshape(x, [-1, 6]), 0),
    "rows joined in pairs, each pair's first": (lambda x, ids, w: tf.reshape(x, [-1, 2, 3])[:, 0], 0),
    "pairs of rows split back into rows": (lambda x, ids, w: tf.reshape(tf.reshape(x, [-1, 6]) * 2.0, [-1, 3]), 0),
    "rows joined into two entries": (lambda x, ids, w: tf.reshape(x, [2, -1]), UNKNOWN),
    "a row and part of the next in one entry": (lambda x, ids, w: tf.reshape(x, [-1, 2]), 0),
    # its first size can only be the values over 2, as -1 gives (before: unknown, a meeting past it missed)
    "parts of rows in a count of entries computed": (
        lambda x, ids, w: tf.reshape(x, tf.stack([tf.shape(x)[0] * 3 // 2, 2])), 0),
    "pairs of rows in a count of entries computed": (
        lambda x, ids, w: tf.reshape(x, tf.stack([tf.shape(x)[0] // 2, 2, 3]))[:, 1], 0),
    "rows of distinct ids, repeated": (lambda x, ids, w: tf.gather(tf.gather(w, tf.unique(ids)[0]), tf.unique(ids)[1]),
                                       0),
    "a set of distinct ids": (lambda x, ids, w: tf.unique(ids)[0], None),
    "tiled columns": (lambda x, ids, w: tf.tile(x, [1, 2]), 0),
    "tiled rows": (lambda x, ids, w: tf.tile(x, [2, 1]), 0),
    "columns tiled by a count read": (lambda x, ids, w: tf.tile(x, tf.stack([1, tf.shape(w)[0]])), 0),
    "columns split": (lambda x, ids, w: tf.split(x, 3, axis=1)[2], 0),
    "columns unstacked": (lambda x, ids, w: tf.unstack(x, axis=1)[0], 0),
    "rows unstacked": (lambda x, ids, w: tf.unstack(x, num=4, axis=0)[0], UNKNOWN),
    "columns joined": (lambda x, ids, w: tf.concat([x, x * 2.0], axis=1), 0),
    "rows joined": (lambda x, ids, w: tf.concat([x, x], axis=0), 0),
    "stacked after the rows": (lambda x, ids, w: tf.stack([x, x], axis=1), 0),
    "stacked before the rows": (lambda x, ids, w: tf.stack([x, x]), 1),
    "looked up by id": (lambda x, ids, w: tf.gather(w, ids), 0),
    "gathered columns": (lambda x, ids, w: tf.gather(x, [2, 0], axis=1), 0),
    "gathered rows": (lambda x, ids, w: tf.gather(x, [2, 0]), UNKNOWN),
    "one-hot ids": (lambda x, ids, w: tf.one_hot(ids, 5), 0),
    "padded columns": (lambda x, ids, w: tf.pad(x, [[0, 0], [1, 1]]), 0),
    "padded rows": (lambda x, ids, w: tf.pad(x, [[1, 0], [0, 0]]), UNKNOWN),
    "its shape": (lambda x, ids, w: tf.shape(x), None),
    "a softmax per row": (lambda x, ids, w: tf.nn.softmax(x), 0),
    "each row's top values": (lambda x, ids, w: tf.math.top_k(x, k=2).values, 0),
    "each row's values sorted": (lambda x, ids, w: tf.sort(x, axis=-1, direction="DESCENDING"), 0),
    "each row's order": (lambda x, ids, w: tf.argsort(x), 0),
    "each row's values rolled": (lambda x, ids, w: tf.roll(x, shift=1, axis=1), 0),
    "each row's values reversed": (lambda x, ids, w: tf.reverse(x[None], axis=[2]), 1),
    "a function of its own": (lambda x, ids, w: tf.function(lambda t: t * 2.0)(x), 0),
    "a function's column sums": (lambda x, ids, w: tf.function(lambda t: tf.reduce_sum(t, 0))(x), STATISTIC),
    "a function called in a function": (lambda x, ids, w: tf.function(lambda t: tf.function(tf.transpose)(t))(x), 1),
    "a function capturing a weight": (lambda x, ids, w: tf.function(lambda t: t @ w)(x), 0),
    "entries joined back in a function": (
        lambda x, ids, w: tf.function(lambda t: tf.reshape(t, [-1, 3]))(tf.reshape(x, [-1, 1]) * 2.0), 0),
    "a cond's branches": (lambda x, ids, w: tf.cond(w[0, 0] > 0, lambda: x * 2.0, lambda: x + w[0]), 0),
    "a while loop keeping the rows": (
        lambda x, ids, w: tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h @ w), (0, x))[1], 0),
    "a loop's state of the batch's size, rows from its first step": (
        lambda x, ids, w: tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h + x),
                                        (0, tf.zeros([tf.shape(x)[0], 3])))[1], 0),
    "a Keras LSTM's last output": (lambda x, ids, w: tf.keras.layers.LSTM(2)(x[:, None, :] * tf.ones([1, 4, 1])), 0),
    "a Keras GRU's sequences": (
        lambda x, ids, w: tf.keras.layers.GRU(2, return_sequences=True)(x[:, None, :] * tf.ones([1, 4, 1])), 0),
    "a map over the rows": (lambda x, ids, w: tf.map_fn(lambda r: r * 2.0, x), 0),
    "a map of each row's own mean": (
        lambda x, ids, w: tf.map_fn(lambda r: tf.nn.relu(r[None] @ w)[0] - tf.reduce_mean(r), x), 0),
    "a map of the transposed rows": (lambda x, ids, w: tf.map_fn(lambda r: r * 2.0, tf.transpose(x)), 1),
    "a map of a function of each row": (lambda x, ids, w: tf.map_fn(tf.function(lambda r: r[::-1]), x), 0),
    "a map over a row's values, in a map": (
        lambda x, ids, w: tf.map_fn(lambda r: tf.reduce_sum(tf.map_fn(lambda v: v * w[0, 0], r)), x), 0),
    "a map's rows and a list of a row's values": (
        lambda x, ids, w: tf.map_fn(lambda r: tf.TensorArray(tf.float32, 2).write(0, r).write(1, r).stack(), x), 0),
    "a list of a row's values": (
        lambda x, ids, w: tf.TensorArray(tf.float32, 1).write(0, tf.TensorArray(tf.float32, 4).unstack(x).read(0))
        .stack(), ROW),
    "a map of a row's values gathered": (lambda x, ids, w: tf.map_fn(lambda i: tf.gather(w, i), ids,
                                                                     fn_output_signature=tf.float32), 0),
    "a map reading a row's size": (lambda x, ids, w: tf.map_fn(lambda r: r / tf.cast(tf.size(r), tf.float32), x), 0),
    "a cond's branches disagreeing": (lambda x, ids, w: tf.cond(w[0, 0] > 0, lambda: tf.transpose(x) @ x,
                                                                lambda: w), UNKNOWN),
}


# The expressions above that take rows of the batch by their place in it: ``sliced`` meetings where they are made.
TAKEN_BY_PLACE = {"some rows", "one row", "rows joined into two entries", "gathered rows", "padded rows",
                  "rows unstacked"}


def _axes(rows):
    """Each expression's rows' axis, traced with a batch of ``rows`` rows (None: unknown), and the names of the
    expressions whose op made a meeting."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
        ids = tf.compat.v1.placeholder(tf.int32, [rows])
        w = tf.constant(np.ones((3, 3), np.float32))
        first = len(graph.get_operations())
        outputs = {name: build(x, ids, w) for name, (build, _) in EXPRESSIONS.items()}
        axes = row_axes.RowAxes((x, ids))
        axes.follow(graph.get_operations()[first:])
        met = {m.op.name: m.kind for m in axes.meetings}
        return ({name: axes.axis(output) for name, output in outputs.items()},
                {name: met[output.op.name] for name, output in outputs.items() if output.op.name in met},
                len(axes.meetings))


def test_the_rows_axis_is_followed_through_the_ops_of_a_step():
    for rows in (None, 4):
        got, met, count = _axes(rows)
        for name, (_, expected) in EXPRESSIONS.items():
            assert got[name] == expected, (rows, name, got[name])
        assert met == {name: "sliced" for name in TAKEN_BY_PLACE} and count == len(TAKEN_BY_PLACE), (rows, met)


def _followed(build, rows, columns=3):
    """``RowAxes`` of the batch (x [rows, 3], y [rows, ``columns``]) followed through ``build(x, y)``, traced with
    ``rows`` rows (None: unknown); x and the output."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
        y = tf.compat.v1.placeholder(tf.float32, [rows, columns])
        first = len(graph.get_operations())
        output = build(x, y)
        axes = row_axes.RowAxes((x, y))
        axes.follow(graph.get_operations()[first:])
    return axes, x, output


# Rows of the batch x [B, 3] (y: another batch tensor [B, 2]) taken by their place in it: whether each makes a
# ``sliced`` meeting, and whether its bounds are left to the step (checked on the output's size).
TAKEN = {
    "the first row as an anchor": (lambda x, y: x - x[:1], "sliced"),
    "the last row": (lambda x, y: x[-1], "sliced"),
    "all rows but the first": (lambda x, y: x[1:], "sliced"),
    "every other row": (lambda x, y: x[::2], "sliced"),
    "the rows reversed by a slice": (lambda x, y: x[::-1], "sliced"),
    "halves split": (lambda x, y: tf.split(x, 2)[1], "sliced"),
    "halves split by sizes": (lambda x, y: tf.split(x, [1, -1])[0], "sliced"),
    "a slice op of some rows": (lambda x, y: tf.slice(x, [1, 0], [-1, 3]), "sliced"),
    "rows shuffled": (lambda x, y: tf.random.shuffle(x), "sliced"),
    "rows at a shuffled range": (lambda x, y: tf.gather(x, tf.random.shuffle(tf.range(tf.shape(x)[0]))), "sliced"),
    "rows joined into 4 entries of pairs": (lambda x, y: tf.reshape(x, [4, -1, 3]), "sliced"),
    "rows joined into 2 entries by a shape read": (lambda x, y: tf.reshape(x, [2, tf.shape(x)[0] // 2, 3]),
                                                   "sliced"),
    "a row padded on before the batch": (lambda x, y: tf.pad(x, [[1, 0], [0, 0]]), "sliced"),
    "rows mirrored on both ends": (lambda x, y: tf.pad(x, [[1, 1], [0, 0]], mode="REFLECT"), "sliced"),
    "as many rows as another batch tensor": (lambda x, y: x[:tf.shape(y)[0]], "part"),
    "rows up to a count read": (lambda x, y: tf.slice(x, [0, 0], tf.stack([tf.shape(y)[0] - 1, 3])), "part"),
    "rows padded by a count read": (
        lambda x, y: tf.pad(x, tf.stack([tf.stack([0, tf.size(tf.unique(tf.cast(y[:, 0], tf.int32))[0])]), [0, 0]])),
        "part"),
    "a column": (lambda x, y: x[:, 1], None),
    "columns padded": (lambda x, y: tf.pad(x, [[0, 0], [2, 1]], constant_values=1.0), None),
    "columns from a count read": (lambda x, y: x[:, tf.shape(y)[1]:], None),
    "a slice op of the columns": (lambda x, y: tf.slice(x, [0, 1], [-1, 2]), None),
    "columns split": (lambda x, y: tf.split(x, 3, axis=1)[0], None),
    "one split": (lambda x, y: tf.split(x, 1)[0], None),
    "the whole batch as one entry (AUC's)": (lambda x, y: tf.reshape(x, [1, -1]), None),
    "pairs of consecutive rows": (lambda x, y: tf.reshape(x, [-1, 2, 3]), None),
    "rows of a weight at the batch's ids": (lambda x, y: tf.gather(tf.ones([5, 3]), tf.cast(y[:, 0], tf.int32)), None),
    "rows picked by a mask of their values": (lambda x, y: tf.boolean_mask(x, x[:, 0] > 0.0), None),
}


# Tensors of the batch x [B, 3] (y: [B, 3], another) joined along the rows, block after block (two views of the batch,
# as a contrastive loss joins them): the rows' axis, entries per row and blocks of what follows, and the meetings
# made on the way.
BLOCKS = {
    "two views joined": (lambda x, y: tf.concat([x, y * 2.0], axis=0), (0, 2, 2), []),
    "three joined": (lambda x, y: tf.concat([x, y, x], axis=0), (0, 3, 3), []),
    "a joined pair joined to a third": (lambda x, y: tf.concat([tf.concat([x, y], 0), x], 0), (0, 3, 3), []),
    "a dense layer of two views": (lambda x, y: tf.nn.relu(tf.concat([x, y], 0) @ tf.ones([3, 2])), (0, 2, 2), []),
    "stacked and flattened": (lambda x, y: tf.reshape(tf.stack([x, y]), [-1, 3]), (0, 2, 2), []),
    "transposed and flattened (a block per column)": (lambda x, y: tf.reshape(tf.transpose(x), [-1]), (0, 3, 3), []),
    "split back into its views": (lambda x, y: tf.split(tf.concat([x, y], 0), 2)[1], (0, 1, 1), []),
    "three split in three": (lambda x, y: tf.split(tf.concat([x, y, x], 0), 3)[2], (0, 1, 1), []),
    "each view by a shape read": (lambda x, y: tf.concat([x, y], 0)[tf.shape(x)[0]:], (UNKNOWN, 1, 1), []),
    "split by sizes read": (lambda x, y: tf.split(tf.concat([x, y], 0), [tf.shape(x)[0], tf.shape(y)[0]])[0],
                            (UNKNOWN, 1, 1), []),
    "the views apart again": (lambda x, y: tf.reshape(tf.concat([x, y], 0), [2, -1, 3]), (1, 1, 1), []),
    "each row's values as entries": (lambda x, y: tf.reshape(tf.concat([x, y], 0), [-1]), (0, 6, 2), []),
    "and joined back": (lambda x, y: tf.reshape(tf.reshape(tf.concat([x, y], 0), [-1]), [-1, 3]), (0, 2, 2), []),
    "rows of a view joined in pairs": (lambda x, y: tf.reshape(tf.concat([x, y], 0), [-1, 6]), (UNKNOWN, 1, 1), []),
    "split in four": (lambda x, y: tf.split(tf.concat([x, y], 0), 4)[0], (UNKNOWN, 1, 1), ["sliced"]),
    "its first row": (lambda x, y: tf.concat([x, y], 0)[:1], (UNKNOWN, 1, 1), ["sliced"]),
    "in three groups": (lambda x, y: tf.reshape(tf.concat([x, y], 0), [3, -1]), (UNKNOWN, 1, 1), ["sliced"]),
    "tiled twice (two copies of the batch, a block each)": (lambda x, y: tf.tile(x, [2, 1]), (0, 2, 2), []),
    "a joined pair tiled": (lambda x, y: tf.tile(tf.concat([x, y], 0), [3, 1]), (0, 6, 6), []),
    "tiled and split back": (lambda x, y: tf.split(tf.tile(x, [3, 1]), 3)[1], (0, 1, 1), []),
    "tiled, its first row": (lambda x, y: tf.tile(x, [2, 1])[:1], (UNKNOWN, 1, 1), ["sliced"]),
    "tiled and centered over its rows": (lambda x, y: tf.tile(x, [2, 1]) - tf.reduce_mean(tf.tile(x, [2, 1]), 0),
                                         (0, 2, 2), ["statistic"]),
    "centered over its rows": (lambda x, y: tf.concat([x, y], 0) - tf.reduce_mean(tf.concat([x, y], 0), axis=0),
                              (0, 2, 2), ["statistic"]),
    "a function of the views": (lambda x, y: tf.function(lambda t: tf.split(t * 2.0, 2)[0])(tf.concat([x, y], 0)),
                                (0, 1, 1), []),
    "a Keras LSTM over the views, split back": (
        lambda x, y: tf.split(tf.keras.layers.LSTM(2)(tf.concat([x, y], 0)[:, None, :] * tf.ones([1, 4, 1])), 2)[0],
        (0, 1, 1), []),
    "a Keras GRU's sequences over the views": (
        lambda x, y: tf.keras.layers.GRU(2, return_sequences=True)(
            tf.concat([x, y], 0)[:, None, :] * tf.ones([1, 4, 1])),
        (0, 2, 2), []),
    "a while loop summing the views, its state from zeros": (
        lambda x, y: tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h + tf.concat([x, y], 0) * 2.0),
                                   (0, tf.zeros([2 * tf.shape(x)[0], 3])))[1],
        (0, 2, 2), []),
}


def test_rows_joined_block_after_block_keep_their_blocks_and_split_back_into_them():
    # Before, a concat along the rows was UNKNOWN: a contrastive loss scoring [z1; z2] against itself trained 0.70
    # off one process on 2 workers, silently; a view split back out of it must not be taken for rows by their place.
    for rows in (None, 4):
        for name, (build, expected, kinds) in BLOCKS.items():
            axes, _, output = _followed(build, rows)
            got = (axes.axis(output), axes.entries(output), axes.blocks(output))
            assert got == expected, (rows, name, got)
            assert [m.kind for m in axes.meetings] == kinds, (rows, name, [m.op.name for m in axes.meetings])


# The batch x [B, 3] (y: [B, 3], another) joined along the rows to entries of something else than the batch (w: a
# weight [3, 3]; ids: int ids of each row; 2 sampled ids): the rows' axis, entries per row and blocks of what follows,
# and the meetings made on the way. A reduction or softmax along the join is a ``joined`` meeting; split back at the
# parts' edges, the rows are the batch's again and the other entries have none.
def _w():
    return tf.ones([3, 3])


def _ids(x):
    return tf.cast(x[:, 0], tf.int64)


def _sampled():
    return tf.constant([1, 2], tf.int64)


JOINS = {
    "a weight joined after the rows": (lambda x, y: tf.concat([x, _w()], 0), (UNKNOWN, 1, 1), []),
    "its mean": (lambda x, y: tf.reduce_mean(tf.concat([x * 2.0, _w()], 0)), (UNKNOWN, 1, 1), ["joined"]),
    "a mean along the rows, cast and scaled": (
        lambda x, y: tf.reduce_mean(2.0 * tf.cast(tf.concat([x, _w()], 0), tf.float64), axis=0), (UNKNOWN, 1, 1),
        ["joined"]),
    "a prior before the rows, summed": (
        lambda x, y: tf.reduce_sum(tf.concat([tf.reshape(_w(), [-1]), x[:, 0]], 0)), (UNKNOWN, 1, 1), ["joined"]),
    "a softmax over the rows and the weight's": (
        lambda x, y: tf.nn.softmax(tf.concat([x[:, 0], _w()[0]], 0)), (UNKNOWN, 1, 1), ["joined"]),
    "a dense layer of it, its mean": (lambda x, y: tf.reduce_mean(tf.nn.bias_add(tf.concat([x, _w()], 0) @ _w(),
                                                                              _w()[0])), (UNKNOWN, 1, 1), ["joined"]),
    "a dense layer of it, the rows split back": (
        lambda x, y: tf.split(tf.matmul(_w(), tf.concat([x, _w()], 0), transpose_b=True), [tf.shape(x)[0], 3],
                              axis=1)[0], (1, 1, 1), []),
    # replayed examples joined to the batch: their predictions against their labels, joined alike
    "replayed inputs' squared errors, their mean": (
        lambda x, y: tf.reduce_mean(tf.square(tf.concat([x, _w()], 0) @ _w() - tf.concat([y, _w() * 2.0], 0))),
        (UNKNOWN, 1, 1), ["joined"]),
    "flattened, its mean": (lambda x, y: tf.reduce_mean(tf.reshape(tf.concat([x, _w()], 0), [-1])),
                            (UNKNOWN, 1, 1), ["joined"]),
    "flattened, the rows split back": (
        lambda x, y: tf.split(tf.reshape(tf.concat([x, _w()], 0), [-1]), [3 * tf.shape(x)[0], -1])[0], (0, 3, 1), []),
    "flattened, the weight split back by its size": (
        lambda x, y: tf.reshape(tf.concat([x, _w()], 0), [-1])[-9:], (UNKNOWN, 1, 1), []),
    "a column squeezed, its sum": (lambda x, y: tf.reduce_sum(tf.squeeze(tf.concat([x, _w()], 0)[:, :1], 1)),
                                   (UNKNOWN, 1, 1), ["joined"]),
    # into the functions the step calls
    "its mean in a function": (lambda x, y: tf.function(tf.reduce_mean)(tf.concat([x, _w()], 0)), (UNKNOWN, 1, 1),
                               ["joined"]),
    "returned by a function, its mean": (
        lambda x, y: tf.reduce_mean(tf.function(lambda t: t * 2.0)(tf.concat([x, _w()], 0))), (UNKNOWN, 1, 1),
        ["joined"]),
    "the rows split back in a function": (
        lambda x, y: tf.function(lambda t, r: tf.split(t, [tf.shape(r)[0], -1])[0])(tf.concat([x, _w()], 0), y),
        (0, 1, 1), []),
    "a sum per entry along the columns": (lambda x, y: tf.reduce_sum(tf.concat([x, _w()], 0), axis=1),
                                          (UNKNOWN, 1, 1), []),
    "the rows split back": (lambda x, y: tf.split(tf.concat([x, _w()], 0), tf.stack([tf.shape(x)[0], 3]))[0],
                            (0, 1, 1), []),
    "the weight split back": (lambda x, y: tf.split(tf.concat([x, _w()], 0), [tf.shape(x)[0], -1])[1],
                              (None, 1, 1), []),
    "the rows sliced back by a shape read": (
        lambda x, y: tf.slice(tf.concat([x, _w()], 0), [0, 0], tf.stack([tf.shape(y)[0], -1])), (0, 1, 1), []),
    "the weight sliced back by a shape": (
        lambda x, y: tf.slice(tf.concat([x[:, 0], _w()[0]], 0), tf.shape(x[:, 0]), [-1]), (None, 1, 1), []),
    "the rows up to their count": (lambda x, y: (tf.concat([x, _w()], 0) * 2.0)[:tf.shape(x)[0]], (0, 1, 1), []),
    "the weight past them": (lambda x, y: tf.concat([x, _w()], 0)[tf.shape(x)[0]:], (None, 1, 1), []),
    "the rows after the weight": (lambda x, y: tf.concat([_w(), x], 0)[3:], (0, 1, 1), []),
    "all of it sliced": (lambda x, y: tf.reduce_mean(tf.concat([x, _w()], 0)[0:]), (UNKNOWN, 1, 1), ["joined"]),
    "the rows and a row more": (lambda x, y: tf.concat([x, _w()], 0)[:tf.shape(x)[0] + 1], (UNKNOWN, 1, 1), []),
    "pairs of values of each row, the rows split back": (
        lambda x, y: tf.split(tf.concat([tf.reshape(x, [-1, 1]), _w()[:2, :1]], 0), [3 * tf.shape(x)[0], 2])[0],
        (0, 3, 1), []),
    # a sampled softmax's lookup: the true and sampled ids in one gather, the looked-up rows split back
    "true and sampled ids looked up, the true rows": (
        lambda x, y: tf.split(tf.gather(_w(), tf.concat([_ids(x), _sampled()], 0)),
                              tf.stack([tf.shape(_ids(x))[0], 2]))[0], (0, 1, 1), []),
    "a column of the looked-up rows, the true ids' split back": (
        lambda x, y: tf.split(tf.gather(_w(), tf.concat([_ids(x), _sampled()], 0))[:, 0], [tf.shape(x)[0], -1])[0],
        (0, 1, 1), []),
    "all but the last entry": (lambda x, y: tf.reduce_mean(tf.concat([x, _w()], 0)[:-1]), (UNKNOWN, 1, 1), []),
    "the sampled rows": (
        lambda x, y: tf.split(tf.gather(_w(), tf.concat([_ids(x), _sampled()], 0)), [tf.shape(x)[0], 2])[1],
        (None, 1, 1), []),
    "a softmax over the rows and the weight's, along the first axis": (
        lambda x, y: tf.nn.softmax(tf.concat([x, _w()], 0), axis=0), (UNKNOWN, 1, 1), ["joined"]),
    "the true rows' softmax over the batch": (
        lambda x, y: tf.nn.softmax(tf.split(tf.gather(_w(), tf.concat([_ids(x), _sampled()], 0)),
                                            [tf.shape(x)[0], -1])[0], axis=0), (UNKNOWN, 1, 1), ["softmax"]),
    # a new axis; through loops and lists (a Keras RNN reads its time steps from a list in a while loop)
    "a new axis, a mean along the rows": (lambda x, y: tf.reduce_mean(tf.concat([x, _w()], 0)[:, None] * 2.0, axis=0),
                                          (UNKNOWN, 1, 1), ["joined"]),
    "a new axis after an ellipsis, the rows sliced back": (
        lambda x, y: tf.concat([x, _w()], 0)[..., None][:tf.shape(x)[0]], (0, 1, 1), []),
    "a Keras LSTM's last output of it, its mean": (
        lambda x, y: tf.reduce_mean(tf.keras.layers.LSTM(2)(tf.concat([x, _w()], 0)[:, None, :] * tf.ones([1, 4, 1]))),
        (UNKNOWN, 1, 1), ["joined"]),
    "a Keras GRU's sequences of it, the rows split back": (
        lambda x, y: tf.split(tf.keras.layers.GRU(2, return_sequences=True)(
            tf.concat([x, _w()], 0)[:, None, :] * tf.ones([1, 4, 1])), [tf.shape(x)[0], -1])[0], (0, 1, 1), []),
    "a bidirectional GRU's sequences of it, their mean": (
        lambda x, y: tf.reduce_mean(tf.keras.layers.Bidirectional(tf.keras.layers.GRU(2, return_sequences=True))(
            tf.concat([x, _w()], 0)[:, None, :] * tf.ones([1, 4, 1]))), (UNKNOWN, 1, 1), ["joined"]),
    "a scan over its columns, its mean": (
        lambda x, y: tf.reduce_mean(tf.scan(lambda h, c: h * 0.5 + c, tf.transpose(tf.concat([x, _w()], 0)))),
        (UNKNOWN, 1, 1), ["joined"]),
    "a while loop's state from it, its mean": (
        lambda x, y: tf.reduce_mean(tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h @ _w())),
                                                  (0, tf.concat([x, _w()], 0)))[1]), (UNKNOWN, 1, 1), ["joined"]),
    "a while loop's state from it, the rows split back": (
        lambda x, y: tf.split(tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h @ _w())),
                                            (0, tf.concat([x, _w()], 0)))[1], [tf.shape(x)[0], -1])[0], (0, 1, 1), []),
    "a while loop reading it into a zeros state, its mean": (
        lambda x, y: (lambda j: tf.reduce_mean(tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h + j * 2.0),
                                                             (0, tf.zeros_like(j)))[1]))(tf.concat([x, _w()], 0)),
        (UNKNOWN, 1, 1), ["joined"]),
    # tf.map_fn over its entries (a list of them): each entry's own, stacked back the join
    "a map over its entries, its mean": (lambda x, y: tf.reduce_mean(tf.map_fn(lambda e: e * 2.0,
                                                                               tf.concat([x, _w()], 0))),
                                         (UNKNOWN, 1, 1), ["joined"]),
    "a map of each entry's sum, the rows sliced back": (
        lambda x, y: tf.map_fn(lambda e: tf.reduce_sum(e), tf.concat([x, _w()], 0))[:tf.shape(x)[0]], (0, 1, 1), []),
    "a scan carrying a value along its entries, the rows sliced back": (
        lambda x, y: tf.scan(lambda a, e: a * 0.5 + e, tf.concat([x, _w()], 0))[:tf.shape(x)[0]], (UNKNOWN, 1, 1),
        ["joined"]),
    "its columns in a TensorArray stacked back, a mean along the rows": (
        lambda x, y: tf.reduce_mean(tf.TensorArray(tf.float32, 3).unstack(tf.transpose(tf.concat([x, _w()], 0)))
                                    .stack(), axis=1), (UNKNOWN, 1, 1), ["joined"]),
}


def test_rows_joined_to_other_entries_meet_where_reduced_along_the_join_and_split_back_into_rows():
    # Before, such a join was UNKNOWN: a custom train_step's mean over tf.concat([per_example, prior], 0) trained
    # 0.010 off one process on 2 workers, silently; and refusing every such join refused LM1B's sampled softmax.
    for rows in (None, 4):
        for name, (build, expected, kinds) in JOINS.items():
            axes, x, output = _followed(build, rows)
            got = (axes.axis(output), axes.entries(output), axes.blocks(output))
            assert got == expected, (rows, name, got)
            assert [m.kind for m in axes.meetings] == kinds, (rows, name, [m.op.name for m in axes.meetings])
            for meeting in axes.meetings:
                assert meeting.checked, (rows, name, meeting)
                if meeting.kind == "joined":  # checked on the batch's part, at the join
                    part, axis = meeting.checked[0]
                    assert meeting.source.type == "ConcatV2" and axis == 0, (rows, name)
                    assert any(part is t for t in meeting.source.inputs), (rows, name)


def test_entries_of_the_batch_s_size_joined_to_the_rows_are_not_a_join():
    # Zeros shaped by the batch's size read while the step runs grow with the batch as its rows do: a mean over both
    # is the workers' average of theirs, not a meeting (of a batch of static size the size is a constant: taken for
    # entries of something else, so such a mean is refused there).
    axes, _, output = _followed(lambda x, y: tf.reduce_mean(tf.concat([x, tf.zeros(tf.stack([tf.shape(y)[0], 3]))],
                                                                      0)), None)
    assert axes.axis(output) == UNKNOWN and not axes.meetings
    axes, _, output = _followed(lambda x, y: tf.reduce_mean(tf.concat([x, tf.zeros([2, 3])], 0)), None)
    assert [m.kind for m in axes.meetings] == ["joined"]


def test_rows_taken_by_their_place_in_the_batch_are_sliced_meetings():
    # Before, each of these was UNKNOWN and met nothing: a loss of a batch laid out in halves and split trained 0.11
    # off one process, silently.
    for rows in (None, 4):
        for name, (build, expected) in TAKEN.items():
            axes, x, _ = _followed(build, rows, columns=2)
            got = [("part" if m.part else m.kind) for m in axes.meetings]
            assert got == ([expected] if expected else []), (rows, name, got)
            assert all(m.rows[0][0] is x and m.rows[0][1] == 0 for m in axes.meetings), (rows, name)


def _b(t):
    return tf.shape(t)[0]


# Every pair of rows of the batch x [B, 3] and y [B, 3] built, each pair in one entry: the meetings made, with the
# batch's size unknown (None) and static (4). With a static size, tf.shape(x)[0] is the constant 4: a tile by it is 4
# blocks (as tf.tile(x, [4, 1])), met where its entries are paired with rows in another order. Then what builds no
# pairs.
PAIRS = {
    "tiled by the batch's size": (lambda x, y: tf.tile(x, tf.stack([_b(x), 1])), {None: ["tiled"], 4: []}),
    "repeated by the batch's size": (lambda x, y: tf.repeat(x, _b(y), axis=0), {None: ["tiled"], 4: []}),
    "repeated beside tiled": (lambda x, y: tf.concat([tf.repeat(x, _b(y), axis=0), tf.tile(y, [_b(x), 1])], 1),
                              {None: ["tiled", "tiled"], 4: ["pairwise"]}),
    "repeated minus tiled": (lambda x, y: tf.repeat(x, _b(y), axis=0) - tf.tile(y, [_b(x), 1]),
                             {None: ["tiled", "tiled"], 4: ["pairwise"]}),
    "a new axis tiled by the batch's size, side by side": (
        lambda x, y: tf.concat([tf.tile(x[:, None], [1, _b(y), 1]), tf.tile(y[None], [_b(x), 1, 1])], -1),
        {None: ["tiled", "tiled", "pairwise"], 4: ["pairwise"]}),
    "broadcast side by side": (
        lambda x, y: tf.concat([tf.broadcast_to(x[:, None], tf.stack([_b(x), _b(y), 3])),
                                tf.broadcast_to(y[None], tf.stack([_b(x), _b(y), 3]))], -1),
        {None: ["pairwise"], 4: ["pairwise"]}),
    "broadcast and stacked": (
        lambda x, y: tf.stack([tf.broadcast_to(x[:, None], tf.stack([_b(x), _b(y), 3])),
                               tf.broadcast_to(y[None], tf.stack([_b(x), _b(y), 3]))], -1),
        {None: ["pairwise"], 4: ["pairwise"]}),
    "columns tiled by a count read": (lambda x, y: tf.tile(x, tf.stack([1, tf.shape(y)[1]])), {None: [], 4: []}),
    "a weight tiled by the batch's size (a position's embedding)": (
        lambda x, y: x + tf.tile(tf.ones([1, 3]), [_b(x), 1]), {None: [], 4: []}),
    "two copies beside two views": (lambda x, y: tf.tile(x, [2, 1]) * tf.concat([y, x], 0), {None: [], 4: []}),
    "each row repeated beside itself repeated": (
        lambda x, y: tf.repeat(x, 2, axis=0) - tf.repeat(y, 2, axis=0), {None: [], 4: []}),
}


def test_pairs_of_rows_built_by_tiles_repeats_and_side_by_side_joins_are_meetings():
    # Before, these were UNKNOWN and met nothing: a loss over every pair of the batch's rows trained apart from one
    # process on 2 workers, silently (each worker pairs its own rows only).
    for rows in (None, 4):
        for name, (build, expected) in PAIRS.items():
            axes, _, _ = _followed(build, rows)
            assert sorted(m.kind for m in axes.meetings) == sorted(expected[rows]), (rows, name, axes.meetings)


def test_a_reshape_splitting_rows_into_entries_counts_them_and_joining_them_back_restores_the_rows():
    # A sequence's cross-entropy: logits [B, 7, 11] -> [B * 7, 11] with labels [B, 7] -> [B * 7], back to [B, 7].
    for rows in (None, 4):
        graph = tf.Graph()
        with graph.as_default():
            labels = tf.compat.v1.placeholder(tf.int32, [rows, 7])
            logits = tf.compat.v1.placeholder(tf.float32, [rows, 7, 11])
            first = len(graph.get_operations())
            flat = tf.reshape(logits, [-1, tf.shape(logits)[-1]])
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.reshape(labels, [-1]), flat)
            back = tf.reshape(losses, tf.shape(labels))
            # The same in functions the step calls: split in one, joined back in another.
            split = tf.function(lambda t: tf.reshape(t, [-1, 11]))(logits)
            joined = tf.function(lambda t: tf.reshape(t, [-1, 7]))(losses)
            axes = row_axes.RowAxes((labels, logits))
            axes.follow(graph.get_operations()[first:])
        assert [axes.axis(t) for t in (flat, losses, back, split, joined)] == [0] * 5, rows
        assert [axes.entries(t) for t in (flat, losses, back, split, joined)] == [7, 7, 1, 7, 1], rows


def test_a_lookup_of_distinct_rows_repeated_keeps_the_rows_of_its_ids():
    # cached_reads.gather_policy: the ids made distinct, their rows gathered and repeated, reshaped to the ids' shape;
    # sequences of a length unknown while tracing are gathered as they are (their rows could not be followed).
    from kparallax.step import cached_reads  # pylint: disable=import-outside-toplevel
    table = tf.Variable(tf.zeros([10, 4]))
    for shape in ([None, None], [None, 5], [3, 5]):
        seen = {}

        @tf.function(input_signature=[tf.TensorSpec(shape, tf.int32)])
        def step(ids):
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            with tf.GradientTape():
                rows = cached_reads.gather_policy(table, ids, table.sparse_read)
            axes = row_axes.RowAxes((ids,))
            axes.follow(graph.get_operations()[first:])
            seen["ops"] = {op.type for op in graph.get_operations()[first:]}
            seen["rows"] = (axes.axis(rows), axes.entries(rows))
            return rows

        step.get_concrete_function()
        assert ("Unique" in seen["ops"]) == (shape[1] is not None) and seen["rows"] == (0, 1), shape


# Functions of a statistic of the batch x [B, 3]: the op of the nonlinear meeting each makes and the reduction it
# names, or None for sums, differences and scalings by values without rows (w), which make none.
FUNCTIONS = {
    "a root": (lambda x, w: tf.sqrt(tf.reduce_mean(tf.square(x))), ("Sqrt", "Mean")),
    "a square of column means": (lambda x, w: tf.square(tf.reduce_mean(x, axis=0)), ("Square", "Mean")),
    "a log": (lambda x, w: tf.math.log(tf.reduce_sum(tf.exp(x))), ("Log", "Sum")),
    "a product of two": (lambda x, w: tf.reduce_mean(x) * tf.reduce_max(x), ("mul", "Mean")),
    "a quotient": (lambda x, w: tf.reduce_sum(x) / tf.stop_gradient(tf.reduce_sum(tf.abs(x))), ("truediv", "Sum_1")),
    "a maximum": (lambda x, w: tf.maximum(tf.reduce_mean(x), 1.0), ("Maximum", "Mean")),
    "a softmax of column means": (lambda x, w: tf.nn.softmax(tf.reduce_mean(x, axis=0)), ("Softmax", "Mean")),
    "the largest column mean": (lambda x, w: tf.reduce_max(tf.reduce_mean(x, axis=0)), ("Max", "Mean")),
    "a Gram matrix's distance from a weight": (
        lambda x, w: tf.reduce_sum(tf.square(tf.matmul(x, x, transpose_a=True) / 4.0 - w)), ("Square", "MatMul")),
    "a root of an einsum's Gram matrix": (lambda x, w: tf.sqrt(tf.reduce_sum(tf.einsum("bi,bj->ij", x, x))),
                                          ("Sqrt", "einsum/Einsum")),
    "a product of two statistics": (lambda x, w: tf.matmul(tf.reduce_mean(x, axis=0, keepdims=True),
                                                           tf.reduce_mean(x, axis=0, keepdims=True), transpose_b=True),
                                    ("MatMul", "Mean")),
    "a choice by a comparison of one": (lambda x, w: tf.where(tf.reduce_mean(x) > 0.0, tf.reduce_sum(x), 1.0),
                                        ("SelectV2", "Mean")),
    "a choice by a weight": (lambda x, w: tf.where(w[0, 0] > 0.0, tf.reduce_sum(x), 2.0 * tf.reduce_mean(x)), None),
    "a Gram matrix scaled": (lambda x, w: tf.reduce_sum(tf.matmul(x, x, transpose_a=True) * w), None),
    "sums and scalings": (lambda x, w: tf.add_n([tf.reduce_mean(x) * 2.0, tf.reduce_sum(w), -tf.reduce_sum(x) / 4.0]),
                          None),
    "divided by a count": (lambda x, w: tf.reduce_sum(x) / tf.cast(tf.shape(x)[0], tf.float32), None),
    "scaled by a weight": (lambda x, w: tf.stop_gradient(tf.reduce_mean(x, axis=0)) * w, None),
    "a mean of means": (lambda x, w: tf.reduce_mean(tf.reduce_mean(x, axis=0)), None),
    "rounded": (lambda x, w: tf.round(tf.reduce_mean(x)), None),
    "compared": (lambda x, w: tf.cast(tf.reduce_mean(x) > 0.0, tf.float32), None),
}


def test_nonlinear_functions_of_a_statistic_are_meetings_and_sums_are_not():
    for rows in (None, 4):
        for name, (build, expected) in FUNCTIONS.items():
            graph = tf.Graph()
            with graph.as_default():
                x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
                w = tf.constant(np.ones((3, 3), np.float32))
                first = len(graph.get_operations())
                output = build(x, w)
                axes = row_axes.RowAxes((x,))
                axes.follow(graph.get_operations()[first:])
            assert axes.axis(output) == STATISTIC, (rows, name)
            got = [(m.op.name, m.source.name) for m in axes.meetings]
            assert all(m.kind == "nonlinear" and m.rows[0][0].shape.rank == 2 for m in axes.meetings), (rows, name)
            assert (got[0] if got else None) == expected, (rows, name, got)


# Counts of each row's ids [B, 4] (a bincount per row), and whether a meeting is made on the way: Keras' encoding
# layers size their bincount by the batch's largest id clamped to their depth (minlength == maxlength), one number.
BINCOUNTS = {
    "CategoryEncoding multi_hot": (lambda ids: tf.keras.layers.CategoryEncoding(7, output_mode="multi_hot")(ids), 0,
                                   False),
    "CategoryEncoding count": (lambda ids: tf.keras.layers.CategoryEncoding(7, output_mode="count")(ids), 0, False),
    # (its hash of the ids is not followed)
    "Hashing multi_hot": (lambda ids: tf.keras.layers.Hashing(9, output_mode="multi_hot")(ids), UNKNOWN, False),
    "a bincount clamped by clip_by_value": (
        lambda ids: tf.raw_ops.DenseBincount(input=ids, size=tf.clip_by_value(tf.reduce_max(ids) + 1, 7, 7),
                                             weights=tf.constant([], tf.float32)), 0, False),
    # sized by the batch's largest id, at least 7: a function of a statistic (each worker's own)
    "a bincount of a least length": (lambda ids: tf.math.bincount(ids, minlength=7, axis=-1), UNKNOWN, True),
    # centered over the batch: the counts are rows, and they meet
    "counts centered over the batch": (
        lambda ids: (lambda c: c - tf.reduce_mean(c, axis=0))(
            tf.keras.layers.CategoryEncoding(7, output_mode="count")(ids)), 0, True),
}


def test_a_bincount_per_row_keeps_the_rows_and_a_size_clamped_to_one_number_meets_nothing():
    for rows in (None, 4):
        for name, (build, expected, meets) in BINCOUNTS.items():
            graph = tf.Graph()
            with graph.as_default():
                ids = tf.compat.v1.placeholder(tf.int64, [rows, 4])
                first = len(graph.get_operations())
                output = build(ids)
                axes = row_axes.RowAxes((ids,))
                axes.follow(graph.get_operations()[first:])
                fed = row_axes.feeding([output], graph.get_operations()[first:])
            assert axes.axis(output) == expected, (rows, name, axes.axis(output))
            met = [m for m in axes.meetings if m.op.name in fed]
            assert bool(met) == meets, (rows, name, [(m.op.name, m.kind) for m in met])


def test_a_weight_s_gradient_is_not_a_statistic_of_the_batch():
    # The backward pass sums each weight's gradient over the rows (x^T @ upstream); a product over the rows in the
    # forward pass is a statistic (a Gram matrix), in a tape's gradient it is left unknown: a clip of the gradients
    # by their norm is not a function of a statistic of the batch the loss is computed from.
    kernel = tf.Variable(tf.ones([3, 2]))
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def step(x):
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with tf.GradientTape() as tape:
            gram = tf.matmul(x, x, transpose_a=True)
            loss = tf.reduce_mean(tf.square(x @ kernel)) + tf.reduce_sum(gram)
        grad = tape.gradient(loss, kernel)
        clipped = tf.clip_by_global_norm([grad], 1.0)[0][0]
        axes = row_axes.RowAxes((x,))
        axes.follow(graph.get_operations()[first:])
        products = [op for op in graph.get_operations()[first:] if op.type == "MatMul"]
        seen["products"] = [(row_axes.BACKWARD in f"/{op.name}", axes.axis(op.outputs[0])) for op in products]
        seen["axes"] = [axes.axis(t) for t in (gram, grad, clipped)]
        seen["meetings"] = [m.op.name for m in axes.meetings]
        return clipped

    step.get_concrete_function()
    assert seen["axes"] == [STATISTIC, UNKNOWN, UNKNOWN] and not seen["meetings"], seen
    assert (True, UNKNOWN) in seen["products"] and (False, STATISTIC) in seen["products"], seen


def test_rows_joined_in_groups_count_a_fraction_of_an_entry_and_meet_past_the_reshape():
    """Triplets laid out row after row ([B, d] -> [-1, 3, d]): each entry holds 3 rows, so a worker's groups are one
    process's; a loss per triplet meets no rows, each anchor's distance to every triplet's negative does (before, the
    reshape's output was UNKNOWN and that meeting was not seen); it is checked on 1/3 entry per row."""
    from fractions import Fraction  # pylint: disable=import-outside-toplevel
    for rows in (None, 6):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [rows, 4])
            first = len(graph.get_operations())
            triplets = tf.reshape(x, [-1, 3, 4])
            anchor, positive, negative = tf.unstack(triplets, axis=1)
            per_triplet = tf.nn.relu(tf.reduce_sum(tf.square(anchor - positive), 1)
                                     - tf.reduce_sum(tf.square(anchor - negative), 1) + 1.0)
            axes = row_axes.RowAxes((x,))
            axes.follow(graph.get_operations()[first:])
            assert (axes.axis(triplets), axes.entries(triplets)) == (0, Fraction(1, 3)), rows
            assert (axes.axis(per_triplet), axes.entries(per_triplet)) == (0, Fraction(1, 3)), rows
            assert not axes.meetings, [m.op.name for m in axes.meetings]
            first = len(graph.get_operations())
            hardest = tf.reduce_min(tf.reduce_sum(tf.square(anchor[:, None] - negative[None]), -1), axis=1)
            axes.follow(graph.get_operations()[first:])
            assert axes.axis(hardest) == UNKNOWN and [m.kind for m in axes.meetings] == ["pairwise"], rows
            assert [axes.entries(t) for t, _ in axes.meetings[0].checked] == [Fraction(1, 3)] * 2, rows


def test_rows_cut_into_entries_of_another_size_count_a_fraction_and_meet_past_the_reshape():
    """[B, 3] -> [-1, 2] (3/2 entries per row: an entry may hold the end of one row and the start of the next) and
    [B, 3] -> [-1, 4] (3/4): each worker's part of the batch starts on an entry's edge (the parts before it filled whole
    entries, else their reshape failed), so work per entry meets no rows, and joined back they are the rows again; a
    softmax over the entries meets them (before, the reshape's output was UNKNOWN and that meeting was not seen),
    checked on 3/2 entries per row."""
    from fractions import Fraction  # pylint: disable=import-outside-toplevel
    for rows in (None, 4):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
            first = len(graph.get_operations())
            pairs, quads = tf.reshape(x, [-1, 2]), tf.reshape(x, [-1, 4])
            per_pair = tf.reduce_sum(tf.square(pairs @ tf.ones([2, 2])), axis=1)
            back, back_from_quads = tf.reshape(tf.nn.relu(pairs), [-1, 3]), tf.reshape(quads * 2.0, [-1, 3])
            axes = row_axes.RowAxes((x,))
            axes.follow(graph.get_operations()[first:])
            got = [(axes.axis(t), axes.entries(t)) for t in (pairs, quads, per_pair, back, back_from_quads)]
            assert got == [(0, Fraction(3, 2)), (0, Fraction(3, 4)), (0, Fraction(3, 2)), (0, 1), (0, 1)], (rows, got)
            assert not axes.meetings, [m.op.name for m in axes.meetings]
            first = len(graph.get_operations())
            normalized = tf.nn.softmax(pairs, axis=0)
            axes.follow(graph.get_operations()[first:])
            assert [m.kind for m in axes.meetings] == ["softmax"] and axes.axis(normalized) == UNKNOWN, rows
            assert [axes.entries(t) for t, _ in axes.meetings[0].checked] == [Fraction(3, 2)], rows
            # In a count computed from the batch's size, or a constant one on a batch of static size: the same
            # entries (the first size can only be the values over the rest's), a softmax over them the same meeting.
            first = len(graph.get_operations())
            computed = tf.reshape(x, tf.stack([tf.shape(x)[0] * 3 // 2, 2]))
            joined = tf.reshape(x, [2, 6]) if rows else tf.reshape(x, [-1, 6])
            normalized = tf.nn.softmax(computed, axis=0)
            axes.follow(graph.get_operations()[first:])
            assert [(axes.axis(t), axes.entries(t)) for t in (computed, joined)] == [
                (0, Fraction(3, 2)), (0, Fraction(1, 2))], rows
            assert [m.kind for m in axes.meetings] == ["softmax"] * 2 and axes.axis(normalized) == UNKNOWN, rows
            assert [cut.entries for cut in axes.cuts] == [Fraction(3, 2), Fraction(3, 4), Fraction(3, 2),
                                                          Fraction(1, 2)], rows
