"""`tutti admin`: the admin API's command-line client (httpx; no FastAPI needed to run it, and
neither for ``--help``).

    tutti admin status                    nodes, units, capacity, engines, drain state
    tutti admin stats                     hits, bytes, evictions, checksum failures, remote fetches; each tier
    tutti admin objects --prefix P | --key K [--key K ...] [--limit N]
    tutti admin evict --all | --prefix P | --node N
    tutti admin pin [--tier any|memory] KEY [KEY ...]      tutti admin unpin KEY [KEY ...]
    tutti admin drain NODE [--mode replicated|all|none] [--wait S] [--undo]
    tutti admin serve                     the cluster-wide admin API (nodes from the directory)

The API's address is ``--url``, else ``TUTTI_ADMIN_URL``, else the node's ``admin_host:admin_port``;
the token is ``--token-file``, else ``TUTTI_ADMIN_TOKEN`` / ``TUTTI_ADMIN_TOKEN_FILE``, else the
node's ``<data_dir>/admin.token``. Tables by default, ``--json`` for the API's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from tutti_cluster.config import TuttiConfig, add_config_arguments, config_arguments, load_config
from tutti_cluster.errors import TuttiError

from tutti_control.auth import client_token, read_token_file
from tutti_control.models import node_path

if TYPE_CHECKING:
    import httpx

EXIT_API_ERROR = 1
EXIT_UNREACHABLE = 3


class AdminError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message} (HTTP {status})")
        self.status = status
        self.code = code


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Client:
    def __init__(self, url: str, token: str | None, timeout_s: float = 30.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http: httpx.Client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def call(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        try:
            body = r.json()
        except ValueError:
            raise AdminError(r.status_code, "bad_reply", r.text[:200]) from None
        if r.status_code not in ok:
            e = body.get("error", {}) if isinstance(body, dict) else {}
            raise AdminError(r.status_code, str(e.get("code", "error")), str(e.get("message", r.text[:200])))
        return body


# The etcd connection's TLS and user settings (docs/CLUSTER.md), taken by `tutti admin serve` as by `tutti up`.
ETCD_TLS_FIELDS = ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_user", "etcd_password_file")


def _config(a: argparse.Namespace) -> TuttiConfig:
    return load_config(**config_arguments(a, ("data_dir", "etcd", *ETCD_TLS_FIELDS, "cluster_secret_file",
                                              "admin_host", "admin_port",
                                              "health_port", "metrics_token_file", "admin_docs")))


def _url(a: argparse.Namespace, cfg: TuttiConfig) -> str:
    if a.url:
        return str(a.url)
    if os.environ.get("TUTTI_ADMIN_URL"):
        return os.environ["TUTTI_ADMIN_URL"]
    host = "127.0.0.1" if cfg.admin_host in ("0.0.0.0", "", "::") else cfg.admin_host
    return f"http://[{host}]:{cfg.admin_port}" if ":" in host else f"http://{host}:{cfg.admin_port}"


def _keys_arg(keys: list[str]) -> list[str]:
    return [k.lower() for k in keys]


def show_status(c: Client) -> tuple[Any, str]:
    ready = c.call("GET", "/readyz", ok=(200, 503))
    nodes = c.call("GET", "/v1/nodes")
    rows = []
    for n in nodes["nodes"]:
        if not n["reachable"]:
            rows.append([n["node_id"], n["mode"], "unreachable", None, None, None, None, n.get("error")])
            continue
        cap = sum(n["capacity_bytes"])
        engines = sum(1 for i in n["instances"] if i["engine_connected"])
        d = n.get("drain") or {}
        rows.append([n["node_id"], n["mode"], "up", n["units"], f"{human_bytes(n['used_bytes'])} / {human_bytes(cap)}",
                     f"{engines}/{len(n['instances'])}", d.get("state", "serving"), None])
    text = ("ready" if ready["ready"] else "NOT READY: " + "; ".join(ready["reasons"])) + "\n"
    text += table(rows, ["NODE", "MODE", "STATE", "UNITS", "USED / CAPACITY", "ENGINES", "DRAIN", "ERROR"])
    return {"ready": ready, "nodes": nodes["nodes"]}, text


def show_stats(c: Client) -> tuple[Any, str]:
    s = c.call("GET", "/v1/stats")
    rows = []
    for n in s["nodes"] + [dict(s["totals"], node_id="total", reachable=True)]:
        if not n.get("reachable", True):
            rows.append([n["node_id"]] + [None] * 9)
            continue
        hr = n.get("hit_rate")
        rows.append([n["node_id"], n["units"], n["pinned"], "-" if hr is None else f"{hr * 100:.1f} %",
                     human_bytes(n["bytes_read"]), human_bytes(n["bytes_written"]), n["evictions"],
                     n["checksum_failures"], f"{n['remote_units']} / {n['stage_units']}", n["directory_errors"]])
    text = table(rows, ["NODE", "UNITS", "PINNED", "HIT RATE", "READ", "WRITTEN", "EVICTIONS", "CHECKSUM FAIL",
                        "REMOTE IN / OUT", "DIR ERRORS"])
    # The tiers, where some node has a memory tier: its nodes and the total.
    tiered = [n for n in s["nodes"] if n.get("reachable", True) and (n["memory_slots"] or n["memory_capacity_bytes"])]
    if tiered:
        rows = [[n["node_id"], f"{n['memory_units']} / {n['memory_slots']}", n["memory_hits"], n["storage_hits"],
                 human_bytes(n["memory_bytes_read"]), n["promotions"], n["demotions"], n["flushes"], n["flush_backlog"],
                 n["flush_errors"]] for n in tiered + [dict(s["totals"], node_id="total")]]
        text += "\n\n" + table(rows, ["NODE", "MEMORY UNITS / SLOTS", "MEMORY HITS", "STORAGE HITS", "READ FROM MEMORY",
                                     "PROMOTIONS", "DEMOTIONS", "FLUSHES", "FLUSH BACKLOG", "FLUSH ERRORS"])
    return s, text


def instances_text(o: dict[str, Any]) -> str:
    """A unit's instances per node, each with its tier where known: ``node-a: e0 (both),e1``."""
    tiers = o.get("tiers", {})
    return "; ".join(f"{n}: " + ",".join(f"{i} ({tiers[n][i]})" if i in tiers.get(n, {}) else i for i in inst)
                     for n, inst in o["instances"].items())


def run(a: argparse.Namespace) -> int:
    cfg = _config(a)
    if a.admin_cmd == "serve":
        return serve(cfg, a)
    token = read_token_file(a.token_file) if a.token_file else client_token(cfg)
    c = Client(_url(a, cfg), token, timeout_s=a.timeout)
    if a.admin_cmd == "status":
        body, text = show_status(c)
    elif a.admin_cmd == "stats":
        body, text = show_stats(c)
    elif a.admin_cmd == "objects":
        params: dict[str, Any] = {"limit": a.limit}
        if a.key:
            params["key"] = _keys_arg(a.key)
        else:
            params["prefix"] = (a.prefix or "").lower()
        body = c.call("GET", "/v1/objects", params=params)
        rows = [[o["key"], ",".join(o["nodes"]) or "(nowhere)", instances_text(o), "yes" if o["pinned"] else ""]
                for o in body["objects"]]
        text = table(rows, ["KEY", "NODES", "INSTANCES", "PINNED"]) + ("\n(more match: raise --limit)" if body["truncated"] else "")
    elif a.admin_cmd == "evict":
        params = {"all": "true" if a.all else "false"}
        if a.prefix:
            params["prefix"] = a.prefix.lower()
        if a.node:
            params["node"] = a.node
        body = c.call("DELETE", "/v1/cache", params=params)
        rows = [[n, v["evicted"], v["pinned_kept"], v["unreachable"]] for n, v in sorted(body["nodes"].items())]
        rows.append(["total", body["evicted"], body["pinned_kept"], body["unreachable"]])
        text = table(rows, ["NODE", "EVICTED", "PINNED (KEPT)", "UNREACHABLE"])
    elif a.admin_cmd in ("pin", "unpin"):
        req: dict[str, Any] = {"keys": _keys_arg(a.keys)}
        if a.admin_cmd == "pin":
            req["tier"] = a.tier
        body = c.call("POST" if a.admin_cmd == "pin" else "DELETE", "/v1/pins", json=req)
        rows = [[k, state] for state in body for k in body[state]]
        text = table(rows, ["KEY", "RESULT"])
    elif a.admin_cmd == "drain":
        if a.undo:
            body = c.call("DELETE", node_path(a.node, "/drain"))
        else:
            body = c.call("POST", node_path(a.node, "/drain"), json={"mode": a.mode})
            deadline = time.monotonic() + a.wait
            while body["drain"]["state"] == "draining" and time.monotonic() < deadline:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                body = {"node_id": a.node, "drain": c.call("GET", node_path(a.node))["drain"]}
        d = body["drain"]
        text = table([[body["node_id"], d["state"], d["mode"], d["units_left"], d["replicated_elsewhere"], d["pinned_left"]]],
                     ["NODE", "STATE", "MODE", "UNITS LEFT", "REPLICATED ELSEWHERE", "PINNED LEFT"])
    else:  # argparse keeps this unreachable
        raise SystemExit(2)
    print(json.dumps(body, indent=1) if a.json else text)
    if a.admin_cmd == "drain" and a.wait and not a.undo and body["drain"]["state"] == "draining":
        return EXIT_API_ERROR  # asked to wait, and it did not drain in time
    return 0


def serve(cfg: TuttiConfig, a: argparse.Namespace) -> int:
    from tutti_control.serve import bind, bind_health, cluster_admin

    sock = bind(cfg.admin_host, cfg.admin_port)
    try:
        health_sock = bind_health(cfg)
    except TuttiError:
        sock.close()
        raise
    server, _, health = cluster_admin(cfg, sock, health_sock)
    assert health is not None
    done = threading.Event()
    old = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        health.start()
        server.start()  # in a thread: SIGTERM ends it gracefully here, status 0
        print(f"tutti cluster admin API on http://{server.address} (health: http://{health.address}/livez, /readyz; "
              f"nodes from etcd {','.join(cfg.etcd)}). Ctrl-C stops it.", flush=True)
        while not done.wait(1.0):
            if any(s.thread is not None and not s.thread.is_alive() for s in (server, health)):
                return 1  # uvicorn ended on its own: the log says why
    finally:
        server.stop()
        health.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(prog="tutti admin", description="Tutti admin plane client (and cluster-wide server). Needs "
                     "the admin extra: pip install 'tutti-cluster[admin]'.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    p.add_argument("--url", help="admin API address (default TUTTI_ADMIN_URL, else http://admin_host:admin_port)")
    p.add_argument("--token-file", help="file holding the bearer token (default TUTTI_ADMIN_TOKEN(_FILE), "
                   "else <data_dir>/admin.token)")
    add_config_arguments(p, ["data_dir"], groups=False)
    p.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    sub = p.add_subparsers(dest="admin_cmd", required=True)
    sub.add_parser("status", help="nodes, units, capacity, engines, drain state")
    sub.add_parser("stats", help="hit rate, bytes, evictions, checksum failures, remote fetches; with a memory "
                   "tier, each tier's units, hits, promotions, demotions and flush backlog")
    o = sub.add_parser("objects", help="units by key or key prefix, with their nodes")
    g = o.add_mutually_exclusive_group(required=True)
    g.add_argument("--prefix", help="hex prefix of the 16-digit keys ('' lists all)")
    g.add_argument("--key", action="append", help="a key (repeat for more)")
    o.add_argument("--limit", type=int, default=1000)
    e = sub.add_parser("evict", help="evict units: all, by key prefix, or a node's")
    e.add_argument("--all", action="store_true", help="every unpinned unit")
    e.add_argument("--prefix", help="units whose key starts so (hex)")
    e.add_argument("--node", help="only this node's units")
    for name in ("pin", "unpin"):
        q = sub.add_parser(name, help=f"{name} units (16-digit hex keys)")
        q.add_argument("keys", nargs="+")
        if name == "pin":
            q.add_argument("--tier", choices=["any", "memory"], default="any",
                           help="memory: also keep the units in the memory tier (default any: wherever they lie)")
    d = sub.add_parser("drain", help="stop a node taking new units; evict as --mode says")
    d.add_argument("node")
    d.add_argument("--mode", choices=["replicated", "all", "none"], default="replicated")
    d.add_argument("--wait", type=float, default=0.0, help="seconds to wait until it is drained")
    d.add_argument("--undo", action="store_true", help="end the drain")
    s = sub.add_parser("serve", help="serve the cluster-wide admin API (nodes from the cluster directory)")
    add_config_arguments(s, ["etcd", *ETCD_TLS_FIELDS, "cluster_secret_file", "admin_host", "admin_port",
                             "health_port", "metrics_token_file", "admin_docs"],
                         groups=False)
    return p


def main(argv: list[str]) -> int:
    return run_args(parser().parse_args(argv))


def run_args(a: argparse.Namespace) -> int:
    """``tutti admin`` with its flags parsed: errors are one ``tutti: error:`` line."""
    if a.admin_cmd == "evict" and not (a.all or a.prefix or a.node):
        print("tutti: error: tutti admin evict: say what to evict: --all, --prefix P or --node N", file=sys.stderr)
        return 2
    import httpx  # the admin extra; tutti's cli says so where it is missing

    try:
        return run(a)
    except AdminError as exc:
        print(f"tutti: error: {exc}", file=sys.stderr)
        return EXIT_API_ERROR
    except httpx.HTTPError as exc:
        print(f"tutti: error: cannot reach the admin API at {_url_or_none(a)}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except TuttiError as exc:
        print(f"tutti: error: {exc}", file=sys.stderr)
        return 2


def _url_or_none(a: argparse.Namespace) -> str:
    try:
        return _url(a, _config(a))
    except TuttiError:
        return "(no address)"
