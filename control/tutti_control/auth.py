"""Bearer-token auth of the ``/v1`` routes.

The token comes from ``TUTTI_ADMIN_TOKEN`` or the file named by ``TUTTI_ADMIN_TOKEN_FILE``
(``TuttiConfig.admin_token`` / ``admin_token_file``; a Kubernetes Secret in the chart); on the
embedded default ``tutti up`` writes one to ``<data_dir>/admin.token`` (mode 0600) on first start.
Tokens are compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import ConfigError, StorageError

TOKEN_FILE_NAME = "admin.token"
CHALLENGE = 'Bearer realm="tutti-admin"'


def default_token_path(config: TuttiConfig) -> Path:
    return Path(config.data_dir) / TOKEN_FILE_NAME


def read_token_file(path: Path) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the admin token file {path}: {exc}") from exc
    if not token:
        raise ConfigError(f"the admin token file {path} is empty")
    return token


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path), path, False
    except OSError as exc:
        raise StorageError(f"cannot create the admin token file {path}: {exc.strerror or exc} "
                           "(set TUTTI_ADMIN_TOKEN or TUTTI_ADMIN_TOKEN_FILE)") from None
    token = secrets.token_urlsafe(32)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    except OSError as exc:
        path.unlink(missing_ok=True)  # never leave an empty token file behind
        raise StorageError(f"cannot write the admin token file {path}: {exc.strerror or exc}") from None
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
