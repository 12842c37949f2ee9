"""``partitions="auto"``: choose the number of shards per embedding table in the running job.

Parallax chose the partition count by relaunching the job at several values. Here the job is never restarted:
a Keras callback trains ``1 + auto_steps`` real steps at each candidate P (powers of two from the number of PS
tasks up to ``max_partitions`` and the table's row count), re-partitioning the tables between candidates with
their values and optimizer state carried over, so every search step is also a normal training step. The median
step time of each candidate (averaged over workers, so every worker decides alike) is fitted to Parallax's cost
model t(P) = a/P + b(P-1) + c by least squares; the integer P in the searched range that minimizes the fit is kept
(with fewer than three candidates, the fastest measured one). Samples, coefficients and the choice are logged
and kept in ``strategy.partition_search``.
"""

import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from kparallax import log as logging


def candidates(num_ps, max_partitions, min_rows):
    """Powers of two times ``num_ps`` (at least 1) up to ``max_partitions`` and the smallest table's rows."""
    first = max(num_ps, 1)
    limit = max(first, min(max_partitions, min_rows))
    out, p = [], first
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def fit_cost_model(samples):
    """Least-squares (a, b, c) of t(P) = a/P + b(P-1) + c for ``samples`` {P: seconds}; None if < 3 samples."""
    if len(samples) < 3:
        return None
    ps = np.array(sorted(samples), dtype=np.float64)
    design = np.stack([1.0 / ps, ps - 1.0, np.ones_like(ps)], axis=1)
    coefficients, *_ = np.linalg.lstsq(design, np.array([samples[p] for p in sorted(samples)]), rcond=None)
    return tuple(float(c) for c in coefficients)


def choose(samples):
    """(chosen P, coefficients or None): argmin of the fitted model over the integers of the searched range."""
    model = fit_cost_model(samples)
    if model is None:
        return min(samples, key=lambda p: (samples[p], p)), None
    a, b, c = model
    grid = range(min(samples), max(samples) + 1)
    return min(grid, key=lambda p: (a / p + b * (p - 1) + c, p)), model


class PartitionSearch(tf.keras.callbacks.Callback):
    """Runs the search during ``fit`` (added by kparallax when ``partitions="auto"``); a no-op once done.

    The search state lives in the strategy, so a search that an epoch end interrupts continues in the next
    ``fit`` call.
    """

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy
        self._state = strategy.partition_search
        self._last = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        state = self._state
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        if state["done"]:
            return
        weights = self.model.weights
        tables = [t for t in self._strategy.partitioned_tables if any(w is t.shards[0] for w in weights)]
        if not tables:
            return
        if not state["candidates"]:
            state["candidates"] = candidates(self._strategy.cluster.num_ps, self._strategy.options.max_partitions,
                                             min(t.shape[0] for t in tables))
            state["current"] = 0
            state["times"] = []
        state["step"] += 1
        if state["step"] == 1:
            return  # warm-up: includes tracing the step for this partition count
        state["times"].append(elapsed)
        if len(state["times"]) < self._strategy.options.auto_steps:
            return
        p = state["candidates"][state["current"]]
        local = float(np.median(state["times"]))
        mean = float(hvd.allreduce(tf.constant(local, tf.float64), op=hvd.Average, name=f"kp_search_{p}").numpy()) \
            if self._strategy.num_workers > 1 else local
        state["samples"][p] = mean
        logging.info("partition search: P=%d -> %.2f ms/step (median of %d steps, mean over workers)", p,
                     mean * 1e3, len(state["times"]))
        state["current"] += 1
        if state["current"] < len(state["candidates"]):
            target = state["candidates"][state["current"]]
        else:
            target, state["model"] = choose(state["samples"])
            state["done"], state["chosen"] = True, target
            self._strategy.settle_partitions(target)
            fitted = ("t(P) = %.3g/P + %.3g(P-1) + %.3g s" % state["model"]) if state["model"] else "too few samples"
            logging.info("partition search: samples %s ms; fit %s; chosen P=%d",
                         {k: round(v * 1e3, 2) for k, v in state["samples"].items()}, fitted, target)
        for table in tables:
            self._strategy.repartition(table, target, self.model)
        state["step"], state["times"] = 0, []
        self._last = None


def new_state():
    return {"done": False, "candidates": [], "current": 0, "step": 0, "times": [], "samples": {}, "model": None,
            "chosen": None}
