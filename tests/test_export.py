"""Models trained with partitioned tables are saved with each table whole (.keras, .h5, SavedModel with a serving
signature, weights files) and load in a plain TensorFlow process (issue 14: load_model used to fail)."""

import os
import subprocess
import sys

import pytest

from kparallax import testing

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")


@pytest.mark.multiprocess
def test_partitioned_tables_export_whole_and_load_without_kparallax(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "export_partitioned.py"), str(out)],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=2, timeout=240)
    assert run.returncode == 0, run.report()
    assert "exported" in run.logs()["worker-0.log"], run.report()
    done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "load_plain.py"), str(out)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
