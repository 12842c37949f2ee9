import subprocess
import sys

import pytest

from kparallax.core import options as options_lib
from kparallax.core import partition_search
from kparallax.core.options import Options


@pytest.mark.parametrize("kwargs, message", [
    ({"architecture": "mesh"}, r"architecture must be one of .*Received: architecture='mesh'"),
    ({"partitions": 0}, r"partitions must be an integer >= 1 .* or 'auto'. Received: partitions=0"),
    ({"partitions": "many"}, r"Received: partitions='many'"),
    ({"partitions": True}, r"Received: partitions=True"),
    ({"backward_passes_per_step": 0}, r"Received: backward_passes_per_step=0"),
    ({"compression": "int8"}, r"compression must be one of \('none', 'fp16'\). Received: compression='int8'"),
    ({"sync": "no"}, r"sync must be True or False. Received: sync='no'"),
    ({"sparse_as_dense": True}, r"sparse_as_dense applies to architecture='allreduce' only"),
    ({"architecture": "allreduce", "sync": False}, r"sync=False .* needs PS variables"),
    ({"partitions": "auto", "backward_passes_per_step": 2}, r"partitions='auto' needs sync=True and"),
    ({"auto_steps": 0}, r"Received: auto_steps=0"),
    ({"local_aggregation": "yes"}, r"local_aggregation must be True, False or 'auto'. Received: local_aggregation='yes'"),
])
def test_bad_options_get_one_clear_error(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Options(**kwargs)


def test_architecture_comes_from_the_launcher_env_unless_given(monkeypatch):
    monkeypatch.delenv(options_lib.ARCHITECTURE_ENV, raising=False)
    assert options_lib.architecture_from_env(None) == "hybrid"
    monkeypatch.setenv(options_lib.ARCHITECTURE_ENV, "ps")
    assert options_lib.architecture_from_env(None) == "ps"
    assert options_lib.architecture_from_env("allreduce") == "allreduce"
    monkeypatch.setenv(options_lib.ARCHITECTURE_ENV, "pss")
    with pytest.raises(ValueError, match=r"\$KPARALLAX_ARCHITECTURE must be one of \('hybrid', 'allreduce', 'ps'\) "
                                         r"\(or unset\)\. Received: KPARALLAX_ARCHITECTURE='pss'\."):
        options_lib.architecture_from_env(None)


def test_search_candidates_are_powers_of_two_from_num_ps():
    assert partition_search.candidates(1, 16, 10**6) == [1, 2, 4, 8, 16]
    assert partition_search.candidates(2, 8, 10**6) == [2, 4, 8]
    assert partition_search.candidates(3, 16, 10**6) == [3, 6, 12]
    assert partition_search.candidates(2, 16, 5) == [2, 4]
    assert partition_search.candidates(4, 2, 10**6) == [4]


def test_cost_model_fit_recovers_known_coefficients_and_argmin():
    a, b, c = 0.08, 0.002, 0.01
    samples = {p: a / p + b * (p - 1) + c for p in (1, 2, 4, 8, 16)}
    fitted = partition_search.fit_cost_model(samples)
    assert fitted == pytest.approx((a, b, c), rel=1e-9)
    chosen, _ = partition_search.choose(samples)
    assert chosen == 6  # sqrt(a/b) = 6.32; t(6) < t(7)
    assert partition_search.choose({2: 0.3, 4: 0.2})[0] == 4  # too few samples: fastest measured


def test_job_on_one_host_decides_auto_local_aggregation():
    from kparallax.cluster import runtime  # pylint: disable=import-outside-toplevel
    from kparallax.cluster import Cluster  # pylint: disable=import-outside-toplevel
    assert runtime.job_on_one_host(Cluster(ps=["localhost:2222"], workers=["127.0.0.1:2300", "localhost:2301"]))
    assert not runtime.job_on_one_host(Cluster(ps=["10.0.0.2:2222"], workers=["10.0.0.1:2300", "10.0.0.1:2301"]))
    assert not runtime.job_on_one_host(Cluster(ps=["10.0.0.1:2222"], workers=["10.0.0.1:2300", "10.0.0.2:2300"]))


def test_free_ports_lie_below_the_ephemeral_range_whatever_the_programs_seed():
    """A port an outgoing connection may take (the kernel's ephemeral range) is never handed out: a worker once could
    not bind one in CI. Two processes that seeded Python's ``random`` alike (``tf.keras.utils.set_random_seed``)
    still pick apart: a TF_CONFIG worker picks its own server's port after the program's seeding."""
    from kparallax.cluster import net  # pylint: disable=import-outside-toplevel
    low, _ = net._ephemeral_range()  # pylint: disable=protected-access
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(15000 <= port < low for port in ports), ports
    code = "import random; random.seed(0); from kparallax.cluster import net; print(net.free_port())"
    picked = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             timeout=60).stdout.strip() for _ in range(2)]
    assert picked[0] != picked[1], picked
