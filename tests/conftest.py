def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: runs a real cluster (PS + Horovod workers) via kparallax-run")


import pytest


def pytest_addoption(parser):
    parser.addoption("--failure-trials", type=int, default=2,
                     help="repeated kill -9 trials per task kind in test_launcher (the reliability target is 20)")


@pytest.fixture
def failure_trials(request):
    return request.config.getoption("--failure-trials")
