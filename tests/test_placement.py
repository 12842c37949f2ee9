import pytest

from kparallax.core.placement import PS, REPLICATED, Placement, shard_rows


def test_defaults_embedding_to_ps_and_dense_replicated():
    p = Placement(num_ps=1)
    assert p.decide("embedding/embeddings", [100], is_embedding=True).where == PS
    assert p.decide("dense/kernel", [100], is_embedding=False).where == REPLICATED


def test_rules_override_defaults():
    p = Placement({r"dense/.*": "ps", r"embedding/.*": "replicated"}, num_ps=1)
    d = p.decide("dense/kernel", [10], is_embedding=False)
    assert d.where == PS and "placement rule 'dense/.*'" in d.why
    assert p.decide("embedding/embeddings", [10], is_embedding=True).where == REPLICATED


def test_ps_tasks_are_balanced_by_size():
    p = Placement(num_ps=2)
    tasks = [p.decide(f"e{i}/embeddings", [n], True).ps_task for i, n in enumerate([1000, 10, 10, 500])]
    assert tasks == [0, 1, 1, 1]


def test_two_matching_rules_is_an_error_naming_both():
    p = Placement({r"dense.*": "ps", r".*kernel": "replicated"}, num_ps=1)
    with pytest.raises(ValueError, match=r"matches two placement rules: 'dense\.\*' -> 'ps' and '\.\*kernel'"):
        p.decide("dense/kernel", [1], False)


def test_no_ps_for_an_embedding_is_a_clear_error():
    with pytest.raises(ValueError, match=r"must live on a parameter server .*Received: num_ps=0"):
        Placement(num_ps=0).decide("embedding/embeddings", [10], True)


def test_bad_rules():
    with pytest.raises(ValueError, match=r"maps to 'ps', 'ps:P' .* or 'replicated'. Received: \{'x': 'gpu'\}"):
        Placement({"x": "gpu"})
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Placement({"(": "ps"})
    with pytest.raises(ValueError, match=r"key is a regex \(a string\).*Received: \{3: 'ps'\}"):  # was a TypeError
        Placement({3: "ps"})
    with pytest.raises(ValueError, match=r"placement must be a dict .*Received: list \['embedding'\]"):
        Placement(["embedding"])


def test_architectures_change_the_defaults():
    ps = Placement(num_ps=1, architecture="ps")
    assert ps.decide("dense/kernel", [4, 4], is_embedding=False).where == PS
    assert ps.decide("bn/moving_mean", [4], is_embedding=False, trainable=False).where == REPLICATED
    allreduce = Placement(num_ps=0, architecture="allreduce")
    assert allreduce.decide("embedding/embeddings", [10, 2], is_embedding=True).where == REPLICATED


def test_a_ps_rule_under_allreduce_is_an_error():
    with pytest.raises(ValueError, match=r"architecture='allreduce' replicates every variable.*Received: \{'e': 'ps'\}"):
        Placement({"e": "ps"}, num_ps=1, architecture="allreduce")


def test_partitions_split_rows_div_style_and_spread_shards():
    assert shard_rows(10, 3) == (4, 3, 3)
    d = Placement(num_ps=2, partitions=3).decide("embedding/embeddings", [10, 4], is_embedding=True)
    assert d.rows == (4, 3, 3) and d.ps_tasks == (0, 1, 1)
    rule = Placement({"big/.*": "ps:2"}, num_ps=2).decide("big/table", [6, 2], is_embedding=False)
    assert rule.rows == (3, 3) and "placement rule 'big/.*'" in rule.why


def test_auto_starts_at_num_ps_and_is_clamped_to_rows():
    d = Placement(num_ps=2, partitions="auto").decide("e/embeddings", [100, 4], is_embedding=True)
    assert d.auto and d.rows == (50, 50)
    assert Placement(num_ps=4, partitions="auto").decide("e/embeddings", [3, 4], True).rows == (1, 1, 1)


def test_too_many_partitions_and_bad_rule_values():
    with pytest.raises(ValueError, match=r"has 3 rows and cannot be split into 4 shards. Received: partitions=4"):
        Placement(num_ps=1, partitions=4).decide("e/embeddings", [3, 4], True)
    for bad in ("ps:0", "replicated:2", "ps:x"):
        with pytest.raises(ValueError, match=r"'ps', 'ps:P' \(P >= 1 row shards\) or 'replicated'"):
            Placement({"x": bad})
