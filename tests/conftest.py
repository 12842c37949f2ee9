import os
import sys

import pytest

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: runs a real cluster (PS + Horovod workers) via kparallax-run")


@pytest.fixture
def python():
    return sys.executable


@pytest.fixture
def program():
    return lambda name: os.path.join(PROGRAMS, name)
