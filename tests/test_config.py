"""TuttiConfig: every invalid setting is a ConfigError (issue 13, finding 7), wherever it comes from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.config import INSTANCE_MAX_CHARS, load_config
from tutti_cluster.errors import ConfigError, TuttiError

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("capacity", [0, -1, NAN, INF, -INF, "nan", "inf", [1.0, NAN], 1e300, "lots"])
def test_bad_capacities_are_config_errors_at_construction(capacity):
    with pytest.raises(ConfigError, match="capacity_gb") as e:
        TuttiConfig(paths=["/a", "/b"], capacity_gb=capacity)
    assert isinstance(e.value, TuttiError)


def test_bad_capacities_from_the_environment_and_a_file(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TUTTI_CAPACITY_GB", "nan")
    with pytest.raises(ConfigError, match="finite"):
        TuttiConfig()
    monkeypatch.delenv("TUTTI_CAPACITY_GB")
    f = tmp_path / "tutti.json"
    f.write_text(json.dumps({"capacity_gb": [-2]}))
    monkeypatch.setenv("TUTTI_CONFIG_FILE", str(f))
    with pytest.raises(ConfigError, match="greater than 0"):
        TuttiConfig()


def test_a_store_with_a_bad_capacity_fails_before_it_touches_storage(tmp_path: Path):
    for cap in (NAN, INF, 0):
        with pytest.raises(ConfigError, match="capacity_gb"):
            TuttiStore(paths=[str(tmp_path)], capacity_gb=cap)
    assert list(tmp_path.iterdir()) == []


def test_every_invalid_config_is_a_config_error_not_a_validation_error():
    for kw in ({"capacity_gb": 0}, {"unit_tokens": 0}, {"backend": "tpu"}, {"no_such_setting": 1},
               {"queue_depth": "deep"}, {"paths": ["/a", "/b", "/c"], "capacity_gb": [1, 2]},
               {"backend": "cuda", "io_sms": 3}):
        with pytest.raises(ConfigError):
            TuttiConfig(**kw)
        with pytest.raises(ConfigError):
            load_config(**kw)
    cfg = TuttiConfig()
    with pytest.raises(ConfigError, match="capacity_gb"):
        cfg.capacity_gb = [NAN]  # validated assignment too
    assert cfg.capacity_gb == [4.0]
    # Still a ValueError for code that treats bad settings as bad values.
    assert issubclass(ConfigError, ValueError)


def test_instance_names_have_a_limit_and_a_charset():
    with pytest.raises(ConfigError, match=f"at most {INSTANCE_MAX_CHARS}"):
        TuttiConfig(instance="x" * 300)
    for bad in ("", "a/b", ".hidden", "-flag", "a b", "é", "a\x00b", "../up"):
        with pytest.raises(ConfigError, match="instance"):
            TuttiConfig(instance=bad)
    for good in ("default", "engine0", "default-r0-dp1", "Llama_3.8b", "x" * INSTANCE_MAX_CHARS):
        assert TuttiConfig(instance=good).instance == good


def test_a_store_with_a_long_instance_name_is_a_config_error_not_an_os_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="300 characters"):
        TuttiStore(paths=[str(tmp_path)], capacity_gb=0.01, instance="x" * 300)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_path_is_refused_not_the_working_directory(tmp_path: Path):
    for paths in ([""], ["   "], [str(tmp_path), ""]):
        with pytest.raises(ConfigError, match="empty"):
            TuttiConfig(paths=paths)
    with pytest.raises(ConfigError, match="data_dir"):
        TuttiConfig(data_dir="")
    # The environment's comma form too: an empty item is a path left out by mistake (an unset
    # variable in TUTTI_PATHS=$A,$B), never a separator to skip.
    for text in (f"{tmp_path},", f",{tmp_path}", f"{tmp_path},,{tmp_path}"):
        with pytest.raises(ConfigError, match="empty"):
            TuttiConfig(paths=text)
    assert TuttiConfig(paths=f"{tmp_path}, {tmp_path}").paths == [tmp_path, tmp_path]


def _read_only_dir_command(d: Path, argv: list[str]) -> list[str] | None:
    """``argv`` run with ``d`` read-only: by permissions for a normal user; for root (whom
    permissions do not stop) under a read-only bind mount in a private mount namespace."""
    if os.geteuid() != 0:
        d.chmod(0o555)
        return argv
    if not shutil.which("unshare"):
        return None
    probe = subprocess.run(["unshare", "--mount", "sh", "-c",
                            f"mount --bind {d} {d} && mount -o remount,bind,ro {d} && ! touch {d}/probe"],
                           capture_output=True)
    if probe.returncode:
        return None
    script = f'mount --bind {d} {d} && mount -o remount,bind,ro {d} && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, "sh", *argv]


def test_tutti_up_on_a_read_only_data_dir_is_one_error_line(tmp_path: Path):
    data = tmp_path / "node"
    data.mkdir()
    cmd = _read_only_dir_command(data, [sys.executable, "-m", "tutti_cluster.cli", "up", "--data-dir", str(data),
                                        "--paths", str(tmp_path), "--capacity-gb", "0.01"])
    if cmd is None:
        pytest.skip("cannot make a read-only directory here (root without a mount namespace)")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        data.chmod(0o755)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("tutti: error:")]
    assert len(lines) == 1 and str(data) in lines[0] and "ead-only" in lines[0], r.stderr


def test_the_memory_tier_settings_are_checked_where_they_are_given(tmp_path: Path, monkeypatch):
    ssd, shm = tmp_path / "ssd", tmp_path / "shm"
    # A directory is in one tier, once (spelled alike or not), and the embedded default's store counts.
    for kw in ({"paths": [str(ssd)], "memory_paths": [f"{ssd}/"]}, {"paths": [str(ssd)], "memory_paths": [f"{ssd}/."]},
               {"data_dir": str(tmp_path), "memory_paths": [str(tmp_path / "store")]}):
        with pytest.raises(ConfigError, match="also a storage path"):
            TuttiConfig(**kw)
    with pytest.raises(ConfigError, match="given twice"):
        TuttiConfig(paths=[str(ssd)], memory_paths=[str(shm), f"{shm}/"])
    with pytest.raises(ConfigError, match="write_policy"):
        TuttiConfig(memory_paths=[str(shm)], write_policy="write_around")
    with pytest.raises(ConfigError, match="memory_only needs memory_paths"):
        TuttiConfig(write_policy="memory_only")
    # One capacity for every memory path, or one per path.
    with pytest.raises(ConfigError, match="memory_capacity_gb has 2 values for 3 memory paths"):
        TuttiConfig(memory_paths=[str(shm / c) for c in "abc"], memory_capacity_gb=[1, 2])
    with pytest.raises(ConfigError, match="memory_capacity_gb has 2 values for 0 memory paths"):
        TuttiConfig(memory_capacity_gb=[1, 2])
    for bad in ({"memory_capacity_gb": 0}, {"memory_capacity_gb": NAN}, {"memory_paths": [str(shm), ""]},
                {"promote_hits": -1}, {"promote_window_s": 0}, {"promote_window_s": INF}):
        with pytest.raises(ConfigError, match="memory_capacity_gb|memory_paths|promote_"):
            TuttiConfig(**bad)
    # Lists from the environment, as paths and capacity_gb; the capacity of each memory path in bytes.
    monkeypatch.setenv("TUTTI_MEMORY_PATHS", f"{shm}/a,{shm}/b")
    monkeypatch.setenv("TUTTI_MEMORY_CAPACITY_GB", "0.5")
    cfg = TuttiConfig(paths=[str(ssd)], write_policy="write_through", promote_hits=0)
    assert cfg.memory_paths == [shm / "a", shm / "b"] and cfg.memory_capacity_bytes() == [1 << 29, 1 << 29]
    assert TuttiConfig(memory_paths=[], paths=[str(ssd)]).memory_capacity_bytes() == []
    assert TuttiConfig(memory_paths=[str(shm / "a"), str(shm / "b")],
                       memory_capacity_gb=[1, 2]).memory_capacity_bytes() == [1 << 30, 2 << 30]


def test_the_memory_tier_is_off_and_its_policy_the_native_default_unless_configured():
    from tutti_cluster import _native
    from tutti_cluster.config import NATIVE_FIELDS

    cfg, native = TuttiConfig(), _native.StoreOptions()
    assert cfg.memory_paths == [] and cfg.memory_capacity_bytes() == []
    assert (cfg.write_policy, cfg.promote_hits, cfg.promote_window_s) == (
        native.write_policy, native.promote_hits, native.promote_window_s) == ("write_back", 2, 60.0)
    assert {"write_policy", "promote_hits", "promote_window_s"} <= set(NATIVE_FIELDS)
