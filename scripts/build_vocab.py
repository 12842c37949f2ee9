"""Builds an LM1B vocabulary file (``word count`` per line, ``<S>``, ``</S>``, ``<UNK>`` first) from text files.

    python scripts/build_vocab.py --output vocab.txt [--max_size 100000] FILE [FILE ...]
"""

import argparse
import os

from kparallax_models import lm1b_data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--max_size", type=int, default=None, help="keep the most frequent words only")
    parser.add_argument("files", nargs="+", help="tokenized text, one sentence per line")
    args = parser.parse_args(argv)
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        parser.error(f"no such file: {missing[0]}. Received: {missing[0]}.")
    if args.max_size is not None and args.max_size < 1:
        parser.error(f"--max_size must be >= 1 (or left out: every word). Received: --max_size={args.max_size}.")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        parser.error(f"--output: the directory of {args.output!r} does not exist; create it first. "
                     f"Received: --output={args.output}.")
    try:
        size = lm1b_data.build_vocabulary(args.files, args.output, args.max_size)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {size} entries to {args.output}")


if __name__ == "__main__":
    main()
