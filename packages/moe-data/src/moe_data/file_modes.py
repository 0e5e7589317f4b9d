"""Files and directories with the permissions the user's umask gives, as `cp` or `mkdir` would
make them (files 0666, directories 0777, less the umask), also where the usual way to make
them (`tempfile.mkdtemp`, a library that writes through a private temporary file) gives the
owner alone access: a model or checkpoint on a shared file system stays readable by the
colleagues the umask lets in.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

FILE_MODE = 0o666
"""Mode new files ask for; the umask takes bits away."""
DIR_MODE = 0o777
"""Mode new directories ask for; the umask takes bits away."""

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process's umask (read from /proc where it is shown, else set and set back)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def new_scratch_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named, empty directory `parent/prefix<random>`, made like `mkdir` makes
    one (unlike `tempfile.mkdtemp`, which gives it mode 0700)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free directory name {prefix}* in {parent}")


def give_umask_mode(path: Path) -> None:
    """Set the mode of the file or directory `path` to what the umask gives a new one (for a
    file some library wrote with a narrower mode)."""
    full = DIR_MODE if path.is_dir() else FILE_MODE
    os.chmod(path, full & ~current_umask())
