"""Placement: which variables live on parameter-server tasks, in how many row shards, and which are replicated.

Placement is data: a mapping from a regular expression over variable paths (``"embedding/embeddings"``) to
``"ps"``, ``"ps:P"`` (on PS, split row-wise into P shards) or ``"replicated"``. Defaults depend on the
architecture: ``hybrid`` puts every ``tf.keras.layers.Embedding`` table on PS and replicates the rest; ``ps`` puts
every trainable variable on PS; ``allreduce`` replicates everything (a rule mapping to PS is then an error).
User rules override the default; a path matched by two user rules is an error. Under ``hybrid``, a replicated
trainable variable that no rule names and whose gradient turns out sparse moves onto a PS task at the first step
(``for_sparse_gradient``), as Parallax places variables by their gradients' type.
"""

import dataclasses
import math
import re
from typing import Mapping, Optional, Tuple

from kparallax._compat import striped

PS = "ps"
REPLICATED = "replicated"
_RULE = re.compile(r"(ps|replicated)(?::([0-9]+))?")


@dataclasses.dataclass(frozen=True)
class Decision:
    where: str                      # PS or REPLICATED
    why: str                        # human-readable reason, logged once per variable
    ps_tasks: Tuple[int, ...] = ()  # one PS task per row shard (one entry: not partitioned)
    rows: Tuple[int, ...] = ()      # rows of each shard
    auto: bool = False              # the partition count may be changed by the partitions="auto" search

    @property
    def ps_task(self):
        return self.ps_tasks[0] if self.ps_tasks else None


def variable_path(variable) -> str:
    """A variable's path, as placement rules match it and the registry records it (``dense_1/kernel``)."""
    return variable.name.split(":")[0]


def shard_rows(num_rows: int, partitions: int) -> Tuple[int, ...]:
    """Row counts of ``partitions`` shards: the stripes of ``striped`` (shard i holds rows i, i + P, ...)."""
    return striped.stripe_rows(num_rows, partitions)


def _parse_rule(pattern, value):
    match = _RULE.fullmatch(value) if isinstance(value, str) else None
    if not match or (match.group(2) is not None and (match.group(1) != PS or int(match.group(2)) < 1)):
        raise ValueError(f"A placement rule maps to 'ps', 'ps:P' (P >= 1 row shards) or 'replicated'. "
                         f"Received: {{{pattern!r}: {value!r}}}.")
    return match.group(1), (int(match.group(2)) if match.group(2) else None)


class Placement:
    """Decides where each variable goes and, for PS variables, its shards' PS tasks.

    Args:
      rules: mapping from regex (``re.fullmatch`` against the variable path without ``:0``) to ``"ps"``,
        ``"ps:P"`` or ``"replicated"``.
      num_ps: number of PS tasks; shards are spread over them greedily by size (least loaded first).
      architecture: ``"hybrid"``, ``"allreduce"`` or ``"ps"``.
      partitions: default shard count of embedding tables (int), or ``"auto"`` (start at ``num_ps`` shards).
    """

    def __init__(self, rules: Optional[Mapping[str, str]] = None, num_ps: int = 0, architecture: str = "hybrid",
                 partitions=1):
        compiled = []
        if rules is not None and not isinstance(rules, Mapping):
            raise ValueError(f"placement must be a dict of variable-path regex -> 'ps' | 'ps:P' | 'replicated', e.g. "
                             f"{{'.*embedding.*': 'ps:4'}}. Received: {type(rules).__name__} {rules!r}.")
        for pattern, value in dict(rules or {}).items():
            if not isinstance(pattern, str):
                raise ValueError(f"A placement rule's key is a regex (a string) matched against variable paths. "
                                 f"Received: {{{pattern!r}: {value!r}}}.")
            where, parts = _parse_rule(pattern, value)
            if where == PS and architecture == "allreduce":
                raise ValueError(f"architecture='allreduce' replicates every variable, so placement rule "
                                 f"{pattern!r} -> {value!r} cannot be honoured. Received: {{{pattern!r}: {value!r}}}. "
                                 "Use architecture='hybrid' or drop the rule.")
            try:
                compiled.append((pattern, re.compile(pattern), where, parts))
            except re.error as e:
                raise ValueError(f"Placement rule {pattern!r} is not a valid regular expression ({e}). "
                                 f"Received: {pattern!r}.") from None
        self._rules = tuple(compiled)
        self._architecture = architecture
        self._auto = partitions == "auto"
        self._settled = False
        self._partitions = max(num_ps, 1) if self._auto else partitions
        self._ps_load = [0] * num_ps

    def decide(self, path: str, shape, is_embedding: bool, trainable: bool = True) -> Decision:
        """Returns the Decision for a variable of ``shape`` (a list of ints) at ``path``."""
        matches = [(p, w, n) for p, r, w, n in self._rules if r.fullmatch(path)]
        if len(matches) > 1:
            raise ValueError(
                f"Variable {path!r} matches two placement rules: {matches[0][0]!r} -> {matches[0][1]!r} and "
                f"{matches[1][0]!r} -> {matches[1][1]!r}. Make the patterns disjoint. Received: rules="
                f"{[p for p, _, _, _ in self._rules]}.")
        parts, auto = None, False
        if matches:
            where, why, parts = matches[0][1], f"placement rule {matches[0][0]!r}", matches[0][2]
        elif self._architecture == "allreduce":
            where, why = REPLICATED, "architecture 'allreduce'"
        elif is_embedding:
            where, why = PS, "tf.keras.layers.Embedding table (sparse gradient)"
        elif self._architecture == "ps" and trainable:
            where, why = PS, "architecture 'ps'"
        else:
            where, why = REPLICATED, "dense variable (default)" if trainable else "non-trainable variable"
        if where == REPLICATED:
            return Decision(REPLICATED, why)
        if not self._ps_load:
            raise ValueError(
                f"Variable {path!r} must live on a parameter server ({why}), but the cluster has no PS task. "
                "Received: num_ps=0. Start PS tasks (kparallax-run --ps 1 ...), use architecture='allreduce', or "
                f"map it to 'replicated' with placement={{{path!r}: 'replicated'}}.")
        num_rows = shape[0] if shape else 0
        if parts is None and is_embedding:
            parts, auto = self._partitions, self._auto
            if self._auto or self._settled:  # a searched count never exceeds a small table's rows
                parts = min(parts, max(num_rows, 1))
        parts = parts or 1
        if parts > 1 and parts > num_rows:
            raise ValueError(f"Variable {path!r} has {num_rows} rows and cannot be split into {parts} shards. "
                             f"Received: partitions={parts}. Use at most {max(num_rows, 1)}.")
        rows = shard_rows(num_rows, parts) if parts > 1 else (num_rows,)
        row_size = math.prod(int(d) for d in shape[1:])
        return Decision(PS, why, tuple(self.assign(r * row_size) for r in rows), rows, auto)

    def moves_sparse(self, path: str) -> bool:
        """Whether the replicated trainable variable ``path`` goes onto a PS task if its gradient is sparse (see
        ``for_sparse_gradient``)."""
        return (self._architecture == "hybrid" and bool(self._ps_load)
                and not any(r.fullmatch(path) for _, r, _, _ in self._rules))

    def for_sparse_gradient(self, path: str, shape) -> Optional[Decision]:
        """Where a replicated trainable variable goes once its gradient is found to be sparse (``tf.IndexedSlices``)
        in the first traced step: under ``hybrid``, onto the least-loaded PS task, whole (a variable cannot become
        row shards in place; a ``"ps:P"`` rule splits it when it is created). None when it stays replicated: any
        other architecture, a placement rule naming it (the user chose), or no PS task."""
        if not self.moves_sparse(path):
            return None
        return Decision(PS, "its gradient is sparse (tf.IndexedSlices)", (self.assign(math.prod(shape)),),
                        (shape[0] if shape else 0,))

    def settle_auto(self, partitions: int):
        """After the ``"auto"`` search: tables created from now on get ``partitions`` shards, no new search."""
        self._partitions, self._auto, self._settled = partitions, False, True

    def assign(self, num_elements: int) -> int:
        """The least-loaded PS task (ties: lowest index), charged with ``num_elements``."""
        task = min(range(len(self._ps_load)), key=lambda i: (self._ps_load[i], i))
        self._ps_load[task] += num_elements
        return task
