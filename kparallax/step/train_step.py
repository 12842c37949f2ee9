"""One training step under kparallax: the optimizer wrapper that routes each gradient to its path.

``wrap(optimizer, step)`` returns an optimizer of the user's class (same hyper-parameters) whose
``apply_gradients`` builds the step:

  1. when the workers' batches may differ in size, weight each gradient by this worker's share of the global batch
     (``global_losses``); split the gradients: replicated variables vs PS variables (the strategy's registry
     decides). A custom ``train_step`` that transforms its gradients before ``apply_gradients`` (a clip) transforms
     each worker's own, as under Horovod and tf.distribute; the optimizer's ``clipnorm`` / ``global_clipnorm``
     clip the averaged ones (``clipping``);
  2. PS path (``ps_sync.SyncPs`` or ``ps_async.AsyncPs``): push; the step's last push updates on the PS;
  3. dense path: one Horovod allreduce per gradient (``collectives.average_gradients``; each starts when its
     gradient exists, Horovod fuses what is ready), applied locally by the user's optimizer, while the PS path is
     in flight;
  4. synchronous PS training ends at a barrier carrying the PS path's tokens, so no worker reads PS rows of the
     next step before the update of this one has landed.
With ``backward_passes_per_step = k`` the gradients are first accumulated locally (``accumulation.py``) and steps
2-4 run every k-th call. Around it, the model's ``train_step`` (``core/train_function.train_step_synchronous``) takes the
step's logs over the workers (``logs.over_workers``), concurrently with backprop. Called outside a model's training
step (a custom training loop) in a job of several workers, ``apply_gradients`` is refused (``refuse_custom_loop``).
"""

import contextlib
import threading

import tensorflow as tf
from kparallax import log as logging

from kparallax._compat import optimizers as optimizer_compat
from kparallax.step import accumulation
from kparallax.step import clipping
from kparallax.step import collectives
from kparallax.step import global_losses

_TRACED = threading.local()

_KNOWN = ("sgd", "adam", "adagrad", "rmsprop", "adamax", "nadam", "adadelta", "ftrl", "adamw", "lion")


def resolve(optimizer):
    """Turns a string or instance into a tf.keras optimizer instance, with one clear error for anything else."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in _KNOWN:
            raise ValueError(f"Unknown optimizer {optimizer!r}. Use one of {list(_KNOWN)} or a "
                             f"tf.keras.optimizers instance. Received: optimizer={optimizer!r}.")
        optimizer = tf.keras.optimizers.get(optimizer)
    optimizer_compat.optimizer_family(optimizer)  # raises for anything that is not a tf.keras optimizer
    return optimizer


@contextlib.contextmanager
def model_step(strategy, seeded=None):
    """While a model's training step (Keras' ``train_step`` or the user's, from ``fit`` or ``train_on_batch``) is
    traced under ``strategy``: optimizers applying gradients are part of it (``model_step_strategy``). ``seeded``:
    a context entered inside (the worker's own random seed)."""
    outer, _TRACED.strategy = getattr(_TRACED, "strategy", None), strategy
    try:
        with seeded or contextlib.nullcontext():
            yield
    finally:
        _TRACED.strategy = outer


def model_step_strategy():
    """The strategy whose model's training step is being traced on this thread; None outside one (a custom training
    loop)."""
    return getattr(_TRACED, "strategy", None)


def refuse_custom_loop(optimizer, num_workers, compiled):
    """The error for ``optimizer.apply_gradients`` called outside a model's training step in a job of
    ``num_workers`` > 1 workers; ``compiled``: ``optimizer`` is the one kparallax made at ``compile``."""
    name = type(optimizer).__name__
    if compiled:
        why = ("its gradients would be averaged, but nothing else a training step under kparallax does happens there: "
               "worker 0's weights are not broadcast before the first step (each worker starts from its own "
               "initialization or loaded weights), BatchNormalization statistics and the layers' aggregated "
               "variables stay each worker's own, batches of different sizes are not weighted, so the workers "
               "would drift from one process silently")
        received = (f"model.optimizer ({name}) applied outside the model's fit / train_on_batch (a custom training "
                    "loop?)")
    else:
        why = "each worker would update its own copy of the weights alone (no allreduce, no shared PS update)"
        received = "an optimizer applied outside a model's synchronous training step (a custom training loop?)"
    raise ValueError(
        f"{name}.apply_gradients was called outside kparallax's training step in a job of {num_workers} workers: "
        f"{why}. Received: {received}. Compile the model inside `with strategy.scope():` and train with model.fit "
        "or train_on_batch; a custom train_step (calling self.optimizer.apply_gradients, and other optimizers for "
        "replicated variables) is supported. With one worker a custom training loop trains as in one process.")


class Step:
    """Everything the routing optimizer of one compiled model needs to build its step.

    Args:
      options: the strategy's ``Options``.
      num_workers: Horovod size.
      is_ps_variable: callable(variable) -> bool.
      ps_path: ``SyncPs`` or ``AsyncPs`` (``build(grads_and_vars) -> PsStep``); None for a step of replicated
        variables only.
      log_architecture: log the effective architecture at the first step (the compiled optimizer's step does).
    """

    def __init__(self, options, num_workers, is_ps_variable, ps_path, log_architecture=True):
        self.options = options
        self.num_workers = num_workers
        self.is_ps_variable = is_ps_variable
        self.ps_path = ps_path
        self.clones = None  # the model's ``Clones`` (set by the strategy)
        self.accumulator = (accumulation.GradientAccumulator(options.backward_passes_per_step)
                            if options.backward_passes_per_step > 1 else None)
        self._logged = not log_architecture
        # Replicated variables found with sparse gradients in a traced step, to move onto PS tasks before the step
        # runs (``sparse_to_move``); ``moves_sparse(variable)`` (the strategy's) says which may move.
        self.moves_sparse = None
        self.pending_moves = []
        self.probing = False  # True while ``core/train_function`` traces the first step to find them
        self.decided = False  # in that trace: none was found, so the step is built (and the optimizer with it)
        self._sent = None  # {"dense", "sparse"}: int64 variables, bytes this worker sent

    def sent_bytes(self):
        """(dense, sparse) bytes this worker has sent so far: allreduce payload and PS pushes."""
        if self._sent is None:
            return 0, 0
        return int(self._sent["dense"].numpy()), int(self._sent["sparse"].numpy())

    @tf.autograph.experimental.do_not_convert
    def _count_sent(self, dense_grads, ps_bytes):
        if self._sent is None:
            with tf.init_scope():
                self._sent = {k: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"kp_{k}_bytes_sent")
                              for k in ("dense", "sparse")}
        tensors = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in dense_grads]
        tensors += [g.indices for g, _ in dense_grads if isinstance(g, tf.IndexedSlices)]
        dense_bytes = tf.add_n([tf.cast(tf.size(t), tf.int64) * t.dtype.size for t in tensors]
                               or [tf.constant(0, tf.int64)])
        return [self._sent["dense"].assign_add(dense_bytes), self._sent["sparse"].assign_add(ps_bytes)]

    def sparse_to_move(self, grads_and_vars):
        """The replicated variables of ``grads_and_vars`` whose gradients are sparse (``tf.IndexedSlices``) and that
        go onto PS tasks (Parallax's rule: a sparse variable lives on a PS, a dense one is replicated). Only while a
        step is traced (an eager step cannot use PS variables)."""
        if self.moves_sparse is None or tf.executing_eagerly():
            return []
        return [v for g, v in grads_and_vars if isinstance(g, tf.IndexedSlices) and self.moves_sparse(v)]

    def split(self, grads_and_vars):
        """(replicated, PS) pairs of ``grads_and_vars`` with a gradient; logs the architecture at the first call."""
        dense, ps = [], []
        for grad, variable in grads_and_vars:
            if grad is not None:
                (ps if self.is_ps_variable(variable) else dense).append((grad, variable))
        if not self._logged:
            self._logged = True
            on_ps, replicated = len(ps), len(dense)
            effective = self.options.architecture
            if effective == "hybrid" and not on_ps:
                effective = "allreduce (the model has no PS variable)"
            elif effective == "hybrid" and not replicated:
                effective = "ps (the model has no replicated trainable variable)"
            logging.info("architecture: %s -> %s; %d variable(s) on PS, %d replicated; sync=%s, "
                         "backward_passes_per_step=%d, compression=%s", self.options.architecture, effective,
                         on_ps, replicated, self.options.sync, self.options.backward_passes_per_step,
                         self.options.compression)
        return dense, ps

    def build(self, optimizer, dense, ps, apply_dense):
        """Builds one step for ``dense`` and ``ps`` (lists of (gradient, variable)); ``apply_dense`` applies the
        averaged dense gradients with the user's optimizer. Returns the op Keras' step waits for."""
        if self.options.sparse_as_dense and optimizer_compat.clipping(optimizer):
            sparse = [v.name for g, v in dense if isinstance(g, tf.IndexedSlices)]
            if sparse:
                raise ValueError(
                    "sparse_as_dense=True cannot be combined with clipnorm / clipvalue / global_clipnorm: one process "
                    "clips a sparse gradient slice by slice (one per looked-up id), a densified one after the slices "
                    "of each id are summed. Received: sparse_as_dense=True, clipping "
                    f"{optimizer_compat.clipping(optimizer)} and sparse gradients of {sparse}. Use sparse_as_dense=False "
                    "(the default).")
        overall = optimizer_compat.global_clipnorm(optimizer)
        if overall and ps and not self.options.sync:
            raise ValueError(
                "global_clipnorm cannot be combined with sync=False when the model has PS variables: each worker "
                "updates them on its own, so no norm over the whole step exists. Received: global_clipnorm="
                f"{overall}, sync=False, {len(ps)} PS variable(s), e.g. {ps[0][1].name!r}. Use clipnorm (per "
                "variable), or sync=True.")
        averaged = None
        if dense:
            averaged = collectives.average_gradients(dense, self.num_workers, compression=self.options.compression,
                                                     sparse_as_dense=self.options.sparse_as_dense)
        # With global_clipnorm and PS variables the PS path scales by the norm of the whole step, replicated
        # gradients included, and Keras applies the scaled ones without clipping them again (clipping by value
        # again changes nothing); without PS variables Keras' own clipping of the averaged gradients is one
        # process's.
        norm = {}
        if overall and ps:  # clipped by value first where Keras does (legacy optimizers)
            bounds = [bound for kind, bound in optimizer_compat.clipping(optimizer) if kind == "value"]
            averaged = [(clipping.by_value(g, bounds), v) for g, v in averaged or []] or None
            norm = {"replicated_sum_of_squares": clipping.sum_of_squares([g for g, _ in averaged or []])}
        ps_step = self.ps_path.build(ps, **norm) if ps else None
        keep = list(ps_step.keep) if ps_step else []
        counters = self._count_sent(dense, ps_step.sent_bytes if ps_step else tf.constant(0, tf.int64))
        applied = None
        if averaged is not None:
            if ps_step is not None and ps_step.factor is not None:
                averaged = [(clipping.scaled(g, ps_step.factor), v) for g, v in averaged]
                with optimizer_compat.global_clipnorm_unset(optimizer):
                    applied = apply_dense(averaged)
            else:
                applied = apply_dense(averaged)
        if ps_step is not None and self.options.sync:
            keep.append(collectives.barrier(self.num_workers, ps_step.tokens, name="kp_step_done"))
        outputs = [collectives.keep_alive(keep)] if keep else []
        if applied is None:
            with tf.control_dependencies(outputs + [c.op for c in counters]):
                applied = optimizer.iterations.assign_add(1)
        return applied


def route(optimizer, step, grads_and_vars, apply_dense):
    """Builds ``step`` for ``grads_and_vars`` of ``optimizer``: weighted by this worker's share of the global batch
    when batches may differ in size, split, optionally accumulated, exchanged; ``apply_dense(averaged)`` applies the
    averaged replicated gradients with the user's optimizer. Returns the op Keras' step waits for."""
    grads_and_vars = list(grads_and_vars)
    moving = step.sparse_to_move(grads_and_vars)
    if moving and step.probing:
        # This trace only finds them (``core/train_function.make_train_function`` traces before the first step runs): they
        # move onto PS tasks, then the step is traced again. Nothing is built, so no optimizer slot is made for them.
        step.pending_moves = moving
        return optimizer.iterations.assign_add(0)
    step.decided = True
    if moving:
        names = [v.name for v in moving]
        raise ValueError(
            f"Variable(s) {names} get sparse gradients (tf.IndexedSlices), so under architecture='hybrid' they live "
            "on PS tasks, but this training step was traced outside the model's fit / train_on_batch, which move "
            f"them there before the first step. Received: sparse gradients of replicated variables {names}. Train "
            "with fit or train_on_batch, or name them in a placement rule, e.g. "
            f"placement={{{names[0].split(':')[0]!r}: 'ps'}} (or 'replicated' to allgather their rows).")
    on_ps = [v for g, v in grads_and_vars if g is not None and step.is_ps_variable(v)]
    if on_ps and tf.executing_eagerly():
        raise ValueError(
            "A model with PS variables cannot train eagerly under HybridStrategy: the PS path of its step (pushes "
            "counted on the PS, the update made by the last push, the end-of-step barrier) is built as one traced "
            "function, as TensorFlow's ParameterServerStrategy requires too. Received: run_eagerly=True (or "
            f"tf.config.run_functions_eagerly(True)) with {len(on_ps)} PS variable(s), e.g. {on_ps[0].name!r}. "
            "Leave run_eagerly unset or False; to step through the model's Python, run it in one process without "
            "the strategy.")
    if on_ps and optimizer_compat.unclonable_reason(optimizer):
        raise ValueError(f"{optimizer_compat.unclonable_reason(optimizer)} Received: {type(optimizer).__name__} with "
                         f"{len(on_ps)} PS variable(s), e.g. {on_ps[0].name!r}.")
    dense, ps = step.split(global_losses.weighted(grads_and_vars, global_losses.gradient_share()))

    def build(dense, ps):
        return step.build(optimizer, dense, ps, apply_dense)

    if step.accumulator is not None:
        return step.accumulator.accumulate_then(dense + ps, lambda averaged: build(*step.split(averaged)))
    return build(dense, ps)


class _RoutingMixin:
    """Mixed in front of the user's optimizer class; the step is set by ``wrap``."""

    _kp_step = None

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if self._kp_step.num_workers > 1 and model_step_strategy() is None:
            refuse_custom_loop(self, self._kp_step.num_workers, compiled=True)
        return route(self, self._kp_step, grads_and_vars, lambda averaged: super(_RoutingMixin, self).apply_gradients(
            averaged, *args, **kwargs))

    def build(self, var_list):
        """Keras 2.11+ optimizers: slots for the replicated variables only. Keras' ``LossScaleOptimizer`` (mixed
        precision) builds its inner optimizer over every trainable variable, but the PS variables' slots live in
        the PS-side clones: created here too, they were dead copies placed on the PS, one set per worker."""
        step = self._kp_step
        if step is not None and step.probing and not step.decided:
            return None  # Keras' loss-scale optimizer builds before ``route`` knows which variables move to a PS
        if step is not None:
            var_list = [v for v in var_list if not step.is_ps_variable(v)]
        return super().build(var_list)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """Checkpoints and SavedModels walk this; kparallax's own savers and loaders swap in a plain optimizer
        first, anything else reaching it is refused (``tracking_check``, set at compile when the model has PS
        variables)."""
        check = self.__dict__.get("_kp_tracking_check")
        if check is not None:
            check(self, save_type)
        return super()._trackable_children(save_type, **kwargs)

    def finalize_variable_values(self, var_list):
        """End of ``fit`` (Keras 2.11+ optimizers): with ``use_ema``, every variable takes its moving average.
        Replicated ones from this optimizer; PS ones from the clones (their moving averages are shared slots on the
        PS), then every worker waits for that at a barrier."""
        step = self._kp_step
        ps = [v for v in var_list if step.is_ps_variable(v)]
        super().finalize_variable_values([v for v in var_list if not step.is_ps_variable(v)])
        if ps and getattr(self, "use_ema", False):
            step.clones.finalize(ps)
            collectives.eager_barrier(step.num_workers, name="kp_ema_finalized")


def wrap(optimizer, step):
    """Returns a routing optimizer of ``optimizer``'s class, hyper-parameters and name.

    Args:
      optimizer: a tf.keras optimizer instance (new or legacy).
      step: the model's ``Step``.
    """
    base = type(optimizer)
    cls = type(base.__name__, (_RoutingMixin, base), {"__module__": base.__module__})
    wrapped = optimizer_compat.copy_optimizer(optimizer, cls)
    optimizer_compat.mark_owned(wrapped)
    wrapped._kp_step = step  # pylint: disable=protected-access
    return wrapped


def plain_class(optimizer):
    """The user's optimizer class behind a routing optimizer (``wrap``); any other optimizer's own class."""
    cls = type(optimizer)
    if issubclass(cls, _RoutingMixin):
        return next(c for c in cls.__mro__[1:] if not issubclass(c, _RoutingMixin))
    return cls
