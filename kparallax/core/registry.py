"""The one owner of "which variables live on which PS task": path, task, table and shard, helper variables.

Every shared PS variable a strategy creates is registered here with its path (``embedding/embeddings``, or
``.../part_1_of_2`` for a shard), its PS task, and for a shard its ``Table`` and index. Helper variables that live
next to a PS variable on the same task (the sparse-gradient accumulator, push and update counters, async optimizer
slots) are created and remembered here too, so a re-partitioning or a checkpoint finds everything in one place.
"""

import dataclasses
from typing import Dict, List, Optional

import tensorflow as tf

from kparallax._compat import tf as tf_compat


@dataclasses.dataclass
class PsEntry:
    variable: tf.Variable
    path: str
    task: int
    table: Optional[object] = None   # tables.Table when the variable is a shard of a partitioned table
    shard: Optional[int] = None
    helpers: Dict[str, tf.Variable] = dataclasses.field(default_factory=dict)
    moved: bool = False              # made replicated, moved here at the first step (its gradient is sparse)
    shared_name: str = ""            # its resource's name on the PS task (the same on every worker)


class Registry:
    """PS variables of one strategy.

    Args:
      store: the ``SharedVariableStore`` creating shared variables.
    """

    def __init__(self, store):
        self._store = store
        self._entries: Dict[object, PsEntry] = {}

    @property
    def store(self):
        return self._store

    def create(self, path, shape, dtype, initial_value, task, trainable=True, constraint=None, table=None,
               shard=None):
        """Creates (or joins) the shared variable ``path`` on PS ``task`` and registers it."""
        variable = self._store.create(path, shape, dtype, initial_value, task, trainable=trainable,
                                      constraint=constraint)
        self._entries[variable.ref()] = PsEntry(variable, path, task, table, shard,
                                                shared_name=variable.kp_shared_name)
        return variable

    def move(self, variable, path, task):
        """Moves the replicated ``variable`` onto PS ``task`` as the shared variable ``path`` and registers it: the
        chief writes its current value there, then the object itself is pointed at the shared one
        (``_compat.tf.rehome``), so every reference to it reaches the PS. Returns ``variable``."""
        inner = tf_compat.unwrapped(variable)
        shared = self._store.create(path, inner.shape, inner.dtype, inner.read_value, task,
                                    trainable=inner.trainable, constraint=inner.constraint)
        tf_compat.rehome(inner, shared)
        self._entries[inner.ref()] = PsEntry(inner, path, task, moved=True, shared_name=shared.kp_shared_name)
        return variable

    def remove(self, variable):
        """Forgets ``variable``; returns its helper variables (the caller frees them)."""
        entry = self._entries.pop(variable.ref(), None)
        return list(entry.helpers.values()) if entry else []

    def get(self, variable) -> Optional[PsEntry]:
        try:
            return self._entries.get(tf_compat.unwrapped(variable).ref())
        except (AttributeError, TypeError):
            return None

    def entry(self, variable) -> PsEntry:
        entry = self.get(variable)
        if entry is None:
            raise KeyError(f"{getattr(variable, 'name', variable)!r} is not a PS variable of this strategy.")
        return entry

    def is_ps(self, variable) -> bool:
        return self.get(variable) is not None

    def entries(self) -> List[PsEntry]:
        return list(self._entries.values())

    def table_of(self, variable):
        """(Table, shard index) if ``variable`` is a shard of a partitioned table, else None."""
        entry = self.get(variable)
        return (entry.table, entry.shard) if entry is not None and entry.table is not None else None

    @tf.autograph.experimental.do_not_convert
    def helper(self, variable, name, shape, dtype):
        """The zero-initialized shared helper ``<path>/<name>`` on ``variable``'s PS task (created once)."""
        entry = self.entry(variable)
        if name not in entry.helpers:
            with tf.init_scope():
                entry.helpers[name] = self._store.create(f"{entry.path}/{name}", shape, dtype,
                                                         lambda: tf.zeros(shape, dtype), entry.task, trainable=False)
        return entry.helpers[name]

    def shared_slot(self, variable, name, value):
        """A shared optimizer slot ``<path>/<name>`` initialized to ``value`` (every worker's optimizer clone of
        ``variable`` uses the same slots); ``name`` starts with the clones' namespace."""
        entry = self.entry(variable)
        key = name
        if key not in entry.helpers:
            entry.helpers[key] = self._store.create(f"{entry.path}/{key}", value.shape, value.dtype, value,
                                                    entry.task, trainable=False)
        return entry.helpers[key]

    def counts(self, helper_name):
        """{path: value} of the helper ``helper_name`` of every PS variable that has one (read from the PS)."""
        return {e.path: int(e.helpers[helper_name].numpy()) for e in self._entries.values()
                if helper_name in e.helpers}

    def summary(self):
        """What lives where, as data: [{"path", "task", "shape", "table", "shard"}], in creation order."""
        return [{"path": e.path, "task": e.task, "shape": e.variable.shape.as_list(),
                 "table": e.table.path if e.table is not None else None, "shard": e.shard}
                for e in self._entries.values()]
