"""flashsac_opt.toolchain: one Triton assembler for a training and the processes it starts."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsac_opt import compile_cache, toolchain
from flashsac_opt.unilab import collector_start

VARIABLE = toolchain.PTXAS_VARIABLE


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    """A torch package at tmp_path/torch whose bin/ptxas the test creates; find_spec("torch") finds it."""
    package = tmp_path / "torch"
    (package / "bin").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "torch":
            return importlib.machinery.ModuleSpec("torch", None, origin=str(package / "__init__.py"))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(toolchain.importlib.util, "find_spec", find_spec)
    monkeypatch.delenv(VARIABLE, raising=False)
    return package


def test_torchs_assembler_is_exported_for_this_process_and_its_children(fake_torch):
    ptxas = fake_torch / "bin" / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    assert toolchain.align_triton_toolchain() == str(ptxas)
    assert os.environ[VARIABLE] == str(ptxas)
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({VARIABLE!r}))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(ptxas)  # a compile-ahead child or collector started later has it


def test_an_explicit_assembler_is_kept(fake_torch, monkeypatch):
    ptxas = fake_torch / "bin" / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setenv(VARIABLE, "/opt/cuda/bin/ptxas")
    assert toolchain.align_triton_toolchain() == "/opt/cuda/bin/ptxas"
    assert os.environ[VARIABLE] == "/opt/cuda/bin/ptxas"


@pytest.mark.parametrize("what", ["missing", "not executable"])
def test_without_an_executable_torch_assembler_nothing_changes(fake_torch, what):
    if what == "not executable":
        (fake_torch / "bin" / "ptxas").write_text("not a program")
        (fake_torch / "bin" / "ptxas").chmod(0o644)
    assert toolchain.align_triton_toolchain() is None
    assert VARIABLE not in os.environ


def test_the_installed_torch_decides(monkeypatch):
    """On this torch: its bin/ptxas when the wheel has one (CUDA builds), else nothing changes."""
    monkeypatch.delenv(VARIABLE, raising=False)
    ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
    expected = str(ptxas) if ptxas.is_file() and os.access(ptxas, os.X_OK) else None
    assert toolchain.align_triton_toolchain() == expected
    assert os.environ.get(VARIABLE) == expected


def test_the_launch_hook_aligns_before_anything_compiles_preload_or_not(fake_torch, monkeypatch):
    ptxas = fake_torch / "bin" / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setenv(collector_start.DISABLE_ENV, "0")  # no server: only the alignment happens
    assert collector_start.start_preload() is False
    assert os.environ[VARIABLE] == str(ptxas)


def test_the_toolchain_module_imports_nothing_heavy():
    """The launch hook runs first thing in UniLab's train script: importing torch there would
    delay the collector's preload server by the whole import."""
    code = "import sys; import flashsac_opt.toolchain, flashsac_opt.unilab.collector_start; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_compile_cache_key_holds_the_assembler(monkeypatch):
    """A file of kernels built with another assembler would load and then miss Triton's cache."""
    args = dict(rows=8, dims={"obs": 6}, config={"learner_mode": "compile"})
    monkeypatch.setenv(VARIABLE, "/a/ptxas")
    first = compile_cache.environment(torch.device("cpu"))
    monkeypatch.setenv(VARIABLE, "/b/ptxas")
    second = compile_cache.environment(torch.device("cpu"))
    assert first["triton_ptxas"] == "/a/ptxas" and second["triton_ptxas"] == "/b/ptxas"
    assert compile_cache.cache_key(first, **args) != compile_cache.cache_key(second, **args)
