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


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO")."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _apply(fd: int, mode: int, gid: int | None) -> None:
    # The group first: where it is refused (not a member), the mode stays as it was, never opened
    # to the group the file happens to have (often one shared by every user, such as "users").
    if gid is not None and os.fstat(fd).st_gid != gid:
        os.fchown(fd, -1, gid)
    os.fchmod(fd, mode)  # whatever the umask took away at creation


def set_access(fd: int, path: Path | str, mode: int, gid: int | None) -> None:
    """``mode`` and (when given) group ``gid`` on an open file or directory; StorageError otherwise."""
    try:
        _apply(fd, mode, gid)
    except OSError as exc:
        hint = " (this user must be a member of file_group)" if gid is not None and exc.errno == errno.EPERM else ""
        raise StorageError(f"cannot set the mode of {path}: {exc.strerror or exc}{hint}") from None


def _mkdirs(path: Path) -> bool:
    """Makes ``path`` (mode 0700) and its missing parents (mode 0755 at most, whatever the umask: a
    parent others may write would let them replace ``path``). Whether ``path`` itself was made."""
    missing = []
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    made = False
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700 if p == path else 0o755)
            made = p == path
        except FileExistsError:
            pass  # made by another process a moment ago: checked like any existing directory
    return made


def check_dir(path: Path) -> None:
    """StorageError unless directory ``path`` (followed where it is a symbolic link) is one that no
    other user can put files in or take files from: it, and each directory above it, belongs to
    this user or root and is writable by no one else. Group write is let pass where the group is
    this process's own (a user private group); a directory above may be sticky (``/tmp``). A data
    directory another user made (say in ``/tmp``, before the node first started) would let that user
    choose the admin token and the cluster credential and replace the daemon's socket."""
    real = Path(os.path.realpath(path))
    uid, egid = os.geteuid(), os.getegid()
    given = Path(os.path.abspath(path))
    for p in (given, *given.parents):  # a link's owner may point it elsewhere at any time
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in (uid, 0):
                raise StorageError(f"refusing the directory {path}: {p} is a symbolic link of uid {st.st_uid}, not of "
                                   f"this process's uid {uid} or root, so that user could point it elsewhere")
    for p in (real, *real.parents):
        try:
            st = os.stat(p)
        except OSError as exc:
            raise StorageError(f"cannot check the directory {p}: {exc.strerror or exc}") from None
        where = f"the directory {path}" + (f" (at {p})" if p != Path(path) else "")
        if p == real and not stat.S_ISDIR(st.st_mode):
            raise StorageError(f"{path} exists and is not a directory")
        if st.st_uid not in (uid, 0):
            raise StorageError(f"refusing {where}: it is owned by uid {st.st_uid}, not by this process's uid {uid} "
                               "or root, so that user could replace the node's files in it; use a directory of "
                               "this user's")
        sticky = p != real and st.st_mode & stat.S_ISVTX
        others = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != egid)
        if others and not sticky:
            raise StorageError(f"refusing {where}: mode {stat.S_IMODE(st.st_mode):04o} lets other users write to it, "
                               f"so they could replace the node's files in it (chmod go-w {p})")


def make_dir(path: Path, gid: int | None = None) -> None:
    """Makes directory ``path`` (and missing parents) with :func:`dir_mode`; an existing directory
    (or a symbolic link to one, as an operator may give) keeps its mode. Either way it must pass
    :func:`check_dir`. StorageError otherwise."""
    path = Path(path)
    try:
        made = _mkdirs(path)
    except OSError as exc:
        raise StorageError(f"cannot create the directory {path}: {exc.strerror or exc}") from None
    if made:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageError(f"cannot open the directory {path} just made: {exc.strerror or exc}") from None
        try:
            set_access(fd, path, dir_mode(gid), gid)
        finally:
            os.close(fd)
    check_dir(path)


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
                raise error(f"{what} {path} is {file_kind(st.st_mode)}, not a regular file") from None
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is {file_kind(st.st_mode)}, not a regular file")
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


def read_credential(path: str | os.PathLike[str], what: str, limit: int, *, private: bool) -> bytes:
    """The bytes of a credential or token file: a regular file (a symbolic link to one is followed,
    as a Kubernetes Secret volume mounts them) of at most ``limit`` bytes, not blank, and with
    ``private`` (a key, a password, a token) one that neither its group nor others may access.
    ConfigError naming ``what`` and the path otherwise; a FIFO or a device is refused without being
    read (O_NONBLOCK, then the kind of the open file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path}: not a regular file but {file_kind(st.st_mode)}")
        mode = stat.S_IMODE(st.st_mode)
        if private and mode & 0o077:
            raise ConfigError(f"{what} {path}: mode {mode:04o} lets its group or others access it; it must be "
                              f"owner-only (chmod 600 {path})")
        raw = b""
        while len(raw) <= limit and (chunk := os.read(fd, limit + 1 - len(raw))):
            raw += chunk
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise ConfigError(f"{what} {path}: larger than {limit} bytes")
    if not raw.strip():
        raise ConfigError(f"{what} {path}: empty")
    return raw


def tighten_files(directory: Path, gid: int | None = None) -> None:
    """Takes away what no file of the node grants: every regular file of this user directly in
    ``directory`` keeps at most owner read and write, and group read where its group is ``gid``
    (files that an older build left readable by others, an ``admin.token`` or ``pins.json`` made
    0644, are closed at the next start). Only ever narrows a mode, never changes a group. Files
    are opened without following a link or waiting on a FIFO; other users' files are left alone."""
    with os.scandir(directory) as entries:
        names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
    for name in names:
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone, or not ours to open: nothing of ours to close
        try:
            st = os.fstat(fd)
            allowed = 0o640 if gid is not None and st.st_gid == gid else 0o600
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and mode & ~allowed:
                set_access(fd, path, mode & allowed, None)
        finally:
            os.close(fd)
