"""Output files of the benchmark scripts: their directories are checked before a run, not after it."""

import os


def check_dirs(parser, args, flags):
    """``parser.error`` naming the first of ``flags`` (attributes of ``args``) whose file's directory is missing."""
    for flag in flags:
        path = getattr(args, flag)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"--{flag}: the directory of {path!r} does not exist; create it first. Received: "
                         f"--{flag}={path}.")
