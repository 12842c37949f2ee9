"""``python -m kparallax.launch`` = ``kparallax-run``."""

from kparallax.launch import cli

if __name__ == "__main__":
    cli.main()
