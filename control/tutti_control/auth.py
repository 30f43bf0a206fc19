"""Bearer-token auth of the ``/v1`` routes.

The token comes from ``TUTTI_ADMIN_TOKEN`` or the file named by ``TUTTI_ADMIN_TOKEN_FILE``
(``TuttiConfig.admin_token`` / ``admin_token_file``; a Kubernetes Secret in the chart); on the
embedded default ``tutti up`` writes one to ``<data_dir>/admin.token`` (mode 0600) on first start.
``/metrics`` may have a token of its own (``metrics_token_file``: a :class:`TokenFile`, read again
when the file changes, so that it can be rotated while the node runs). Tokens are compared in
constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
from pathlib import Path

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import ConfigError, StorageError
from tutti_cluster.files import file_mode, group_id, make_dir, read_credential, set_access

log = logging.getLogger(__name__)

TOKEN_FILE_NAME = "admin.token"
CHALLENGE = 'Bearer realm="tutti-admin"'


def default_token_path(config: TuttiConfig) -> Path:
    return Path(config.data_dir) / TOKEN_FILE_NAME


# A token file holds one token: anything larger is not one (and is never read whole).
MAX_TOKEN_FILE_BYTES = 4096


def read_token_file(path: Path, what: str = "admin token", *, private: bool = False) -> str:
    """The token in ``path`` (``files.read_credential``: a regular file of at most
    MAX_TOKEN_FILE_BYTES, not empty, owner-only with ``private``), as UTF-8 text; ConfigError
    otherwise."""
    raw = read_credential(path, f"the {what} file", MAX_TOKEN_FILE_BYTES, private=private)
    try:
        return raw.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"the {what} file {path} is not UTF-8 text") from None


class TokenFile:
    """A token kept in a file and read again when the file changes (its inode, size or mtime), so
    that a rotated token (a Secret volume's new version, a file renamed into place) takes effect
    at the next request. The file must be owner-only (``read_token_file``'s ``private``). A file
    that cannot be read, or holds no token, matches nothing."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int, int] | None = None
        self._token: str | None = None
        self.current()  # a bad file at start is a ConfigError, not a server that refuses everyone

    def current(self) -> str:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise ConfigError(f"cannot read the {self.what} file {self.path}: {exc.strerror or exc}") from None
        seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if seen != self._seen or self._token is None:
                self._token = read_token_file(self.path, self.what, private=True)
                self._seen = seen
            return self._token

    def matches(self, given: str | None) -> bool:
        try:
            expected = self.current()
        except ConfigError as exc:
            with self._lock:
                if self._token is not None:  # once per failure, not once per request
                    log.warning("%s; refusing every request until it holds a token", exc)
                self._token, self._seen = None, None
            return False
        return token_matches(given, expected)


def configured_token(config: TuttiConfig) -> str | None:
    """The token set by TUTTI_ADMIN_TOKEN or TUTTI_ADMIN_TOKEN_FILE, else None."""
    if config.admin_token is not None and config.admin_token.get_secret_value():
        return config.admin_token.get_secret_value()
    if config.admin_token_file is not None:
        return read_token_file(config.admin_token_file)
    return None


def ensure_token(config: TuttiConfig) -> tuple[str, Path | None, bool]:
    """The node's admin token: (token, file it lives in or None, whether it was just created).

    Without a configured token, ``<data_dir>/admin.token`` is used, created on first start with
    mode 0600 (O_EXCL: two starts never write two tokens).
    """
    token = configured_token(config)
    if token is not None:
        return token, config.admin_token_file, False
    path = default_token_path(config)
    gid = group_id(config.file_group)  # owner-only, or readable by file_group (tutti_cluster.files)
    make_dir(path.parent, gid)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return read_token_file(path), path, False
    except OSError as exc:
        raise StorageError(f"cannot create the admin token file {path}: {exc.strerror or exc} "
                           "(set TUTTI_ADMIN_TOKEN or TUTTI_ADMIN_TOKEN_FILE)") from None
    token = secrets.token_urlsafe(32)
    try:
        with os.fdopen(fd, "w") as f:
            set_access(f.fileno(), path, file_mode(gid), gid)
            f.write(token + "\n")
    except (OSError, StorageError) as exc:
        path.unlink(missing_ok=True)  # never leave an empty token file behind
        raise StorageError(f"cannot write the admin token file {path}: "
                           f"{getattr(exc, 'strerror', None) or exc}") from None
    return token, path, True


def client_token(config: TuttiConfig) -> str | None:
    """The token a client (``tutti admin``) sends: configured, else the node's token file if readable."""
    token = configured_token(config)
    if token is not None:
        return token
    path = default_token_path(config)
    return read_token_file(path) if path.exists() else None


def token_matches(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())
