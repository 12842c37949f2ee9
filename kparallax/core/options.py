"""Typed, validated training options of a ``HybridStrategy`` (one dataclass, one error per bad value)."""

import dataclasses
import os
from typing import Optional, Union

ARCHITECTURES = ("hybrid", "allreduce", "ps")
COMPRESSIONS = ("none", "fp16")
ARCHITECTURE_ENV = "KPARALLAX_ARCHITECTURE"
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Options:
    """How a ``HybridStrategy`` trains.

    Attributes:
      architecture: ``"hybrid"`` (dense variables allreduced, sparse ones on PS), ``"allreduce"`` (everything
        replicated, Horovod only) or ``"ps"`` (every trainable variable on PS tasks).
      partitions: row shards per embedding table (an int >= 1), or ``"auto"`` to choose it by timing steps.
      max_partitions: upper bound of the ``"auto"`` search.
      auto_steps: timed steps per candidate partition count of the ``"auto"`` search (after one warm-up step).
      average_sparse: average (True, the single-process equivalent) or sum sparse gradients over workers.
      sparse_as_dense: under ``"allreduce"``, densify IndexedSlices and allreduce them instead of allgathering.
      local_aggregation: workers on one host combine their sparse gradients before one push per host. ``"auto"``
        (default): on unless the whole job (every worker and PS task) runs on one host, where pushes never cross
        a network and the extra collective only costs time.
      backward_passes_per_step: micro-batches each worker accumulates locally before communicating once.
      sync: False applies each worker's PS update on arrival (asynchronous PS); dense allreduce stays synchronous.
      compression: ``"none"`` or ``"fp16"`` for the dense allreduce.
    """

    architecture: str = "hybrid"
    partitions: Union[int, str] = 1
    max_partitions: int = 16
    auto_steps: int = 5
    average_sparse: bool = True
    sparse_as_dense: bool = False
    local_aggregation: Union[bool, str] = AUTO
    backward_passes_per_step: int = 1
    sync: bool = True
    compression: str = "none"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}. Received: architecture="
                             f"{self.architecture!r}.")
        if self.partitions != AUTO and not (_is_int(self.partitions) and self.partitions >= 1):
            raise ValueError("partitions must be an integer >= 1 (row shards per embedding table) or 'auto'. "
                             f"Received: partitions={self.partitions!r}.")
        if not (_is_int(self.max_partitions) and self.max_partitions >= 1):
            raise ValueError(f"max_partitions must be an integer >= 1. Received: max_partitions={self.max_partitions!r}.")
        if not (_is_int(self.auto_steps) and self.auto_steps >= 1):
            raise ValueError(f"auto_steps must be an integer >= 1. Received: auto_steps={self.auto_steps!r}.")
        if not (_is_int(self.backward_passes_per_step) and self.backward_passes_per_step >= 1):
            raise ValueError("backward_passes_per_step must be an integer >= 1. Received: backward_passes_per_step="
                             f"{self.backward_passes_per_step!r}.")
        if self.local_aggregation != AUTO and not isinstance(self.local_aggregation, bool):
            raise TypeError("local_aggregation must be True, False or 'auto'. Received: local_aggregation="
                            f"{self.local_aggregation!r}.")
        for name in ("average_sparse", "sparse_as_dense", "sync"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False. Received: {name}={getattr(self, name)!r}.")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}. Received: compression={self.compression!r}.")
        if self.sparse_as_dense and self.architecture != "allreduce":
            raise ValueError("sparse_as_dense applies to architecture='allreduce' only (other architectures send "
                             f"sparse gradients to PS). Received: sparse_as_dense=True, architecture={self.architecture!r}.")
        if not self.sync and self.architecture == "allreduce":
            raise ValueError("sync=False (asynchronous PS) needs PS variables: use architecture='ps' or 'hybrid'. "
                             "Received: sync=False, architecture='allreduce'.")
        if not self.sync and self.backward_passes_per_step > 1:
            raise ValueError("backward_passes_per_step > 1 is supported with sync=True only. Received: sync=False, "
                             f"backward_passes_per_step={self.backward_passes_per_step}.")
        if self.partitions == AUTO and (not self.sync or self.backward_passes_per_step > 1):
            raise ValueError("partitions='auto' needs sync=True and backward_passes_per_step=1 (a re-partitioning "
                             "happens between steps). Received: partitions='auto', sync="
                             f"{self.sync}, backward_passes_per_step={self.backward_passes_per_step}.")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def architecture_from_env(explicit: Optional[str], default: str = "hybrid") -> str:
    """The architecture argument if given, else ``$KPARALLAX_ARCHITECTURE`` (set by ``kparallax-run
    --architecture``), else ``default``."""
    if explicit is not None:
        return explicit
    value = os.environ.get(ARCHITECTURE_ENV)
    if value and value not in ARCHITECTURES:
        raise ValueError(f"${ARCHITECTURE_ENV} must be one of {ARCHITECTURES} (or unset). "
                         f"Received: {ARCHITECTURE_ENV}={value!r}.")
    return value or default
