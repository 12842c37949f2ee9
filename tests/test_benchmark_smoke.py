"""Smoke test of scripts/benchmark.py: tiny model, one timed step per variant; checks the report's shape."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.multiprocess
def test_benchmark_runs_every_variant_and_reports_bytes(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--model", "lm1b_tiny",
                           "--workers", "1,2", "--steps", "1", "--warmup", "1", "--repeats", "1", "--batch_size", "4",
                           "--json", str(out), "--markdown", str(tmp_path / "bench.md"), "--png",
                           str(tmp_path / "bench.png")], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())["variants"]
    expected = {f"{v}@{n}" for n in (1, 2) for v in ("kparallax-hybrid", "kparallax-allreduce",
                                                      "kparallax-allreduce-dense", "kparallax-ps", "horovod",
                                                      "horovod-dense")} | {"single@1"}
    assert set(report) == expected
    for key, entry in report.items():
        for field in ("throughput", "throughput_min", "throughput_max", "ms_per_step", "bytes_per_step",
                      "floor_bytes_per_step"):
            assert entry[field] >= 0, (key, field)
        assert entry["throughput"] > 0
    assert report["horovod@2"]["bytes_per_step"] > 0 and report["kparallax-hybrid@2"]["bytes_per_step"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 1000 and "| kparallax-hybrid | 2 |" in (tmp_path / "bench.md").read_text()


def test_unimplemented_parts_say_so():
    for argv, message in ((["--variants", "tf-pss"], "ParameterServerStrategy is not implemented"),
                          (["--emulate-network", "1gbit"], "--emulate-network is not implemented yet")):
        done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), *argv],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and message in done.stderr
