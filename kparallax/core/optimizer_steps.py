"""The routing optimizer and ``Step`` of each optimizer compiled under a strategy."""

import weakref

from kparallax._compat import optimizers as optimizer_compat
from kparallax.cluster import runtime
from kparallax.step import clones as clones_lib
from kparallax.step import local_aggregation
from kparallax.step import ps_async
from kparallax.step import ps_sync
from kparallax.step import train_step


class OptimizerSteps:
    """Every optimizer compiled under ``strategy``: its routing optimizer, ``Step`` and PS-side ``Clones``."""

    def __init__(self, strategy):
        self._strategy = strategy
        self.clones = []        # the PS-side optimizer state of every compiled model
        self._optimizers = []   # (routing optimizer, weakref to the user's, Step, Clones) per optimizer instance

    def make(self, optimizer):
        """Returns (the optimizer to compile with, its ``Step``, its ``Clones``) for ``optimizer`` (a string or
        instance); the first is the routing optimizer (``train_step.wrap``).

        An optimizer instance compiled before in this strategy (the user's, or the one a model holds, as in
        ``model.compile(optimizer=model.optimizer, ...)``: the routing optimizer, or under mixed precision Keras'
        ``LossScaleOptimizer`` around it, returned as it is) gets the same back: as in one process, its step count,
        slots and PS-side state carry over to the new compile. A ``LossScaleOptimizer`` of the user's gives one of
        the same class and loss-scale settings around the routing optimizer of its inner one (Keras keeps it as it
        is, as it keeps the user's in one process).
        """
        inner = getattr(optimizer, "inner_optimizer", None)
        for made in ([] if isinstance(optimizer, str) else self._optimizers):
            if inner is made[0]:  # model.optimizer under mixed precision: Keras' LossScaleOptimizer around ours
                return optimizer, made[2], made[3]
            if optimizer is made[0] or optimizer is made[1]():
                return made[0], made[2], made[3]
        source, loss_scale = optimizer, None
        if optimizer_compat.is_loss_scale_optimizer(optimizer):  # the user's own: ours goes inside it
            loss_scale, optimizer = optimizer, optimizer.inner_optimizer
        optimizer = train_step.resolve(optimizer)
        sync = self._strategy.options.sync
        clones = clones_lib.Clones(self._strategy.registry, optimizer, namespace=f"kp_optimizer_{len(self.clones)}",
                                   clip=not sync)
        if sync:
            local_set = None
            aggregate = self._strategy.options.local_aggregation
            if aggregate == "auto":
                aggregate = not runtime.job_on_one_host(self._strategy.cluster)
            if aggregate and self._strategy.num_workers > 1 and self._strategy.cluster.ps:
                local_set = runtime.local_process_set()
            pushers = len(runtime.host_groups(self._strategy.cluster)) if local_set is not None else self._strategy.num_workers
            ps_path = ps_sync.SyncPs(self._strategy.registry, clones, self._strategy.num_workers, self._strategy.is_chief,
                                     self._strategy.options.average_sparse, local_aggregation.LocalAggregation(local_set),
                                     pushers, optimizer_compat.clipping(optimizer))
        else:
            ps_path = ps_async.AsyncPs(self._strategy.registry, clones)
        step = train_step.Step(self._strategy.options, self._strategy.num_workers, self._strategy.is_ps_variable, ps_path)
        step.clones = clones
        step.moves_sparse = self._strategy.moves_sparse
        wrapped = train_step.wrap(optimizer, step)
        clones.learning_rate_source = wrapped
        if loss_scale is not None:
            wrapped = optimizer_compat.copy_loss_scale_optimizer(loss_scale, wrapped)
            optimizer_compat.copy_loss_scale(loss_scale, wrapped)
        self.clones.append(clones)
        if not isinstance(source, str):
            self._optimizers.append((wrapped, weakref.ref(source), step, clones))
        return wrapped, step, clones

    def extra_step(self, optimizer):
        """The ``Step`` of an optimizer that a model's own ``train_step`` uses besides the compiled one (a GAN's
        second optimizer): its gradients of replicated variables are averaged over the workers as the compiled
        optimizer's are, then it applies them itself. Made at the optimizer's first use in a step, one per instance.
        """
        step = optimizer.__dict__.get("_kp_extra_step")
        if step is None:
            step = train_step.Step(self._strategy.options, self._strategy.num_workers, self._strategy.is_ps_variable, ps_path=None,
                                   log_architecture=False)
            optimizer.__dict__["_kp_extra_step"] = step
        return step
