"""Synchronous aggregation of the gradients of PS variables: one update per step, applied on the PS.

Per step and per PS variable with a sparse gradient, in ONE remote chain on the variable's PS task:
  1. push: every worker (with local aggregation, one worker per host, after an allgather inside the host, one per
     table) adds its deduplicated rows into an accumulator next to the variable (``scatter_add``), marks their ids
     in a *touched* mask of the variable's rows, then increments the variable's push counter;
  2. the push that brings the counter to ``pushers x (updates + 1)`` is the step's last: it reads the accumulated
     rows of the touched ids, applies ONE optimizer update with its clone (``clones.py``; every pusher has one, their
     slots are shared on the PS), zeroes those rows and the mask and increments the update counter. That value is
     its token; the other pushes' token is their count. So the update starts where the last rows land, with no
     collective and no further round trip. Everything the update reads is on the PS or crossed before the push
     (the learning rate and the optimizer's step count, which live on the worker, are read once per step outside
     it and cross to each PS task as one tensor);
  3. the end-of-step barrier (``train_step.py``) carries every pusher's tokens: no worker goes on before the update.
Dense gradients of PS variables (the ``ps`` architecture) are added whole into the accumulator, and the step's last
push applies them the same way. With ``clipnorm`` they instead pass a barrier carrying those pushes' tokens, then the
chief reads the sums and applies them: their norm may span a table's shards on several tasks. With
``global_clipnorm`` every update waits for one factor over the whole step (``clipping.py``); where there are dense
gradients of PS variables, the sparse pushes' counts go through that barrier too, then the last pushes update.
Gradient clipping (the user's ``clipnorm`` / ``clipvalue``) is applied along the way as one process would
(``clipping.py``); the clones do not clip again.
Only touched rows and their ids cross the network (an embedding lookup's push sends the ids its pull sent:
``cached_reads.distinct``); the update math runs on the PS device. Ordering across devices
uses data edges only (see ``collectives.py``); control edges are used only between ops on the same PS device.
"""

import dataclasses
from typing import List, Optional

import tensorflow as tf

from kparallax._compat import optimizers as optimizer_compat
from kparallax.step import clipping as clipping_lib
from kparallax.step import collectives
from kparallax.step import local_aggregation

ACCUMULATOR = "kp_accumulator"
TOUCHED = "kp_touched"
PUSHES = "kp_pushes"
UPDATES = "kp_updates"


@dataclasses.dataclass
class PsStep:
    """What the PS path of one step hands to the step builder.

    Attributes:
      tokens: int64 scalars the end-of-step barrier must wait for (this worker's pushes, the updates they made).
      keep: collective outputs nothing else reads (kept alive by the step).
      sent_bytes: int64 scalar, the bytes this worker sent to PS tasks in this step.
      factor: with ``global_clipnorm``, the step's clipping factor (the same on every worker), else None.
    """
    tokens: List[tf.Tensor]
    keep: List[tf.Tensor]
    sent_bytes: tf.Tensor
    factor: Optional[tf.Tensor] = None


def nbytes(tensors):
    """Total size in bytes of ``tensors`` (an int64 scalar)."""
    sizes = [tf.cast(tf.size(t), tf.int64) * t.dtype.size for t in tensors]
    return tf.add_n(sizes) if sizes else tf.constant(0, tf.int64)


def _op(value):
    """The op of a variable update (``assign_add`` etc. return a variable-like object in graphs)."""
    return getattr(value, "op", value)


def count(counter):
    """Increments ``counter`` (a PS int64 helper) and returns its new value, atomically on the counter's device:
    concurrent increments see distinct values. (``assign_add`` then a read is two ops: two workers pushing at once
    both read the final count, and both would have taken their push for the step's last.)"""
    return tf.raw_ops.ResourceCountUpTo(resource=counter.handle, limit=2 ** 62, T=tf.int64) + 1


class SyncPs:
    """Builds the synchronous PS path of a step.

    Args:
      registry: the strategy's ``Registry`` (helper variables next to each PS variable).
      clones: the model's ``Clones`` (optimizer state on the PS).
      num_workers, is_chief: from Horovod.
      average: divide summed gradients by the worker count (the single-process equivalent).
      local: the ``LocalAggregation`` of this worker.
      pushers: how many workers push each step (``num_workers``, or the host count with local aggregation).
      clipping: the user's optimizer's clipping (``_compat.keras.clipping``), done here; the clones do not clip.
    """

    def __init__(self, registry, clones, num_workers, is_chief, average, local, pushers, clipping=()):
        self._registry = registry
        self._pushers = pushers
        self._rates = {}
        self._step_count = None
        self._clones = clones
        self._n = num_workers
        self._is_chief = is_chief
        self._average = average
        self._local = local
        self._clip = clipping_lib.Clipping(clipping, self._divisor(), num_workers, self._group)

    def _helper(self, variable, name):
        if name == ACCUMULATOR:
            return self._registry.helper(variable, name, variable.shape, variable.dtype)
        if name == TOUCHED:
            return self._registry.helper(variable, name, variable.shape[:1], tf.int32)
        return self._registry.helper(variable, name, [], tf.int64)

    @tf.autograph.experimental.do_not_convert
    def build(self, grads_and_vars, replicated_sum_of_squares=None):
        """Builds the pushes of ``grads_and_vars`` (PS variables) and the update by each variable's last push (with
        ``clipnorm``, for dense gradients: the barrier and, on the chief, their update).
        ``replicated_sum_of_squares``: with ``global_clipnorm``, that of the step's averaged replicated gradients
        (its ``PsStep.factor`` scales them)."""
        sparse = [(g, v) for g, v in grads_and_vars if isinstance(g, tf.IndexedSlices)]
        dense = [(g, v) for g, v in grads_and_vars if not isinstance(g, tf.IndexedSlices)]
        tokens, keep, sent = [], [], []
        self._rates = {}  # the learning rates read in this step (``_update_if_last``)
        self._step_count = self._read_step_count()  # and the optimizer's step count (``_apply``, through ``_on_ps``)
        self._copies = {}  # the worker's tensors an update reads, one copy per PS task (``_on_ps``)
        sparse = [(self._clip.slices(g), v) for g, v in sparse]
        factors, sums = self._clip.sparse_norm_factors(sparse)
        keep += sums
        overall = self._clip.by_global_norm
        sum_of_squares = None
        if overall:
            sum_of_squares = self._clip.sparse_sum_of_squares(sparse)
            if replicated_sum_of_squares is not None:
                sum_of_squares += replicated_sum_of_squares
        deduped = [local_aggregation.dedup(g.indices, g.values) for g, _ in sparse]
        tables = self._tables(sparse)
        pushed, unused = self._local.sparse(deduped, tables)
        keep += unused
        counted = []  # (variable, its push's count): the update is made by the step's last push
        for (_, variable), (ids, rows) in zip(sparse, pushed or []):
            with tf.device(variable.device):
                added = self._helper(variable, ACCUMULATOR).scatter_add(tf.IndexedSlices(rows, ids))
                marked = self._helper(variable, TOUCHED).scatter_update(
                    tf.IndexedSlices(tf.ones_like(ids, tf.int32), ids))
                with tf.control_dependencies([_op(added), _op(marked)]):
                    counted.append((variable, count(self._helper(variable, PUSHES))))
            sent.append(nbytes([rows, ids]))
        dense_grads, unused = self._local.dense([g for g, _ in dense])
        keep += unused
        # With ``clipnorm`` or ``global_clipnorm``, a dense gradient's factor spans its table's shards (on several
        # tasks) or the whole step: every push must land before any update, so those go through a barrier and the
        # chief. Without, the last push applies.
        by_barrier = self._clip.by_norm or overall
        dense_tokens = []
        for grad, (_, variable) in zip(dense_grads or [], dense):
            with tf.device(variable.device):
                added = self._helper(variable, ACCUMULATOR).assign_add(grad)
                with tf.control_dependencies([_op(added)]):
                    pushes = count(self._helper(variable, PUSHES))
                dense_tokens.append(pushes if by_barrier else self._update_if_last(
                    variable, pushes, lambda clone, step, v=variable: self._apply_summed(v, clone, step)))
            sent.append(nbytes([grad]))
        sent_bytes = tf.add_n(sent) if sent else tf.constant(0, tf.int64)
        through_barrier = bool(dense and by_barrier)
        pushed_all = None
        if through_barrier:  # with ``global_clipnorm`` sparse updates wait for it: their pushes' counts go in
            pushed_all = collectives.barrier(self._n, dense_tokens + ([p for _, p in counted] if overall else []),
                                             "kp_ps_pushed")
        grads = []
        if dense and by_barrier and self._is_chief:
            grads = [(self._clip.dense(self._read_whole(variable, pushed_all)), variable) for _, variable in dense]
        factor = None
        if overall:
            if dense:  # the chief's sum, passed to every worker (zero from the others: computed, not a constant,
                # which Grappler would fold the collective into)
                local = (self._clip.dense_sum_of_squares(grads) if self._is_chief
                         else tf.minimum(pushed_all, 0.0))
                sum_of_squares += collectives.sum_over_workers(local, self._n, "kp_global_norm_ps_dense_sumsq")
            factor = self._clip.global_factor(sum_of_squares)
            keep.append(factor)  # its allreduces run on every worker, also where nothing reads it (e.g. no push)
        for variable, pushes in counted:
            scale = factor if overall else factors.get(self._group(variable))
            with tf.device(variable.device):
                scale = self._on_ps(scale, variable)
                tokens.append(self._update_if_last(
                    variable, pushes, lambda clone, step, v=variable, f=scale: self._apply_rows(v, clone, step, f)))
        tokens += dense_tokens
        if not through_barrier:
            return PsStep(tokens, keep, sent_bytes, factor)
        if not self._is_chief:
            return PsStep(tokens, keep + [pushed_all], sent_bytes, factor)
        updates = []
        if grads:
            factors = ({self._group(v): factor for _, v in grads} if overall
                       else self._clip.dense_norm_factors(grads))
            updates = [self._apply_whole(variable, grad, factors.get(self._group(variable)))
                       for grad, variable in grads]
        return PsStep(tokens + updates, keep, sent_bytes, factor)

    def _tables(self, sparse):
        """The positions in ``sparse`` of each table's variables (a variable, or all shards of a partitioned table),
        in order of first appearance: the unit of the per-table collectives."""
        groups = {}
        for i, (_, variable) in enumerate(sparse):
            groups.setdefault(self._group(variable), []).append(i)
        return list(groups.values())

    def _divisor(self):
        """What an update divides summed gradients by: the worker count when averaging, else 1."""
        return self._n if self._average and self._n > 1 else 1

    def _scaled(self, value):
        if self._divisor() > 1:
            return value / tf.cast(self._divisor(), value.dtype)
        return value

    def _group(self, variable):
        """The variable one process would clip as one gradient: a partitioned table (all its shards), else itself."""
        owner = self._registry.table_of(variable)
        return id(owner[0]) if owner else variable.ref()

    def _finish(self, variable, check, zeroed):
        """The update token: incremented on the PS after the update is readable and the accumulator is zero."""
        with tf.control_dependencies([check, _op(zeroed)]):
            return count(self._helper(variable, UPDATES))

    def _update_if_last(self, variable, pushes, apply):
        """On ``variable``'s PS task: if ``pushes`` (this push's count) completes the step's pushes, the update
        (``apply(clone, step)``: ``_apply_rows`` or ``_apply_summed``, ``step`` the step count's copy on that task)
        and its token, else ``pushes``. Every push counted before this one has landed, since each push counts after
        its rows (and ids) are written."""
        with tf.control_dependencies([pushes]):
            done = self._helper(variable, UPDATES).read_value()  # this step's update cannot have run yet
        last = tf.equal(pushes, (done + 1) * self._pushers)
        clone = self._clones.get(variable)
        step, rate = self._step_and_rate(clone, variable)
        with optimizer_compat.learning_rate_value(clone, rate):
            return tf.cond(last, lambda: apply(clone, step), lambda: tf.identity(pushes))

    def _on_ps(self, value, variable):
        """``value`` (a tensor of the worker's the update reads: the learning rate, the step count, a clipping
        factor), copied once per step onto ``variable``'s PS task; None stays None. Read from the worker inside the
        update's branch, each would cross per variable, and only after the branch's predicate had crossed from the
        PS to the worker and back (a lowered ``tf.cond`` gates its inputs where they are): a round trip on the
        update's path."""
        if value is None:
            return None
        key = (value.ref(), collectives.task_of(variable.device))
        if key not in self._copies:
            with tf.device(variable.device):
                self._copies[key] = tf.identity(value)
        return self._copies[key]

    def _step_and_rate(self, clone, variable):
        """The step count and ``clone``'s learning rate (``_rate``) copied onto ``variable``'s PS task (``_on_ps``),
        crossing as ONE tensor where both are there: one message per step and PS task instead of two. Packed as
        float64, which holds either exactly (a float rate, a count below 2**53)."""
        step, rate = self._step_count, self._rate(clone)
        if step is None or rate is None or rate.shape.rank != 0 or not rate.dtype.is_floating:
            return self._on_ps(step, variable), self._on_ps(rate, variable)
        key = (step.ref(), rate.ref(), collectives.task_of(variable.device))
        if key not in self._copies:
            with tf.device(step.device):  # where the count was read (the caller may be in the PS task's scope)
                packed = tf.stack([tf.cast(step, tf.float64), tf.cast(rate, tf.float64)])
            with tf.device(variable.device):
                copy = tf.identity(packed)
                self._copies[key] = (tf.cast(copy[0], step.dtype), tf.cast(copy[1], rate.dtype))
        return self._copies[key]

    def _rate(self, clone):
        """This step's read of the learning rate ``clone`` shares with the user's optimizer, or None (not shared).
        The rate lives on the worker. Read inside the update's branch, it would cost every push a message from the
        PS to the worker and back (taken or not), and the update a round trip; read once, it crosses once per step
        and PS task."""
        rate = optimizer_compat.shared_learning_rate(clone)
        if rate is None:
            return None
        if rate.ref() not in self._rates:
            with tf.device(rate.device):
                self._rates[rate.ref()] = rate.read_value()
        return self._rates[rate.ref()]

    def _apply(self, clone, grad, variable, step):
        """``clone`` applies ``grad`` to ``variable`` at the step of the optimizer Keras trains with: the clone's
        own step count (Adam's bias correction, a schedule's step) is set to ``step``, that optimizer's, first. They
        differ after a step Keras' ``LossScaleOptimizer`` skipped (an overflow under mixed precision): it counts the
        step but updates nothing, so no clone applied one. The count lives on the worker and is read once per step,
        before this step's increment; ``step`` is its copy on ``variable``'s PS task (``_on_ps``), None without an
        optimizer to follow."""
        if step is not None:
            clone.iterations.assign(step)
        clone.apply_gradients([(grad, variable)])

    def _read_step_count(self):
        """The step count of the optimizer Keras trains with, read on its device (None without one)."""
        source = self._clones.learning_rate_source
        if source is None:
            return None
        with tf.init_scope():
            counter = source.iterations  # a legacy optimizer creates it at first use: not inside the traced step
        with tf.device(counter.device):
            return counter.read_value()

    def _apply_rows(self, variable, clone, step, factor=None):
        """The step's one update of ``variable`` by ``clone`` from the accumulated rows of its touched ids; its
        token."""
        accumulator, touched = self._helper(variable, ACCUMULATOR), self._helper(variable, TOUCHED)
        ids = tf.where(touched.read_value() > 0)[:, 0]
        rows = self._scaled(accumulator.sparse_read(ids))
        if factor is not None:
            rows = clipping_lib.scaled(rows, factor)
        grad = tf.IndexedSlices(rows, ids, dense_shape=tf.constant(variable.shape.as_list(), tf.int64))
        self._apply(clone, grad, variable, step)
        # Automatic control dependencies order these reads and writes after the update of the same variables.
        check = tf.reduce_sum(variable.sparse_read(ids[:1]))
        zeroed = accumulator.scatter_update(tf.IndexedSlices(tf.zeros_like(rows), ids))
        cleared = touched.scatter_update(tf.IndexedSlices(tf.zeros_like(ids, tf.int32), ids))
        with tf.control_dependencies([_op(cleared)]):
            return self._finish(variable, check, zeroed)

    def _read_whole(self, variable, pushed_all):
        """The summed dense gradient of ``variable`` once every push landed, divided as the step averages."""
        accumulator = self._helper(variable, ACCUMULATOR)
        with tf.device(variable.device):
            if variable.shape.rank:
                # Gathering every row with ids tied to the barrier makes the read wait for all pushes (a data edge).
                every_row = collectives.tie(tf.range(variable.shape[0], dtype=tf.int64),
                                            [tf.cast(pushed_all, tf.int64)])
                grad = accumulator.sparse_read(every_row)
            else:
                with tf.control_dependencies([tf.identity(pushed_all)]):
                    grad = accumulator.read_value()
            return self._scaled(grad)

    def _apply_summed(self, variable, clone, step):
        """The step's one update of ``variable`` by ``clone`` from its summed dense gradient (no ``clipnorm``)."""
        grad = self._clip.dense(self._scaled(self._helper(variable, ACCUMULATOR).read_value()))
        return self._apply_dense(variable, clone, grad, step)

    def _apply_whole(self, variable, grad, factor=None):
        with tf.device(variable.device):
            if factor is not None:
                grad = clipping_lib.scaled(grad, factor)
            clone = self._clones.get(variable)
            return self._apply_dense(variable, clone, grad, self._step_and_rate(clone, variable)[0])

    def _apply_dense(self, variable, clone, grad, step):
        """Applies the aggregated ``grad`` with ``clone`` at ``step``, zeroes the accumulator; the update's token."""
        self._apply(clone, grad, variable, step)
        check = tf.reduce_sum(tf.reshape(variable.read_value(), [-1])[:1])
        zeroed = self._helper(variable, ACCUMULATOR).assign(tf.zeros_like(grad))
        return self._finish(variable, check, zeroed)
