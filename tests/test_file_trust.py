"""The node's files against the host's other users and against what is planted in a storage
directory (docs/SECURITY.md, "Files and local users"), with real files, a real non-root user (made
with useradd when the tests run as root) and a real `tutti up`.

Regressions, each of which once failed:
- a symbolic link at a pool file's name made the store open its target read-write and overwrite it
  from byte 0; a plain file with the pool's name was rewritten the same way;
- pool files were made mode 0644: with storage paths in ordinary 0755 directories any local user
  read the KV cache;
- ``TUTTI_CONFIG_FILE`` naming a FIFO hung for good, ``/dev/zero`` ended in a bare MemoryError, and
  an empty entry in ``TUTTI_PATHS`` was dropped silently;
- a pool file that could not be preallocated (a full tmpfs) was left behind, empty;
- the daemon's read-only view read a pool file another user planted in a storage directory (and
  would have indexed, advertised and served its units);
- a data directory another user made or could write (in /tmp, say) was taken, with the admin token
  planted in it; parents made on the way were 0777 under umask 0;
- files an older build left 0644 in the data directory (the admin token) stayed readable;
- a refused file_group left pools and directories readable by the group they happened to have;
- the daemon removed any file at its socket's name, and at stop another daemon's socket;
- the demo's clean-up removed files its store never opened: another user's, or the pool of a
  store of the same instance in use.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import make_kv, open_store
from tutti_cluster import TuttiConfig, TuttiStore
from tutti_cluster.errors import CapacityExceeded, ConfigError, LayoutError, StorageError

ROOT = os.geteuid() == 0
POOL = "tutti-default.pool"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def pools(d: Path) -> list[Path]:
    return sorted(d.glob("tutti-*.pool"))


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every local user may enter and list (0755, as /mnt/nvme0 or a hostPath is),
    outside pytest's own owner-only temporary tree."""
    d = Path(tempfile.mkdtemp(prefix="tutti-trust-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def probe_user() -> Iterator[tuple[int, int, int]]:
    """A real unprivileged user and a group of its own besides: (uid, gid, extra group's gid)."""
    if not ROOT:
        pytest.skip("making a second local user (useradd, groupadd) needs root")
    if not (shutil.which("useradd") and shutil.which("groupadd")):
        pytest.skip("useradd/groupadd are not installed")
    name, group = f"tuttiprobe{os.getpid()}", f"tuttishare{os.getpid()}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", group, name],
                       capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["groupdel", group], check=False, capture_output=True)
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    try:
        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid, grp.getgrnam(group).gr_gid
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)
        subprocess.run(["groupdel", group], check=False, capture_output=True)


def readable_by(user: tuple[int, int, int], paths: list[Path], *, in_group: bool = False) -> dict[str, str]:
    """What the user reads of each path, in a process of its own: 'read' or the error's name."""
    uid, gid, extra = user
    code = textwrap.dedent("""
        import json, sys
        out = {}
        for p in sys.argv[1:]:
            try:
                with open(p, "rb") as f:
                    f.read(16)
                out[p] = "read"
            except OSError as e:
                out[p] = type(e).__name__
        print(json.dumps(out))
    """)
    r = subprocess.run(["/usr/bin/python3", "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=60,
                       user=uid, group=gid, extra_groups=[extra] if in_group else [], cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---- finding 1: planted files are never written ------------------------------------------------

def test_a_symlink_at_the_pool_name_is_refused_and_its_target_untouched(tmp_path: Path):
    d, victim = tmp_path / "ssd", tmp_path / "victim.txt"
    d.mkdir()
    victim.write_bytes(os.urandom(11 * 1024))
    before = victim.read_bytes()
    (d / POOL).symlink_to(victim)
    kv = make_kv(seed=1)
    with pytest.raises(StorageError, match=f"{d / POOL}.*symbolic link"):
        open_store([d], kv)
    r = TuttiStore(TuttiConfig(paths=[d], unit_tokens=64))
    with pytest.raises(StorageError, match="symbolic link"):  # the daemon's read-only view too
        r.register_kv_caches(kv, block_tokens=16, read_only=True)
    assert victim.read_bytes() == before and (d / POOL).is_symlink()
    # The operator's storage path may itself be a symbolic link to a directory: only the pool
    # file's own name may not be one.
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir()
    with open_store([link], kv) as s:
        assert s.store([1], np.arange(s.unit_blocks)).ok
    assert pools(tmp_path / "real") == [tmp_path / "real" / POOL] and not (tmp_path / "real" / POOL).is_symlink()


def test_a_foreign_file_with_the_pool_name_is_refused_and_untouched(tmp_path: Path):
    d = tmp_path / "ssd"
    d.mkdir()
    foreign = os.urandom(11 * 1024)
    (d / POOL).write_bytes(foreign)
    with pytest.raises(StorageError, match=f"{d / POOL}.*non-empty file of {len(foreign)} bytes"):
        open_store([d], make_kv(seed=2))
    assert (d / POOL).read_bytes() == foreign
    # Empty files and pools of ours are taken; a pool of another layout is still a LayoutError.
    (d / POOL).write_bytes(b"")
    kv = make_kv(seed=4)
    with open_store([d], kv) as s:
        assert s.store([1, 2], np.arange(2 * s.unit_blocks)).ok
    with open_store([d], kv) as s:
        assert s.lookup([1, 2]) == 2
    with pytest.raises(LayoutError, match="another layout"):
        open_store([d], make_kv("block_first", layers=2, seed=4), layout="block_first")


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_fifo_or_directory_at_the_pool_name_is_refused_at_once(tmp_path: Path, kind: str):
    d = tmp_path / "ssd"
    d.mkdir()
    os.mkfifo(d / POOL) if kind == "fifo" else (d / POOL).mkdir()
    for read_only in (False, True):  # a reader never waits on the FIFO for a writer
        s = TuttiStore(TuttiConfig(paths=[d], unit_tokens=64, capacity_gb=0.02, staging_mb=2, min_io_bytes=4096))
        with pytest.raises(StorageError, match="FIFO" if kind == "fifo" else "directory"):
            s.register_kv_caches(make_kv(seed=3), block_tokens=16, read_only=read_only)


# ---- finding 2: owner-only files ---------------------------------------------------------------

def test_pool_files_and_the_default_directories_are_owner_only_whatever_the_umask(tmp_path: Path):
    old = os.umask(0)
    try:
        with TuttiStore(TuttiConfig(data_dir=tmp_path / "node", unit_tokens=64, capacity_gb=0.02, staging_mb=2,
                                    min_io_bytes=4096)) as s:
            s.register_kv_caches(make_kv(seed=6), block_tokens=16)
    finally:
        os.umask(old)
    store = tmp_path / "node" / "store"
    assert mode(tmp_path / "node") == 0o700 and mode(store) == 0o700
    assert [mode(p) for p in pools(store)] == [0o600]
    # A pool an older build made world-readable is tightened at its next open.
    os.chmod(store / POOL, 0o644)
    with open_store([store], make_kv(seed=6)):
        pass
    assert mode(store / POOL) == 0o600


def test_a_file_group_gets_read_access_and_nothing_more(tmp_path: Path, open_dir: Path):
    if ROOT:
        if not shutil.which("groupadd"):
            pytest.skip("groupadd is not installed")
        name = f"tuttigrp{os.getpid()}"
        subprocess.run(["groupadd", name], check=True, capture_output=True)
    else:
        others = [g for g in os.getgroups() if g != os.getegid()]
        if not others:
            pytest.skip("needs root (groupadd) or a user in a second group to give files to")
        name = str(others[0])
    try:
        gid = int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
        cfg = dict(data_dir=open_dir / "node", unit_tokens=64, capacity_gb=0.02, staging_mb=2, min_io_bytes=4096,
                   file_group=name)
        with TuttiStore(TuttiConfig(**cfg)) as s:
            s.register_kv_caches(make_kv(seed=7), block_tokens=16)
        store = open_dir / "node" / "store"
        for d in (open_dir / "node", store):
            assert (mode(d), os.stat(d).st_gid) == (0o750, gid)
        assert [(mode(p), p.stat().st_gid) for p in pools(store)] == [(0o640, gid)]
        with pytest.raises(ConfigError, match="file_group 'no-such-group-here' is not a group"):
            TuttiStore(TuttiConfig(**{**cfg, "file_group": "no-such-group-here"})).register_kv_caches(
                make_kv(seed=7), block_tokens=16)
    finally:
        if ROOT:
            subprocess.run(["groupdel", name], check=False, capture_output=True)


def test_another_user_reads_no_pool_even_in_an_open_directory(open_dir: Path, probe_user):
    ssd, shared = open_dir / "ssd", open_dir / "shared"
    for d in (ssd, shared):
        d.mkdir()
        os.chmod(d, 0o755)
    kv = make_kv(seed=8)
    with open_store([ssd], kv) as s:
        assert s.store([1], np.arange(s.unit_blocks)).ok
    with open_store([shared], kv, file_group=str(probe_user[2])) as s:
        assert s.store([1], np.arange(s.unit_blocks)).ok
    assert readable_by(probe_user, [ssd]) == {str(ssd): "IsADirectoryError"}  # the directory is open to it
    assert readable_by(probe_user, [ssd / POOL, shared / POOL]) == {str(ssd / POOL): "PermissionError",
                                                                    str(shared / POOL): "PermissionError"}
    # A member of file_group reads what is shared with it, and only that.
    assert readable_by(probe_user, [ssd / POOL, shared / POOL], in_group=True) == {
        str(ssd / POOL): "PermissionError", str(shared / POOL): "read"}


# ---- the daemon's files, through a real `tutti up` ---------------------------------------------

OLDER_FILES = {"admin.token": "token-of-an-older-build\n", "pins.json": "[]", "instances.json.bad": "{}"}


@pytest.fixture(scope="module")
def up_node() -> Iterator[Path]:
    """A real `tutti up` whose data directory and storage path exist beforehand, open (0755)."""
    pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")
    from cluster_fixtures import free_port
    from test_admin_cli import TuttiUp
    from test_daemon import GEO
    from tutti_cluster.node.link import DaemonLink

    work = Path(tempfile.mkdtemp(prefix="tutti-trust-up-", dir="/tmp"))
    for d in (work, work / "node", work / "ssd"):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o755)
    # Files an older build left readable by every user (it made them 0644).
    for name, text in OLDER_FILES.items():
        (work / "node" / name).write_text(text)
        os.chmod(work / "node" / name, 0o644)
    up = TuttiUp(work, free_port())
    try:
        link = DaemonLink(TuttiConfig(data_dir=work / "node", paths=[work / "ssd"], unit_tokens=64))
        try:
            assert link.request({"op": "attach", "instance": "engine0", "geometry": GEO})["ok"]
        finally:
            link.close()
        yield work
    finally:
        up.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_tutti_up_keeps_its_state_token_and_socket_owner_only(up_node: Path):
    node = up_node / "node"
    modes = {p.name: mode(p) for p in node.iterdir()}
    assert {"admin.token", "tutti.sock", "instances.json"} <= set(modes)
    assert set(modes.values()) == {0o600}, modes  # whatever else the node keeps there, too


def test_tutti_up_closes_the_files_an_older_build_left_readable(up_node: Path):
    """An older build made admin.token and pins.json 0644: a `tutti up` on its data directory kept
    them so, and any local user read the admin token."""
    node = up_node / "node"
    assert {name: mode(node / name) for name in OLDER_FILES} == dict.fromkeys(OLDER_FILES, 0o600)
    assert (node / "admin.token").read_text() == OLDER_FILES["admin.token"]  # closed, not replaced


def test_another_user_reads_none_of_the_daemons_files(up_node: Path, probe_user):
    node = up_node / "node"
    files = sorted(p for p in node.iterdir() if not p.is_socket())
    assert {"admin.token", "instances.json"} <= {p.name for p in files}
    assert set(readable_by(probe_user, files).values()) == {"PermissionError"}


def test_a_data_directory_the_daemon_makes_is_owner_only(tmp_path: Path):
    from tutti_cluster.node.daemon import NodeDaemon

    old = os.umask(0)
    try:
        d = NodeDaemon(TuttiConfig(data_dir=tmp_path / "a" / "node", paths=[tmp_path], unit_tokens=64)).start()
    finally:
        os.umask(old)
    try:
        assert mode(tmp_path / "a" / "node") == 0o700 and mode(tmp_path / "a" / "node" / "tutti.sock") == 0o600
        # A parent made on the way is never one others may write (it was 0777 under umask 0, so
        # anyone could have swapped the data directory for one of their own).
        assert mode(tmp_path / "a") == 0o755
    finally:
        d.stop()


def test_the_daemon_refuses_a_fifo_as_its_state(tmp_path: Path):
    """A FIFO planted as instances.json is a StorageError at start, never a daemon that hangs."""
    node = tmp_path / "node"
    node.mkdir()
    os.mkfifo(node / "instances.json")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from tutti_cluster import TuttiConfig
        from tutti_cluster.node.daemon import NodeDaemon
        from tutti_cluster.errors import StorageError
        try:
            NodeDaemon(TuttiConfig(data_dir={str(node)!r}, paths=[{str(tmp_path)!r}])).start()
        except StorageError as e:
            print("refused:", e)
    """)], capture_output=True, text=True, timeout=60)
    assert "refused:" in r.stdout and "FIFO" in r.stdout, r.stdout + r.stderr


def test_the_daemon_removes_no_file_at_its_socket_name_but_a_socket(tmp_path: Path):
    """A start took whatever was at tutti.sock for a stale socket and removed it, a regular file
    included."""
    from tutti_cluster.node.daemon import NodeDaemon

    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    (node / "tutti.sock").write_text("not a socket")
    with pytest.raises(StorageError, match="tutti.sock is not a socket"):
        NodeDaemon(TuttiConfig(data_dir=node, paths=[tmp_path], unit_tokens=64)).start()
    assert (node / "tutti.sock").read_text() == "not a socket"


def test_a_stopping_daemon_removes_its_own_socket_only(tmp_path: Path):
    """stop() removed whatever was at tutti.sock by then: the socket of a daemon started in the
    meantime (after this one's was removed) went with it, and that daemon could no longer be
    reached."""
    import socket

    from tutti_cluster.node.daemon import NodeDaemon

    cfg = TuttiConfig(data_dir=tmp_path / "node", paths=[tmp_path], unit_tokens=64)
    d = NodeDaemon(cfg).start()
    try:
        (tmp_path / "node" / "tutti.sock").unlink()
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(tmp_path / "node" / "tutti.sock"))
    finally:
        d.stop()
    try:
        assert (tmp_path / "node" / "tutti.sock").is_socket()
    finally:
        other.close()
    d = NodeDaemon(cfg).start()  # a stale socket is still replaced, and its own removed at stop
    d.stop()
    assert not (tmp_path / "node" / "tutti.sock").exists()


# ---- finding 5: hostile configuration ------------------------------------------------------------

def load_in_child(env: dict[str, str]) -> subprocess.CompletedProcess:
    """load_config() in a process of its own, so that a hang fails this test instead of the suite."""
    code = textwrap.dedent("""
        from tutti_cluster.config import load_config
        from tutti_cluster.errors import ConfigError
        try:
            load_config()
        except ConfigError as e:
            print("ConfigError:", e)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "large", "directory"])
def test_a_config_file_that_is_no_small_regular_file_is_a_config_error(tmp_path: Path, kind: str):
    path = {"fifo": tmp_path / "fifo.json", "dev_zero": Path("/dev/zero"), "large": tmp_path / "large.json",
            "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "large":
        path.write_text(json.dumps({"instance": "x" * (2 << 20)}))
    r = load_in_child({"TUTTI_CONFIG_FILE": str(path)})
    want = {"fifo": "is a FIFO", "dev_zero": "is a character device", "large": "more than the 1048576",
            "directory": "is a directory"}[kind]
    assert r.stdout.startswith("ConfigError:") and want in r.stdout, r.stdout + r.stderr


def test_a_config_file_is_read_through_a_symlink_but_never_from_a_fifo(tmp_path: Path):
    """Kubernetes mounts ConfigMaps through symbolic links: a link to a regular file is read, one
    to a FIFO is refused like the FIFO itself."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo.json").symlink_to(tmp_path / "fifo")
    r = load_in_child({"TUTTI_CONFIG_FILE": str(tmp_path / "to-fifo.json")})
    assert r.stdout.startswith("ConfigError:") and "is a FIFO" in r.stdout, r.stdout + r.stderr
    (tmp_path / "real.json").write_text(json.dumps({"instance": "from-file"}))
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    code = "from tutti_cluster.config import load_config; print(load_config().instance)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TUTTI_CONFIG_FILE": str(tmp_path / "link.json")})
    assert r.stdout.strip() == "from-file", r.stderr


@pytest.mark.parametrize("env", [",/tmp", "/tmp,", "/tmp,,/tmp", " , "])
def test_an_empty_storage_path_in_the_environment_is_a_config_error(monkeypatch, env: str):
    """``paths=[""]`` was refused already; the comma form dropped the empty item silently."""
    monkeypatch.setenv("TUTTI_PATHS", env)
    with pytest.raises(ConfigError, match="empty entry"):
        TuttiConfig()


# ---- a pool that cannot be allocated leaves nothing behind (issue 44, finding 4) ------------------

def test_a_pool_that_cannot_be_preallocated_is_removed_again(tmpfs):
    d = tmpfs("4m")
    with pytest.raises(CapacityExceeded, match="no space left"):
        open_store([d], make_kv(seed=9), capacity_gb=0.25)
    assert pools(d) == []
    # A file that was there, empty, before is left empty, not removed (it is not this open's).
    (d / POOL).touch()
    with pytest.raises(CapacityExceeded):
        open_store([d], make_kv(seed=9), capacity_gb=0.25, pool_files=1)
    assert [(p.name, p.stat().st_size) for p in pools(d)] == [(POOL, 0)]


# ---- what another user can put in a storage directory or next to the data directory -----------

def as_user(user: tuple[int, int, int], script: str, *args: str) -> None:
    """Runs a shell script as the user, as that user would, in a process of its own."""
    uid, gid, _ = user
    r = subprocess.run(["/bin/sh", "-c", script, "sh", *args], capture_output=True, text=True, timeout=60,
                       user=uid, group=gid, extra_groups=[], cwd="/")
    assert r.returncode == 0, r.stderr


def test_a_reader_refuses_a_pool_file_another_user_planted(open_dir: Path, probe_user):
    """The daemon's read-only view counted every `tutti-<instance>.<k>.pool` there was and read
    them whoever owned them: a user who could write the storage directory added a file of its own
    and the node indexed, advertised and served the units in it as its own."""
    ssd, forge = open_dir / "ssd", open_dir / "forge"
    ssd.mkdir()
    forge.mkdir()
    os.chmod(ssd, 0o1777)  # writable by every user (sticky: none removes another's files)
    kv = make_kv(seed=11)
    with open_store([ssd], kv) as s:
        assert s.store([1], np.arange(s.unit_blocks)).ok
    with open_store([forge], kv) as s:  # a pool with a unit the node never stored
        assert s.store([99], np.arange(s.unit_blocks)).ok
    os.chmod(forge / POOL, 0o644)  # for the other user to copy
    as_user(probe_user, 'cp "$1" "$2"', str(forge / POOL), str(ssd / "tutti-default.1.pool"))
    assert os.stat(ssd / "tutti-default.1.pool").st_uid == probe_user[0]
    r = TuttiStore(TuttiConfig(paths=[ssd], unit_tokens=64, capacity_gb=0.02, staging_mb=2, min_io_bytes=4096))
    with pytest.raises(StorageError, match=f"tutti-default.1.pool: it is owned by uid {probe_user[0]}"):
        r.register_kv_caches(make_kv(seed=11), block_tokens=16, read_only=True)
    # The engine's own pool still opens (a writer opens only the files it makes).
    with open_store([ssd], kv) as s:
        assert s.lookup([1]) == 1 and s.lookup([99]) == 0


def test_a_refused_file_group_leaves_pools_and_directories_owner_only(open_dir: Path, probe_user):
    """chmod came before chgrp: where the group was refused (the user not a member), a pool file
    and a new data directory were left readable by the group they happened to have."""
    uid, gid, _ = probe_user
    work = open_dir / "work"
    work.mkdir()
    os.chown(work, uid, gid)
    code = textwrap.dedent(f"""
        import json, os, stat, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import make_kv, open_store
        from tutti_cluster import TuttiConfig, TuttiStore
        from tutti_cluster.errors import StorageError
        os.setgroups([]); os.setgid({gid}); os.setuid({uid})  # everything imported: now the user
        work = {str(work)!r}
        kv = make_kv(seed=12)
        with open_store([work], kv):
            pass
        out = {{}}
        try:
            open_store([work], kv, file_group="0")  # root's group: this user is no member
        except StorageError as e:
            out["pool"] = str(e)
        try:
            TuttiStore(TuttiConfig(data_dir=work + "/node", unit_tokens=64, file_group="0")).register_kv_caches(
                kv, block_tokens=16)
        except StorageError as e:
            out["dir"] = str(e)
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)
        out["modes"] = [mode(work + "/tutti-default.pool"), mode(work + "/node")]
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "member of file_group" in out["pool"] and "member of file_group" in out["dir"], out
    assert out["modes"] == [0o600, 0o700]


@pytest.mark.parametrize("case", ["other_users_dir", "link_to_other_users_dir", "other_users_link",
                                  "other_users_parent", "world_writable", "sticky_world_writable"])
def test_a_data_directory_others_can_write_is_refused(open_dir: Path, probe_user, case: str):
    """A data directory another user made beforehand (say in /tmp) was taken as it was: that user
    chose the admin token (a planted admin.token was used) and could replace the socket."""
    from tutti_cluster.node.daemon import NodeDaemon

    os.chmod(open_dir, 0o1777)  # a shared parent, as /tmp is
    node = open_dir / "node"
    planted = "echo planted-token > \"$1\"/admin.token"
    if case == "other_users_dir":
        as_user(probe_user, 'mkdir -m 777 "$1" && ' + planted, str(node))
    elif case == "link_to_other_users_dir":
        as_user(probe_user, 'mkdir -m 777 "$1.real" && ln -s "$1.real" "$1" && ' + planted, str(node))
    elif case == "other_users_link":  # to a directory of ours, for now: its owner may point it elsewhere later
        ours = open_dir / "ours"
        ours.mkdir(mode=0o700)
        as_user(probe_user, 'ln -s "$1" "$2"', str(ours), str(node))
    elif case == "other_users_parent":
        as_user(probe_user, 'mkdir -m 755 "$1"', str(open_dir / "theirs"))
        node = open_dir / "theirs" / "node"  # root may make it; its parent is still theirs
        node.mkdir()
    else:
        node.mkdir()
        os.chmod(node, 0o1777 if case == "sticky_world_writable" else 0o777)
    want = {"other_users_link": "symbolic link of uid", "link_to_other_users_dir": "symbolic link of uid",
            "world_writable": "lets other users write",
            "sticky_world_writable": "lets other users write"}.get(case, "owned by uid")
    before = sorted(p.name for p in Path(os.path.realpath(node)).iterdir())
    d = NodeDaemon(TuttiConfig(data_dir=node, paths=[open_dir], unit_tokens=64))
    try:
        with pytest.raises(StorageError, match=f"refusing the directory {node}.*{want}"):
            d.start()
    finally:
        d.stop()
    with pytest.raises(StorageError, match=want):  # the embedded default's store, too
        TuttiStore(TuttiConfig(data_dir=node, unit_tokens=64, capacity_gb=0.02, staging_mb=2,
                               min_io_bytes=4096)).register_kv_caches(make_kv(seed=13), block_tokens=16)
    assert sorted(p.name for p in Path(os.path.realpath(node)).iterdir()) == before  # nothing made there


def test_tutti_up_never_takes_a_data_directory_and_token_another_user_planted(open_dir: Path, probe_user):
    pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")
    from cluster_fixtures import free_port

    os.chmod(open_dir, 0o1777)
    node, ssd = open_dir / "node", open_dir / "ssd"
    ssd.mkdir()
    as_user(probe_user, 'mkdir -m 777 "$1" && echo planted-token > "$1"/admin.token', str(node))
    proc = subprocess.Popen([sys.executable, "-m", "tutti_cluster.cli", "up", "--data-dir", str(node), "--paths",
                             str(ssd), "--capacity-gb", "0.05", "--unit-tokens", "64", "--admin-host", "127.0.0.1",
                             "--admin-port", str(free_port()), "--health-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)  # served (the planted token in use): still running
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"tutti up served from another user's data directory: {out}")
    assert proc.returncode != 0 and f"refusing the directory {node}" in err and "owned by uid" in err, err
    assert sorted(p.name for p in node.iterdir()) == ["admin.token"]


@pytest.fixture
def demo_config(open_dir: Path):
    from tutti_cluster.demo import run_demo

    d = open_dir / "ssd"
    d.mkdir()
    cfg = TuttiConfig(paths=[d], instance="demo", unit_tokens=64, capacity_gb=0.02, staging_mb=2, min_io_bytes=4096)
    return d, lambda: run_demo(cfg, prefix_tokens=64, keep=False)


def test_the_demo_removes_only_a_pool_it_opened(demo_config):
    """The demo's clean-up removed every file with its pool's name, even when its store never
    opened them: the pool of another store of the same instance (in use, so this open failed) was
    deleted under it, and a dangling link there ended the demo in a bare FileNotFoundError."""
    d, demo = demo_config
    assert demo().exact and pools(d) == []  # its own pool is removed
    kv = make_kv(seed=14)
    with open_store([d], kv, instance="demo") as held:
        with pytest.raises(ConfigError, match="in use by another process"):
            demo()
        assert pools(d) == [d / "tutti-demo.pool"]
        assert held.store([1], np.arange(held.unit_blocks)).ok
    (d / "tutti-demo.pool").unlink()
    (d / "tutti-demo.pool").symlink_to(d / "nowhere")
    with pytest.raises(StorageError, match="symbolic link"):
        demo()
    assert (d / "tutti-demo.pool").is_symlink()


def test_the_demo_never_removes_another_users_file(demo_config, probe_user):
    d, demo = demo_config
    os.chmod(d, 0o1777)
    as_user(probe_user, 'echo theirs > "$1"', str(d / "tutti-demo.pool"))
    with pytest.raises(StorageError, match=f"owned by uid {probe_user[0]}"):
        demo()
    assert (d / "tutti-demo.pool").read_text() == "theirs\n"
