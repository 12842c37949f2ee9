"""Shim: ``python scripts/benchmark.py ...`` runs ``kparallax_bench.benchmark`` (see its docstring)."""

import sys

from kparallax_bench import benchmark

if __name__ == "__main__":
    sys.exit(benchmark.main())
