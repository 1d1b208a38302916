"""How a learner iteration runs: eagerly, compiled, or captured whole into one CUDA graph.

The learner hands the engine plain callables and the tensors its iteration changes in place;
the engine never sees the learner. This is the one module that reads the mode:

- ``eager``: the callables as they are.
- ``compile``: each network update under ``torch.compile`` with Inductor's CUDA graphs
  (cudagraph trees); the loop over updates stays in Python.
- ``graph``: the same compiled functions with Inductor's CUDA graphs off, and the whole
  iteration (every update, optimizer step, Polyak update, noise draw and metric write)
  captured into one ``torch.cuda.CUDAGraph``: one launch per iteration. A capture cannot
  contain another, hence Inductor's graphs off.

Every compiled function has ``fullgraph=True`` (a graph break is an error, not a silent
slowdown) and ``dynamic=False`` (batch shapes are fixed per run).

A network update comes in two forms (``NetworkUpdate``), and the engine compiles one:
- fused: one function computes the loss, its gradient (``torch.func``, traced by Dynamo),
  the guarded optimizer step and the commits, so Inductor fuses the gradient assembly into
  Adam and the renormalization. Fewer kernels: faster at small batches.
- split: the loss compiled with its backward (AOTAutograd), autograd between, then the step
  compiled apart. At large batches AOTAutograd's recomputing partitioner keeps fewer
  activations than the single fused graph: faster there. Data parallel needs it too: the
  ranks' all-reduce sits between loss and step.
The form is chosen from the first batch's per-update rows (shapes are static anyway):
fused up to ``FUSED_UPDATE_MAX_BATCH`` rows unless ``fused_update`` forces it.

Graph-mode lifetime rules (what keeps a captured graph valid):
- It reads and writes tensors by address. Everything an iteration changes (``state``) is
  only ever updated in place (``copy_``), including by checkpoint loads, so the graph
  survives them.
- The capture key is (schedule, every batch field's shape and dtype), or the replay's
  identity for in-graph sampling. A different key recaptures; the compiled functions stay.
- Noise comes from the default CUDA generator, which is graph-safe: each replay draws new
  values, in the sequence eager execution would. Another generator (a replay's sampler) is
  registered with the graph so that each replay advances it.
- A graph that captured NCCL collectives keeps the communicator referenced:
  ``destroy_process_group`` then waits forever (pytorch/pytorch#115388). ``release()`` first.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from flashsac_opt import compile_cache, gemm_templates, pdl, precompiled, toolchain

MODES = ("eager", "compile", "graph")
FUSED_UPDATE_MAX_BATCH = 1024
# Programmatic Dependent Launch pays where an update is a chain of small kernels: graph mode on
# an H200, side by side (results/learner_benchmark/side_by_side_pdl_wait_first_2026-12-03/):
# 0.930x at 256 rows x 2 updates, 0.947x at 256 x 8, 1.001x at 2048 x 8 and 1.025x at 8192 x 4
# (there the early-scheduled blocks of the next kernel hold SM slots the current one's waves need).
PDL_MAX_BATCH = 1024
# Iterations run on a side stream before a capture: they compile every function and let the
# allocator and cuBLAS settle; their effects on the training state are undone.
CAPTURE_WARMUP_ITERATIONS = 2
# With the compile deferred (graph mode), the first iterations run uncaptured: the compile-ahead
# child is often done by the second, and capturing the uncompiled iteration (its warm-ups, the
# capture, a graph of the eager kernels) took 5.1 s at 64 updates against ~1.3 s for one plain
# iteration: the first update of a warm start (results/startup/background_vs_plain_2026-12-01/).
DEFERRED_ITERATIONS_UNCAPTURED = 1


def is_compiled(mode: str) -> bool:
    """Whether ``mode`` runs the objectives under torch.compile (compile and graph mode)."""
    return check_mode(mode) != "eager"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"learner_mode must be one of {MODES}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class Schedule:
    """The update schedule of one iteration (UniLab's names)."""

    updates_per_step: int
    policy_frequency: int
    target_frequency: int
    policy_before_critic: bool


@dataclass(frozen=True)
class NetworkUpdate:
    """One network's update in both forms; the engine compiles the one it picks.

    ``step(batch, noise, *args)``: fused, gradient inside; returns the metric values.
    ``loss(batch, noise)``: a NamedTuple whose first field is the loss (then statistics the
    step needs); ``apply(grad, *loss_outputs, *args)``: the step; returns the metric values.
    ``params``: what the split form differentiates the loss by.
    ``compose_loss(compile, stream)``: where set, the split form's loss is what it returns, built
    of several functions each passed through ``compile`` (the engine's: a compile boundary, or the
    function itself where nothing is compiled); ``stream`` is a second CUDA stream where the
    iteration is captured (graph mode), for independent parts of the loss, else None (eager, and
    compile mode, whose cudagraph trees replay on one stream). Such a network always runs the
    split form.
    """

    params: torch.Tensor
    step: Callable[..., torch.Tensor]
    loss: Callable[..., NamedTuple]
    apply: Callable[..., torch.Tensor]
    compose_loss: Callable[[Callable[[Callable], Callable], "torch.cuda.Stream | None"], Callable[..., NamedTuple]] | None = None


# iteration(batch, schedule, updates): the whole iteration's device work, where
# updates[name](batch_slice, noise, *args) runs one update of network `name`.
Iteration = Callable[[dict, Schedule, Mapping[str, Callable[..., torch.Tensor]]], None]


def inductor_options(mode: str, device: torch.device, extra: Mapping[str, Any] | None = None,
                     rows: int | None = None, triton_gemm_table: bool = False) -> dict[str, Any]:
    """Inductor options of the compiled modes for ``rows`` per update (None: not known yet):
    flashsac_opt's defaults, ``triton_gemm_table``'s (gemm_templates.py), then ``extra``."""
    cuda = device.type == "cuda"
    options = {
        # Inductor's CUDA graphs in compile mode only: graph mode captures the whole
        # iteration itself, and a capture cannot contain another.
        "triton.cudagraphs": mode == "compile" and cuda,
        # Pad GEMM operands whose rows are not 16-byte aligned (101 atoms, 29 actions,
        # 130-wide critic input) instead of letting cuBLAS fall back to align-1 kernels.
        "force_shape_pad": cuda,
        # Horizontal fusion of independent small kernels (per-layer BN statistics,
        # renormalization groups, Adam/Polyak pieces) where an iteration is one captured
        # chain of hundreds of small kernels: fewer kernels and less time on the H200
        # (FLASH_SAC_OPTIMIZATION.md, "Inductor options"), for ~25% more peak memory;
        # extra={"combo_kernels": False} opts out.
        "combo_kernels": cuda and mode == "graph",
        # Programmatic Dependent Launch (Hopper and newer): each generated Triton kernel's
        # blocks are scheduled while the kernel before it drains and wait on the device for
        # it (pdl.py: every kernel waits before its first memory access, then lets the next
        # one launch; Inductor's own placement reads early). Graph mode only, where an
        # iteration is one dependent chain of hundreds of small kernels, and at most
        # PDL_MAX_BATCH rows per update; extra={"triton.enable_pdl": False} opts out, True
        # opts in at any batch.
        "triton.enable_pdl": mode == "graph" and rows is not None and rows <= PDL_MAX_BATCH and pdl.supported(device),
    }
    if triton_gemm_table:
        options.update(gemm_templates.inductor_options())
    options.update(extra or {})
    if options["triton.enable_pdl"]:
        own = (extra or {}).get("post_grad_custom_pre_pass")
        placement = pdl.key_placement(own)
        if own is not None and placement is None:
            raise ValueError(
                "inductor_options: triton.enable_pdl with your own post_grad_custom_pre_pass is not supported "
                "(flashsac_opt keys its wait-first PDL kernels by that pass, flashsac_opt/pdl.py); "
                "set triton.enable_pdl to False or drop the pass"
            )
        # trigger-first unless extra names pdl.cache_key(trigger_first=False), the wait-only
        # placement (a study, pdl.py)
        options.update(pdl.inductor_options(trigger_first=placement != "wait_first"))
    return options


def _as_it_is(fn: Callable) -> Callable:
    return fn


def mark_static(*tensors: torch.Tensor) -> None:
    """Declare persistent state as fixed-address graph inputs.

    Cudagraph trees then neither copy these tensors into graph-owned placeholders nor refuse
    to graph a function that updates them in place. (Parameters are static inputs already.)
    """
    for tensor in tensors:
        if not isinstance(tensor, torch.nn.Parameter):
            torch._dynamo.mark_static_address(tensor)


def compile_objective(fn: Callable, backend: str, options: Mapping[str, Any] | None,
                      functorch_config: Mapping[str, Any] | None = None) -> Callable:
    """``fn`` under torch.compile as the engine compiles it (one whole graph, static shapes),
    with ``functorch_config`` (AOTAutograd's settings) set around every call: torch.compile
    compiles at the first call and looks its caches up at each new compile, with the config of
    that moment, so a process-wide setting would reach other code's compiles too. The same holds
    for an ``inductor_choices_class`` in ``options`` (gemm_templates.choices_context)."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, options=options)
    choices = (options or {}).get("inductor_choices_class") is not None
    if not functorch_config and not choices:
        return compiled
    settings = dict(functorch_config or {})

    @functools.wraps(fn)
    def with_settings(*args, **kwargs):
        with torch._functorch.config.patch(**settings), gemm_templates.choices_context(options):
            return compiled(*args, **kwargs)

    return with_settings


class Engine:
    """Runs a learner's iterations in one mode; built once per learner."""

    def __init__(
        self,
        mode: str,
        device: torch.device,
        *,
        updates: Mapping[str, NetworkUpdate],
        iteration: Iteration,
        state: Sequence[torch.Tensor],
        backend: str = "inductor",
        inductor_options: Mapping[str, Any] | None = None,
        fused_update: bool | None = None,
        activation_memory_budget: float | None = None,
        cache_custom_autograd_functions: bool = False,
        reduce: Callable[..., list[torch.Tensor]] | None = None,
        compile_cache_file: str | None = None,
        compile_cache_key: Mapping[str, Any] | None = None,
        precompiled_steps: bool = False,
        triton_gemm_table: bool = False,
    ):
        """``state``: every tensor an iteration changes in place (parameters included).
        ``cache_custom_autograd_functions``: the updates call a custom autograd.Function (traced
        into the graph): let AOTAutograd's cache keep their graphs (torch bypasses it for them
        unless told, and a bypassed graph is traced and partitioned again at every launch).
        ``reduce``: averages (grad, *loss outputs) across data-parallel ranks between loss and
        step (forces the split form). ``compile_cache_file``: a file of torch.compile's cache
        artifacts (compiled modes only), or ``"auto"`` for the keyed file in the default
        directory (compile_cache.py), resolved at the first batch from ``compile_cache_key``
        (the caller's ``dims`` and ``config`` mappings) and what the engine adds.
        ``precompiled_steps``: the fused steps are saved whole and loaded by later processes
        (precompiled.py), with Inductor and without its CUDA graphs (graph mode, or the CPU).
        ``triton_gemm_table``: every GEMM on a Triton template (gemm_templates.py; CUDA only)."""
        self.mode = check_mode(mode)
        self.device = device
        if self.mode == "graph" and device.type != "cuda":
            raise ValueError(f"learner_mode=graph needs a CUDA device, got {device}; use learner_mode=eager or compile there")
        self.compiled = is_compiled(self.mode)
        self._networks = dict(updates)
        self._iteration = iteration
        self.state = list(state)
        self._backend = backend
        self._extra_options = dict(inductor_options or {})
        self._triton_gemm_table = triton_gemm_table and self.compiled and gemm_templates.require(device) is None  # or raises
        self._fused_option = fused_update
        # AOTAutograd's settings for these compiles: applied around every compiled call, never
        # process-wide (other code's compiles keep torch's defaults); both are in its cache key.
        self._functorch_config: dict[str, Any] = {}
        if activation_memory_budget is not None:
            self._functorch_config["activation_memory_budget"] = activation_memory_budget
        if cache_custom_autograd_functions:
            self._functorch_config["autograd_cache_allow_custom_autograd_functions"] = True
        self._reduce = reduce
        # Fused only where it is compiled: in eager, torch.func's per-op wrapping is pure overhead.
        self._fusable = self.compiled and reduce is None
        self.fused_update: bool | None = None  # decided by the first batch
        self._rows: int | None = None  # the first batch's rows per update (static from then on)
        self._updates: dict[str, Callable[..., torch.Tensor]] | None = None
        self._graph: CapturedIteration | None = CapturedIteration(self) if self.mode == "graph" else None
        if self.compiled:
            mark_static(*self.state)
            if device.type == "cuda":  # before this process's first compile, for it and its children
                toolchain.align_triton_toolchain()
        # The artifact file is loaded before the first compile and written after the first
        # iteration when it was not loaded. An explicit file is loaded now; "auto" names a file
        # by a key that needs the per-update rows, so it is resolved by the first batch.
        self._cache_option = compile_cache_file if self.compiled else None
        self._cache_key_inputs = dict(compile_cache_key or {})
        self._precompiled = precompiled_steps and self.compiled and backend == "inductor"
        self.precompiled_steps: dict[str, precompiled.PrecompiledStep] = {}  # by network, once built
        self.compile_cache_file: str | None = None  # the file in use, once resolved
        self.compile_cache_loaded = False
        self.compile_cache_saved = False
        self._save_cache_after_iteration = False
        if self._cache_option and self._cache_option != compile_cache.AUTO:
            self._open_compile_cache(self._cache_option)
        self.compile_deferred = False  # defer_compile(): iterations run uncompiled until compile_now()
        self._uncaptured_left = 0  # graph mode, deferred: iterations still to run without a capture
        self.compiled_networks: frozenset[str] | None = None  # compile_only(): the rest run uncompiled

    def defer_compile(self) -> None:
        """Until ``compile_now()``, iterations run the update functions uncompiled (the split
        form; graph mode captures them as they are): a training starts without waiting for its
        compile, which a compile-ahead child does meanwhile (compile_ahead.py, "background").
        Only before the first iteration, and only for a compiled mode."""
        if not self.compiled:
            raise ValueError("defer_compile() is for learner_mode=compile or graph; eager compiles nothing")
        if self._updates is not None:
            raise RuntimeError("defer_compile() must come before the first iteration")
        self.compile_deferred = True
        self._uncaptured_left = DEFERRED_ITERATIONS_UNCAPTURED if self._graph is not None else 0

    def compile_only(self, names: Sequence[str]) -> None:
        """Compile only the update functions of the networks ``names``; the others run uncompiled
        (the split form, as deferred iterations do). For a compile-ahead child that fills the
        caches with its share of the learner while another child compiles the rest: the FX graphs
        and kernels of a network's update do not depend on whether the other networks' are
        compiled, so the training process's compile finds both shares. No compile-cache file
        here (it would hold one share under the whole learner's key): the training process writes
        it after its own compile. Only before the first iteration, and only for a compiled mode."""
        if not self.compiled:
            raise ValueError("compile_only() is for learner_mode=compile or graph; eager compiles nothing")
        if self._updates is not None:
            raise RuntimeError("compile_only() must come before the first iteration")
        unknown = sorted(set(names) - set(self._networks))
        if unknown or not names:
            raise ValueError(f"compile_only({list(names)!r}): networks are {sorted(self._networks)}")
        self.compiled_networks = frozenset(names)
        self._cache_option, self.compile_cache_file = None, None
        self.compile_cache_loaded = self._save_cache_after_iteration = False

    def compile_now(self) -> None:
        """End ``defer_compile()``: the next iteration builds and compiles the update functions
        (from the caches the child filled) and, in graph mode, captures anew."""
        if not self.compile_deferred:
            return
        self.compile_deferred = False
        self._updates, self.fused_update = None, None
        if self._graph is not None:
            self._graph.release()

    # ---------------------------------------------------------------- building
    def _open_compile_cache(self, path: str) -> None:
        self.compile_cache_file = str(path)
        self.compile_cache_loaded = compile_cache.load(path)
        self._save_cache_after_iteration = not self.compile_cache_loaded

    def open_compile_cache(self, rows: int, schedule: Schedule | None = None) -> str | None:
        """Load the compile-cache file now rather than at the first compile: the configured
        one, or (``auto``) the keyed one for ``rows`` per update and ``schedule`` when it exists.
        Returns the file when it loaded (a corrupt one warns once and is rewritten after the
        first compile, as ever), else the precompiled steps' folder when it holds every fused
        network's step (they load in about a second); None otherwise."""
        if self.compile_cache_file is None and self._cache_option == compile_cache.AUTO:
            file = compile_cache.default_file(self.compile_cache_key(rows, schedule))
            if file.is_file():
                self._open_compile_cache(str(file))
        if self.compile_cache_loaded:
            return self.compile_cache_file
        if self._precompiles(rows):
            where = self.precompiled_folder(rows)
            if precompiled.ready(where, [name for name, net in self._networks.items() if net.compose_loss is None]):
                return str(where)
        return None

    def _fused_at(self, rows: int) -> bool:
        """Whether the updates take the fused form at ``rows`` per update (``fused_update``, else
        up to FUSED_UPDATE_MAX_BATCH rows; never where it cannot be fused)."""
        fused = rows <= FUSED_UPDATE_MAX_BATCH if self._fused_option is None else bool(self._fused_option)
        return fused and self._fusable

    def _precompiles(self, rows: int) -> bool:
        """Whether fused steps for ``rows`` per update are precompiled: asked, no Inductor CUDA
        graphs (cudagraph trees around a loaded function are untried), fused at these rows."""
        return self._precompiled and self._fused_at(rows) and not self._inductor_options(rows).get("triton.cudagraphs")

    def precompiled_folder(self, rows: int) -> Path:
        """The precompiled steps' folder: keyed as the compile-cache file, less the schedule."""
        return precompiled.folder(self.compile_cache_key(rows))

    def forget_compile_cache(self) -> None:
        """Undo ``open_compile_cache`` (``auto`` only): the first compile resolves the keyed file
        again, under the key it then has (data parallel changes it)."""
        if self._cache_option == compile_cache.AUTO:
            self.compile_cache_file, self.compile_cache_loaded, self._save_cache_after_iteration = None, False, False

    def compile_cache_key(self, rows: int, schedule: Schedule | None = None) -> str:
        """The default cache file's key for a first batch of ``rows`` per update."""
        return compile_cache.cache_key(
            compile_cache.environment(self.device),
            rows=rows,
            dims=self._cache_key_inputs.get("dims", {}),
            config=self._cache_key_inputs.get("config", {}),
            mode=self.mode,
            backend=self._backend,
            inductor_options=self._inductor_options(rows),
            fused_update=self._fused_option,
            data_parallel=self._reduce is not None,
            networks=sorted(self._networks),
            schedule=asdict(schedule) if schedule is not None else None,
        )

    def update_functions(self, rows: int, schedule: Schedule | None = None) -> Mapping[str, Callable[..., torch.Tensor]]:
        """The per-network update callables; the first call picks their form from ``rows``
        (the per-update batch size) and compiles them (lazily: torch.compile compiles at the
        first call), after loading the compile cache."""
        if self._updates is None:
            self._rows = int(rows)
            if self.compile_deferred:  # uncompiled, split form (in eager the fused form is pure overhead)
                self.fused_update = False
                self._updates = {name: self._build(net) for name, net in self._networks.items()}
                return self._updates
            if self._cache_option == compile_cache.AUTO and self.compile_cache_file is None:
                self._open_compile_cache(str(compile_cache.default_file(self.compile_cache_key(rows, schedule))))
            self.fused_update = self._fused_at(rows)
            self._updates = {name: self._build(net, self._compiles(name), name) for name, net in self._networks.items()}
        return self._updates

    def _compiles(self, name: str) -> bool:
        return self.compiled_networks is None or name in self.compiled_networks

    def _fused(self, net: NetworkUpdate) -> bool:
        return bool(self.fused_update) and net.compose_loss is None

    def compiled_names(self) -> list[str]:
        """The update forms in use: ``{net}_step`` (fused) or ``{net}_loss``/``{net}_apply``
        (a composed loss is several compile boundaries under the one name)."""
        if self.fused_update is None or self.compile_deferred:
            return []
        return [
            f"{name}_{part}" for name, net in self._networks.items() if self._compiles(name)
            for part in (("step",) if self._fused(net) else ("loss", "apply"))
        ]

    def _inductor_options(self, rows: int | None) -> dict[str, Any] | None:
        """The options the compiled functions get for ``rows`` per update (None for a backend
        other than Inductor)."""
        return inductor_options(self.mode, self.device, self._extra_options, rows, self._triton_gemm_table) if self._backend == "inductor" else None

    def _compile(self, fn: Callable) -> Callable:
        if not self.compiled or self.compile_deferred:
            return fn
        return compile_objective(fn, self._backend, self._inductor_options(self._rows), self._functorch_config)

    def _compile_step(self, name: str, fn: Callable) -> Callable:
        """A fused step compiled: saved whole and loaded where precompiled (precompiled.py)."""
        if not self._precompiles(self._rows):
            return self._compile(fn)
        where = self.precompiled_folder(self._rows)
        step = precompiled.PrecompiledStep(fn, name, where, lambda: self._compile(fn),
                                           {"backend": self._backend, "options": self._inductor_options(self._rows)}, self._functorch_config)
        self.precompiled_steps[name] = step
        return step

    def precompiled_report(self) -> dict[str, list[str]] | None:
        """Which precompiled steps this process loaded, saved, or compiled otherwise; None where
        none are in use."""
        if not self.precompiled_steps:
            return None
        steps = self.precompiled_steps.values()
        return {what: sorted(name for s in steps for name in getattr(s, what)) for what in ("loaded", "saved", "fell_back", "stale")}

    def _build(self, net: NetworkUpdate, compiles: bool = True, name: str = "") -> Callable[..., torch.Tensor]:
        # In compile mode nothing a previous update's CUDA-graph replay returned is still held
        # (metric values are copied out at once), so each update may begin a cudagraph-tree step.
        mark_step = self.mode == "compile"
        compile = self._compile if compiles else _as_it_is
        if compiles and self._fused(net):
            step = self._compile_step(name, net.step)

            def fused(batch, noise, *args):
                if mark_step:
                    torch.compiler.cudagraph_mark_step_begin()
                # torch.func computes the gradient whatever the outer grad mode; no_grad keeps
                # AOTAutograd from also building an outer backward for the compiled step.
                with torch.no_grad():
                    return step(batch, noise, *args)

            return fused
        if net.compose_loss is not None:
            loss_fn = net.compose_loss(compile, torch.cuda.Stream(self.device) if self._graph is not None else None)
        else:
            loss_fn = compile(net.loss)
        apply_fn, reduce = compile(net.apply), self._reduce

        def split(batch, noise, *args):
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            out = loss_fn(batch, noise)
            (grad,) = torch.autograd.grad(out[0], net.params)
            inputs = [grad, *out]
            if reduce is not None:
                inputs = reduce(*inputs)
            return apply_fn(*inputs, *args)

        return split

    # ----------------------------------------------------------------- running
    def run(self, batch: dict[str, torch.Tensor], schedule: Schedule) -> "torch.cuda.Event | None":
        """One iteration on a batch of ``updates_per_step`` x rows. Does not synchronize.

        Returns, where a captured graph runs the iteration, an event recorded once ``batch`` is
        copied into the graph's inputs: from then on the caller may overwrite ``batch``. None
        where the iteration reads ``batch`` itself, until it ends."""
        rows = next(iter(batch.values())).shape[0] // schedule.updates_per_step
        updates = self.update_functions(rows, schedule)
        inputs_read = None
        if self._graph is not None and not self._run_uncaptured():
            inputs_read = self._graph.run(batch, schedule)
        else:
            self._iteration(batch, schedule, updates)
        self._after_iteration()
        return inputs_read

    def run_sampled(self, sample: Callable[[], dict], rows: int, schedule: Schedule, *, source: tuple, generator: torch.Generator) -> None:
        """One iteration on ``sample()``: ``updates_per_step`` x ``rows`` rows from a replay
        whose draws come from ``generator``. In graph mode the sampling is captured too (one
        replay draws new indices, gathers the rows and runs every update); ``source``
        identifies the replay in the capture key."""
        updates = self.update_functions(rows, schedule)
        if self._graph is not None and not self._run_uncaptured():
            self._graph.run_sampled(sample, schedule, source, generator)
        else:
            self._iteration(sample(), schedule, updates)
        self._after_iteration()

    def _run_uncaptured(self) -> bool:
        """Graph mode: whether this iteration runs as it is, without a capture (the first ones
        of a deferred compile, DEFERRED_ITERATIONS_UNCAPTURED)."""
        if not (self.compile_deferred and self._uncaptured_left > 0):
            return False
        self._uncaptured_left -= 1
        return True

    def _after_iteration(self) -> None:
        if self._save_cache_after_iteration and not self.compile_deferred:  # once: the first compiled iteration compiled everything
            self._save_cache_after_iteration = False
            self.compile_cache_saved = compile_cache.save(self.compile_cache_file)

    @contextlib.contextmanager
    def preserved(self, generators: Sequence[torch.Generator] = ()) -> Iterator[None]:
        """Undo, on exit, what the iterations run inside did to the state and the RNGs."""
        saved = [(t, t.detach().clone()) for t in self.state]
        cuda = self.device.type == "cuda"
        rng = torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None
        extra = [g.get_state() for g in generators]
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)
            torch.set_rng_state(rng[0])
            if cuda:
                torch.cuda.set_rng_state(rng[1], self.device)
            for g, s in zip(generators, extra):
                g.set_state(s)

    def release(self) -> None:
        """Free a captured iteration (graph mode; a no-op otherwise). The next one recaptures."""
        if self._graph is not None:
            self._graph.release()

    @property
    def graph(self) -> "CapturedIteration | None":
        return self._graph


class CapturedIteration:
    """A whole iteration captured into one ``torch.cuda.CUDAGraph`` (graph mode)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None
        self.static_batch: dict[str, torch.Tensor] = {}
        self.captures = 0
        self.last_warmup_seconds = 0.0
        self.last_capture_seconds = 0.0

    def release(self) -> None:
        if self.graph is not None:
            torch.cuda.synchronize(self.engine.device)  # no replay may still be running
            self.graph.reset()
        self.graph, self.key, self.static_batch = None, None, {}

    def run(self, batch: dict[str, torch.Tensor], schedule: Schedule) -> torch.cuda.Event:
        """Copy ``batch`` into the graph's inputs and replay it; returns an event recorded after
        the copy (Engine.run)."""
        key = (schedule, tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items())))
        if key != self.key:
            self.static_batch = {k: v.detach().clone() for k, v in batch.items()}
            updates = self.engine._updates
            self._capture(key, lambda: self.engine._iteration(self.static_batch, schedule, updates))
        for name, tensor in batch.items():
            self.static_batch[name].copy_(tensor)
        inputs_read = torch.cuda.Event()
        inputs_read.record()
        self.graph.replay()
        return inputs_read

    def run_sampled(self, sample: Callable[[], dict], schedule: Schedule, source: tuple, generator: torch.Generator) -> None:
        key = ("sampled", source, schedule)
        if key != self.key:
            self.static_batch = {}
            updates = self.engine._updates
            self._capture(key, lambda: self.engine._iteration(sample(), schedule, updates), generator)
        self.graph.replay()

    def _capture(self, key: tuple, body: Callable[[], None], generator: torch.Generator | None = None) -> None:
        engine, device = self.engine, self.engine.device
        self.graph = None
        start = time.perf_counter()
        with engine.preserved([generator] if generator is not None else []):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(CAPTURE_WARMUP_ITERATIONS):
                    body()
            torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.last_warmup_seconds = time.perf_counter() - start
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            body()
        torch.cuda.synchronize(device)
        self.last_capture_seconds = time.perf_counter() - start
        self.graph, self.key = graph, key
        self.captures += 1

