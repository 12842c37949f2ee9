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


def check_writable_dir(path, flag):
    """Creates directory ``path`` (given by ``flag``) if needed; a ``ValueError`` naming it if it cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".kparallax_write_test")
        with open(probe, "w", encoding="utf-8") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{flag} is not writable ({e.strerror}). Pass a directory this user can create and write. "
                         f"Received: {flag}={path}.") from None
