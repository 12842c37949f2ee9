"""The optimizer state Keras' savers write and loaders read: the state one process would hold.

Under kparallax the state of a model's optimizer lives in two places. The optimizer Keras trains with holds
``iterations`` and the slots of the replicated variables. The PS-side clones (``step/clones.py``) hold the slots of
each PS variable, shard by shard. Keras' savers write ``model.optimizer.variables``, and Keras' loaders expect them
in the order a plain optimizer creates them over the model's trainable variables. A list of any other length is
skipped with a warning, and training goes on with a fresh optimizer.

``plain_optimizer`` builds that plain optimizer (the user's class and config, over the model's trainable variables,
each table whole) and fills it with the trained state; its ``load_back`` is the inverse, after a loader restored
into it. ``saving.whole_state`` makes it the model's optimizer around a Keras saver or loader (``model.save``,
TensorFlow-format ``save_weights`` / ``load_weights``, ``BackupAndRestore``); ``loading`` fills it from a file
Keras loaded (``strategy.load_model``).

Which slot belongs to which variable is recorded while each optimizer creates its slots (Keras 2.11+:
``add_variable_from_reference``; legacy: ``add_slot``). The trained optimizers were built before saving, so small
stand-in copies (same class, config, ranks and order) are built and recorded to find positions in their variable
lists. Variables that belong to no model variable (``iterations``, legacy hyper-parameters) are matched by position.
"""

import contextlib

import tensorflow as tf

from kparallax._compat import optimizers as optimizer_compat
from kparallax.core import tables
from kparallax.step import train_step


def plain_optimizer(strategy, model, clones, wholes, trained=None, variables=None):
    """A plain optimizer holding ``model``'s trained optimizer state, for Keras' savers and loaders.

    Call it while each partitioned table of ``model`` is one whole variable (``saving.whole_tables``).

    Args:
      strategy: the model's ``HybridStrategy``.
      model: a model compiled inside the strategy's scope, with the tables swapped for whole variables.
      clones: the model's ``Clones`` (the PS-side optimizer state).
      wholes: [(table, the whole variable standing in for its shards in ``model``)].
      trained: the optimizer Keras trains with (default ``model.optimizer``; of a list of optimizers, the last).
      variables: the variables ``trained`` applies gradients to, in order (default ``model.trainable_variables``).

    Returns:
      (plain, load_back). ``plain``: an optimizer of the user's class and config, built over
      ``model.trainable_variables``, holding the trained state: ``iterations`` and the replicated variables' slots
      from ``model.optimizer``, each PS variable's slots joined over its shards. Under mixed precision, Keras'
      ``LossScaleOptimizer`` around such an optimizer, with the trained loss scale. ``load_back()``: the inverse,
      after a Keras loader has restored into ``plain``: its state goes to ``model.optimizer`` and, on worker 0, to
      the PS-side clones.

    Raises:
      ValueError: the trained optimizer's variables do not follow the layout of a plain copy of it.
    """
    trained = model.optimizer if trained is None else trained
    variables = list(model.trainable_variables if variables is None else variables)
    if optimizer_compat.is_loss_scale_optimizer(trained):
        plain = optimizer_compat.copy_loss_scale_optimizer(trained, _fresh(trained.inner_optimizer))
        layout = _Correspondence(strategy, variables, wholes, trained.inner_optimizer, plain.inner_optimizer)
        optimizer_compat.copy_loss_scale(trained, plain)
    else:
        plain = _fresh(trained)
        layout = _Correspondence(strategy, variables, wholes, trained, plain)
    layout.read(clones)

    def load_back():
        layout.write(clones, strategy.is_chief)
        if optimizer_compat.is_loss_scale_optimizer(trained):
            optimizer_compat.copy_loss_scale(plain, trained)

    return plain, load_back


def copy_state(source, target, origin):
    """Assigns the state of the optimizer ``source`` (loaded by Keras) to ``target`` (the same class and config, built
    over the same variables in the same order; a ``LossScaleOptimizer``: its inner optimizer and loss scale)."""
    if optimizer_compat.is_loss_scale_optimizer(source) != optimizer_compat.is_loss_scale_optimizer(target):
        raise ValueError(
            f"The optimizer of {origin!r} and the one compiled from its config differ. Received: "
            f"{type(source).__name__} and {type(target).__name__}.")
    if optimizer_compat.is_loss_scale_optimizer(source):
        optimizer_compat.copy_loss_scale(source, target)
        source, target = source.inner_optimizer, target.inner_optimizer
    values = optimizer_compat.optimizer_variables(source)
    variables = optimizer_compat.optimizer_variables(target)
    if [tuple(v.shape) for v in values] != [tuple(v.shape) for v in variables]:
        raise ValueError(
            f"The optimizer state of {origin!r} does not fit its model: was the file written for another model? "
            f"Received: shapes {[tuple(v.shape) for v in values]}, expected {[tuple(v.shape) for v in variables]}.")
    for variable, value in zip(variables, values):
        variable.assign(value)


class _Correspondence:
    """Which variable of ``plain`` (built here over ``variables``, the model's trainable ones) is which variable of the
    ``trained`` optimizer (built over the replicated variables, as kparallax's step builds it), and which is which
    of each PS variable's clone state (joined over shards)."""

    def __init__(self, strategy, variables, wholes, trained, plain):
        self._groups = _ps_groups(strategy, variables, wholes)
        saved_whole = {whole.ref() for whole, _ in self._groups}
        # The variables ``trained`` holds slots for, in model order: the replicated ones, and any that moved onto a
        # PS task after it was built over them (their slots there are stale, the clones hold their state).
        dense = [v for v in variables if v.ref() not in saved_whole or optimizer_compat.holds_slots(trained, v)]
        optimizer_compat.build_optimizer(trained, dense)  # idempotent; as training builds it
        target_slots, target_others = _build_recorded(plain, variables)
        index_of = {v.ref(): i for i, v in enumerate(variables)}
        self._plain = optimizer_compat.optimizer_variables(plain)
        self._trained = optimizer_compat.optimizer_variables(trained)

        probe = _fresh(trained)
        probe_slots, probe_others = _build_recorded(probe, [_stand_in(v) for v in dense])
        if (len(optimizer_compat.optimizer_variables(probe)) != len(self._trained)
                or len(probe_others) != len(target_others)):
            raise ValueError(
                "kparallax cannot save or load this optimizer's state with the model: its variables do not follow "
                f"the layout of a plain {type(plain).__name__}. Received: {len(self._trained)} trained optimizer "
                f"variable(s) for {len(dense)} replicated variable(s), where a plain copy has "
                f"{len(optimizer_compat.optimizer_variables(probe))}. Save with include_optimizer=False, or use "
                "kparallax.checkpoint to resume training.")
        self._dense = list(zip(target_others, probe_others))  # (plain index, trained index)
        for position, variable in enumerate(dense):
            self._dense += list(zip(target_slots.get(index_of[variable.ref()], []), probe_slots.get(position, [])))

        self._clone_layouts = []  # per group: ([(plain index, clone index)] of slots, ... of the others, count)
        for whole, _ in self._groups:
            probe = _fresh(trained)
            probe_slots, probe_others = _build_recorded(probe, [_stand_in(whole)])
            self._clone_layouts.append((list(zip(target_slots.get(index_of[whole.ref()], []), probe_slots.get(0, []))),
                                        list(zip(target_others, probe_others)),
                                        len(optimizer_compat.optimizer_variables(probe))))

    def read(self, clones):
        """plain <- the trained optimizer and the clones (the slots of a PS variable never updated keep their
        initial state, as in one process)."""
        for target, source in self._dense:
            self._plain[target].assign(self._trained[source])
        for (_, shards), (slots, _, _) in zip(self._groups, self._clone_layouts):
            joined = clones.state(shards)
            if joined is not None:
                for target, source in slots:
                    self._plain[target].assign(joined[source])

    def write(self, clones, chief):
        """The trained optimizer <- plain; on the chief also each PS variable's clones (made if missing)."""
        for target, source in self._dense:
            self._trained[source].assign(self._plain[target])
        if not chief:
            return
        for (_, shards), (slots, others, count) in zip(self._groups, self._clone_layouts):
            states = [optimizer_compat.optimizer_variables(clones.get(shard)) for shard in shards]
            joined = [None] * count
            for target, source in slots + others:
                joined[source] = self._plain[target].numpy()
            if any(value is None for value in joined):
                raise ValueError(
                    "kparallax cannot load this optimizer's state into the PS-side copies: some of their variables "
                    f"have no counterpart in a plain {type(self._plain).__name__}. Received: {joined.count(None)} of "
                    f"{count} unmatched.")
            tables.split_row_state(shards, states, joined)


def _fresh(optimizer):
    """A new optimizer of ``optimizer``'s plain class (not kparallax's routing class) and config."""
    return optimizer_compat.copy_optimizer(optimizer, train_step.plain_class(optimizer))


def _stand_in(variable):
    """A one-element variable of ``variable``'s rank and dtype: the slots an optimizer creates depend on those."""
    with tf.init_scope():
        return tf.Variable(tf.zeros([1] * variable.shape.rank, variable.dtype), trainable=variable.trainable,
                           name=variable.name.split(":")[0].split("/")[-1])


def _ps_groups(strategy, variables, wholes):
    """[(the variable as saved, [its shards])] for the PS variables among ``variables``: each whole table with its
    shards, each other PS variable with itself."""
    table_of = {whole.ref(): table for table, whole in wholes}
    groups = []
    for variable in variables:
        if variable.ref() in table_of:
            groups.append((variable, list(table_of[variable.ref()].shards)))
        elif strategy.is_ps_variable(variable):
            groups.append((variable, [variable]))
    return groups


def _build_recorded(optimizer, variables):
    """Builds ``optimizer`` over ``variables``; returns ({position in ``variables``: [indices of its slots]},
    [indices of the variables that belong to no model variable]), indices into ``optimizer_variables(optimizer)``."""
    made = []
    with _recording(optimizer, made):
        optimizer_compat.build_optimizer(optimizer, variables)
    owner = {id(slot): reference for slot, reference in made}
    position = {v.ref(): i for i, v in enumerate(variables)}
    slots, others = {}, []
    for index, variable in enumerate(optimizer_compat.optimizer_variables(optimizer)):
        reference = owner.get(id(variable))
        if reference is None:
            others.append(index)
            continue
        slots.setdefault(position[reference.ref()], []).append(index)
    return slots, others


@contextlib.contextmanager
def _recording(optimizer, made):
    """Inside: every slot ``optimizer`` creates is appended to ``made`` as (slot, model variable)."""
    if optimizer_compat.optimizer_family(optimizer) == "new":
        name, keyword = "add_variable_from_reference", "model_variable"
    else:
        name, keyword = "add_slot", "var"
    original = getattr(optimizer, name)

    def record(*args, **kwargs):
        slot = original(*args, **kwargs)
        made.append((slot, args[0] if args else kwargs[keyword]))
        return slot

    optimizer.__dict__[name] = record
    try:
        yield
    finally:
        del optimizer.__dict__[name]
