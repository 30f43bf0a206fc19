"""The one configuration object of Tutti.

Precedence: explicit arguments > ``TUTTI_*`` environment variables > a config file named by
``TUTTI_CONFIG_FILE`` (JSON) > defaults. Lists (``paths``, ``capacity_gb``, ``etcd``) are given in the
environment as comma-separated text, e.g. ``TUTTI_PATHS=/mnt/nvme0,/mnt/nvme1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from tutti_cluster.errors import ConfigError

_LIST_FIELDS = ("paths", "capacity_gb", "etcd")


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
        try:
            with open(name) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read config file {name}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {name} must hold a JSON object")
        return data


class TuttiConfig(BaseSettings):
    """Settings of a Tutti node and of each store instance in it."""

    model_config = SettingsConfigDict(env_prefix="TUTTI_", extra="forbid", validate_assignment=True)

    # Storage
    paths: list[Path] = Field(default_factory=list, description="Storage directories, one per SSD.")
    capacity_gb: list[float] = Field(
        default_factory=lambda: [4.0], description="Byte cap per path in GiB (one value applies to all paths)."
    )
    data_dir: Path = Field(default_factory=default_data_dir, description="Node state (socket, default storage).")
    instance: str = Field("default", description="Name of this process's share of the file pool.")
    direct_io: Literal["auto", "on", "off"] = Field("auto", description="O_DIRECT: auto falls back where refused.")
    pool_files: int = Field(
        0, ge=0, le=64,
        description="Pool files per path; 0 = 16 on memory file systems (parallel writes; fewer where the "
        "capacity holds fewer GPU files), 1 elsewhere.",
    )
    prewrite_pool: bool = Field(
        True,
        description="Write zeros once over the pool space a block device's file system keeps unwritten "
        "after fallocate, so that stores are overwrites (first start writes the capacity once); on memory "
        "file systems, touch the pages of new pool files once, so that the first store runs at full speed.",
    )

    map_memory_paths: bool = Field(
        True,
        description="Map the pool files on memory file systems (tmpfs, ramfs) and let the I/O kernel move "
        "objects with loads and stores instead of io_uring (byte-addressable storage: one pass over "
        "each byte, no staging; on CUDA the pool is pinned). Other paths always go through io_uring.",
    )

    # Layout
    unit_tokens: int = Field(256, gt=0, description="Tokens per cache unit (one GPU file).")
    min_io_bytes: int = Field(256 << 10, gt=0, description="Smallest storage I/O the layout aims for.")

    # Data path
    backend: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda for CUDA tensors.")
    device: int = Field(0, ge=0, description="CUDA device ordinal for the cuda backend.")
    queue_depth: int = Field(64, gt=0, description="io_uring depth of the host agent.")
    iocb_depth: int = Field(1024, gt=0, description="IOCBs in the gio_uring table (init_queue).")
    staging_mb: int = Field(
        128,
        gt=0,
        description="Pinned staging area in MiB; fixed, whatever the context. Twice queue_depth x 1 MiB keeps "
        "the agent's queue full while the I/O kernel gathers and scatters the other half (the CUDA kernel "
        "keeps at most 2 x queue_depth chunks in use, whatever the size).",
    )
    max_requests: int = Field(256, gt=0, description="Requests in flight per store instance.")
    io_sms: int = Field(8, gt=0, description="SMs given to the I/O kernel (multiples of 8 on CUDA).")
    cuda_pair: bool = Field(False, description="CUDA: K and V of a unit-layer as one I/O (slower on the H200).")
    cuda_trace: bool = Field(False, description="CUDA: print the I/O kernel's counters when the store closes.")

    # Cluster (all unset: single-node embedded default)
    etcd: list[str] = Field(default_factory=list, description="etcd endpoints host:port.")
    mooncake_master: str | None = Field(None, description="Mooncake master address host:port.")
    node_id: str | None = Field(None, description="This node's name in the cluster (default: hostname).")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake Transfer Engine protocol.")
    lease_ttl_s: int = Field(10, gt=0, description="TTL of this node's replica registrations.")

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

    @field_validator("paths", "capacity_gb", "etcd", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        if isinstance(v, (int, float)):
            return [v]
        return v

    @field_validator("instance")
    @classmethod
    def _instance(cls, v: str) -> str:
        if not v or "/" in v or v.startswith("."):
            raise ValueError("instance must be a plain name")
        return v

    @model_validator(mode="after")
    def _check(self) -> "TuttiConfig":
        if any(c <= 0 for c in self.capacity_gb):
            raise ValueError("capacity_gb values must be positive")
        n = len(self.storage_paths())
        if len(self.capacity_gb) not in (1, n):
            raise ValueError(f"capacity_gb has {len(self.capacity_gb)} values for {n} paths")
        if self.io_sms % 8 and self.backend == "cuda":
            raise ValueError("io_sms must be a multiple of 8 on the cuda backend")
        return self

    def storage_paths(self) -> list[Path]:
        """The configured paths, or ``<data_dir>/store`` for the embedded default."""
        return list(self.paths) if self.paths else [self.data_dir / "store"]

    def capacity_bytes(self) -> list[int]:
        """Byte cap of each storage path."""
        caps = self.capacity_gb * len(self.storage_paths()) if len(self.capacity_gb) == 1 else self.capacity_gb
        return [int(c * (1 << 30)) for c in caps]

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
    """Builds the config, turning validation failures into :class:`ConfigError`."""
    try:
        return TuttiConfig(**{k: v for k, v in overrides.items() if v is not None})
    except ConfigError:
        raise
    except Exception as e:  # pydantic.ValidationError, with its field-by-field message
        raise ConfigError(str(e)) from e
