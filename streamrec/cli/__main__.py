"""``python -m streamrec.cli``: the `streamrec` command (how the demo, the trainer's launcher
and the tests start it)."""

import sys

from streamrec.cli import main

if __name__ == "__main__":
    sys.exit(main())
