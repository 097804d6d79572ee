"""Where the processes of one node share small files: /dev/shm (memory, never a disk), or the
temporary directory where there is none; one name per user, so two users' services on a box
never open each other's."""

from __future__ import annotations

import os
import tempfile


def node_path(name: str) -> str:
    """The node-wide path for `name` (a lock, a board) of this user."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"latency-serve-{name}-{os.getuid()}")
