"""Embedding tables split row-wise into shards on several PS tasks.

A partitioned table is a ``StripedVariable`` (``_compat/striped.py``, a ``ShardedVariable`` whose shard i of P
holds rows i, i + P, i + 2P, ...: a frequency-sorted vocabulary's hot rows spread evenly over the PS tasks).
``tf.nn.embedding_lookup`` on it gathers from the shards that own the ids only, and each shard receives its own
IndexedSlices gradient, so lookups and updates touch only the owning shards. Keras lists the shards as the layer's weights (as under TensorFlow's
ParameterServerStrategy); ``get_weights``/``set_weights`` of the layers and models holding one are bound per
instance (``layer_weights``) to present each table whole, with these functions. ``table_of(variable)`` is the
registry's: (Table, shard index) for a shard, else None. The layout itself (``stripe``, ``unstripe``,
``stripe_rows``) is defined once, in ``striped``.
"""

import dataclasses
from typing import List, Tuple

import numpy as np
import tensorflow as tf

from kparallax._compat import striped
from kparallax.step import cached_reads


@dataclasses.dataclass
class Table:
    """One partitioned table: its path and current shards (replaced by a re-partitioning)."""
    path: str
    shape: Tuple[int, ...]
    dtype: tf.DType
    shards: List[tf.Variable]
    sharded: object  # the StripedVariable handed to Keras
    generation: int = 0


def make_sharded(table_path, shards):
    return striped.StripedVariable(list(shards), name=table_path)


def constraint_is_row_wise(constraint, rank):
    """Whether ``constraint`` maps each row of a rank-``rank`` table independently of the other rows.

    Then applying it to each shard gives the same table as applying it to the whole, as a single process does.
    True for Keras' ``NonNeg`` and for ``MaxNorm`` / ``MinMaxNorm`` / ``UnitNorm`` whose ``axis`` excludes the rows'
    axis 0 (the classes themselves, not subclasses); False for any other callable (kparallax cannot know what it
    reads).
    """
    constraints = tf.keras.constraints
    if constraint is None or type(constraint) is constraints.NonNeg:
        return True
    if type(constraint) in (constraints.MaxNorm, constraints.MinMaxNorm, constraints.UnitNorm) and rank > 1:
        axes = constraint.axis if isinstance(constraint.axis, (list, tuple)) else [constraint.axis]
        return all(isinstance(a, int) and a % rank != 0 for a in axes)
    return False


def check_constraint(path, constraint, rank):
    """Refuses a constraint that may span rows on a table that is or may become partitioned."""
    if not constraint_is_row_wise(constraint, rank):
        config = getattr(constraint, "get_config", lambda: None)()
        constraint = f"{type(constraint).__name__}({config or ''})" if config is not None else repr(constraint)
        raise ValueError(
            f"Table {path!r} is split into row shards, and its constraint {constraint} may read across rows: "
            "kparallax applies a partitioned table's constraint to each shard on its own, which equals one process "
            "only for row-wise constraints (NonNeg; MaxNorm, MinMaxNorm or UnitNorm with axis=1). "
            f"Received: constraint={constraint}. Keep the table in one piece with placement={{{path!r}: 'ps:1'}}, "
            "or use a row-wise constraint.")


def merge_weights(variables, values, table_of):
    """Given a layer's weight variables and their values, returns the values with each table's shards joined."""
    position = {id(v): i for i, v in enumerate(variables)}
    out = []
    for variable, value in zip(variables, values):
        owner = table_of(variable)
        if owner is None:
            out.append(value)
        elif owner[1] == 0:
            out.append(striped.unstripe([values[position[id(s)]] if id(s) in position else s.numpy()
                                 for s in owner[0].shards]))
    return out


def split_weights(variables, values, table_of):
    """Inverse of ``merge_weights``: expands each whole-table value into one value per shard of ``variables``."""
    expanded, it = [], iter(values)
    pending = {}
    for variable in variables:
        owner = table_of(variable)
        if owner is None:
            expanded.append(next(it))
            continue
        table, index = owner
        if index == 0:
            whole = np.asarray(next(it))
            if tuple(whole.shape) != tuple(table.shape):
                raise ValueError(f"Weight for partitioned table {table.path!r} has shape {whole.shape}, expected "
                                 f"{tuple(table.shape)} (the whole table). Received: shape={whole.shape}.")
            pending[id(table)] = striped.stripe(whole, len(table.shards))
        expanded.append(pending[id(table)][index])
    return expanded


def whole_weight_count(variables, table_of):
    return sum(1 for v in variables if table_of(v) is None or table_of(v)[1] == 0)


def join_row_state(shards, states):
    """Joins per-shard optimizer state into per-table arrays.

    ``states[i]`` lists shard i's optimizer variables (same order for every shard). Row-shaped ones (slots shaped
    like their shard) are joined over shards into table order; the others (``iterations``, ...) are taken from shard 0.
    """
    joined = []
    for j in range(len(states[0])):
        parts = [state[j] for state in states]
        if all(p.shape.rank and p.shape == s.shape for p, s in zip(parts, shards)):
            joined.append(striped.unstripe([p.numpy() for p in parts]))
        else:
            joined.append(parts[0].numpy())
    return joined


def split_row_state(shards, states, joined):
    """Inverse of ``join_row_state``: assigns each joined array to the optimizer variables of ``shards``."""
    for j, value in enumerate(joined):
        for i, state in enumerate(states):
            row_shaped = state[j].shape.rank and state[j].shape == shards[i].shape
            part = striped.stripe_of(value, i, len(shards)) if row_shaped and np.ndim(value) else value
            if tuple(state[j].shape) != tuple(np.shape(part)):
                raise ValueError(f"Optimizer state {j} of a table has shape {np.shape(value)}, which does not fit "
                                 f"{state[j].shape}: was it written for another model or optimizer? "
                                 f"Received: {np.shape(value)}.")
            state[j].assign(part)


def create_shards(registry, cluster, table, rows, ps_tasks, whole_value, trainable, constraint):
    """Creates ``table``'s stripes (``rows`` rows each, on ``ps_tasks``) in ``registry``, each cut from
    ``whole_value()`` where that value is made, and sets ``table.shards`` / ``table.sharded``."""
    shards = []
    row_shape = list(table.shape[1:])
    made_on = cluster.ps_device(ps_tasks[0])  # the first stripe's creation evaluates the whole value there
    for i, (count, task) in enumerate(zip(rows, ps_tasks)):
        shard_path = f"{table.path}/part_{i}_of_{len(rows)}"
        if table.generation:
            shard_path += f"_g{table.generation}"
        initial = lambda i=i: stripe_where_made(whole_value(), i, len(rows), made_on)  # noqa: E731
        shards.append(registry.create(shard_path, [count] + row_shape, table.dtype, initial, task,
                                      trainable=trainable, constraint=constraint, table=table, shard=i))
        shards[-1].read_policy = cached_reads.policy
        shards[-1].gather_policy = cached_reads.gather_policy
    table.shards, table.sharded = shards, make_sharded(table.path, shards)


def stripe_where_made(whole, shard, partitions, made_on):
    """Stripe ``shard`` of the tensor ``whole``, cut on ``made_on`` (the PS device where the chief made ``whole``):
    only the stripe then crosses to its PS task. Cut under the stripe's own PS device, the whole table crossed to
    every PS task once per stripe (lm1b_sparse's 410 MB of tables in 8 stripes: 2.9 GB from PS task 0's host before
    the first step). Named by the cluster, not by ``whole.device``: a value made before this process joined the
    cluster names the local job it had then ("/job:localhost/...: unknown device" once connected)."""
    with tf.device(made_on):
        return striped.stripe_of(whole, shard, partitions)


def whole_value(initial_value, dtype):
    """A callable returning the table's initial value, evaluated at most once (by the chief only)."""
    cache = []

    def value():
        if not cache:
            cache.append(tf.cast(initial_value() if callable(initial_value) else initial_value, dtype))
        return cache[0]
    return value
