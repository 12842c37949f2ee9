"""Keras 2's compiled losses and metrics, scaled for the workers (Keras 2.15 as ``tf.keras``; the same private
containers exist in tf-keras 2.16-2.18).

- Compiled losses are wrapped through the private ``LossesContainer._losses`` list once its ``build`` ran
  (``scale_compiled_losses``), compiled metrics through ``MetricsContainer._metrics`` / ``_weighted_metrics``
  (``weigh_compiled_metrics``).
- ``_valid_count`` mirrors how Keras 2.15's ``Loss.__call__`` averages under a mask (the Keras mask of ``y_pred``,
  a sparse cross-entropy's ``ignore_class``).
- A ``MeanMetricWrapper`` keeps its function in the private ``_fn`` / ``_fn_kwargs``.

``step/global_losses.py`` says why and when each scale applies.
"""

import contextlib
import functools
import typing

import tensorflow as tf

from kparallax._compat import repeated_rows
from kparallax._compat import tf as tf_compat


class LossScales(typing.NamedTuple):
    """What ``scale_compiled_losses`` scales by in one traced step.

    ``workers``: the worker count. ``rows_share``: this worker's rows over the mean rows per worker (a float64
    scalar tensor), or None when every worker's batch has the same rows. ``over_workers``: a function giving the sum
    of a float scalar over the workers (a collective), for the valid counts of masked losses. ``micro_batches``:
    the micro-batches accumulated per update (``backward_passes_per_step``), whose gradients the step averages.
    ``globalized``: a function giving, for a loss function and its (y_true, y_pred), a replacement taking its
    statistics of the batch over every worker, or None where it needs none (``step/batch_statistics.py``); None:
    never replaced.
    """
    workers: int
    rows_share: object
    over_workers: typing.Callable
    micro_batches: int = 1
    globalized: typing.Callable = None


_SUMMED = (tf.keras.losses.Reduction.SUM, tf.keras.losses.Reduction.NONE)
_AVERAGED = (tf.keras.losses.Reduction.AUTO, tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE)
_APART = [contextlib.nullcontext]  # the context ops of counts of kparallax's own are made under (hook_apart)


class _ScaledLoss:
    """A compiled loss scaled by ``scales()`` (a ``LossScales``; None: unchanged) so that the workers' average
    gradient, and the logged value Keras' loss metric weights by the batch's rows, are one process's.

    With ``rows_share`` the step multiplies the worker's whole gradient by it (``global_losses``), so each factor
    below is divided by it. ``SUM``: value and gradient times ``workers``. ``NONE`` (Keras logs the mean of the
    per-example values and differentiates their sum): the gradient times ``workers``. Averaged losses: unchanged
    without a mask (Keras divides by the element count; the share does the rest); under a mask (Keras divides by
    the valid count) value and gradient times ``workers * valid / valid over all workers``. A loss function that
    gives one scalar for the batch, whatever the reduction (Keras leaves a scalar as it is): value and gradient
    times ``workers`` if it sums over the batch, unchanged if it averages (``_batch_scalar_sums``). A loss function
    of statistics of the batch other than their sums and means runs with the global batch's (``globalized``): one
    scalar so computed is one process's on every worker and is left as it is. Every other attribute is the wrapped
    loss's.
    """

    def __init__(self, loss, scales):
        self._loss, self._scales = loss, scales

    def __getattr__(self, name):
        return getattr(self._loss, name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        with _own_average_loss():
            return self._scaled(y_true, y_pred, sample_weight)

    def _scaled(self, y_true, y_pred, sample_weight):
        scales = self._scales()
        replaced = None
        if scales is not None and scales.globalized is not None and not _masked(self._loss, y_pred):
            replaced = scales.globalized(self._loss.call, y_true, y_pred)
        with _call_replaced(self._loss, replaced):
            value = self._loss(y_true, y_pred, sample_weight=sample_weight)
        if scales is None or scales.workers * scales.micro_batches == 1:
            return value
        if replaced is not None and _gives_one_scalar(self._loss.call, y_true, y_pred):
            return value  # one process's value on the global batch, on every worker
        _, sums = _batch_scalar_sums(self._loss.call, y_true, y_pred)
        if sums is not None:  # a mean needs nothing more than an averaged loss does; a sum what reduction "sum" does
            summed = summed_factor(scales, value.dtype)
            return value * tf.where(sums, summed, tf.ones([], value.dtype))
        if self._loss.reduction in _SUMMED:
            factor = summed_factor(scales, value.dtype)
        else:
            valid = _valid_count(self._loss, y_true, y_pred)
            if valid is None:
                return value
            if scales.micro_batches > 1:
                raise ValueError(
                    f"A masked loss ({self._loss.name}) under backward_passes_per_step={scales.micro_batches} is not "
                    "supported: Keras divides each micro-batch's loss by its own count of valid elements, one process "
                    "by the count of the whole batch, which is known only after the last micro-batch, so the "
                    "accumulated gradient would differ from one process's. Received: "
                    f"a loss averaged under a mask (mask_zero or ignore_class) in a step accumulating "
                    f"{scales.micro_batches} micro-batches. Train with backward_passes_per_step=1 (a larger batch "
                    "per worker), or sum the loss (reduction=\"sum\") and divide by a constant.")
            valid = tf.cast(valid, tf.float64)  # a float64 model's loss keeps its precision
            factor = _over_share(tf.cast(scales.workers * valid / scales.over_workers(valid), value.dtype), scales)
        if self._loss.reduction == tf.keras.losses.Reduction.NONE:
            return _scaled(value, 1.0, factor)
        return value * factor


@contextlib.contextmanager
def _call_replaced(loss, call):
    """While active, ``loss.call`` (the function Keras' ``Loss.__call__`` runs) is ``call``; unchanged if None."""
    if call is None:
        yield
        return
    loss.__dict__["call"] = call
    try:
        yield
    finally:
        del loss.__dict__["call"]


def _own_average_loss():
    """TensorFlow's own ``tf.nn.compute_average_loss`` while a compiled loss or metric function runs: these scale a
    scalar summed over the batch themselves (``_batch_scalar_sums``), which the step's (``global_losses``) would
    scale again."""
    return tf_compat.average_loss_replaced(lambda own: own)


def _share(scales, dtype):
    """This worker's share of the global batch (``rows_share``; 1 when every worker's batch has the same rows)."""
    return tf.ones([], dtype) if scales.rows_share is None else tf.cast(scales.rows_share, dtype)


def summed_factor(scales, dtype):
    """The factor of a loss summed over the worker's rows (reduction ``SUM``): ``workers * micro_batches``, over this
    worker's share of the global batch when batches differ in size, so that the average gradient over the workers
    and micro-batches is one process's sum."""
    return _over_share(tf.cast(scales.workers * scales.micro_batches, dtype), scales)


def _over_share(factor, scales):
    """``factor`` divided by this worker's share of the global batch when batches differ in size: the step then
    multiplies the worker's whole gradient by that share (``global_losses``)."""
    return factor if scales.rows_share is None else factor / tf.cast(scales.rows_share, factor.dtype)


def _batch_scalar_sums(fn, y_true, y_pred):
    """For a loss or metric function ``fn(y_true, y_pred)`` that gives ONE scalar for the whole batch (a user's
    function ending in ``tf.reduce_sum`` or ``tf.reduce_mean`` over the batch): its value, and whether it sums over
    the batch, a boolean tensor, true when its value on the batch repeated twice is nearer twice its value than its
    value (a mean stays, a sum doubles). ``(None, None)`` for a function giving a value per example, which Keras
    reduces itself.

    The function's output rank is read from a trace of its own, so the step gets no extra ops (and no extra random
    draws) for a function that gives a value per example, such as every Keras loss and metric. The value on the
    doubled batch is recomputed from the ops after the batch's rows (``repeated_rows``), which cannot fail where the
    function runs (before, the whole function ran on the doubled batch: an in-batch-negatives loss, labels
    ``tf.range`` over the rows against a column per candidate, failed with a label out of range on several workers).
    Where those ops cannot tell (the step runs eagerly, an op that is not copied, a static batch's count divided by)
    the whole function runs on the doubled batch."""
    if not _gives_one_scalar(fn, y_true, y_pred):
        return None, None
    once = fn(y_true, y_pred)
    with _APART[0]():  # a count of kparallax's own: the batch's rows meeting there are not refused
        twice = repeated_rows.twice_where_told(once, (y_true, y_pred))
        if twice is None:
            twice = fn(tf.concat([y_true, y_true], axis=0), tf.concat([y_pred, y_pred], axis=0))
        return once, repeated_rows.doubles(once, twice)


def _gives_one_scalar(fn, y_true, y_pred):
    """Whether ``fn(y_true, y_pred)`` gives one scalar, read from a trace of its own (no ops in the step)."""
    specs = [tf.type_spec_from_value(t) for t in (y_true, y_pred)]
    return tf.function(fn).get_concrete_function(*specs).structured_outputs.shape.rank == 0


def batch_scalar_update(value, sums, workers, share):
    """(value, sample weight) with which a worker adds ``value``, one scalar for its batch, to a ``Mean`` or ``Sum``
    so that the states summed over the ``workers`` are one process's: ``value * N`` with weight ``1 / N`` where
    ``sums`` (a sum over the batch: the global batch's sum, counted once), ``value`` with weight ``share / N``
    otherwise (a mean: the global batch's mean). ``share``: this worker's share of the global batch (a scalar
    tensor, ones when batches have one size); the weight takes its dtype."""
    return (value * tf.where(sums, tf.cast(workers, value.dtype), tf.ones([], value.dtype)),
            tf.where(sums, tf.ones([], share.dtype), share) / tf.cast(workers, share.dtype))


def _scaled(value, shown, gradient):
    """``value`` times ``shown``, with its gradient times ``gradient``."""
    return value * shown + (gradient - shown) * (value - tf.stop_gradient(value))


def _keras_mask(y_pred):
    """``y_pred``'s Keras mask (a private attribute Keras sets on a masked layer's output), or None."""
    return getattr(y_pred, "_keras_mask", None)


def _ignore_class(loss):
    """A sparse cross-entropy's ``ignore_class`` (kept in a ``LossFunctionWrapper``'s private ``_fn_kwargs``), or
    None."""
    return (getattr(loss, "_fn_kwargs", None) or {}).get("ignore_class")


def _masked(loss, y_pred):
    """Whether Keras averages ``loss`` under a mask (``_valid_count``)."""
    return _keras_mask(y_pred) is not None or _ignore_class(loss) is not None


def _valid_count(loss, y_true, y_pred):
    """The count Keras 2.15's ``Loss.__call__`` divides an averaged loss by when a mask applies (``y_pred``'s
    Keras mask, and a sparse cross-entropy's ``ignore_class``); None when none does (it divides by the element
    count)."""
    masks = []
    if _keras_mask(y_pred) is not None:
        masks.append(tf.cast(_keras_mask(y_pred), tf.bool))
    ignore_class = _ignore_class(loss)
    if ignore_class is not None:
        valid = tf.not_equal(tf.cast(y_true, tf.int64), ignore_class)
        if masks and valid.shape.rank == masks[0].shape.rank + 1:
            valid = tf.squeeze(valid, axis=-1)
        masks.append(valid)
    if not masks:
        return None
    mask = masks[0] if len(masks) == 1 else tf.logical_and(masks[0], masks[1])
    return tf.reduce_sum(tf.cast(mask, tf.float32))


def hook_apart(apart):
    """Makes the ops of counts the step takes over the workers itself under ``apart()`` (once, process-wide), so
    the batch's rows meeting there are not refused (``step/rows_meet.py``): Keras 2.15's
    ``losses_utils.apply_valid_mask`` (for a mean loss under a mask it multiplies the mask by its size over its valid
    count, a count over the whole batch; the step counts that over the workers, ``_ScaledLoss``), and a scalar loss
    recomputed on the batch's rows repeated twice (``_batch_scalar_sums``: its doubled rows are two blocks of the
    batch, which ``row_axes`` follows as a contrastive loss's two views)."""
    _APART[0] = apart
    from keras.src.utils import losses_utils  # pylint: disable=import-outside-toplevel
    original = losses_utils.apply_valid_mask
    if getattr(original, "_kp_apart", False):
        return

    @functools.wraps(original)
    def apply_valid_mask(*args, **kwargs):
        with apart():
            return original(*args, **kwargs)

    apply_valid_mask._kp_apart = True  # pylint: disable=protected-access
    losses_utils.apply_valid_mask = apply_valid_mask


def scale_compiled_losses(model, scales):
    """Wraps the losses of ``model.compiled_loss`` (a private ``LossesContainer``: its flat ``_losses`` list exists
    once ``build`` ran, at the first call) in ``_ScaledLoss(loss, scales)``, and weighs the loss it logs when no
    compiled loss gives it the batch's rows (``_weigh_rowless_mean``)."""
    container = getattr(model, "compiled_loss", None)
    if container is None:
        return

    def scale():
        container._losses = [  # pylint: disable=protected-access
            _ScaledLoss(loss, scales) if getattr(loss, "reduction", None) in _SUMMED + _AVERAGED else loss
            for loss in container._losses]  # pylint: disable=protected-access
        _weigh_rowless_mean(container._total_loss_mean, scales)  # pylint: disable=protected-access

    _after_build(container, scale)


def _after_build(container, hook):
    """Runs ``hook()`` after the one-time ``build`` of ``container`` (a ``LossesContainer`` or ``MetricsContainer``),
    which makes its loss and metric objects at the first call."""
    build = type(container).build

    def build_then_hook(*args, **kwargs):
        build(container, *args, **kwargs)
        hook()

    container.build = build_then_hook


def _weigh_rowless_mean(metric, scales):
    """Keras' logged loss (a ``Mean``), updated once per step with the step's total loss weighted by the batch's rows,
    or, when no compiled loss gives the rows (a model trained by ``add_loss`` alone), with no weight. Then, while
    ``scales()`` is set, this worker's value is weighted by ``share / N``: its states summed over the workers are one
    process's (the global batch's mean; count 1), also when batches differ in size, where each worker's mean counted
    alike was seen 0.0005 off one process's log."""
    update = metric.update_state

    def update_state(values, sample_weight=None):
        current = scales()
        if current is None or current.workers == 1 or sample_weight is not None:
            return update(values, sample_weight=sample_weight)
        return update(values, sample_weight=_share(current, tf.as_dtype(metric.dtype)) / float(current.workers))

    metric.update_state = update_state


def weigh_compiled_metrics(model, scales):
    """Makes the metric functions of ``model.compiled_metrics`` (a private ``MetricsContainer``: its ``_metrics``
    and ``_weighted_metrics`` hold ``Metric`` objects once ``build`` ran, at the first call) that give one scalar
    for the batch update their means as one process's do (``_weigh_batch_scalars``)."""
    container = getattr(model, "compiled_metrics", None)
    if container is None:
        return

    def weigh():
        for metric in tf.nest.flatten([container._metrics, container._weighted_metrics]):  # pylint: disable=protected-access
            if isinstance(metric, tf.keras.metrics.MeanMetricWrapper):
                _weigh_batch_scalars(metric, scales)

    _after_build(container, weigh)


def _weigh_batch_scalars(metric, scales):
    """``metric`` (a ``MeanMetricWrapper``) updated, while ``scales()`` (a ``LossScales``) is set, so that its states
    summed over the workers are one process's when its function gives one scalar for the batch.

    One process adds its global batch's scalar to the mean's total and 1 to its count. The states are summed over
    the workers (``step/logs.py``), so each worker adds ``value * N`` with weight ``1 / N`` for a sum over the batch
    (total: the global batch's sum; count: 1), and ``value`` with weight ``share / N`` for a mean (total: the global
    batch's mean, also when batches differ in size; count: 1). A function of statistics of the batch other than
    their sums and means (a mean over a mask written by hand, ``LossScales.globalized``) runs with the global
    batch's: each worker adds that one value with weight ``1 / N``. Functions giving a value per example, and updates
    with a sample weight or a mask, are Keras' own."""
    update = metric.update_state

    def update_state(y_true, y_pred, sample_weight=None):
        with _own_average_loss():
            return weighed_update(y_true, y_pred, sample_weight)

    def weighed_update(y_true, y_pred, sample_weight):
        current = scales()
        value = sums = None
        if current is not None and current.workers > 1 and sample_weight is None:
            fn = functools.partial(metric._fn, **metric._fn_kwargs)  # pylint: disable=protected-access
            cast = tf.cast(y_true, metric.dtype), tf.cast(y_pred, metric.dtype)
            replaced = current.globalized and current.globalized(fn, *cast)
            if replaced is not None and _gives_one_scalar(fn, *cast):  # one process's value on every worker
                weight = tf.constant(1 / current.workers, metric.dtype)  # counted once over the summed states
                return tf.keras.metrics.Mean.update_state(metric, replaced(*cast), sample_weight=weight)
            value, sums = _batch_scalar_sums(fn, *cast)
        if sums is None:
            return update(y_true, y_pred, sample_weight=sample_weight)
        value, weight = batch_scalar_update(value, sums, current.workers, _share(current, value.dtype))
        return tf.keras.metrics.Mean.update_state(metric, value, sample_weight=weight)

    metric.update_state = update_state


def batch_rows(data):
    """The number of rows of a training step's batch ``data`` (Keras' ``(x, y, sample_weight)``): the first
    dimension of its first tensor (an int64 scalar tensor)."""
    first = tf.nest.flatten(data)[0]  # composites stay whole
    if isinstance(first, tf.SparseTensor):
        return first.dense_shape[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows(out_type=tf.int64)
    return tf.shape(first, out_type=tf.int64)[0]


def _plain_reduce(metric):
    """Whether ``metric`` is a Keras ``Mean`` or ``Sum`` whose class keeps their ``update_state(values,
    sample_weight)`` (not a ``MeanMetricWrapper``, which takes ``y_true, y_pred``)."""
    return (isinstance(metric, (tf.keras.metrics.Mean, tf.keras.metrics.Sum))
            and type(metric).update_state is tf.keras.metrics.Sum.update_state)


def weigh_scalar_updates(metric, weigh):
    """Makes ``metric`` (a ``Mean`` or ``Sum``; others are left alone), when updated with one value and no sample
    weight, update with ``weigh(metric, value)`` instead: a (value, sample weight) pair, or None for Keras' own
    update. Once per metric: Keras binds ``update_state`` to each instance when it makes it (``Metric.__new__``), so
    the instance attribute is what is wrapped."""
    if not _plain_reduce(metric) or metric.__dict__.get("_kparallax_scalar_updates"):
        return
    update = metric.update_state

    def update_state(values, sample_weight=None):
        if sample_weight is None and tf.is_tensor(values) and values.shape.rank == 0:
            weighed = weigh(metric, values)
            if weighed is not None:
                values, sample_weight = weighed
        return update(values, sample_weight=sample_weight)

    metric.update_state = update_state
    metric.__dict__["_kparallax_scalar_updates"] = True


@contextlib.contextmanager
def on_metric_call(install):
    """While one step is traced: calling a metric (``Metric.__call__``, which ``add_metric`` does with the ``Mean`` it
    has just made) runs ``install(metric)`` first."""
    cls = tf.keras.metrics.Metric  # defines __call__, which Mean and Sum inherit
    original = cls.__call__

    def call(self, *args, **kwargs):
        install(self)
        return original(self, *args, **kwargs)

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = original
