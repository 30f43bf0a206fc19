"""tests/ holds tests: test_*.py, conftest.py and the fixtures a test imports or runs. Measurement
scripts and the GPU host's run scripts live in tools/, the native benchmarks in native/bench/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def test_every_other_file_in_tests_is_used_by_a_test():
    sources = {p: p.read_text() for p in TESTS.glob("*.py") if p.name.startswith("test_") or p.name == "conftest.py"}
    unused = []
    for p in sorted(TESTS.iterdir()):
        if p.is_dir() or p in sources:
            continue
        name = p.stem if p.suffix == ".py" else p.name
        if not any(name in text for q, text in sources.items() if q != p):
            unused.append(p.name)
    assert not unused, f"not a test nor used by one, belongs in tools/: {unused}"


def test_native_benchmarks_are_apart_from_the_native_tests():
    assert not [p.name for p in (ROOT / "native" / "tests").iterdir() if not p.name.startswith("test_")]
