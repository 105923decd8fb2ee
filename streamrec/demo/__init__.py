"""``streamrec demo`` (the whole loop, measured) and ``streamrec report``."""

from streamrec.demo.run import run_demo

__all__ = ["run_demo"]
