"""Shim: ``python scripts/project_scaling.py ...`` runs ``kparallax_bench.project_scaling`` (see its docstring)."""

import sys

from kparallax_bench import project_scaling

if __name__ == "__main__":
    sys.exit(project_scaling.main())
