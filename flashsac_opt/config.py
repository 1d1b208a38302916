"""FlashSAC configuration in two groups: UniLab's hyperparameters and flashsac_opt's engine options.

``UniLabHyperparameters``: field names are the keys of ``algo`` / ``algo.algo_params`` in
UniLab 1.5.2's ``conf/flashsac/config.yaml`` (plus ``training.use_amp``); defaults are that
file's values. ``EngineOptions``: how flashsac_opt runs the same mathematics (mode, compiler,
caches); patch 0001 adds the UniLab-facing ones to UniLab's config. ``FlashSACConfig`` is both,
flat, so a UniLab run configuration and a flashsac_opt one are the same object:
``from_unilab`` accepts the YAML file, a composed Hydra/omegaconf config or a plain mapping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from flashsac_opt.engine import check_mode, is_compiled


@dataclass
class UniLabHyperparameters:
    """UniLab's FlashSAC hyperparameters, names and defaults as in its config.yaml."""

    # algo.*
    num_envs: int = 1024
    batch_size: int = 2048
    replay_buffer_n: int = 512
    updates_per_step: int = 2
    learning_starts: int = 98
    policy_frequency: int = 2
    policy_before_critic: bool = False
    target_frequency: int = 1
    max_iterations: int = 5000
    gamma: float = 0.97
    tau: float = 0.01
    actor_lr: float = 3.0e-4
    critic_lr: float = 3.0e-4
    actor_hidden_dim: int = 128
    critic_hidden_dim: int = 256
    num_atoms: int = 101
    obs_normalization: bool = False
    # algo.algo_params.*
    normalize_reward: bool = True
    normalized_g_max: float = 5.0
    actor_num_blocks: int = 2
    critic_num_blocks: int = 2
    actor_bc_alpha: float = 0.0
    actor_noise_zeta_mu: float = 2.0
    actor_noise_zeta_max: int = 16
    critic_min_v: float = -5.0
    critic_max_v: float = 5.0
    temp_initial_value: float = 0.01
    temp_target_sigma: float = 0.15
    temp_target_entropy: float | None = None
    learning_rate_init: float = 3.0e-4
    learning_rate_peak: float = 3.0e-4
    learning_rate_end: float = 1.5e-4
    learning_rate_warmup_steps: int = 0
    learning_rate_decay_steps: int = 500000
    n_step: int = 1
    amp_dtype: str = "auto"
    # training.use_amp
    use_amp: bool = True


@dataclass
class EngineOptions:
    """How flashsac_opt runs the update (engine.py); none of these changes the mathematics."""

    # eager | compile | graph (engine.py says what each runs); patch 0001 adds it to UniLab's config.
    learner_mode: str = "eager"
    # torch.compile backend for the compiled modes ("inductor"; "aot_eager" for debugging)
    compile_backend: str = "inductor"
    # Extra Inductor options for the compiled modes, over flashsac_opt's defaults
    # (engine.inductor_options: graph mode on CUDA turns on combo_kernels).
    # {"coordinate_descent_tuning": True} tunes launch configs for minutes of compile (0.96x);
    # {"aggressive_fusion": True} measured 0.97-1.02x (results/learner_benchmark/benchmark_learner_study_W1_W3.json).
    inductor_options: dict | None = None
    # File of torch.compile's portable cache artifacts ("mega-cache"): loaded before the
    # first compile when it exists, written after the first compiled iteration when it does
    # not. A fresh machine (same GPU kind, torch and triton) then skips Inductor's code
    # generation and Triton compilation. "auto": the file named by a key over GPU, versions,
    # dims, per-update rows and this config in $FLASHSAC_OPT_CACHE_DIR or
    # ~/.cache/flashsac_opt (compile_cache.py; `flashsac-opt precompile` fills it). None: no
    # file. Off by default: Inductor's own on-disk caches already warm a second run on the
    # same machine, and a default file would make every run load generated code from the
    # home directory, cold-start measurements included. It holds generated code: only
    # point it at files you trust. Eager mode ignores it.
    compile_cache_file: str | None = None
    # Save the fused update steps whole after their first compile and load them in later
    # processes (precompiled.py: Dynamo's AOT precompile, next to the compile-cache file):
    # no tracing at a warm start, and the compile-ahead children hand them to the training
    # process. Inductor without its CUDA graphs only (graph mode; compile mode on the CPU).
    # Off for the library; under UniLab on for a learner on CUDA unless FLASHSAC_OPT_PRECOMPILED_STEPS=0
    # (results/time_to_reward/protocol_u64_mps_precompiled_h100_2026-12-06: both steps loaded in every seed).
    precompiled_steps: bool = False
    # One compile boundary per network update: forward, backward (torch.func), finite
    # guard, Adam, renormalization and commits in one graph. False: loss and step compiled
    # apart (autograd between). None: fused when the first batch has at most
    # engine.FUSED_UPDATE_MAX_BATCH rows per update. Applies to the compiled modes; eager and
    # data parallel run the split form.
    # Measured on the H200 (FLASH_SAC_OPTIMIZATION.md): fused is faster at batch 256 (fewer
    # kernels), slower at 2048/8192, where the single graph keeps more forward activations
    # for the backward than AOTAutograd's recomputing partitioner does.
    fused_update: bool | None = None
    # AOTAutograd's activation memory budget for the split form's losses (0 < b < 1): the
    # partitioner then recomputes in the backward what the forward would otherwise save, by a
    # knapsack over the recomputable ops. The critic's BN apply and ReLU outputs are fp32 (bf16
    # GEMM output times fp32 BN affine): by default the forward writes them and the backward
    # reads them back; with a budget it saves the bf16 GEMM outputs only and recomputes the
    # pointwise chain inside the backward's kernels (W3's critic loss: 193 -> 57 MB saved an
    # update, no GEMM recomputed at 0.7; experiments/bench/saved_activations.py). Same values
    # (the same ops, recomputed). The fused form (no partition) ignores it. None: torch's default
    # (min-cut without a budget). Measured (ours_graph_budget): 1.069x at W3, 1.088x at W4, slower:
    # the recomputation lands in the backward's reductions and combo kernels, which then cost more
    # than reading the saved copy did (results/learner_benchmark/studies_2026-12-02). Off.
    activation_memory_budget: float | None = None
    # Under autocast, the critic's ReLU after each up projection's BN runs on the autocast dtype
    # (the BN output rounded first) instead of on the BN's fp32 output (a bf16 GEMM output times
    # the fp32 BN affine). Its only consumer is the down GEMM, which autocast feeds the rounded
    # value anyway, and rounding commutes with ReLU: the same forward values, the same gradients
    # (the mask of a rounded value is the fp32 one's, except below bf16's smallest subnormal), but
    # the forward writes and the backward reads a bf16 tensor where they used an fp32 one beside
    # its bf16 cast (W3's critic loss: 2 x 33.5 MB an update; experiments/bench/saved_activations.py).
    # No autocast (fp32, CPU): nothing changes. Study ours_graph_relu_bf16. None: on in the
    # compiled modes (see contiguous_weight_grads).
    relu_in_autocast_dtype: bool | None = None
    # Under autocast, cast each network's GEMM weights to bf16 in one kernel per call (they
    # are one contiguous prefix of its flat buffer) instead of one cast per matmul. Same
    # values; False exists to measure the difference (benchmark variant ours_graph_percast).
    cast_gemm_weights_once: bool = True
    # The critics' input BatchNorm statistics (training mode) over the batch axis in chunks of
    # this many rows, combined exactly (networks.batch_moments): the same statistics up to
    # rounding, as a reduction Inductor can spread over many thread blocks. One pass over every
    # row has 2 x 130 outputs at W3 (2 x 318 at W4), few blocks: the slowest BN kernel there
    # (43 / 68 us a launch). 0: one pass, UniLab's order (eager bit-identical); rows it does not
    # split into two or more chunks: one pass. Chunking every critic BN layer was measured
    # 1.02-1.12x slower (the study of 2026-12-01, commit 62bc0bd; hidden layers have enough outputs and
    # their fusion changed); the input alone (study ours_graph_input_bn_chunks) measured 1.012x at
    # W3, 0.961x at W4 (results/learner_benchmark/studies_2026-12-02): off.
    input_bn_chunk_rows: int = 0
    # The critic ensemble's GEMMs with their weight gradients formed as g^T x, in the weights' own
    # (members, out, in) layout (networks.member_linear), instead of einsum's x^T g returned
    # transposed, which the flat gradient's assembly then gathers with strided reads (~2% of W2's
    # iteration, results/roofline/README.md). The same sums, possibly rounded in another order, so
    # not in eager, which stays bit-identical to UniLab's einsum. Measured (ours_graph_weight_grads,
    # results/learner_benchmark/studies_2026-12-02): 0.993x / 0.988x / 1.000x at W1 / W2 / W4.
    # None (this and the next two options): on in the compiled modes, off in eager (UniLab's
    # order: the oracle stays bit-identical). Together they measured 0.934-0.975x of graph mode
    # at W1-W4 with no warm-start cost once the cache takes member_linear's graphs
    # (results/learner_benchmark/side_by_side_graph_options_2026-12-02_2).
    contiguous_weight_grads: bool | None = None
    # The critic's input BatchNorm statistics reduced once and broadcast to the members: every
    # member normalizes the same rows (cat(obs, action) expanded over the ensemble), so UniLab's
    # per-member reduction computes the same statistics n times, in the slowest BN kernel at W3 /
    # W4 (2 x 130 / 2 x 318 outputs with a loop over every row, 43 / 81 us a launch; results/
    # roofline/README.md). Same values (a member's reduction over the same rows). Measured (study
    # ours_graph_shared_input_bn, results/learner_benchmark/studies_2026-12-02): 0.989x at W3, 0.975x
    # at W4. None: on in the compiled modes (see contiguous_weight_grads).
    shared_input_bn_statistics: bool | None = None
    # The online and target critics as one ensemble of twice the members in the critic loss
    # (FlashSACCritic.forward_stacked): one batched GEMM, statistics and activation pass per
    # layer for both instead of two chains. The target half is detached, but the backward runs
    # the full width (zeros for it): the critic's backward FLOPs double. Meant for batches
    # where the kernels are latency-bound (W1/W2, B256: a chain of ~350 small kernels an
    # iteration); same values up to the GEMMs' rounding. Measured (ours_graph_stacked, same studies):
    # 1.13x / 1.08x / 1.24x slower at W1 / W2 / W3: the backward's doubled width costs more than the
    # forward saves (Inductor already shared the two forwards' common work). Off.
    stack_target_critic: bool = False
    # The critic loss as separate compile boundaries (bootstrap inputs; the target critic's
    # forward and projection; the online critic's forward; the cross-entropy) so that, in graph
    # mode, the target branch runs on a second CUDA stream while the online critic's forward runs
    # on the first: two independent chains of small kernels side by side in the captured graph,
    # for W1/W2's latency-bound kernels. The critic then runs the split form (autograd between
    # loss and step), which loses the fused form's gradient-into-Adam fusion. Same mathematics:
    # eager is bit-identical to the plain loss. Study ours_graph_target_stream; off.
    critic_target_stream: bool = False
    # Each layer of a critic or actor block in training mode (the up projection, BatchNorm, ReLU;
    # the down projection, BatchNorm, ReLU and the skip connection) as one hand-written Triton
    # kernel (kernels.member_linear_bn_relu, a torch.library.custom_op: traced, compiled and
    # captured with the rest); batches up to kernels.MAX_ROWS rows. The statistics come from the
    # float32 accumulator, so values agree with the composite path to the GEMM output's rounding.
    # Needs Triton. Issue 45's first step, off: slower than graph mode on one H100
    # (results/learner_benchmark/fused_linear_bn_relu_2026-12-07).
    fused_linear_bn_relu: bool = False
    # Each critic or actor block in training mode through gemm_stats.block: row-split Triton GEMMs
    # that reduce BatchNorm's statistics in their epilogues, the up layer's BN + ReLU in the down
    # GEMM's prologue, the last BN, ReLU and skip connection in a fourth launch; the backward in
    # PyTorch. Batches up to gemm_stats.MAX_ROWS rows. Needs Triton. Issue 45 item 1, off: a block
    # alone is 0.81x of the composite's time, but the learner took 1.056x / 1.060x of graph mode's at
    # W1 / W2 on one H100 (results/learner_benchmark/gemm_stats_block_2026-12-07).
    gemm_stats_block: bool = False
    # Each network's post-backward step (Adam, the unit renormalization, the guarded commit and the
    # critic's Polyak update) as one Triton launch over its flat buffers (fused_step.py, a
    # torch.library.custom_op), after the finite check's reduction. Renormalization norms summed in a
    # different order: values agree with the composite to float32 rounding. Needs Triton. Issue 45
    # item 3, off until measured.
    fused_gated_step: bool = False
    # Every GEMM of the compiled modes as Inductor's own Triton template at one fixed configuration
    # per size (gemm_templates.py): Inductor may then fuse pointwise work before a GEMM (casts, BN
    # apply, ReLU) and after it into the GEMM's kernel (how much it does is what the study counts),
    # without the autotuning that made its templates cost ~10x graph mode's cold compile
    # (ours_graph_triton_gemm, 2026-12-03). CUDA only.
    # Issue 45, off until measured (study ours_graph_triton_gemm_table).
    triton_gemm_table: bool = False
    # Data parallel only: at the end of every iteration, rank 0's actor, critic and target
    # parameters are broadcast to every rank in one bucket (inside the captured iteration in
    # graph mode). Averaged gradients keep the ranks' Adam moments and BN statistics
    # bit-identical, but on the H200 compile/graph mode left the parameters ~1 ulp apart:
    # the compiled optimizer step gives different bits on two GPUs for identical inputs
    # (FLASH_SAC_OPTIMIZATION.md, "Data parallel"). The broadcast makes every iteration end
    # with bit-identical ranks for one more collective (~ the size of two critic gradients
    # and an actor gradient; 13% / 8% of a 2-GPU iteration on the H200 at W3 / W4). None: on
    # where that was seen, i.e. compiled modes on CUDA; eager and CPU ranks are exact without it.
    dp_broadcast_params: bool | None = None


# What patch 0001 passes to the learner where UniLab's config has no value: a UniLab run of
# flashsac_opt is graph mode unless algo.algo_params.learner_mode says otherwise.
UNILAB_RUN_DEFAULTS = {"learner_mode": "graph"}

# The critic's network options whose None means: on in the compiled modes, off in eager.
COMPILED_MODE_NETWORK_OPTIONS = ("contiguous_weight_grads", "shared_input_bn_statistics", "relu_in_autocast_dtype")


@dataclass
class FlashSACConfig(EngineOptions, UniLabHyperparameters):
    """UniLab's hyperparameters and flashsac_opt's engine options, as one flat config."""

    def critic_network_options(self) -> dict[str, bool]:
        """COMPILED_MODE_NETWORK_OPTIONS resolved for this config's learner mode."""
        compiled = is_compiled(self.learner_mode)
        return {name: compiled if getattr(self, name) is None else bool(getattr(self, name))
                for name in COMPILED_MODE_NETWORK_OPTIONS}

    def __post_init__(self) -> None:
        check_mode(self.learner_mode)
        if self.amp_dtype.lower() not in ("auto", "bf16", "fp16"):
            raise ValueError(f"amp_dtype must be auto, bf16 or fp16, got {self.amp_dtype!r}")
        if self.n_step != 1:
            raise ValueError(f"FlashSAC supports n_step=1 only (got {self.n_step})")
        if self.obs_normalization:
            raise ValueError("obs_normalization=true is not supported by flashsac_opt (UniLab's default is false)")
        if self.critic_target_stream and self.stack_target_critic:
            raise ValueError("critic_target_stream and stack_target_critic exclude each other: the stacked forward has no separate target branch")
        if self.activation_memory_budget is not None and not 0.0 < self.activation_memory_budget < 1.0:
            raise ValueError(f"activation_memory_budget must be in (0, 1) or None (torch's default), got {self.activation_memory_budget}")
        for name in COMPILED_MODE_NETWORK_OPTIONS:  # a string from a command line ("false") would read as on
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be true, false or null (on in the compiled modes), got {getattr(self, name)!r}")
        for name in ("fused_linear_bn_relu", "gemm_stats_block", "fused_gated_step", "triton_gemm_table"):
            if getattr(self, name) not in (True, False):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.fused_linear_bn_relu and self.gemm_stats_block:
            raise ValueError("fused_linear_bn_relu and gemm_stats_block exclude each other: each replaces the same block layers")
        if self.input_bn_chunk_rows < 0:
            raise ValueError(f"input_bn_chunk_rows must be >= 0 (0: one pass), got {self.input_bn_chunk_rows}")
        for name in ("batch_size", "updates_per_step", "policy_frequency", "target_frequency", "num_atoms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_atoms < 2 or self.critic_max_v <= self.critic_min_v:
            raise ValueError("the critic support needs num_atoms >= 2 and critic_max_v > critic_min_v")

    def autocast_dtype(self, device: torch.device) -> torch.dtype | None:
        """The update's autocast dtype on ``device``: bf16 with use_amp on CUDA, else None (fp32,
        as UniLab runs off CUDA too)."""
        if not (self.use_amp and device.type == "cuda"):
            return None
        if self.amp_dtype.lower() == "fp16":
            raise ValueError("flashsac_opt supports bf16 autocast only (fp16 needs loss scaling); set amp_dtype=bf16")
        return torch.bfloat16

    def engine_arguments(self) -> dict[str, Any]:
        """The options ``engine.Engine`` takes from this config: the mode is read here and in the
        engine only; everything else asks the engine (``engine.compiled``, ``engine.graph``)."""
        return {
            "mode": self.learner_mode,
            "backend": self.compile_backend,
            "inductor_options": self.inductor_options,
            "fused_update": self.fused_update,
            "activation_memory_budget": self.activation_memory_budget,
            "compile_cache_file": self.compile_cache_file,
            "precompiled_steps": self.precompiled_steps,
            "triton_gemm_table": self.triton_gemm_table,
        }

    @property
    def peak_lr(self) -> float:
        # UniLab falls back to actor_lr only when learning_rate_peak is not positive.
        return self.learning_rate_peak if self.learning_rate_peak > 0 else self.actor_lr

    @classmethod
    def from_unilab(cls, source: Any, defaults: Mapping[str, Any] | None = None, **overrides: Any) -> "FlashSACConfig":
        """Build from UniLab's config.yaml path, a Hydra/omegaconf config or a mapping.

        Reads ``algo`` (or the root if there is no ``algo`` key), merges
        ``algo.algo_params`` into it and ``training.use_amp``; unknown keys are ignored
        (UniLab's config has many runtime keys the learner does not use). ``defaults`` fill
        the fields the source leaves absent or null (``UNILAB_RUN_DEFAULTS``: what patch 0001 does).
        """
        from omegaconf import DictConfig, OmegaConf

        if isinstance(source, (str, Path)):
            source = OmegaConf.load(str(source))
        if isinstance(source, DictConfig):
            source = OmegaConf.to_container(source, resolve=True)
        if not isinstance(source, Mapping):
            raise TypeError(f"cannot read a FlashSAC config from {type(source).__name__}")
        algo = dict(source.get("algo", source))
        flat = {k: v for k, v in algo.items() if k != "algo_params"}
        flat.update(algo.get("algo_params") or {})
        training = source.get("training") or {}
        if "use_amp" in training:
            flat["use_amp"] = training["use_amp"]
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in flat.items() if k in known}
        values.update({k: v for k, v in (defaults or {}).items() if values.get(k) is None})
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> "FlashSACConfig":
        return dataclasses.replace(self, **changes)
