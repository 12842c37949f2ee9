"""Trains dense_table_models in one plain process (MODE=reference, global batch) or under kparallax
(MODE=hybrid|ps|allreduce, per-worker batch; run under kparallax-run). Usage: train_dense_tables.py OUT_DIR MODE"""

import os
import sys

import numpy as np

import dense_table_models as m


def main(out_dir, mode):
    ids, tokens, regression = m.data()
    if mode == "reference":
        scope, batch, chief = None, m.PER_WORKER_BATCH * m.WORKERS, True
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy(architecture=mode)
        scope, batch, chief = strategy.scope, m.PER_WORKER_BATCH, strategy.is_chief
    for name, build in m.MODELS.items():
        if scope is None:
            model, optimizer, loss, options = build()
            model.set_weights(m.initial_weights(model))
            model.compile(optimizer=optimizer, loss=loss, **options)
            history = model.fit(ids, m.targets(name, tokens, regression), batch_size=batch, epochs=m.EPOCHS,
                                shuffle=False, verbose=0)
        else:
            with scope():
                model, optimizer, loss, options = build()
                model.set_weights(m.initial_weights(model))
                model.compile(optimizer=optimizer, loss=loss, **options)
                history = model.fit(ids, m.targets(name, tokens, regression), batch_size=batch, epochs=m.EPOCHS,
                                    shuffle=False, verbose=0)
        if chief:
            np.savez(os.path.join(out_dir, f"{name}.npz"), *model.get_weights(),
                     loss=np.array(history.history["loss"]))
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
