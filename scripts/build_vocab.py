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
    size = lm1b_data.build_vocabulary(args.files, args.output, args.max_size)
    print(f"wrote {size} entries to {args.output}")


if __name__ == "__main__":
    main()
