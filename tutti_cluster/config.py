"""The one configuration object of Tutti.

Precedence: explicit arguments > ``TUTTI_*`` environment variables > a config file named by
``TUTTI_CONFIG_FILE`` (JSON) > defaults. Lists (``paths``, ``capacity_gb``, ``etcd``) are given in the
environment as comma-separated text, e.g. ``TUTTI_PATHS=/mnt/nvme0,/mnt/nvme1``.

The ``tutti`` commands take their flags from the fields below (:func:`add_config_arguments`): each
field ``foo_bar`` is ``--foo-bar``, with the field's description as its help; lists take one or more
values, separated by spaces or commas (``--paths /mnt/a /mnt/b`` or ``--paths /mnt/a,/mnt/b``).

Tiers: ``paths`` are the storage tier. ``memory_paths`` (tmpfs, ramfs or hugetlbfs directories, their own
``memory_capacity_gb``) add a host-memory tier in front of it: stores land in memory and reach storage
as ``write_policy`` says, and a unit read from storage is promoted into memory on its ``promote_hits``-th
hit within ``promote_window_s``. Without ``memory_paths`` there is one tier, the storage paths.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, get_args, get_origin

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from tutti_cluster import _native
from tutti_cluster.errors import ConfigError
from tutti_cluster.files import MAX_CONFIG_BYTES, group_id, read_bounded

_LIST_FIELDS = ("paths", "capacity_gb", "memory_paths", "memory_capacity_gb", "etcd")

# The native store's options (native/include/tutti/options.h) are the one definition of the defaults of
# the fields below that share their names: each such field's default is read from here.
_NATIVE = _native.StoreOptions()
#: TuttiConfig fields that are native store options of the same name and meaning: their defaults are
#: StoreOptions', and the store passes them on as they are (native_options, below).
NATIVE_FIELDS = ("instance", "pool_files", "prewrite_pool", "queue_depth", "staging_mb", "max_requests", "io_sms",
                 "min_io_bytes", "direct_io", "device", "cuda_pair", "cuda_trace", "copy_engine_mb", "map_memory_paths",
                 "write_policy", "promote_hits", "promote_window_s")

# Instance names become pool file names (``tutti-<instance>.pool``, ``tutti-<instance>.<n>.pool``)
# and keys of the daemon's state: a short plain name, so that neither a file system nor a shell ever sees anything odd.
INSTANCE_MAX_CHARS = 64
INSTANCE_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_INSTANCE_RE = re.compile(INSTANCE_PATTERN)
# Largest capacity of one path in GiB: the byte count must fit the native core's signed 64 bits.
MAX_CAPACITY_GB = float(1 << 32)
# Upper bounds of the settings the native core takes in fixed-width fields (StoreOptions, init_queue).
# Each is at most the field's width (uint32 counts, int device ordinal, uint64 bytes: staging_mb is
# shifted by 20 bits first) and, where a value that large is absurd, a practical cap well above any
# real use, so that a typo is a ConfigError naming the setting instead of a native TypeError, a
# failed multi-terabyte allocation or std::bad_alloc.
MAX_UNIT_TOKENS = 1 << 20         # blocks per unit are a uint32; a million tokens outgrows any context
MAX_MIN_IO_BYTES = 1 << 30        # uint64; 1 GiB
MAX_DEVICE = 1023                 # int; a CUDA ordinal on one node
MAX_QUEUE_DEPTH = 32767           # uint32; io_uring takes at most 32768 entries (the agent adds one)
MAX_IOCB_DEPTH = 1 << 20          # uint32; the table is allocated whole at registration
MAX_STAGING_MB = 1 << 20          # uint64 bytes after << 20; 1 TiB of pinned host memory
MAX_COPY_ENGINE_MB = 1 << 20      # uint64 bytes after << 20; 1 TiB of device memory
MAX_REQUESTS = 1 << 16            # uint32; each request's state is allocated at registration
MAX_IO_SMS = 1024                 # uint32; far above the SMs of any GPU
MAX_PROMOTE_HITS = 1 << 20        # uint32; a hit count no window ever reaches


def check_instance_name(name: object) -> str:
    """``name`` if it is a valid instance name, else ConfigError saying what one looks like."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"an instance name must be a non-empty string, not {name!r:.80}")
    if len(name) > INSTANCE_MAX_CHARS:
        raise ConfigError(f"instance name {name[:24]!r}... has {len(name)} characters, at most "
                          f"{INSTANCE_MAX_CHARS} are allowed")
    if not _INSTANCE_RE.fullmatch(name):
        raise ConfigError(f"instance name {name!r} may hold only letters, digits, '_', '.' and '-', "
                          "and must not start with '.' or '-'")
    return name


def validation_summary(exc: ValidationError, limit: int = 5) -> str:
    """A pydantic ValidationError as one line: ``field: problem; ...`` (never the offending input)."""
    errs = exc.errors(include_url=False, include_input=False)
    parts = []
    for e in errs[:limit]:
        loc = ".".join(str(p) for p in e["loc"]) or "value"
        msg = str(e["msg"])
        parts.append(f"{loc}: {msg.removeprefix('Value error, ')}")
    if len(errs) > limit:
        parts.append(f"and {len(errs) - limit} more")
    return "; ".join(parts)


def default_data_dir() -> Path:
    """Where the embedded single-node default keeps its data."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "tutti"


class _JsonFileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        name = os.environ.get("TUTTI_CONFIG_FILE")
        if not name:
            return {}
        # A regular file of bounded size: a FIFO is refused at once (O_NONBLOCK), /dev/zero or a huge
        # file by its size. A symbolic link is followed (Kubernetes mounts ConfigMaps through them).
        try:
            raw = read_bounded(name, MAX_CONFIG_BYTES, what="config file", error=ConfigError, follow=True)
            data = json.loads(raw)
        except (OSError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"cannot read config file {name}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {name} must hold a JSON object")
        return data


class TuttiConfig(BaseSettings):
    """Settings of a Tutti node and of each store instance in it."""

    model_config = SettingsConfigDict(env_prefix="TUTTI_", extra="forbid", validate_assignment=True)

    # Storage
    paths: list[Path] = Field(default_factory=list, description="Storage directories, one per SSD.")
    capacity_gb: list[Annotated[float, Field(gt=0, le=MAX_CAPACITY_GB, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [4.0], description="Byte cap per path in GiB (one value applies to all paths)."
    )
    data_dir: Path = Field(default_factory=default_data_dir, description="Node state (socket, default storage).")
    instance: str = Field(_NATIVE.instance, description="Name of this process's share of the file pool.")
    direct_io: Literal["auto", "on", "off"] = Field(_NATIVE.direct_io, description="O_DIRECT: auto falls back where refused.")
    pool_files: int = Field(
        _NATIVE.pool_files, ge=0, le=64,
        description="Pool files per path; 0 = 16 on memory file systems (parallel writes; fewer where the "
        "capacity holds fewer GPU files), 1 elsewhere.",
    )
    prewrite_pool: bool = Field(
        _NATIVE.prewrite_pool,
        description="Write zeros once over the pool space a block device's file system keeps unwritten "
        "after fallocate, so that stores are overwrites (first start writes the capacity once); on memory "
        "file systems, touch the pages of new pool files once, so that the first store runs at full speed.",
    )

    map_memory_paths: bool = Field(
        _NATIVE.map_memory_paths,
        description="Map the pool files on memory file systems (tmpfs, ramfs) and let the I/O kernel move "
        "objects with loads and stores instead of io_uring (byte-addressable storage: one pass over "
        "each byte, no staging; on CUDA the pool is pinned). Other paths always go through io_uring; "
        "with a memory tier only its files are mapped; hugetlbfs files, which take no write(2), always are.",
    )
    file_group: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
        description="Group (name or gid) given read access to the pool files, the daemon's state, its socket "
        "and admin token, and the directories made for them (files 0640, directories 0750, the socket 0660); "
        "unset: owner only (0600 and 0700).",
    )

    # Tiers (the host-memory tier in front of the storage paths; none by default)
    memory_paths: list[Path] = Field(
        default_factory=list,
        description="Memory-tier directories (tmpfs, ramfs or hugetlbfs), in front of the storage paths: stores land "
        "there first and reads take a unit from its fastest copy. Not one of the storage paths; empty: no "
        "memory tier.")
    memory_capacity_gb: list[Annotated[float, Field(gt=0, le=MAX_CAPACITY_GB, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [1.0],
        description="Byte cap per memory path in GiB (one value applies to all memory paths).")
    write_policy: Literal["write_back", "write_through", "memory_only"] = Field(
        _NATIVE.write_policy,
        description="With a memory tier: write_back commits a store in memory and copies it to storage in the "
        "background (durable once copied), write_through returns once the storage copy is committed, "
        "memory_only never writes to storage.")
    promote_hits: int = Field(
        _NATIVE.promote_hits, ge=0, le=MAX_PROMOTE_HITS,
        description="A unit read from the storage tier is copied into the memory tier on this hit within "
        "promote_window_s (0: never).")
    promote_window_s: float = Field(_NATIVE.promote_window_s, gt=0, allow_inf_nan=False,
                                    description="Window of promote_hits in seconds.")

    # Layout
    unit_tokens: int = Field(256, gt=0, le=MAX_UNIT_TOKENS,
                             description="Tokens per cache unit (one GPU file); at most 2^20.")
    min_io_bytes: int = Field(_NATIVE.min_io_bytes, gt=0, le=MAX_MIN_IO_BYTES,
                              description="Smallest storage I/O the layout aims for; at most 1 GiB.")

    # Data path
    backend: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda for CUDA tensors.")
    device: int = Field(_NATIVE.device, ge=0, le=MAX_DEVICE, description="CUDA device ordinal for the cuda backend (at most 1023).")
    queue_depth: int = Field(_NATIVE.queue_depth, gt=0, le=MAX_QUEUE_DEPTH,
                             description="io_uring depth of the host agent; at most 32767 (io_uring's limit).")
    iocb_depth: int = Field(8192, gt=0, le=MAX_IOCB_DEPTH, description="IOCBs in the gio_uring table (init_queue); a request reserves one per layer (more past 2048 IOCTXs) plus one to commit, at begin; at most 2^20.")
    staging_mb: int = Field(
        _NATIVE.staging_mb,
        gt=0,
        le=MAX_STAGING_MB,
        description="Pinned staging area in MiB; fixed, whatever the context. Twice queue_depth x 1 MiB keeps "
        "the agent's queue full while the I/O kernel gathers and scatters the other half (the CUDA kernel "
        "keeps at most 2 x queue_depth chunks in use, whatever the size); at most 2^20 (1 TiB).",
    )
    max_requests: int = Field(_NATIVE.max_requests, gt=0, le=MAX_REQUESTS,
                              description="Requests in flight per store instance; at most 65536.")
    io_sms: int = Field(_NATIVE.io_sms, gt=0, le=MAX_IO_SMS,
                        description="SMs given to the I/O kernel (multiples of 8 on CUDA); at most 1024.")
    cuda_pair: bool = Field(_NATIVE.cuda_pair, description="CUDA: K and V of a unit-layer as one I/O (slower on the H200).")
    cuda_trace: bool = Field(_NATIVE.cuda_trace, description="CUDA: print the I/O kernel's counters when the store closes.")
    copy_engine_mb: int = Field(
        _NATIVE.copy_engine_mb, ge=0, le=MAX_COPY_ENGINE_MB,
        description="CUDA: device memory in MiB where the copy engine stages a layer's objects of the memory tier "
        "(mapped pool files) before the I/O kernel verifies and scatters them, instead of the kernel's loads over "
        "PCIe; costs host CPU per unit and layer (docs/CUDA.md). Two buffers taken in turn; one buffer holding a "
        "layer of a 128K-token Llama-3-8B prefix takes 512 MiB (1024 in all); units past it, or all with 0 (the "
        "default), the kernel loads itself. Allocated only when a pool file is mapped; at most 2^20.")

    # Cluster (all unset: single-node embedded default)
    etcd: list[str] = Field(default_factory=list, description="etcd endpoints host:port (https://host:port: TLS).")
    etcd_ca_file: Path | None = Field(
        None, description="PEM file of the CA that signed etcd's server certificate; set (or an https:// endpoint): "
        "TLS to etcd (without it, the system's CA certificates).")
    etcd_cert_file: Path | None = Field(
        None, description="PEM client certificate for etcd's mutual TLS (--client-cert-auth), with etcd_key_file.")
    etcd_key_file: Path | None = Field(None, description="PEM private key of etcd_cert_file (unencrypted).")
    etcd_user: str | None = Field(
        None, description="etcd user (etcd's role-based access: readwrite on the prefix tutti/); its password is "
        "read from etcd_password_file.")
    etcd_password_file: Path | None = Field(
        None, description="File holding etcd_user's password (a regular file; trailing line breaks are ignored).")
    mooncake_master: str | None = Field(None, description="Mooncake master address host:port.")
    node_id: str | None = Field(None, description="This node's name in the cluster.")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake Transfer Engine protocol.")
    lease_ttl_s: int = Field(10, gt=0, description="TTL of this node's replica registrations.")
    advertise_host: str | None = Field(
        None, description="Address other nodes reach this node at (its stage endpoint and Transfer Engine "
        "listen there); unset: this host's address on the route to the first etcd endpoint.")
    stage_port: int = Field(0, ge=0, le=65535, description="Port of the node's stage endpoint (0: any free port).")
    transfer_ports: str | None = Field(
        None, pattern=r"^[0-9]{1,5}-[0-9]{1,5}$",
        description="Port range LOW-HIGH each Transfer Engine of the node (the daemon's and every engine's) takes "
        "its two listening ports from (handshake and TCP data), at most 32767; unset: Mooncake's default, "
        "15000-17000.")
    cluster_secret_file: Path | None = Field(
        None, description="File holding the cluster credential: at least 32 random bytes (e.g. 64 hex digits), "
        "mode 0600 or stricter, the same on every node and engine of the cluster; one secret a line, the first "
        "signs and proves, every line is accepted (rotation). Required with etcd (make one with `tutti "
        "cluster-key PATH`); a single node makes <data_dir>/cluster.key on first start.")

    # Admin plane (`tutti up` serves the node's admin API; docs/ADMIN.md)
    admin_host: str = Field("127.0.0.1", description="Address the node's admin API listens on.")
    admin_port: int = Field(9480, ge=0, le=65535, description="Port of the node's admin API (0: any free port).")
    admin_token: SecretStr | None = Field(None, description="Bearer token of the admin API's /v1 routes.")
    admin_token_file: Path | None = Field(
        None, description="File holding the admin token; unset, <data_dir>/admin.token, made (mode 0600) on "
        "first start.")
    health_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the admin plane's health listener (GET /livez and /readyz "
        "only, on admin_host, apart from the API's connections; 0: any free port); unset: admin_port + 1, or any "
        "free port where admin_port is 0.")
    metrics_token_file: Path | None = Field(
        None, description="File holding the bearer token /metrics requires (read again when it changes); "
        "unset: /metrics is open.")
    admin_docs: bool = Field(False, description="Serve /docs, /redoc and /openapi.json without the admin token.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _CommaEnvSource(settings_cls), _JsonFileSource(settings_cls)

    def __init__(self, **values: Any) -> None:
        # Every invalid setting is a ConfigError (a TuttiError), whichever check finds it.
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(f"invalid Tutti configuration: {validation_summary(e)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(f"invalid Tutti configuration: {validation_summary(e)}") from None

    @field_validator("transfer_ports")
    @classmethod
    def _port_range(cls, v: str | None) -> str | None:
        if v is not None:
            low, high = (int(x) for x in v.split("-"))
            # Mooncake refuses ranges past 32767 (falling back to its default, 15000-17000).
            if not 0 < low < high <= 32767:
                raise ValueError("needs 0 < LOW < HIGH <= 32767 (the Transfer Engine listens on two ports, and "
                                 "Mooncake takes no range above 32767)")
        return v

    @field_validator("paths", "capacity_gb", "memory_paths", "memory_capacity_gb", "etcd", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        if isinstance(v, (int, float)):
            return [v]
        return v

    @field_validator("paths", "memory_paths", mode="before")
    @classmethod
    def _paths(cls, v: Any, info: ValidationInfo) -> Any:
        # Path("") is the working directory: an empty entry is a mistake, never a place for a pool
        # (comma-separated text included: TUTTI_PATHS=",/mnt/a" has one).
        items = v.split(",") if isinstance(v, str) else v
        if isinstance(items, (list, tuple)) and any(isinstance(p, (str, os.PathLike)) and not str(p).strip() for p in items):
            raise ValueError(f"{info.field_name} must not hold an empty entry")
        return v

    @field_validator("file_group", mode="before")
    @classmethod
    def _file_group(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else v  # a gid

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir(cls, v: Any) -> Any:
        if isinstance(v, (str, os.PathLike)) and not str(v).strip():
            raise ValueError("data_dir must not be empty")
        return v

    @field_validator("instance")
    @classmethod
    def _instance(cls, v: str) -> str:
        try:
            return check_instance_name(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _check(self) -> "TuttiConfig":
        n = len(self.storage_paths())
        if len(self.capacity_gb) not in (1, n):
            raise ValueError(f"capacity_gb has {len(self.capacity_gb)} values for {n} paths")
        if self.io_sms % 8 and self.backend == "cuda":
            raise ValueError("io_sms must be a multiple of 8 on the cuda backend")
        m = len(self.memory_paths)
        if len(self.memory_capacity_gb) not in (1, m):
            raise ValueError(f"memory_capacity_gb has {len(self.memory_capacity_gb)} values for {m} memory paths")
        # Each tier's pool files are its own: a directory is in one tier, once.
        storage = {os.path.abspath(p) for p in self.storage_paths()}
        seen: set[str] = set()
        for p in self.memory_paths:
            where = os.path.abspath(p)
            if where in storage:
                raise ValueError(f"memory path {p} is also a storage path: a directory belongs to one tier")
            if where in seen:
                raise ValueError(f"memory path {p} is given twice")
            seen.add(where)
        if self.write_policy == "memory_only" and not self.memory_paths:
            raise ValueError("write_policy memory_only needs memory_paths (a memory tier to write to)")
        return self

    def storage_paths(self) -> list[Path]:
        """The configured paths, or ``<data_dir>/store`` for the embedded default."""
        return list(self.paths) if self.paths else [self.data_dir / "store"]

    def capacity_bytes(self) -> list[int]:
        """Byte cap of each storage path."""
        caps = self.capacity_gb * len(self.storage_paths()) if len(self.capacity_gb) == 1 else self.capacity_gb
        return [int(c * (1 << 30)) for c in caps]

    def memory_capacity_bytes(self) -> list[int]:
        """Byte cap of each memory path ([] without a memory tier)."""
        caps = self.memory_capacity_gb * len(self.memory_paths) if len(self.memory_capacity_gb) == 1 \
            else self.memory_capacity_gb
        return [int(c * (1 << 30)) for c in caps[:len(self.memory_paths)]]

    @property
    def cluster_mode(self) -> bool:
        return bool(self.etcd or self.mooncake_master)


class _CommaEnvSource(PydanticBaseSettingsSource):
    """``TUTTI_*`` environment variables, with comma-separated lists."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.settings_cls.model_fields:
            raw = os.environ.get(f"TUTTI_{name.upper()}")
            if raw is None or raw == "":
                continue
            out[name] = raw
        return out


def load_config(**overrides: Any) -> TuttiConfig:
    """Builds the config from the arguments that are not None (ConfigError when invalid)."""
    return TuttiConfig(**{k: v for k, v in overrides.items() if v is not None})


# ---- command-line flags, generated from the fields ----------------------------------------------

# The flag groups of `tutti up`, in order. Every field is in exactly one group (a test checks it);
# types, defaults and help come from the field itself.
CONFIG_GROUPS: dict[str, tuple[str, ...]] = {
    "storage": ("paths", "capacity_gb", "data_dir", "instance", "direct_io", "pool_files", "prewrite_pool",
                "map_memory_paths", "file_group"),
    "tiers (memory_paths unset: the storage paths alone)": ("memory_paths", "memory_capacity_gb", "write_policy",
                                                            "promote_hits", "promote_window_s"),
    "layout": ("unit_tokens", "min_io_bytes"),
    "data path": ("backend", "device", "queue_depth", "iocb_depth", "staging_mb", "max_requests", "io_sms",
                  "cuda_pair", "cuda_trace", "copy_engine_mb"),
    "cluster (etcd unset: single node, the embedded default)": ("etcd", "etcd_ca_file", "etcd_cert_file",
                                                                "etcd_key_file", "etcd_user", "etcd_password_file",
                                                                "mooncake_master", "node_id", "protocol",
                                                                "lease_ttl_s", "advertise_host", "stage_port",
                                                                "transfer_ports", "cluster_secret_file"),
    "admin API (docs/ADMIN.md)": ("admin_host", "admin_port", "admin_token", "admin_token_file", "health_port",
                                  "metrics_token_file", "admin_docs"),
}
# Secrets never go on a command line (other users see it in the process list): environment or file.
NO_FLAG_FIELDS = frozenset({"admin_token"})
_METAVARS = {"paths": "DIR", "memory_paths": "DIR", "memory_capacity_gb": "GIB", "file_group": "GROUP", "capacity_gb": "GIB", "etcd": "HOST:PORT", "mooncake_master": "HOST:PORT",
             "etcd_ca_file": "FILE", "etcd_cert_file": "FILE", "etcd_key_file": "FILE", "etcd_user": "NAME",
             "etcd_password_file": "FILE",
             "data_dir": "DIR", "admin_token_file": "FILE", "instance": "NAME", "node_id": "NAME",
             "admin_host": "ADDRESS", "admin_port": "PORT", "advertise_host": "ADDRESS", "stage_port": "PORT",
             "transfer_ports": "LOW-HIGH", "cluster_secret_file": "FILE", "health_port": "PORT", "metrics_token_file": "FILE"}
_TYPE_METAVARS: dict[Any, str] = {int: "N", float: "X", str: "TEXT", Path: "PATH"}
# Defaults that are not a fixed value of the field.
_DEFAULT_NOTES = {"paths": "<data_dir>/store", "node_id": "the host name", "health_port": "admin_port + 1"}


def flag_name(field: str) -> str:
    """``capacity_gb`` -> ``--capacity-gb``."""
    return "--" + field.replace("_", "-")


def _field_default_text(name: str) -> str:
    value = TuttiConfig.model_fields[name].get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, list):
        return ",".join(map(str, value)) if value else "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_config_arguments(
    parser: argparse.ArgumentParser,
    fields: Sequence[str] | None = None,
    *,
    default_notes: dict[str, str] | None = None,
    groups: bool = True,
) -> None:
    """Adds one flag per TuttiConfig field (``fields``, default all but :data:`NO_FLAG_FIELDS`).

    Flags default to None, so that an unset flag leaves the environment, the config file and the
    field's default in force; :func:`config_arguments` collects the ones given. Values are checked by
    the config itself (one ``ConfigError`` line); Literal fields get argparse choices, booleans a
    ``--no-`` form, lists one or more values separated by spaces or commas. ``default_notes`` replaces
    the default shown for a field (where a command picks its own).
    """
    wanted = [f for f in TuttiConfig.model_fields if f not in NO_FLAG_FIELDS] if fields is None else list(fields)
    unknown = [f for f in wanted if f not in TuttiConfig.model_fields]
    if unknown:
        raise ConfigError(f"no such config fields: {', '.join(unknown)}")
    notes = default_notes or {}
    order = [(title, [f for f in names if f in wanted]) for title, names in CONFIG_GROUPS.items()] if groups \
        else [("", wanted)]
    for title, names in order:
        if not names:
            continue
        target: Any = parser.add_argument_group(title) if title else parser
        for name in names:
            info = TuttiConfig.model_fields[name]
            default = notes.get(name) or _DEFAULT_NOTES.get(name) or _field_default_text(name)
            help_text = f"{info.description or name} [default: {default}; env TUTTI_{name.upper()}]"
            kw: dict[str, Any] = {"dest": name, "default": None, "help": help_text.replace("%", "%%")}
            ann = info.annotation
            args = [a for a in get_args(ann) if a is not type(None)]
            if ann is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif get_origin(ann) is list:
                kw.update(nargs="+", metavar=_METAVARS.get(name, name.upper()))
            elif get_origin(ann) is Literal:
                kw["choices"] = list(get_args(ann))
            else:
                base: Any = args[0] if args else ann
                kw["metavar"] = _METAVARS.get(name, _TYPE_METAVARS.get(base, "VALUE"))
            target.add_argument(flag_name(name), **kw)


def config_arguments(ns: argparse.Namespace, fields: Sequence[str] | None = None) -> dict[str, Any]:
    """The config fields given on the command line (lists joined with commas, as in the environment)."""
    out: dict[str, Any] = {}
    for name in fields if fields is not None else TuttiConfig.model_fields:
        value = getattr(ns, name, None)
        if value is None:
            continue
        out[name] = ",".join(_list_items(value)) if isinstance(value, list) else value
    return out


def _list_items(values: list[Any]) -> list[str]:
    """A list flag's words as items: commas at a word's ends separate it from its neighbours
    (``--paths /mnt/a, /mnt/b``), a word of commas alone is only a separator; an empty word stays
    an empty item (``--paths ""``), for the config to refuse."""
    out = []
    for v in map(str, values):
        if v and not v.strip(", "):
            continue
        out.append(v.strip().strip(",") if v.strip() else v)
    return out


_U32_MAX, _U64_MAX, _INT_MAX = (1 << 32) - 1, (1 << 64) - 1, (1 << 31) - 1


def _fits(setting: str, value: int, most: int) -> int:
    """``value`` when the native field it goes to (at most ``most``) holds it, else ConfigError."""
    if not 0 <= value <= most:
        raise ConfigError(f"invalid Tutti configuration: {setting} ({value}) does not fit the native store's "
                          f"field (at most {most})")
    return value


# The most a native field holds where it is not a uint32 (staging_mb and copy_engine_mb are shifted by
# 20 bits natively).
_NATIVE_MOST = {"staging_mb": _U64_MAX >> 20, "copy_engine_mb": _U64_MAX >> 20, "min_io_bytes": _U64_MAX,
                "device": _INT_MAX}


def native_options(config: TuttiConfig, *, backend: str, unit_blocks: int, read_only: bool = False) -> Any:
    """The native store's options, every field from ``config``: the one place they are translated.

    Every number goes to a fixed-width native field: TuttiConfig bounds each setting (tighter), and
    this checks the widths again for configs that skipped validation (``model_copy(update=...)``),
    so that a misfit is a ConfigError naming the setting, never pybind11's TypeError."""
    _fits("unit_tokens / block_tokens (blocks per unit)", unit_blocks, _U32_MAX)
    _fits("iocb_depth", config.iocb_depth, _U32_MAX)  # init_queue's uint32 (register_kv_caches)
    o = _native.StoreOptions()
    for name in NATIVE_FIELDS:  # the same name and meaning on both sides
        value = getattr(config, name)
        if isinstance(value, int) and not isinstance(value, bool):
            _fits(name, value, _NATIVE_MOST.get(name, _U32_MAX))
        setattr(o, name, value)
    o.paths = [str(p) for p in config.storage_paths()]
    o.capacity = [_fits("capacity_gb", c, _U64_MAX) for c in config.capacity_bytes()]
    o.memory_paths = [str(p) for p in config.memory_paths]
    o.memory_capacity = [_fits("memory_capacity_gb", c, _U64_MAX) for c in config.memory_capacity_bytes()]
    o.unit_blocks = unit_blocks
    o.backend = backend
    o.read_only = read_only
    gid = group_id(config.file_group)
    o.file_gid = -1 if gid is None else _fits("file_group (gid)", gid, _U32_MAX - 1)
    return o
