"""Restricts TensorFlow's servers to the task's cluster address.

Workaround for: TensorFlow 2.15 (seen 2.15.1; 2.16-2.18 unchanged). Symptom without it: an unauthenticated PS
(and every worker's server) listens on all interfaces whatever address the cluster gives it.

TensorFlow listens on ``0.0.0.0:PORT`` whatever address the cluster gives a task. kparallax-run therefore
starts PS tasks and workers with a tiny ``LD_PRELOAD`` library (``native/bind_address.c``) that turns wildcard
binds into binds to ``$KPARALLAX_BIND_ADDRESS``. The library is compiled on first use with the system C compiler
and cached under ``~/.cache/kparallax``.
"""

import hashlib
import os
import shutil
import socket
import subprocess

ENV = "KPARALLAX_BIND_ADDRESS"
_SOURCE = os.path.join(os.path.dirname(__file__), "native", "bind_address.c")


def library():
    """Path of the compiled shim (built once per source version). Raises RuntimeError without a C compiler."""
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kparallax")
    path = os.path.join(cache, f"bind_address-{digest}.so")
    if os.path.exists(path):
        return path
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("kparallax-run restricts servers to their cluster address with a small C library, but no C "
                           "compiler (cc/gcc) was found. Install one, or pass --bind-all to let TensorFlow listen on "
                           "all interfaces (trusted networks only). Received: PATH without cc/gcc.")
    os.makedirs(cache, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", tmp, _SOURCE, "-ldl"], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"Compiling {_SOURCE} failed: {done.stderr.strip()[-500:]}. Pass --bind-all to skip "
                           f"the restriction. Received: {compiler} exit code {done.returncode}.")
    os.replace(tmp, path)  # atomic: concurrent launchers never see a partial file
    return path


def env_for(host, preload):
    """Environment additions making a task's servers listen on ``host`` (a name or IPv4 address) only."""
    address = socket.gethostbyname(host)
    existing = os.environ.get("LD_PRELOAD", "")
    return {ENV: address, "LD_PRELOAD": f"{preload}:{existing}" if existing else preload}
