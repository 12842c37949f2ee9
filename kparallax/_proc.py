"""Small process helpers shared by the launcher and the PS entry point (Linux)."""

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig=signal.SIGTERM):
    """Asks the kernel to send ``sig`` to this process when its parent exits (no orphan tasks)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        pass


def hard_exit(code):
    """Exits without running TensorFlow's static destructors (a stopping gRPC server can abort in them)."""
    os._exit(code)  # pylint: disable=protected-access
