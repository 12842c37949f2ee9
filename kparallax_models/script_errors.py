"""Shared by the training scripts: expected errors end with one message and a non-zero exit, no traceback."""

import os
import sys

from kparallax._compat import process

EXPECTED = (ValueError, FileNotFoundError, ConnectionError, TimeoutError)


def run_with_clear_errors(main, argv, script):
    """Runs ``main(argv)``; an expected error prints ``<script>: error: ...`` and exits 2 (``KPARALLAX_TRACEBACK=1``
    re-raises it instead)."""
    try:
        main(argv)
    except EXPECTED as e:
        if os.environ.get("KPARALLAX_TRACEBACK"):
            raise
        sys.stderr.write(f"{os.path.basename(script)}: error: {e}\n(set KPARALLAX_TRACEBACK=1 for the traceback)\n")
        process.hard_exit(2)  # skip TensorFlow's teardown of live PS connections
