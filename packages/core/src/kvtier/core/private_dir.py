"""Directories only this user may use: the control sockets' and the node tier's.

A directory another local user could have created (in ``/tmp`` or ``/dev/shm``) or opened up
could be used to answer in kvtier's place or to plant chunks. ``private_dir`` creates one
``0700`` when missing and says what is wrong with one that is there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_dir(path: Path, *, parents: bool = False) -> str | None:
    """Create ``path`` (mode ``0700``; missing parents too with ``parents``) if it is missing,
    then what makes it unsafe: "is not a directory ...", "belongs to user id ...", "has mode
    ..."; None when it is a directory of this user's that group and others cannot use. Raises
    ``OSError`` when it cannot be created."""
    try:
        path.mkdir(mode=0o700, parents=parents)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a symlink or a file is there)"
    if st.st_uid != os.getuid():
        return f"belongs to user id {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}: group or others may use it (needs 700)"
    return None
