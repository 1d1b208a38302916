"""Fused update steps compiled once and saved whole (Dynamo's AOT precompile), loaded in about
a second by every later process that needs them.

A warm start's torch.compile finds every graph and kernel in the caches and still re-runs
Dynamo's bytecode tracing and AOTAutograd at each launch: 5.4-6.1 s of the H200's warm start
(results/time_to_reward/protocol_u64_mps_2026-12-05), and it delays the collector's
learning_starts. ``torch.compile(fn).aot_compile(example)`` compiles for that example's guards
and ``save_compiled_function`` writes the result; ``torch.compiler.load_compiled_function``
gives it back with no tracing. On the CPU at W1's shapes, loading both steps and their first
calls took 1.34 s against 6.97 s for the warm torch.compile, bit-identical
(results/startup/aot_precompile_cpu_2026-12-05/aot_precompile_real.json, ``summary``).

What that costs, and how ``PrecompiledStep`` pays it:
- A loaded function never recompiles: a call its guards refuse raises. A step takes constant
  arguments (the critic's ``polyak`` flag), so each combination has its own file, and a call
  the guards still refuse (another shape, dtype or global state) falls back to the engine's
  torch.compile for that combination, with one warning.
- aot_compile neither reads nor writes Inductor's FX-graph cache: the file is the cache. A
  process without the file compiles with aot_compile (a cold compile's work, kernels still go
  through Inductor's caches) and writes it: the compile-ahead children for the training
  process, a first run for the next one.
- Loading installs guards into the current TracingContext, hence a throw-away one around it.
- Nor do the guards look at source code: a file saved before an edit of the step's code would
  run the old code. The file records every traced function's source lines and their digest;
  one that no longer matches the module on disk is compiled and saved again (the check torch's
  own compile packages make).

Files: ``<compile_cache.default_dir()>/<key>.steps/<network>[-<constant>...].bin``, ``key`` the
engine's compile-cache key without the schedule (a step's code does not depend on it, and the
children and the training process must name the same files). They hold generated code, like
the compile-cache file: only use a directory you trust. ``FlashSACConfig.precompiled_steps`` is off for
the library; UniLab runs on CUDA turn it on (unilab/adapter.py ``unilab_precompiled_steps``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch._functorch.config  # noqa: F401  (patched around aot_compile; not imported by torch itself)

from flashsac_opt import gemm_templates

SUFFIX = ".bin"
# torch's message when a loaded function's guards refuse a call (torch 2.11 and 2.13)
GUARD_FAILURE = "GuardManager check failed"


def folder(key: str) -> Path:
    """Where the steps compiled under the compile-cache key ``key`` are saved."""
    from flashsac_opt import compile_cache

    return compile_cache.default_dir() / f"{key}.steps"


def stem(network: str, constants: Iterable[Any]) -> str:
    return "-".join([network, *map(str, constants)])


def ready(where: Path, networks: Iterable[str]) -> bool:
    """Whether ``where`` holds a saved step for every one of ``networks``."""
    return all((where / f"{name}{SUFFIX}").is_file() or any(where.glob(f"{name}-*{SUFFIX}")) for name in networks)


def aot_enabled():
    """Dynamo's AOT-compile switch, on: torch 2.13 has it on by default, torch 2.11 off, and
    there ``torch.compile(fn)`` has no ``aot_compile`` at all (every step fell back to
    torch.compile on the H100 under torch 2.11 until this was set)."""
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(enable_aot_compile=True)


def load(file: Path) -> Callable:
    """The compiled function saved in ``file`` (its first argument is the step's owner)."""
    with open(file, "rb") as fh, aot_enabled(), torch._guards.tracing(torch._guards.TracingContext(None)):
        return torch.compiler.load_compiled_function(fh)


def stale_sources(compiled: Any) -> list[str]:
    """The traced functions (``module:first-last``) whose source lines differ from what
    ``compiled`` was compiled from; every one when the file records none it can be checked by."""
    info = getattr(compiled, "source_info", None)
    sources = info().inlined_sources if info is not None else None
    if not sources:
        return ["<no source record>"]
    stale = []
    for code in sources:
        try:
            lines = inspect.getsourcelines(importlib.import_module(code.module))[0][code.firstlineno - 1 : code.lastlineno - 1]
        except (ImportError, OSError, TypeError):
            lines = None
        if lines is None or hashlib.sha256("".join(lines).encode()).hexdigest() != code.checksum:
            stale.append(f"{code.module}:{code.firstlineno}-{code.lastlineno}")
    return sorted(stale)


class PrecompiledStep:
    """The bound method ``fn`` (a fused step), compiled per combination of its constant
    arguments: loaded from ``where`` when saved there, else aot-compiled and saved; where
    neither works, ``compile_fallback()`` (the engine's torch.compile of ``fn``).
    ``compile_kwargs``: torch.compile's backend and options; ``settings``: AOTAutograd's
    config for the compile. Called as the engine calls a fused step (under no_grad)."""

    def __init__(self, fn: Callable, network: str, where: Path, compile_fallback: Callable[[], Callable],
                 compile_kwargs: Mapping[str, Any], settings: Mapping[str, Any] | None = None):
        if getattr(fn, "__self__", None) is None:
            raise TypeError(f"PrecompiledStep needs a bound method (its owner is the saved function's first argument), got {fn!r}")
        self.fn, self.network, self.where = fn, network, Path(where)
        self._compile_fallback, self._fallback = compile_fallback, None
        self._compile_kwargs, self._settings = dict(compile_kwargs), dict(settings or {})
        self._by_constants: dict[tuple, Callable] = {}
        # file stems, for the start-up report and tests
        self.loaded: list[str] = []
        self.saved: list[str] = []
        self.fell_back: list[str] = []
        self.stale: list[str] = []  # files compiled from source since edited

    def __call__(self, *args: Any) -> Any:
        constants = tuple(a for a in args if not isinstance(a, (torch.Tensor, Mapping)))
        step = self._by_constants.get(constants)
        if step is None:
            step = self._by_constants[constants] = self._obtain(constants, args)
        try:
            return step(*args)
        except RuntimeError as exc:  # the guards run before any of the step's work
            if GUARD_FAILURE not in str(exc) or step is self._fallback:
                raise
            self._fall_back(constants, f"its guards refused the call ({str(exc).splitlines()[-1].strip()[:200]})")
            return self._by_constants[constants](*args)

    def _fall_back(self, constants: tuple, why: str) -> None:
        name = stem(self.network, constants)
        warnings.warn(f"precompiled step {name} in {self.where}: {why}; compiling it with torch.compile instead", stacklevel=4)
        if self._fallback is None:
            self._fallback = self._compile_fallback()
        self._by_constants[constants] = self._fallback
        self.fell_back.append(name)

    def _obtain(self, constants: tuple, args: tuple) -> Callable:
        name = stem(self.network, constants)
        file = self.where / f"{name}{SUFFIX}"
        if file.is_file():
            try:
                compiled = load(file)
                stale = stale_sources(compiled)
            except Exception as exc:  # noqa: BLE001  a corrupt or foreign file must not stop training
                warnings.warn(f"precompiled step {file} could not be loaded ({type(exc).__name__}: {exc}); compiling and rewriting it",
                              stacklevel=4)
            else:
                if not stale:
                    self.loaded.append(name)
                    return functools.partial(compiled, self.fn.__self__)
                warnings.warn(f"precompiled step {file} was compiled from other source ({', '.join(stale[:3])}); compiling and rewriting it",
                              stacklevel=4)
                self.stale.append(name)
        try:
            with aot_enabled(), torch._functorch.config.patch(**self._settings), \
                    gemm_templates.choices_context(self._compile_kwargs.get("options")):
                compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, **self._compile_kwargs).aot_compile((args, {}))
        except Exception as exc:  # noqa: BLE001  e.g. a backend whose output cannot be saved
            self._fall_back(constants, f"aot_compile failed ({type(exc).__name__}: {str(exc)[:200]})")
            return self._by_constants[constants]
        tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")  # readers never see half a file
        try:
            self.where.mkdir(parents=True, exist_ok=True)
            with aot_enabled():
                compiled.save_compiled_function(str(tmp))
            os.replace(tmp, file)
        except Exception as exc:  # noqa: BLE001  not saved: this process runs it all the same
            tmp.unlink(missing_ok=True)
            warnings.warn(f"precompiled step {file} could not be saved ({type(exc).__name__}: {exc})", stacklevel=4)
        else:
            self.saved.append(name)
        return functools.partial(compiled, self.fn.__self__)
