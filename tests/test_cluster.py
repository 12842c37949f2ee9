import json

import pytest

from kparallax import Cluster


def test_from_launcher_env():
    env = {"KPARALLAX_PS_HOSTS": "127.0.0.1:2000,127.0.0.1:2001", "KPARALLAX_WORKER_HOSTS": "127.0.0.1:3000,127.0.0.1:3001",
           "KPARALLAX_TASK_TYPE": "worker", "KPARALLAX_TASK_INDEX": "1", "KPARALLAX_RUN_ID": "r1"}
    c = Cluster.from_env(env)
    assert c.ps == ("127.0.0.1:2000", "127.0.0.1:2001")
    assert c.workers == ("127.0.0.1:3000", "127.0.0.1:3001")
    assert (c.task_type, c.task_index, c.run_id, c.num_ps, c.num_workers) == ("worker", 1, "r1", 2, 2)
    assert not c.is_chief
    assert c.ps_device(1) == "/job:ps/replica:0/task:1/device:CPU:0"


def test_from_env_without_anything_is_single_process():
    c = Cluster.from_env({})
    assert (c.num_ps, c.num_workers, c.task_index, c.is_chief) == (0, 1, 0, True)


def test_from_tf_config_with_chief():
    cfg = {"cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"], "ps": ["p0:1"]},
           "task": {"type": "worker", "index": 1}}
    c = Cluster.from_env({"TF_CONFIG": json.dumps(cfg)})
    assert c.workers == ("h0:1", "h1:1", "h2:1")
    assert c.task_index == 2 and c.ps == ("p0:1",)
    chief = Cluster.from_tf_config({**cfg, "task": {"type": "chief", "index": 0}})
    assert chief.is_chief
    ps = Cluster.from_tf_config({**cfg, "task": {"type": "ps", "index": 0}})
    assert ps.task_type == "ps"


def test_explicit_arguments():
    c = Cluster(ps=["localhost:5000"], workers=["localhost:5001", "localhost:5002"], task_index=1)
    assert c.cluster_spec_dict() == {"ps": ["localhost:5000"], "worker": ["localhost:5001", "localhost:5002"]}


@pytest.mark.parametrize("kwargs, match", [
    (dict(ps=["nohost"]), r"ps\[0\] must be 'host:port'. Received: ps\[0\]='nohost'"),
    (dict(ps=["h:99999"]), r"port between 1 and 65535. Received: ps\[0\]='h:99999'"),
    (dict(workers=[]), r"at least one worker. Received: workers=\(\)"),
    (dict(ps=["h:1"], workers=["h:1"]), r"Address h:1 is used twice: by ps\[0\] and by workers\[0\]"),
    (dict(task_type="chief"), r"task_type must be one of .* Received: task_type='chief'"),
    (dict(workers=["h:1", "h:2"], task_index=2), r"task_index must be in \[0, 2\).*Received: task_index=2"),
    (dict(run_id="a/b"), r"run_id must be a non-empty name without '/'. Received: run_id='a/b'"),
])
def test_validation_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cluster(**kwargs)


def test_bad_tf_config():
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        Cluster.from_tf_config("{nope")
    with pytest.raises(ValueError, match=r"unknown job\(s\) \['evaluator'\]"):
        Cluster.from_tf_config({"cluster": {"worker": ["h:1"], "evaluator": ["h:2"]}})
    with pytest.raises(ValueError, match="KPARALLAX_TASK_INDEX must be an integer"):
        Cluster.from_env({"KPARALLAX_WORKER_HOSTS": "h:1", "KPARALLAX_TASK_INDEX": "x"})
