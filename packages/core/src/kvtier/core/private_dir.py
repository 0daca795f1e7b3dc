"""Directories only this user may use: the control sockets' and the node tier's.

A directory another local user could have created (in ``/tmp`` or ``/dev/shm``), opened up, or
could replace (through a directory above it that they own or may write, without the sticky bit)
could be used to answer in kvtier's place or to plant chunks. ``private_dir`` creates one (and
any missing parents) ``0700`` and says what is wrong with one that is there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents with mode ``0700`` (existing ones are kept)."""
    missing = []
    p = path
    while not os.path.lexists(p) and p.parent != p:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


def private_dir(path: Path, *, parents: bool = False) -> str | None:
    """Create ``path`` (mode ``0700``; missing parents too with ``parents``) if it is missing,
    then what makes it unsafe ("is not a directory ...", "belongs to user id ...", "has mode
    ...", "is under ..."); None when it is a directory of this user's that group and others
    cannot use, under directories only root or this user can change. Raises ``OSError`` when
    it cannot be created."""
    path = Path(os.path.abspath(path))
    if parents:
        make_private_dirs(path)
    else:
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a symlink or a file is there)"
    if st.st_uid != os.getuid():
        return f"belongs to user id {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}: group or others may use it (needs 700)"
    for above in path.parents:
        st = os.lstat(above)
        if st.st_uid not in (0, os.getuid()):
            return f"is under {above}, which user id {st.st_uid} owns (and could replace it)"
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            return f"is under {above}, which every user may write (no sticky bit)"
    return None
