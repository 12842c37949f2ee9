"""Process teardown.

Workaround for: TensorFlow 2.15 (seen 2.15.1). Symptom without it: a process that holds live gRPC channels to PS
tasks (or serves as one) can abort or hang in TensorFlow's static destructors at interpreter exit, turning a clean
exit code into SIGABRT (134) or a stuck process.
"""

import os
import sys


def hard_exit(code):
    """Flushes stdout/stderr and exits with ``code`` without running interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
