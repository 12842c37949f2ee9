"""Keras 2's compiled losses, scaled for the workers (Keras 2.15 as ``tf.keras``; the same private containers
exist in tf-keras 2.16-2.21).

- Compiled losses are wrapped through the private ``LossesContainer._losses`` list once its ``build`` ran
  (``scale_compiled_losses``); Keras' logged loss is its private ``_total_loss_mean``.
- ``_valid_count`` mirrors how Keras 2's ``Loss.__call__`` averages under a mask (the Keras mask of ``y_pred``, a
  sparse cross-entropy's ``ignore_class``, kept in a ``LossFunctionWrapper``'s private ``_fn_kwargs``).

``step/global_losses.py`` says why and when each scale applies.
"""

import typing

import tensorflow as tf


class LossScales(typing.NamedTuple):
    """What ``scale_compiled_losses`` scales by in one traced step.

    ``workers``: the worker count. ``rows_share``: this worker's rows over the mean rows per worker (a float64
    scalar tensor), or None when every worker's batch has the same rows. ``over_workers``: a function giving the sum
    of a float scalar over the workers (a collective), for the valid counts of masked losses. ``micro_batches``:
    the micro-batches accumulated per update (``backward_passes_per_step``), whose gradients the step averages.
    """
    workers: int
    rows_share: object
    over_workers: typing.Callable
    micro_batches: int = 1


_SUMMED = (tf.keras.losses.Reduction.SUM, tf.keras.losses.Reduction.NONE)
_AVERAGED = (tf.keras.losses.Reduction.AUTO, tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE)


class _ScaledLoss:
    """A compiled loss scaled by ``scales()`` (a ``LossScales``; None: unchanged) so that the workers' average
    gradient, and the logged value Keras' loss metric weights by the batch's rows, are one process's.

    With ``rows_share`` the step multiplies the worker's whole gradient by it (``global_losses``), so each factor
    below is divided by it. ``SUM``: value and gradient times ``workers``. ``NONE`` (Keras logs the mean of the
    per-example values and differentiates their sum): the gradient times ``workers``. Averaged losses: unchanged
    without a mask (Keras divides by the element count; the share does the rest); under a mask (Keras divides by
    the valid count) value and gradient times ``workers * valid / valid over all workers``. A loss function that
    returns one scalar for the batch is left as it is (a mean of the worker's batch, by contract). Every other
    attribute is the wrapped loss's.
    """

    def __init__(self, loss, scales):
        self._loss, self._scales = loss, scales

    def __getattr__(self, name):
        return getattr(self._loss, name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        value = self._loss(y_true, y_pred, sample_weight=sample_weight)
        scales = self._scales()
        if scales is None or scales.workers * scales.micro_batches == 1:
            return value
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


def batch_rows(data):
    """The number of rows of a training step's batch ``data`` (Keras' ``(x, y, sample_weight)``): the first
    dimension of its first tensor (an int64 scalar tensor)."""
    first = tf.nest.flatten(data)[0]  # composites stay whole
    if isinstance(first, tf.SparseTensor):
        return first.dense_shape[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows(out_type=tf.int64)
    return tf.shape(first, out_type=tf.int64)[0]
