def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: runs a real cluster (PS + Horovod workers) via kparallax-run")
