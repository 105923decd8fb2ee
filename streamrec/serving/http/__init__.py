"""Serving's HTTP and processes: the app and its routes, the predict shortcut, the guards, the
torch-free front-end processes, and ``streamrec serve`` (``server``), which puts a node together."""
