"""Tier 2: a PS table created by several client processes is one shared resource on a real TF server."""

import os
import subprocess
import sys

import pytest

from kparallax.cluster import net

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")


@pytest.fixture(scope="module")
def ps_address():
    address = f"127.0.0.1:{net.free_port()}"
    env = dict(os.environ, KPARALLAX_PS_HOSTS=address, KPARALLAX_WORKER_HOSTS="127.0.0.1:1",
               KPARALLAX_TASK_TYPE="ps", KPARALLAX_TASK_INDEX="0")
    server = subprocess.Popen([sys.executable, "-m", "kparallax.cluster.ps_server"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    for line in server.stdout:
        if "ready at" in line:
            break
    yield address
    server.terminate()
    assert server.wait(timeout=30) == 0, "the PS task must exit 0 on SIGTERM"


def _client(ps, role, index):
    done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "shared_client.py"), ps, role, str(index)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [float(l.split()[1]) for l in done.stdout.splitlines() if l.startswith("READ")]


def test_one_table_shared_by_all_clients(ps_address):
    assert _client(ps_address, "write", 0) == []
    # A second process sees the first one's value (7 everywhere), then overwrites row 3 with 100.
    assert _client(ps_address, "read_then_write", 1) == [50 * 4 * 7.0]
    # A third process sees the second one's write: one copy on the PS, not one per client.
    assert _client(ps_address, "read", 2) == [49 * 4 * 7.0 + 4 * 100.0]
