"""The node's own files, kept from the host's other users (docs/SECURITY.md, "Files and local users").

Pool files, the daemon's state files, the admin token and the directories Tutti makes for them are
owner-only: files mode 0600, directories 0700, whatever the umask. With ``file_group`` set (a group
name or a numeric gid) they are given to that group and readable by it: files 0640, directories
0750. The group never writes: its members (a daemon or an operator tool running as another user)
only read. The daemon's socket is the one exception, 0660 with the group (0600 without), since a
client needs write permission on a socket to connect to it.

Every file written here is made under a fresh name with ``O_EXCL | O_NOFOLLOW`` (never a file some
one else put there, never through a symbolic link) and renamed into place, atomically. Files read
here (the configuration file, the daemon's state) must be regular files of bounded size, opened
without waiting (``O_NONBLOCK``: a FIFO is refused at once instead of hanging the reader).
Pool files are opened by the native core under the same rules (``FilePool::open``).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import stat
import threading
from pathlib import Path

from tutti_cluster.errors import ConfigError, StorageError, TuttiError

#: Largest configuration file read (``TUTTI_CONFIG_FILE``).
MAX_CONFIG_BYTES = 1 << 20
#: Largest daemon state file read (``instances.json``, ``pins.json``).
MAX_STATE_BYTES = 64 << 20


def group_id(file_group: str | int | None) -> int | None:
    """The gid of ``file_group`` (a group name or a number), None when unset; ConfigError for a
    name this host does not know."""
    if file_group is None or file_group == "":
        return None
    text = str(file_group).strip()
    if text.isdigit():
        return int(text)  # a gid needs no entry in /etc/group (containers often have none)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ConfigError(f"file_group {text!r} is not a group on this host (give a group name or a numeric gid)") from None


def file_mode(gid: int | None) -> int:
    return 0o640 if gid is not None else 0o600


def dir_mode(gid: int | None) -> int:
    return 0o750 if gid is not None else 0o700


def socket_mode(gid: int | None) -> int:
    return 0o660 if gid is not None else 0o600


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _apply(fd: int, mode: int, gid: int | None) -> None:
    os.fchmod(fd, mode)  # whatever the umask took away at creation
    if gid is not None and os.fstat(fd).st_gid != gid:
        os.fchown(fd, -1, gid)


def set_access(fd: int, path: Path | str, mode: int, gid: int | None) -> None:
    """``mode`` and (when given) group ``gid`` on an open file or directory; StorageError otherwise."""
    try:
        _apply(fd, mode, gid)
    except OSError as exc:
        hint = " (this user must be a member of file_group)" if gid is not None and exc.errno == errno.EPERM else ""
        raise StorageError(f"cannot set the mode of {path}: {exc.strerror or exc}{hint}") from None


def make_dir(path: Path, gid: int | None = None) -> None:
    """Makes directory ``path`` (and missing parents) with :func:`dir_mode`; an existing directory
    (or a symbolic link to one, as an operator may give) is left as it is. StorageError otherwise."""
    path = Path(path)
    if path.is_dir():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        if path.is_dir():
            return  # made by another process a moment ago
        raise StorageError(f"{path} exists and is not a directory") from None
    except OSError as exc:
        raise StorageError(f"cannot create the directory {path}: {exc.strerror or exc}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"cannot open the directory {path} just made: {exc.strerror or exc}") from None
    try:
        set_access(fd, path, dir_mode(gid), gid)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, gid: int | None = None, *, sync: bool = True) -> None:
    """Writes ``data`` to ``path`` under a fresh temporary name (``O_EXCL | O_NOFOLLOW``, mode
    :func:`file_mode`), then renames it into place: the old or the new file, never a torn one, and
    never a write into a file or through a link someone else put at ``path``. OSError as the
    system raises it (callers decide whether that stops them)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a process that died with this pid
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _apply(fd, file_mode(gid), gid)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)  # the rename itself survives a power cut
        finally:
            os.close(dfd)


def read_bounded(path: Path | str, limit: int, *, what: str, error: type[TuttiError] = StorageError,
                 follow: bool = False) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them; ``error`` naming ``what`` and
    the path for anything else (a FIFO, a device, a directory, a larger file). Opened with
    O_NONBLOCK, so that nothing waits for a writer; without ``follow``, a symbolic link at the name
    is refused too. FileNotFoundError passes through for the caller to decide."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise error(f"{what} {path} is {_kind(st.st_mode)}, not a regular file") from None
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise error(f"{what} {path} has {st.st_size} bytes, more than the {limit} allowed")
        chunks, total = [], 0
        while True:  # bounded whatever st_size said (a file growing while read)
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise error(f"{what} {path} has more than the {limit} bytes allowed")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
