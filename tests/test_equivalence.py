"""2 workers x batch B through kparallax-run == 1 plain Keras process x batch 2B, for every supported optimizer."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kparallax import testing

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")
from programs import equivalence_common as common

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("equivalence")
    ref_dir, kp_dir = base / "reference", base / "kparallax"
    ref_dir.mkdir()
    kp_dir.mkdir()
    ref = subprocess.run([sys.executable, os.path.join(PROGRAMS, "train_reference.py"), str(ref_dir)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "train_kparallax.py"), str(kp_dir)],
                            log_dir=str(base / "logs"), workers=2, ps=1, timeout=300)
    assert run.returncode == 0, run.report()
    return ref_dir, kp_dir, run


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(common.OPTIMIZERS))
def test_matches_single_process(results, name):
    ref_dir, kp_dir, _ = results
    ref, got = np.load(ref_dir / f"{name}.npz"), np.load(kp_dir / f"{name}.npz")
    weights = [k for k in ref.files if k.startswith("arr_")]
    model = common.build_model(f"probe_{name}")
    initial = common.initial_weights(model)
    assert len(weights) == len(initial) == 5  # table, hidden kernel/bias, out kernel/bias
    for i, key in enumerate(weights):
        assert not np.allclose(ref[key], initial[i]), f"{name}: weight {i} did not train; the test would be vacuous"
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=ATOL, err_msg=f"{name}: weight {i}")
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=RTOL)


@pytest.mark.multiprocess
def test_tables_were_on_the_ps(results):
    _, _, run = results
    logs = run.logs()
    for name in common.OPTIMIZERS:
        assert f"placement: {name}_embedding/embeddings [{common.VOCAB}, {common.EMB}] -> ps[0]" in logs["worker-0.log"]
        assert f"placement: {name}_hidden/kernel" in logs["worker-0.log"]
