import pytest

from kparallax.placement import PS, REPLICATED, Placement


def test_defaults_embedding_to_ps_and_dense_replicated():
    p = Placement(num_ps=1)
    assert p.decide("embedding/embeddings", 100, is_embedding=True).where == PS
    assert p.decide("dense/kernel", 100, is_embedding=False).where == REPLICATED


def test_rules_override_defaults():
    p = Placement({r"dense/.*": "ps", r"embedding/.*": "replicated"}, num_ps=1)
    d = p.decide("dense/kernel", 10, is_embedding=False)
    assert d.where == PS and "placement rule 'dense/.*'" in d.why
    assert p.decide("embedding/embeddings", 10, is_embedding=True).where == REPLICATED


def test_ps_tasks_are_balanced_by_size():
    p = Placement(num_ps=2)
    tasks = [p.decide(f"e{i}/embeddings", n, True).ps_task for i, n in enumerate([1000, 10, 10, 500])]
    assert tasks == [0, 1, 1, 1]


def test_two_matching_rules_is_an_error_naming_both():
    p = Placement({r"dense.*": "ps", r".*kernel": "replicated"}, num_ps=1)
    with pytest.raises(ValueError, match=r"matches two placement rules: 'dense\.\*' -> 'ps' and '\.\*kernel'"):
        p.decide("dense/kernel", 1, False)


def test_no_ps_for_an_embedding_is_a_clear_error():
    with pytest.raises(ValueError, match=r"must live on a parameter server .*Received: num_ps=0"):
        Placement(num_ps=0).decide("embedding/embeddings", 10, True)


def test_bad_rules():
    with pytest.raises(ValueError, match=r"maps to one of \('ps', 'replicated'\). Received: \{'x': 'gpu'\}"):
        Placement({"x": "gpu"})
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Placement({"(": "ps"})
