"""kparallax's own logger (TF-free): ``INFO:kparallax:<message>`` lines on stderr.

Under ``kparallax-run`` every task's stderr goes to its log file, and the launcher does not echo these lines to the
terminal: the per-task logs keep placement, architecture and connection details, the terminal shows what a Keras
user expects (the progress bar, the user's prints, warnings). TensorFlow's own Python logging (absl) is left at its
default level.
"""

import logging as _logging
import sys

PREFIX = "INFO:kparallax:"
# Horovod's error when a collective ends because another rank stopped: a worker says so in one line
# (``core/errors.py``), and the launcher, finding it in a failed worker's log, looks for the worker that caused it.
HOROVOD_SHUT_DOWN = "Horovod has been shut down"
_logger = _logging.getLogger("kparallax")


def _ready():
    if not _logger.handlers:
        handler = _logging.StreamHandler(sys.stderr)
        handler.setFormatter(_logging.Formatter("%(levelname)s:kparallax:%(message)s"))
        _logger.addHandler(handler)
        _logger.setLevel(_logging.INFO)
        _logger.propagate = False
    return _logger


def info(message, *args):
    _ready().info(message, *args)


def debug(message, *args):
    _ready().debug(message, *args)


def warning(message, *args):
    _ready().warning(message, *args)
