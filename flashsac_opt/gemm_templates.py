"""The learner's GEMMs as Inductor's own Triton templates with one fixed configuration each.

Issue 45 item 1 asks for GEMMs whose neighbours (the cast before, the residual or bias after,
BatchNorm's apply and ReLU feeding the next GEMM) run inside the GEMM's kernel. Inductor does
that itself once a GEMM is one of its Triton templates (epilogue and prologue fusion); what ruled
its templates out was the start-up: autotuning benchmarks dozens of configurations per GEMM shape
and every fused epilogue, ~10x graph mode's cold compile (results/learner_benchmark/
studies_2026-12-03). Here every GEMM gets exactly one configuration from the size rule below,
chosen without benchmarking; with a single choice Inductor skips autotuning altogether
(select_algorithm: one choice is returned as is), so the cold start pays only the Triton compile
of the fused kernels.

Installed through Inductor's ``inductor_choices_class`` option (``choices_class()``; its
``uuid`` enters Inductor's cache key, so a change of the rule recompiles). CUDA only: on other
devices the class defers to Inductor's own choices. ``FlashSACConfig.triton_gemm_table`` turns it
on for the compiled modes (off until measured; study ``ours_graph_triton_gemm_table``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch

# The rule's version: part of the cache key (FixedGemmBehaviour.uuid). Bump it with any change below.
TABLE_VERSION = 1
SMS_HOPPER = 132  # H100 / H200 SXM streaming multiprocessors: the rule aims at half a wave or more
# op name (Inductor's lowering) -> the uid of the plain Triton template that serves it
TEMPLATES = {"mm": "triton::mm", "addmm": "triton::mm", "bmm": "triton::bmm", "baddbmm": "triton::bmm"}


def gemm_config(batch: int, m: int, n: int, k: int) -> dict[str, int]:
    """One Triton GEMM configuration for a (batch x) m x k @ k x n product.

    The learner's GEMMs at B <= 1024 are small (2 members x 512 rows x 256-1024 columns at W1), so
    the rule trades tile size for parallelism: 64 x 64 output tiles where they make at least half a
    wave of thread blocks, else 32 x 64, else 32 x 32; K in steps of 64 (32 for a short K, whose
    one or two steps the wider step would mostly mask). Two pipeline stages for K loops of at most
    two steps (nothing to overlap), three otherwise; four warps (16 x 16 per warp of a 64 x 64 tile).
    """
    if min(batch, m, n, k) < 1:
        raise ValueError(f"gemm_config: sizes must be >= 1, got batch={batch} m={m} n={n} k={k}")

    def blocks(bm: int, bn: int) -> int:
        return batch * -(-m // bm) * -(-n // bn)

    block_m, block_n = next(((bm, bn) for bm, bn in ((64, 64), (32, 64), (32, 32)) if blocks(bm, bn) >= SMS_HOPPER // 2), (32, 32))
    block_k = 64 if k > 32 else 32
    steps = -(-k // block_k)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8,
            "num_stages": 2 if steps <= 2 else 3, "num_warps": 4}


@functools.cache
def choices_class() -> type:
    """``FixedGemmChoices``, defined at first use: importing Inductor's choices costs seconds
    (~4.5 s on a CI core), which every process that imports the engine would otherwise pay."""
    from torch._inductor.choices import InductorChoices

    class FixedGemmChoices(FixedGemmBehaviour, InductorChoices):
        """Inductor's choices with every CUDA mm / addmm / bmm / baddbmm served by its Triton
        template at ``gemm_config``'s configuration, and nothing else to choose from."""

    # pickled by reference as this module's FixedGemmChoices (the module __getattr__ below)
    FixedGemmChoices.__module__, FixedGemmChoices.__qualname__ = __name__, "FixedGemmChoices"
    return FixedGemmChoices


def __getattr__(name: str) -> Any:
    if name == "FixedGemmChoices":
        return choices_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FixedGemmBehaviour:
    """What ``choices_class()`` changes in Inductor's InductorChoices (mixed in before it)."""

    def uuid(self) -> str:  # Inductor's cache key for a custom choices class
        return f"flashsac_opt.gemm_templates.FixedGemmChoices/{TABLE_VERSION}"

    def _finalize_template_configs(self, template_choices, kernel_inputs, templates, op_name, kwarg_overrides=None):
        fixed = self._fixed_choice(kernel_inputs, templates, op_name)
        if fixed is None:
            return super()._finalize_template_configs(template_choices, kernel_inputs, templates, op_name, kwarg_overrides)
        return [fixed]

    def _fixed_choice(self, kernel_inputs: Any, templates: list[Any], op_name: str) -> Any | None:
        uid = TEMPLATES.get(op_name)
        template = next((t for t in templates if getattr(t, "uid", None) == uid), None)
        if template is None or kernel_inputs.device_type != "cuda":
            return None  # not a plain GEMM, or its Triton template is not among the backends
        from torch._inductor.kernel_template_choice import KernelTemplateChoice
        from torch._inductor.template_heuristics.params import DictKernelTemplateParams

        base = next(iter(self.get_ktc(kernel_inputs, template, op_name)), None)
        if base is None:  # the template's heuristic refused these inputs (dtype, layout)
            return None
        m, n, k = kernel_inputs.mnk_hinted()
        batch = kernel_inputs.batch_hinted() if op_name in ("bmm", "baddbmm") else 1
        chosen = gemm_config(batch, m, n, k)
        # The heuristic's kwargs carry what the template derives from the inputs (ACC_TYPE,
        # ALLOW_TF32, the addmm epilogue's arguments); EVEN_K depends on BLOCK_K, so it is
        # recomputed for the chosen one (a wrong True would read past K unmasked).
        params = {**base.params.to_kwargs(), **chosen, "EVEN_K": k % chosen["BLOCK_K"] == 0}
        return KernelTemplateChoice(template=base.template, params=DictKernelTemplateParams(params),
                                    extra_kwargs=base.extra_kwargs, layout=base.layout, inputs=base.inputs)


def inductor_options() -> dict[str, Any]:
    """The Inductor options that put every GEMM on its Triton template at the fixed configuration."""
    return {
        "max_autotune_gemm": True,
        # ATen stays a backend for what no Triton template serves (the choices class then keeps
        # Inductor's own choice); where the template serves, the class drops the ATen choice.
        "max_autotune_gemm_backends": "ATEN,TRITON",
        "inductor_choices_class": choices_class(),
        # The templates mask ragged edges themselves: padding the operands (graph mode's default,
        # for cuBLAS's sake) would only add copy kernels.
        "force_shape_pad": False,
    }


def choices_context(options: Mapping[str, Any] | None) -> contextlib.AbstractContextManager:
    """Around a compile with ``options``: their ``inductor_choices_class`` as this thread's
    choices. Inductor builds a thread's choices object from the config once, at its first
    compile, and keeps it: an option given to a later compile in the same thread (the learner's,
    after UniLab's or another learner's) would otherwise not be seen."""
    factory = (options or {}).get("inductor_choices_class")
    if factory is None:
        return contextlib.nullcontext()
    from torch._inductor.virtualized import V

    return V.set_choices_handler(factory())


def require(device: torch.device) -> None:
    """A clear error where this torch lacks the hook the table needs, before any compile."""
    import importlib.util

    from torch._inductor.choices import InductorChoices

    missing = [] if hasattr(InductorChoices, "_finalize_template_configs") else ["InductorChoices._finalize_template_configs"]
    missing += [m for m in ("torch._inductor.kernel_template_choice", "torch._inductor.template_heuristics.params")
                if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"triton_gemm_table needs Inductor's {', '.join(missing)} (torch {torch.__version__} lacks it)")
    if device.type != "cuda":
        raise ValueError(f"triton_gemm_table applies to CUDA learners (Inductor's Triton GEMM templates), got {device}")
