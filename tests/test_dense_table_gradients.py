"""A PS table whose gradient is dense (a regularized table; a table tied to the output layer) trains exactly as one
plain process on the global batch under every architecture (issue 16: it used to hang at the first step); so does a
model compiled with ``steps_per_execution=3`` (it used to diverge silently)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kparallax import testing
from programs import dense_table_models as m

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense_tables_reference")
    done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "train_dense_tables.py"), str(out), "reference"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("architecture", ["hybrid", "ps", "allreduce"])
def test_dense_table_gradient_matches_single_process(architecture, reference, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "train_dense_tables.py"), str(out),
                             architecture], log_dir=str(tmp_path / "logs"), workers=m.WORKERS, ps=1, timeout=240)
    assert run.returncode == 0, run.report()
    for name, build in m.MODELS.items():
        ref, got = np.load(reference / f"{name}.npz"), np.load(out / f"{name}.npz")
        initial = m.initial_weights(build()[0])  # same shapes as the trained model
        weights = [k for k in ref.files if k.startswith("arr_")]
        assert [k for k in got.files if k.startswith("arr_")] == weights
        for i, key in enumerate(weights):
            assert not np.allclose(ref[key], initial[i]), f"{name}: weight {i} did not train (vacuous test)"
            np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} under {architecture}: weight {i}")
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5, err_msg=f"{name} under {architecture}: loss")
