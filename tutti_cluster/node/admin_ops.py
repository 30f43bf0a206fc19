"""The node daemon's admin operations (the admin plane, docs/ADMIN.md): objects, removals, pins,
drain, and the engines' command channel they go through.

Units belong to the engines' stores (the daemon only reads their pools), so pins and removals are
commands the daemon queues per instance; each engine's :class:`~tutti_cluster.node.link.DaemonLink`
takes them on its command channel (``commands``), applies them to its own store and reports the
results on its next request. An engine that is not connected cannot act: its keys are "unreachable".
:class:`AdminOps` is a part of :class:`~tutti_cluster.node.daemon.NodeDaemon`: it reads the daemon's
index and instances, and owns the command queues, the pins and the drain state.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic_core import from_json

from tutti_cluster.config import TuttiConfig
from tutti_cluster.errors import StorageError
from tutti_cluster.files import MAX_STATE_BYTES, read_bounded, write_atomic
from tutti_cluster.node.handlers import handles
from tutti_cluster.node.pool_view import PoolView
from tutti_cluster.node.protocol import (ADMIN_TIMEOUT_S, COMMAND_KEYS, U64, Command, CommandResult, CommandsReply,
                                         CommandsRequest, ConfigReply, ConfigRequest, DrainReply, DrainRequest,
                                         DrainState, HealthReply,
                                         HealthRequest, ObjectsReply, ObjectsRequest, PinReply, PinRequest,
                                         PinsReply, PinsRequest, PinTier, RemoveUnitsReply, RemoveUnitsRequest,
                                         Reply, UndrainRequest, UnitInfo, UnitTier, UnpinReply, UnpinRequest)

log = logging.getLogger(__name__)

PINS_NAME = "pins.json"
PIN_TIERS: tuple[PinTier, ...] = ("any", "memory")
# How long an objects listing waits for the engines' tiers of its units (then the views' answer).
TIERS_TIMEOUT_S = 2.0


class AdminOps:
    """The admin ops of :class:`~tutti_cluster.node.daemon.NodeDaemon` (see the module docstring)."""

    # The daemon's own, read here (set by NodeDaemon.__init__).
    config: TuttiConfig
    data_dir: Path
    node_id: str
    directory: Any
    _file_gid: int | None
    _lock: threading.RLock
    _instances: dict[str, PoolView]
    _index: dict[int, set[str]]

    if TYPE_CHECKING:
        def _known(self, name: str) -> None: ...

        def _evict(self, name: str, keys: list[int], count: bool = True) -> None: ...

    def _init_admin(self) -> None:
        # Commands wait per instance until its engine takes them on its command channel;
        # ``_waiting`` are the ids an admin op waits for, ``_results`` their answers.
        self._cmd_cv = threading.Condition()  # never taken while holding _lock
        self._commands: dict[str, list[Command]] = {}
        self._waiting: set[int] = set()
        self._results: dict[int, CommandResult] = {}
        self._next_command = 0
        self._engines: dict[str, dict[str, Any]] = {}
        self._pins: dict[int, PinTier] = {}  # key -> the tier it was pinned for
        self._drain: dict[str, Any] | None = None
        self._drain_thread: threading.Thread | None = None
        self._stopping = False

    def _load_pins(self) -> dict[int, PinTier]:
        """``pins.json``: ``{"any": [keys], "memory": [keys]}``, or the list of keys of older
        releases (their tier ``any``)."""
        path = self.data_dir / PINS_NAME
        try:
            data = from_json(read_bounded(path, MAX_STATE_BYTES, what="pins"), allow_inf_nan=False)
            if isinstance(data, list):
                data = {"any": data}
            if not isinstance(data, dict) or not set(data) <= set(PIN_TIERS):
                raise ValueError(f"not a list of unit keys nor an object of {', '.join(PIN_TIERS)}")
            pins: dict[int, PinTier] = {}
            for tier in PIN_TIERS:
                keys = data.get(tier, [])
                if not isinstance(keys, list) or not all(isinstance(k, int) and 0 <= k <= U64 for k in keys):
                    raise ValueError(f"{tier!r} is not a list of unit keys")
                pins.update(dict.fromkeys(keys, tier))
            return pins
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, StorageError) as exc:
            log.warning("pins %s unreadable (%s): starting with no pins", path, exc)
            return {}

    def _save_pins(self) -> None:
        path = self.data_dir / PINS_NAME
        with self._lock:
            data = {t: sorted(k for k, v in self._pins.items() if v == t) for t in PIN_TIERS}
        try:
            write_atomic(path, json.dumps(data).encode(), self._file_gid)  # the old or the new pins, never torn ones
        except OSError as exc:
            log.warning("cannot save pins to %s: %s", path, exc)

    def _engine_live(self, name: str) -> bool:
        """Whether ``name``'s engine polls its command channel (call with _cmd_cv held)."""
        e = self._engines.get(name)
        # A live link polls again as soon as a poll returns: a gap of 3 s means the engine is gone,
        # unless the poll handed it commands; it polls again once it has applied them (the results
        # come with that poll), which may take up to ADMIN_TIMEOUT_S, the wait for those results.
        return e is not None and (e["polling"] > 0 or time.monotonic() - e["seen"] < 3.0
                                  or time.monotonic() < e["applying_until"])

    def _owners_of(self, keys: list[int]) -> dict[str, list[int]]:
        """Local instances holding each key: instance -> its keys, in the order given."""
        out: dict[str, list[int]] = {}
        with self._lock:
            for k in keys:
                for name in sorted(self._index.get(k, ())):
                    out.setdefault(name, []).append(k)
        return out

    def _queue_commands(self, name: str, cmds: list[Command]) -> list[int]:
        """Queue commands for ``name``'s engine (call with _cmd_cv held); their ids."""
        ids = []
        q = self._commands.setdefault(name, [])
        for c in cmds:
            self._next_command += 1
            q.append(c.model_copy(update={"id": self._next_command}))
            ids.append(self._next_command)
        self._cmd_cv.notify_all()
        return ids

    def _run_commands(self, cmds: dict[str, list[Command]],
                      timeout_s: float = ADMIN_TIMEOUT_S) -> dict[str, list[CommandResult | None]]:
        """Send commands to the engines and wait for their results: per instance, one result per
        command, None where its engine is not connected or did not answer within ``timeout_s``
        (a command no engine took by then is withdrawn)."""
        ids: dict[str, list[int]] = {}
        with self._cmd_cv:
            for name, lst in cmds.items():
                if lst and self._engine_live(name):
                    ids[name] = self._queue_commands(name, lst)
            want = {i for lst in ids.values() for i in lst}
            self._waiting |= want
            self._cmd_cv.wait_for(lambda: want <= self._results.keys() or self._stopping, timeout_s)
            out: dict[str, list[CommandResult | None]] = {}
            for name, lst in cmds.items():
                got = ids.get(name)
                out[name] = [self._results.pop(i, None) for i in got] if got else [None] * len(lst)
            self._waiting -= want
            for name in ids:
                if self._commands.get(name):
                    self._commands[name] = [c for c in self._commands[name] if c.id not in want]
        return out

    @handles(CommandsRequest)
    def _commands_op(self, req: CommandsRequest) -> Reply:
        self._known(req.instance)
        name, now = req.instance, time.monotonic()
        sync: list[Command] | None = None
        with self._cmd_cv:
            e = self._engines.setdefault(name, {"seen": now, "polling": 0, "synced": False, "stats": None,
                                                "base": None, "rates": {}, "cluster": None, "queued": 0,
                                                "applying_until": 0.0})
            synced = e["synced"]
        if not synced:
            sync = self._sync_commands(name)  # reads _lock: not under _cmd_cv
        with self._cmd_cv:
            if req.stats is not None:
                self._rate(e, dict(req.stats), now)
            if req.cluster is not None:
                e["cluster"] = dict(req.cluster)
            e["queued"], e["seen"] = req.queued, now
            for r in req.results:
                if r.id in self._waiting:
                    self._results[r.id] = r
            if req.results:
                self._cmd_cv.notify_all()
            if sync is not None and not e["synced"]:
                e["synced"] = True
                self._queue_commands(name, sync)  # nobody waits for these results
            e["polling"] += 1
            try:
                self._cmd_cv.wait_for(lambda: bool(self._commands.get(name)) or self._stopping, req.wait_ms / 1000)
            finally:
                e["polling"] -= 1
            cmds = self._commands.pop(name, [])
            e["seen"] = time.monotonic()
            e["applying_until"] = e["seen"] + ADMIN_TIMEOUT_S if cmds else 0.0
        return CommandsReply(commands=cmds)

    def _sync_commands(self, name: str) -> list[Command]:
        """What a newly connected engine must apply: the pins of its units (memory pins bring their
        units into its memory tier again), the drain state."""
        with self._lock:
            pinned = {t: [k for k in sorted(self._pins) if self._pins[k] == t and name in self._index.get(k, ())]
                      for t in PIN_TIERS}
            draining = self._drain is not None
        cmds = [self._pin_command(ks[i:i + COMMAND_KEYS], t) for t, ks in pinned.items()
                for i in range(0, len(ks), COMMAND_KEYS)]
        return cmds + [Command(cmd="drain", on=draining)]

    @staticmethod
    def _pin_command(keys: list[int], tier: PinTier) -> Command:
        return Command(cmd="pin", keys=keys, memory=True) if tier == "memory" else Command(cmd="pin", keys=keys)

    @staticmethod
    def _rate(e: dict[str, Any], stats: dict[str, Any], now: float) -> None:
        """Read and write bandwidth over the last >= 1 s between two reports of an engine."""
        e["stats"] = stats
        base = e["base"]
        if base is None:
            e["base"] = (now, stats)
            return
        t0, s0 = base
        if now - t0 >= 1.0:
            dt = now - t0
            e["rates"] = {f"{k}_bytes_per_s": max(0, int(stats.get(f, 0)) - int(s0.get(f, 0))) / dt
                          for k, f in (("read", "bytes_read"), ("write", "bytes_written"))}
            e["base"] = (now, stats)

    @handles(ConfigRequest)
    def _config_op(self, req: ConfigRequest) -> Reply:
        return ConfigReply(node_id=self.node_id, config=self.config.model_dump(mode="json"))  # secrets come out masked

    @handles(HealthRequest)
    def _health_op(self, req: HealthRequest) -> Reply:
        etcd = None
        if self.directory is not None:
            try:
                self.directory.client.count_prefix(b"tutti/n/")
                etcd = True
            except Exception as exc:  # any etcd or channel failure: not ready
                log.debug("etcd health check failed: %s", exc)
                etcd = False
        return HealthReply(node_id=self.node_id, cluster_mode=self.config.cluster_mode, etcd=etcd)

    @staticmethod
    def _prefix_range(prefix: str) -> tuple[int, int]:
        shift = 4 * (16 - len(prefix))
        lo = int(prefix, 16) << shift if prefix else 0
        return lo, lo + (1 << shift)

    @handles(ObjectsRequest)
    def _objects_op(self, req: ObjectsRequest) -> Reply:
        with self._lock:
            if req.keys is not None:
                keys = list(dict.fromkeys(req.keys))
            else:
                lo, hi = self._prefix_range(req.prefix or "")
                keys = sorted(k for k in self._index if lo <= k < hi)
            truncated = len(keys) > req.limit
            keys = keys[:req.limit]
            held = [(k, sorted(self._index.get(k, ())), k in self._pins) for k in keys]
        tiers = self._tiers(self._owners_of(keys))
        remote: list[list[str]] = []
        if self.directory is not None and keys:
            remote = list(self.directory.lookup(keys, prefix=False))
        remote += [[] for _ in range(len(keys) - len(remote))]  # a failed lookup answers fewer keys
        objs = [UnitInfo(key=k, instances=inst, pinned=pinned, remote=owners,
                         tiers={n: tiers[n][k] for n in inst if tiers.get(n, {}).get(k)})
                for (k, inst, pinned), owners in zip(held, remote)]
        return ObjectsReply(node_id=self.node_id, objects=objs, truncated=truncated)

    def _tiers(self, by_inst: dict[str, list[int]]) -> dict[str, dict[int, UnitTier]]:
        """Where each instance's keys lie: asked of its engine (one ``tiers`` command), at once
        ``storage`` where the engine's last report shows no memory tier; for an engine that is gone
        or does not answer within TIERS_TIMEOUT_S, as the daemon's view of its pools found them at
        its last rescan ("": committed since, not known)."""
        out: dict[str, dict[int, UnitTier]] = {}
        ask: dict[str, list[list[int]]] = {}
        with self._cmd_cv:
            for name, ks in by_inst.items():
                stats = (self._engines.get(name) or {}).get("stats")
                if stats is not None and not stats.get("memory_slots"):
                    out[name] = dict.fromkeys(ks, "storage")
                else:
                    ask[name] = [ks[i:i + COMMAND_KEYS] for i in range(0, len(ks), COMMAND_KEYS)]
        results = self._run_commands({n: [Command(cmd="tiers", keys=c) for c in cs] for n, cs in ask.items()},
                                     timeout_s=TIERS_TIMEOUT_S)
        for name, chunks in ask.items():
            got: dict[int, UnitTier] = {}
            for chunk, r in zip(chunks, results[name]):
                if r is None or r.error or len(r.tiers) != len(chunk):
                    with self._lock:
                        view = self._instances.get(name)
                    got.update(zip(chunk, view.unit_tiers(chunk) if view is not None else []))
                else:
                    got.update(zip(chunk, r.tiers))
            out[name] = got
        return out

    @handles(RemoveUnitsRequest)
    def _remove_units_op(self, req: RemoveUnitsRequest) -> Reply:
        with self._lock:
            if req.keys is not None:
                keys = [k for k in dict.fromkeys(req.keys) if k in self._index]
            elif req.prefix is not None:
                lo, hi = self._prefix_range(req.prefix)
                keys = [k for k in self._index if lo <= k < hi]
            else:
                keys = list(self._index)
        evicted, kept, unreachable = self._remove(keys)
        return RemoveUnitsReply(evicted=evicted, pinned_kept=kept, unreachable=unreachable)

    def _remove(self, keys: list[int]) -> tuple[int, int, int]:
        """Evict ``keys`` from every local store holding them, pinned ones excepted: (evicted, kept
        because pinned, left because their engine did not answer)."""
        with self._lock:
            kept = {k for k in keys if k in self._pins}
        todo = [k for k in keys if k not in kept]
        by_inst = self._owners_of(todo)
        chunks = {n: [ks[i:i + COMMAND_KEYS] for i in range(0, len(ks), COMMAND_KEYS)] for n, ks in by_inst.items()}
        cmds = {n: [Command(cmd="remove", keys=c) for c in cs] for n, cs in chunks.items()}
        unreachable: set[int] = set()
        for name, results in self._run_commands(cmds).items():
            for chunk, r in zip(chunks[name], results):
                if r is None or r.error:
                    unreachable.update(chunk)
                    continue
                kept.update(r.skipped)
                # Gone from the store (or already absent: our index was behind): gone from the index
                # now, before the engine's own eviction notice arrives.
                self._evict(name, [*r.done, *r.absent], count=False)
        return len([k for k in todo if k not in unreachable and k not in kept]), len(kept), len(unreachable - kept)

    def _key_command(self, cmd: Command, keys: list[int]) -> tuple[set[int], set[int], set[int]]:
        """Sends ``cmd`` for ``keys`` to each engine owning some of them: (keys it did, keys whose
        engine did not answer or refused, keys it skipped)."""
        by_inst = self._owners_of(keys)
        results = self._run_commands({n: [cmd.model_copy(update={"keys": ks})] for n, ks in by_inst.items()})
        done: set[int] = set()
        unreachable: set[int] = set()
        skipped: set[int] = set()
        for name, ks in by_inst.items():
            r = results[name][0]
            if r is None or r.error:
                unreachable.update(ks)
            else:
                done.update(r.done)
                skipped.update(r.skipped)
        return done, unreachable, skipped

    @handles(PinRequest)
    def _pin_op(self, req: PinRequest) -> Reply:
        """Pins ``keys`` in every engine holding them and records each pin's tier (a key pinned
        again takes the new tier)."""
        keys = list(dict.fromkeys(req.keys))
        pinned, unreachable, no_memory = self._key_command(self._pin_command([], req.tier), keys)
        unreachable -= pinned  # pinned where its engine answered; the others follow when they connect
        if pinned:
            with self._lock:
                self._pins.update(dict.fromkeys(pinned, req.tier))
            self._save_pins()
        return PinReply(pinned=[k for k in keys if k in pinned], unreachable=[k for k in keys if k in unreachable],
                        absent=[k for k in keys if k not in pinned and k not in unreachable],
                        no_memory_tier=[k for k in keys if k in no_memory and k in pinned])

    @handles(UnpinRequest)
    def _unpin_op(self, req: UnpinRequest) -> Reply:
        keys = list(dict.fromkeys(req.keys))
        done, unreachable, _ = self._key_command(Command(cmd="unpin"), keys)
        with self._lock:
            was = self._pins.keys() & set(keys)
            for k in set(keys) - unreachable:  # a pin whose engine is away stays recorded
                self._pins.pop(k, None)
        if was:
            self._save_pins()
        unpinned = (was | done) - unreachable
        return UnpinReply(unpinned=[k for k in keys if k in unpinned], unreachable=[k for k in keys if k in unreachable],
                          not_pinned=[k for k in keys if k not in unpinned and k not in unreachable])

    @handles(PinsRequest)
    def _pins_op(self, req: PinsRequest) -> Reply:
        with self._lock:
            return PinsReply(keys=sorted(self._pins), memory=sorted(k for k, t in self._pins.items() if t == "memory"))

    @handles(DrainRequest)
    def _drain_op(self, req: DrainRequest) -> Reply:
        """Drain: no new instances, every engine removes the units it commits from now on (so the
        node takes no new units) and keeps serving reads. ``replicated`` evicts each unit once
        another node holds it (checked now and every 2 s), ``all`` evicts every unpinned unit, ``none``
        evicts nothing. Drained when no unit is left."""
        with self._lock:
            if self._drain is None:
                self._drain = {"mode": req.mode, "started_at": time.time(), "replicated_elsewhere": None}
            else:
                self._drain["mode"] = req.mode
            names = list(self._instances)
        with self._cmd_cv:
            live = [n for n in names if self._engine_live(n)]
        self._run_commands({n: [Command(cmd="drain", on=True)] for n in live})
        self._drain_step()
        if self._drain_thread is None or not self._drain_thread.is_alive():
            self._drain_thread = threading.Thread(target=self._drain_loop, name="tutti-drain", daemon=True)
            self._drain_thread.start()
        return DrainReply(drain=self.drain_status())

    @handles(UndrainRequest)
    def _undrain_op(self, req: UndrainRequest) -> Reply:
        with self._lock:
            self._drain = None
            names = list(self._instances)
        with self._cmd_cv:
            live = [n for n in names if self._engine_live(n)]
        self._run_commands({n: [Command(cmd="drain", on=False)] for n in live})
        return DrainReply(drain=self.drain_status())

    def _drain_step(self) -> None:
        with self._lock:
            d = self._drain
            keys = list(self._index)
            unpinned = [k for k in keys if k not in self._pins]
        if d is None:
            return
        if d["mode"] == "all":
            self._remove(unpinned)
        elif self.directory is not None:
            owners = self.directory.lookup(keys, prefix=False) if keys else []
            elsewhere = [k for k, o in zip(keys, owners) if o]
            if d["mode"] == "replicated":
                self._remove(elsewhere)  # pinned ones stay
            with self._lock:
                if self._drain is d:  # of the units left, those another node holds too
                    d["replicated_elsewhere"] = sum(1 for k in elsewhere if k in self._index)

    def _drain_loop(self) -> None:
        while True:
            with self._cmd_cv:
                self._cmd_cv.wait_for(lambda: self._stopping, 2.0)
                if self._stopping:
                    return
            with self._lock:
                if self._drain is None:
                    return
            try:
                self._drain_step()
            except Exception:  # keep draining; the next step tries again
                log.exception("drain step failed")

    def drain_status(self) -> DrainState:
        with self._lock:
            d = self._drain
            units = len(self._index)
            pinned = len(self._pins.keys() & self._index.keys())
        if d is None:
            return DrainState(state="serving", mode=None, units_left=units, replicated_elsewhere=None,
                              pinned_left=pinned, started_at=None)
        return DrainState(state="drained" if units == 0 else "draining", mode=d["mode"], units_left=units,
                          replicated_elsewhere=d["replicated_elsewhere"], pinned_left=pinned,
                          started_at=d["started_at"])

