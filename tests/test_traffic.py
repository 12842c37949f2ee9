"""The benchmark's traffic formulas (scripts/traffic.py) against independent counts."""


import numpy as np
import pytest

from kparallax_bench import traffic

from kparallax_models import lm1b


def test_lm1b_shape_counts_the_models_own_weights():
    config = lm1b.preset("lm1b_tiny")
    model = lm1b.LM1B(config)
    tables = [model.word_embedding.embeddings, model.softmax_w.embeddings, model.softmax_b.embeddings]
    dense = [w for w in model.trainable_weights if not any(w is t for t in tables)]
    shape = traffic.lm1b_shape(config, *traffic.lm1b_windows(config))
    assert shape["dense_bytes"] == 4 * sum(int(np.prod(w.shape)) for w in dense)
    assert shape["table_bytes"] == 4 * sum(int(np.prod(t.shape)) for t in tables)
    tokens = config.batch_size * config.num_steps
    assert 1 <= shape["unique_input_rows"] <= tokens
    assert config.num_sampled <= shape["unique_softmax_rows"] <= tokens + config.num_sampled


def test_lm1b_sparse_touches_more_row_bytes_than_its_dense_gradient():
    """The preset of the sparse regime: the softmax rows a worker samples alone outweigh the dense weights."""
    config = lm1b.preset("lm1b_sparse", vocab_size=10_000)   # the dense weights do not depend on the vocabulary
    model = lm1b.LM1B(config)
    tables = [model.word_embedding.embeddings, model.softmax_w.embeddings, model.softmax_b.embeddings]
    dense_bytes = 4 * sum(int(np.prod(w.shape)) for w in model.trainable_weights if not any(w is t for t in tables))
    sampled_row_bytes = config.num_sampled * 4 * (config.projection_dim + 1)
    assert sampled_row_bytes >= 10 * dense_bytes


SHAPE = {"unit": "words", "items_per_step": 10, "dense_bytes": 1000.0, "table_bytes": 10_000.0, "row_bytes": 10,
         "softmax_row_bytes": 20, "unique_input_rows": 5, "unique_softmax_rows": 7, "gathered_rows_bytes": 300,
         "gathered_ids_bytes": 40}


def test_floors_by_hand():
    rows, ids = 5 * 10 + 7 * 20, 8 * 12          # 190 bytes of touched rows, 96 of ids
    assert traffic.floor_bytes(SHAPE, "kparallax-hybrid", 4) == pytest.approx(2 * rows + ids + 1.5 * 1000)
    assert traffic.floor_bytes(SHAPE, "tf-pss", 4) == pytest.approx(2 * rows + ids + 2000)
    assert traffic.floor_bytes(SHAPE, "horovod", 4) == pytest.approx(3 * 340 + 1500)
    assert traffic.floor_bytes(SHAPE, "horovod-dense", 4) == pytest.approx(1.5 * 11_000)
    assert traffic.floor_bytes(SHAPE, "kparallax-hybrid", 1) == pytest.approx(2 * rows + ids)


def test_link_volumes_by_hand():
    one_way = 190 + 96
    # 4 machines x 2 workers, PS on every machine: out of a machine go its PS task's answers to the 6 workers
    # elsewhere (1/4 of their rows each) and its 2 workers' pushes to the 3 other PS tasks (3/4 of their rows).
    assert traffic.link_bytes(SHAPE, "kparallax-hybrid", 8, 2, 4) == pytest.approx(
        6 * one_way / 4 + 2 * one_way * 3 / 4 + 1.75 * 1000)
    # one machine per worker and PS task, 8 of them: 7/8 of one worker's rows each way, twice.
    assert traffic.link_bytes(SHAPE, "kparallax-hybrid", 8, 1, 8) == pytest.approx(2 * 7 / 8 * one_way + 1.75 * 1000)
    # one PS machine out of 4: it receives everything the other 6 workers push.
    assert traffic.link_bytes(SHAPE, "kparallax-ps", 8, 2, 1) == pytest.approx(6 * (one_way + 1000))
    assert traffic.link_bytes(SHAPE, "horovod", 8, 2, 4) == pytest.approx(7 * 340 + 1.75 * 1000)
    assert traffic.link_bytes(SHAPE, "horovod", 8, 8, 1) == 0.0      # one machine: nothing on the wire
    # allgather grows with the workers, the hybrid's PS part does not (per PS machine, PS on every machine).
    grow = [traffic.link_bytes(SHAPE, "horovod", n, 1, n) for n in (2, 4, 8)]
    assert grow[0] < grow[1] < grow[2]
