"""Fuzzing the node daemon's socket protocol (issue 13): malformed lines of every kind against the
real daemon process (`run_daemon`, as `tutti up` runs it) over its real unix socket.

Every line gets one reply: a valid one, or the one error shape ``{"ok": false, "error": {"class":
..., "message": ...}}``. The daemon never dies, the connection reads on, and afterwards the daemon
restarts cleanly from the ``instances.json`` the run left, holding exactly the instances it granted.
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_fixtures import DaemonProcess
from tutti_cluster import TuttiConfig
from tutti_cluster.config import INSTANCE_PATTERN
from tutti_cluster.node.protocol import socket_path

GEO = {"num_layers": 2, "nptr": 2, "block_stride": 4096, "block_bytes": 4096, "num_blocks": 8,
       "dtype": "uint8", "block_shape": [4096], "block_tokens": 16, "unit_tokens": 64}
ERROR_CLASSES = {"TuttiError", "NotFound", "CapacityExceeded", "StorageError", "DeviceError", "ConfigError",
                 "LayoutError"}

names = st.from_regex(f"^{INSTANCE_PATTERN}$", fullmatch=True).filter(lambda s: len(s) <= 64 and "\n" not in s)
keys = st.lists(st.integers(0, (1 << 64) - 1), max_size=8)
valid = st.one_of(
    st.builds(lambda n, c: {"op": "attach", "instance": n, "geometry": GEO, "capacity": [c]},
              names, st.integers(1 << 16, 1 << 20)),
    st.builds(lambda n, k: {"op": "commit", "instance": n, "keys": k}, names, keys),
    st.builds(lambda n, k: {"op": "evict", "instance": n, "keys": k}, names, keys),
    st.builds(lambda k, r: {"op": "lookup", "keys": k, "remote": r}, keys, st.booleans()),
    st.just({"op": "stats"}),
    st.just({"op": "ping"}),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
huge_numbers = st.sampled_from([b"1e400", b"-1e400", b"1e-400", b"9" * 5000, b"-" + b"9" * 5000, b"NaN",
                                b"Infinity", b"-Infinity", str(1 << 64).encode(), b"-1", b"1.0", b"0x10"])


def _dump(v: Any) -> bytes:
    return json.dumps(v, allow_nan=True).encode()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request with one field replaced, removed, added or set to a raw huge number."""
    msg = dict(draw(valid))
    field = draw(st.sampled_from(sorted(msg) + ["geometry.x", "extra"]))
    how = draw(st.sampled_from(["value", "drop", "number"]))
    if field == "geometry.x" and "geometry" in msg:
        geo = dict(msg["geometry"])
        gkey = draw(st.sampled_from(sorted(geo)))
        if how == "drop":
            del geo[gkey]
        else:
            geo[gkey] = draw(json_values)
        msg["geometry"] = geo
        return _dump(msg)
    if how == "drop":
        msg.pop(field, None)
        return _dump(msg)
    if how == "number":
        marker = "\u0000HUGE\u0000"
        msg[field] = [marker] if field in ("keys", "capacity") else marker
        return _dump(msg).replace(_dump(marker), draw(huge_numbers))
    msg[field] = draw(json_values)
    return _dump(msg)


@st.composite
def deep(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 20000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    inner = opener * n + b"1" + closer * n if opener != b"[" else opener * n + closer * n
    return b'{"op": "lookup", "keys": ' + inner + b"}" if draw(st.booleans()) else inner


lines = st.one_of(
    valid.map(_dump),
    mutated(),
    deep(),
    json_values.map(_dump),
    st.binary(max_size=300).map(lambda b: b.replace(b"\n", b" ")),
    st.text(max_size=100).map(lambda t: t.replace("\n", " ").encode("utf-8", "surrogatepass")),
    huge_numbers,
)


def _check_reply(line: bytes, raw: bytes) -> dict:
    assert raw.endswith(b"\n"), f"no reply to {line[:80]!r}"
    reply = json.loads(raw)
    assert isinstance(reply, dict), reply
    if reply.get("ok") is True:
        return reply
    assert set(reply) == {"ok", "error"} and reply["ok"] is False, (line[:80], reply)
    assert set(reply["error"]) == {"class", "message"}, (line[:80], reply)
    assert reply["error"]["class"] in ERROR_CLASSES, (line[:80], reply)
    assert isinstance(reply["error"]["message"], str)
    return reply


def _granted_over_a_new_connection(cfg) -> dict:
    """The capacity each instance holds, as a fresh connection's stats reply says."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(socket_path(cfg)))
        s.sendall(b'{"op": "stats"}\n')
        stats = json.loads(s.makefile("rb").readline())
    return {n: v["capacity"] for n, v in stats["instances"].items()}


def test_the_daemon_answers_every_malformed_line_keeps_serving_and_restarts_cleanly(tmp_path: Path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg_d = {"paths": [str(ssd)], "capacity_gb": 0.05, "unit_tokens": 64, "data_dir": str(tmp_path / "node")}
    cfg = TuttiConfig(**cfg_d)
    daemon = DaemonProcess(cfg_d, tmp_path / "daemon.log")
    granted: dict[str, list[int]] = {}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(str(socket_path(cfg)))
    f = sock.makefile("rwb")
    counts = {"ok": 0, "error": 0}

    @settings(max_examples=400, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(line=lines)
    def one_line(line: bytes) -> None:
        f.write(line + b"\n")
        f.flush()
        reply = _check_reply(line, f.readline())
        counts["ok" if reply["ok"] else "error"] += 1
        if reply["ok"] and json.loads(line).get("op") == "attach":  # granted (or confirmed)
            granted.setdefault(json.loads(line)["instance"], reply["capacity"])
        assert daemon.proc.poll() is None, "the daemon died"

    try:
        one_line()
        # The same connection, and a new one, still serve.
        f.write(b'{"op": "ping"}\n')
        f.flush()
        assert json.loads(f.readline())["ok"] is True
        assert _granted_over_a_new_connection(cfg) == granted
        assert counts["error"] > 0 and counts["ok"] > 0, counts
    finally:
        f.close()
        sock.close()
        assert daemon.stop(signal.SIGTERM) == 0
    # What was persisted is exactly what was granted, and a new daemon starts from it.
    state = json.loads((tmp_path / "node" / "instances.json").read_text()) if granted else {}
    assert {n: v["capacity"] for n, v in state.items()} == granted
    daemon = DaemonProcess(cfg_d, tmp_path / "daemon.log")
    try:
        assert _granted_over_a_new_connection(cfg) == granted
        assert not (tmp_path / "node" / "instances.json.bad").exists()
        assert "Traceback" not in (tmp_path / "daemon.log").read_text()
    finally:
        assert daemon.stop(signal.SIGTERM) == 0
