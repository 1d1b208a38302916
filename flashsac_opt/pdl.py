"""Programmatic Dependent Launch for Inductor's Triton kernels, every kernel waiting first.

With PDL (Hopper and newer, ``triton.enable_pdl``) a kernel may start while the one before it
drains: its blocks are scheduled early and sit in ``gdc_wait`` (griddepcontrol.wait) until the
previous grid has completed and its writes are visible. That hides the dependent launch
latency of graph mode's captured chain of small kernels. It is only correct if every PDL
kernel waits before its first global memory access (CUDA Programming Guide, "Programmatic
Dependent Launch"; NVIDIA/cccl#9134).

Inductor's codegen (torch 2.11-2.13) waits before a load only when the *scheduler's* previous
node wrote the loaded buffer, and lets every other load run before the wait. That assumes the
previous scheduler node is the kernel launched just before, which breaks for a combo kernel's
sub-kernels (their "previous node" is a sibling inside the same launch), for kernels without
loads (a ``zeros`` fill waits for nothing and may let its successor start before the kernel
two back has finished), and around extern kernels. With Inductor's PDL as the default, two GPU
tests read stale values (results/gpu_tests/gpu_tests_pdl_2026-12-03.json): in-graph replay
sampling 5.5e-4 off (bound 1e-5), the second-stream target branch 0.16 (bound 0.02).

Here every generated Triton kernel (combo kernels included) gets ``gdc_wait`` as its first
statement, so no kernel touches memory before its predecessor has completed: the launch still
overlaps, the early loads do not. Kernels launched without PDL (cuBLAS, ATen) wait for their
predecessor as always, and a second wait is a no-op, so the order of every memory access is
that of an ordinary stream. Triton's own pipelining issue (triton-lang/triton#11905: a load
hoisted above a wait inside a pipelined loop) cannot arise: nothing precedes the wait.

``trigger_first`` also moves the kernel's ``gdc_launch_dependents`` (Inductor places it after the
last load, or after a reduction's loop; kernels without loads have none and trigger at exit)
to just after the wait: the next kernel is launched as soon as every block of this one has
started, so its own launch and block scheduling overlap this kernel's whole body rather than
its tail. It changes no memory order (the next kernel still waits for this one's completion)
and costs SM slots while the next kernel's blocks wait. It is the default: on an H200 beside
UniLab it took 0.972x / 0.982x of the wait-only placement's time at W1 / W2
(results/learner_benchmark/side_by_side_pdl_trigger_first_2026-12-03/).

The codegen hook acts only on compiles whose Inductor config carries ``cache_key()`` (a no-op
post-grad pass whose uuid hashes this file and names the placement), so Inductor's and
AOTAutograd's caches never hand a compile with the hook a kernel generated without it, or with
the other placement.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Callable

import torch

GDC_WAIT = "tl.extra.cuda.gdc_wait()"
GDC_LAUNCH = "tl.extra.cuda.gdc_launch_dependents()"
_INSTALLED_ATTRIBUTE = "_flashsac_opt_pdl_wait_first"


def supported(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.0 or newer (PDL's floor)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def wait_first(source: str, trigger_first: bool = False) -> str:
    """``source`` (one generated Triton kernel module) with ``gdc_wait`` as the kernel's first
    statement; with ``trigger_first`` also ``gdc_launch_dependents`` as its second, and no
    other. Idempotent. Raises ValueError when the module has not exactly one ``@triton.jit``
    function, rather than emit a PDL kernel that might read early.

    Read line by line, not parsed: at codegen time the kernel is still named by Inductor's
    placeholder (``def Placeholder.KERNEL_NAME(...)`` in torch 2.11), which is not Python."""
    lines = source.splitlines(keepends=True)
    decorators = [i for i, line in enumerate(lines) if line.strip().startswith("@triton.jit")]
    signature = decorators[0] + 1 if len(decorators) == 1 else None
    if signature is None or signature >= len(lines) or not lines[signature].startswith("def "):
        raise ValueError(f"expected one @triton.jit function in the generated source, found {len(decorators)}:\n{source[:3000]}")
    end = signature
    while end < len(lines) and not lines[end].rstrip().endswith(":"):  # a signature over several lines
        end += 1
    first = end + 1
    while first < len(lines) and not lines[first].strip():
        first += 1
    indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())] if first < len(lines) else ""
    if not indent:
        raise ValueError(f"no indented body below the @triton.jit signature in the generated source:\n{source[:3000]}")
    head = [indent + GDC_WAIT + "\n"] + ([indent + GDC_LAUNCH + "\n"] if trigger_first else [])
    body = lines[first:]
    if body[0].strip() == GDC_WAIT:  # rewritten before (a trigger after it goes with the others below)
        body = body[1:]
    if trigger_first:
        # a second launch_dependents is harmless but would read as if the trigger came later
        body = [line for line in body if line.strip() != GDC_LAUNCH]
    return "".join(lines[:first] + head + body)


def cache_key(trigger_first: bool = True) -> Any:
    """The one ``CacheKey`` instance of a placement: a post-grad pass that changes nothing. Its
    uuid (this file's hash and the placement) enters Inductor's and AOTAutograd's cache keys,
    and its presence in a compile's config turns the hook on. Built on first use: importing
    Inductor costs ~2 s, which a learner that never compiles should not pay."""
    return _cache_key(bool(trigger_first))  # one instance per placement, however it is asked for


@functools.cache
def _cache_key(trigger_first: bool) -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CacheKey(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return _source_hash() + (TRIGGER_FIRST_SUFFIX if trigger_first else "")

        def __repr__(self) -> str:  # stable across processes: compile_cache's key JSON uses repr
            return f"flashsac_opt.pdl.CacheKey({self.uuid()})"

    return CacheKey()


@functools.cache
def _source_hash() -> str:
    return "flashsac_opt-pdl-wait-first-" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


TRIGGER_FIRST_SUFFIX = "-trigger-first"


def key_placement(value: Any) -> str | None:
    """"wait_first" or "trigger_first" for one of this module's keys (by uuid, not identity: a
    config patch or a deep copy may hold a copy of the pass), None for anything else."""
    uuid = value.uuid() if callable(getattr(value, "uuid", None)) else None
    if uuid == _source_hash():
        return "wait_first"
    if uuid == _source_hash() + TRIGGER_FIRST_SUFFIX:
        return "trigger_first"
    return None


def placement() -> str | None:
    """What the compile in progress wants (read at codegen time): None (no hook), "wait_first"
    or "trigger_first"."""
    config = torch._inductor.config
    return key_placement(config.post_grad_custom_pre_pass) if config.triton.enable_pdl else None


def _wrap(codegen_kernel: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(codegen_kernel)
    def codegen_kernel_waiting_first(self: Any, *args: Any, **kwargs: Any) -> str:
        source = codegen_kernel(self, *args, **kwargs)
        where = placement()
        return source if where is None else wait_first(source, trigger_first=where == "trigger_first")

    setattr(codegen_kernel_waiting_first, _INSTALLED_ATTRIBUTE, True)
    return codegen_kernel_waiting_first


def install() -> None:
    """Wrap the code generation of Inductor's Triton kernels and combo kernels (idempotent).
    Templates are left alone: Inductor never gives them PDL."""
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.triton_combo_kernel import ComboKernel

    for cls in (TritonKernel, ComboKernel):
        current = cls.codegen_kernel
        if not getattr(current, _INSTALLED_ATTRIBUTE, False):
            cls.codegen_kernel = _wrap(current)


def inductor_options(trigger_first: bool = True) -> dict[str, Any]:
    """The Inductor options of wait-first PDL, trigger-first by default (and the hook installed
    for them)."""
    install()
    return {"triton.enable_pdl": True, "post_grad_custom_pre_pass": cache_key(trigger_first)}
