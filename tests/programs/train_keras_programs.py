"""Runs keras_programs in one plain process (MODE=reference, global batch) or under kparallax (MODE=kparallax,
per-worker batch; under kparallax-run). Writes OUT_DIR/<program>.npz (weights, then any logged values) from worker
0, and for keras_programs.PER_WORKER each worker's trainable weights (<program>.w<rank>.npz). SHARD ("i/n", default "0/1") runs part i of n of the programs (keras_programs.shard); "striped" runs
keras_programs.STRIPED, under kparallax with every table in 3 stripes (partitions=3); "ps" runs keras_programs.ON_PS
under architecture="ps" (every trainable variable on the PS); "searched:NAME" runs program
NAME, under kparallax with partitions="auto" (max_partitions=8, auto_steps=1: 2, 4 and 8 stripes over its first 6
steps, then the one chosen), so the search re-partitions its tables during its fit; "only:NAME" runs program NAME
alone, "striped:NAME" alone with its tables in 3 stripes (to check one while writing it).
Usage: train_keras_programs.py OUT_DIR MODE [SHARD]"""

import contextlib
import os
import sys

import numpy as np

import keras_programs as programs

PER_WORKER_BATCH = 16


def main(out_dir, mode, part="0/1"):
    if mode == "reference":
        scope, batch, chief = contextlib.nullcontext, PER_WORKER_BATCH * programs.WORKERS, True
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        options = {"partitions": 3} if part == "striped" or part.startswith("striped:") else {}
        if part.startswith("searched:"):
            options = {"partitions": "auto", "max_partitions": 8, "auto_steps": 1}
        if part == "ps":
            options = {"architecture": "ps"}
        strategy = kp.HybridStrategy(**options)
        scope, batch, chief = strategy.scope, PER_WORKER_BATCH, strategy.is_chief
        programs.RANK, programs.RUN_WORKERS = strategy.worker_index, strategy.num_workers
        programs.pair_weights_per_table(strategy.registry.table_of)
    programs.SHARED_DIR = out_dir
    if part == "striped":
        names = programs.in_order(programs.STRIPED)
    elif part == "ps":
        names = programs.in_order(programs.ON_PS)
    elif part.startswith(("searched:", "only:", "striped:")):
        names = [part.split(":", 1)[1]]
    else:
        index, count = (int(n) for n in part.split("/"))
        names = programs.shard(index, count)
    for name in names:
        model = programs.PROGRAMS[name](scope, batch)
        if mode != "reference" and name in programs.PER_WORKER:  # every worker's replica (the contract's check)
            np.savez(os.path.join(out_dir, f"{name}.w{programs.RANK}.npz"), *[v.numpy() for v in model.trainable_weights])
        if chief:
            # A program may name the weights it compares (not its metrics' variables, say).
            weights = model.compared_weights() if hasattr(model, "compared_weights") else model.get_weights()
            np.savez(os.path.join(out_dir, f"{name}.npz"),  # vocabularies (object arrays) saved as strings
                     *[w.astype(str) if w.dtype.kind == "O" else w for w in weights],
                     *getattr(model, "logged", []))
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(*sys.argv[1:])
