"""What each architecture must move per step: a model's traffic shape, the analytic floor, and per-link volumes.

A *shape* is a dict describing one worker's step: ``unit`` (words/images), ``items_per_step``, ``dense_bytes``
(replicated weights), and for models with tables: ``table_bytes``, ``row_bytes`` / ``softmax_row_bytes`` (bytes of
one input-embedding / softmax row), ``unique_input_rows`` / ``unique_softmax_rows`` (distinct rows a batch touches),
``gathered_rows_bytes`` / ``gathered_ids_bytes`` (the per-token sparse gradients and their int64 indices that an
allgather ships, duplicates included).
scripts/benchmark.py and scripts/project_scaling.py share these formulas.
"""

import numpy as np

PS_VARIANTS = ("kparallax-ps", "tf-pss")
HYBRID_VARIANTS = ("kparallax-hybrid", "kparallax-hybrid-async")  # same bytes per step; async only reorders them
GATHER_VARIANTS = ("kparallax-allreduce", "horovod")
DENSE_VARIANTS = ("kparallax-allreduce-dense", "horovod-dense")


BATCHES = 64  # batches of synthetic LM1B data per worker (repeated)


def lm1b_windows(config, seed=0):
    """The benchmark's synthetic Zipf data for an LM1B config: (ids, next ids), ``BATCHES`` batches."""
    from kparallax_models import lm1b_data  # pylint: disable=import-outside-toplevel
    return lm1b_data.synthetic(config.batch_size * BATCHES, config.num_steps, config.vocab_size, seed=seed)


def lm1b_shape(config, x, y):
    """The shape of an LM1B config on windows ``x, y`` from ``lm1b_windows`` (distinct ids averaged over batches)."""

    def mean_unique(ids):
        return float(np.mean([len(np.unique(batch)) for batch in np.split(ids, BATCHES)]))
    e, p, h, v = config.embedding_dim, config.projection_dim, config.lstm_units, config.vocab_size
    tokens = config.batch_size * config.num_steps
    return {"unit": "words", "items_per_step": tokens, "row_bytes": 4 * e, "softmax_row_bytes": 4 * (p + 1),
            "unique_input_rows": mean_unique(x),
            "unique_softmax_rows": float(min(mean_unique(y) + config.num_sampled, v)),
            "gathered_rows_bytes": 4 * (tokens * e + (tokens + config.num_sampled) * (p + 1)),
            "gathered_ids_bytes": 8 * (tokens + 2 * (tokens + config.num_sampled)),
            "dense_bytes": 4 * ((e + p) * 4 * h + 4 * h + h * p), "table_bytes": 4 * v * (e + p + 1)}


def sparse_rows_bytes(shape):
    """Bytes of the touched rows of all tables (one direction: a pull, or a push of their gradients)."""
    return (shape["unique_input_rows"] * shape["row_bytes"]
            + shape["unique_softmax_rows"] * shape["softmax_row_bytes"])


def sparse_ids_bytes(shape):
    return 8 * (shape["unique_input_rows"] + shape["unique_softmax_rows"])


def ring(volume, n):
    """Bytes each rank sends (and receives) in a ring allreduce of ``volume`` bytes over ``n`` ranks."""
    return 2 * (n - 1) / n * volume if n > 1 else 0.0


def floor_bytes(shape, variant, n):
    """Analytic minimum bytes the job sends per step, divided by the ``n`` workers (ring collectives; PS rows
    pulled and gradients pushed, with their ids)."""
    dense = shape["dense_bytes"]
    if variant == "single":
        return 0.0
    if "table_bytes" not in shape:  # a dense model: every variant moves the dense gradient once
        return 2 * dense if variant in PS_VARIANTS else ring(dense, n)
    rows, ids = sparse_rows_bytes(shape), sparse_ids_bytes(shape)
    if variant in HYBRID_VARIANTS:
        return 2 * rows + ids + ring(dense, n)
    if variant in PS_VARIANTS:
        return 2 * rows + ids + 2 * dense
    if variant in GATHER_VARIANTS:   # ring allgather: each rank forwards everyone else's slices once
        return (n - 1) * (shape["gathered_rows_bytes"] + shape["gathered_ids_bytes"]) + ring(dense, n)
    return ring(dense + shape["table_bytes"], n)  # sparse_as_dense


def link_bytes(shape, variant, n, per_machine, ps_machines):
    """Bytes crossing the busiest machine link in one direction per step, ``n`` workers on machines of
    ``per_machine`` workers, PS tasks spread over ``ps_machines`` of those machines (flat ring collectives in rank
    order: every ring edge carries the same volume and each machine has one outgoing inter-machine edge; traffic
    inside a machine is free).

    A machine holding a PS task sends, in one direction over a step, both its workers' pushes to the other PS
    machines and its PS task's answers to the pulls of workers elsewhere (the pull and push phases of a step use
    the same direction of the link one after the other).
    """
    machines = max(n // per_machine, 1)
    if machines == 1 or variant == "single":
        return 0.0
    dense = shape["dense_bytes"]
    tables = "table_bytes" in shape
    if variant in DENSE_VARIANTS or (not tables and variant not in PS_VARIANTS):
        return ring(dense + (shape.get("table_bytes", 0) if variant in DENSE_VARIANTS else 0), n)
    if variant in GATHER_VARIANTS:  # each ring edge carries every other rank's slices once
        return (n - 1) * (shape["gathered_rows_bytes"] + shape["gathered_ids_bytes"]) + ring(dense, n)
    one_way = (sparse_rows_bytes(shape) + sparse_ids_bytes(shape)) if tables else 0.0
    if variant in PS_VARIANTS:
        one_way += dense
    ps_machines = min(ps_machines, machines)
    answers = (n - per_machine) * one_way / ps_machines                    # to the workers of other machines
    pushes = per_machine * one_way * (ps_machines - 1) / ps_machines       # to the other PS machines
    no_ps_machine = per_machine * one_way if ps_machines < machines else 0.0
    return max(answers + pushes, no_ps_machine) + (ring(dense, n) if variant in HYBRID_VARIANTS else 0.0)


def rounds(variant, n):
    """Sequential message rounds per step (latency terms of the alpha-beta model)."""
    if variant == "single" or n == 1:
        return 0
    if variant in PS_VARIANTS:
        return 2                              # pull, push
    ring_allreduce = 2 * (n - 1)
    if variant in HYBRID_VARIANTS:
        return 2 + ring_allreduce
    if variant in GATHER_VARIANTS:
        return ring_allreduce + (n - 1)       # plus the ring allgather
    return ring_allreduce
