"""Builds and runs the native unit tests (native/tests/test_core.cc) against the CPU core."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_native_unit_tests(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = tmp_path / "build"
    cfg = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), "-DTUTTI_NATIVE_TESTS=ON", "-DTUTTI_CUDA=off",
         "-DCMAKE_BUILD_TYPE=Release", f"-Dpybind11_DIR={_pybind11_dir()}"],
        capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    b = subprocess.run(["cmake", "--build", str(build), "--target", "tutti_native_tests", "-j2"],
                       capture_output=True, text=True)
    assert b.returncode == 0, b.stdout + b.stderr
    r = subprocess.run([str(build / "tutti_native_tests")], capture_output=True, text=True, timeout=120)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failed" in r.stdout


def _pybind11_dir() -> str:
    import pybind11

    return pybind11.get_cmake_dir()
