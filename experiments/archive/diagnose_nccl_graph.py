"""Where do two NCCL ranks of a data-parallel learner stop being bit-identical?

Two processes, one GPU each. (1) A captured all-reduce on its own: a graph holding
cat -> all_reduce -> /2 -> copy, replayed on new inputs; the ranks' outputs compared after
every replay. (2) The data-parallel learner in each of --modes: after every iteration the
ranks' state is gathered (outside any graph) and compared: which tensors differ, by how
much. "trace" compares every optimizer step's inputs and parameters (compile mode), and
--two-devices runs the same learner on cuda:0 and cuda:1 in one process, without
torch.distributed. On two H200s the captured all-reduce and eager mode were bit-identical
across ranks; compile and graph mode differed by ~1 ulp in the parameters (Adam moments, BN
statistics and temperature identical), with Inductor's deterministic mode as well
(results/diagnose_nccl_graph/diagnose_nccl_*_2026-11-29.json).

    python experiments/archive/diagnose_nccl_graph.py --modes trace graph --two-devices --output diagnose.json
    (without CUDA: a 2-process gloo rehearsal of eager mode)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common
from common import run_environment  # noqa: E402
from flashsac_opt.config import FlashSACConfig  # noqa: E402
from flashsac_opt.data_parallel import named_tensors  # noqa: E402
from flashsac_opt.learner import FlashSACLearner  # noqa: E402
from flashsac_opt.testing.oracle import synthetic_batch  # noqa: E402

DIMS = {"obs_dim": 12, "critic_obs_dim": 15, "action_dim": 4}
DEVICE = torch.device("cpu")  # set per rank
CONFIG_OVERRIDES: dict = {}  # --no-amp, --inductor-option
SMALL = dict(batch_size=16, updates_per_step=4, policy_frequency=2, actor_hidden_dim=16, critic_hidden_dim=32, num_atoms=21)


def rank_difference(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """max |rank0 - rank1| per tensor (gathered eagerly, outside any graph)."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().float().reshape(-1).contiguous().to(DEVICE)
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t)
        out[name] = float((parts[0] - parts[1]).abs().max()) if t.numel() else 0.0
    return out


def captured_all_reduce(device, replays: int) -> dict:
    a = torch.zeros(4096, device=device)
    b = torch.zeros(333, device=device)
    out = torch.zeros(4096 + 333, device=device)

    def body():
        flat = torch.cat([a * 1.0001, b.exp()])
        dist.all_reduce(flat)
        out.copy_(flat / 2)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    worst, wrong = 0.0, 0.0
    for _ in range(replays):
        a.copy_(torch.randn(a.shape, device=device, generator=g))
        b.copy_(torch.randn(b.shape, device=device, generator=g))
        graph.replay()
        worst = max(worst, rank_difference({"out": out})["out"])
        expect = torch.cat([a * 1.0001, b.exp()])  # eager reference of the same reduction
        dist.all_reduce(expect)
        wrong = max(wrong, float((expect / 2 - out).abs().max()))
    graph.reset()
    return {"max_rank_difference": worst, "max_difference_from_eager_all_reduce": wrong}


def config(mode: str) -> FlashSACConfig:
    return FlashSACConfig(**SMALL, learner_mode=mode, **CONFIG_OVERRIDES)


def rank_learner(device, mode: str) -> FlashSACLearner:
    torch.manual_seed(100 + dist.get_rank())  # different seeds: the learner must still start equal
    return FlashSACLearner(config(mode), process_group=True, device=device, **DIMS)


def train(learner: FlashSACLearner, device, iterations: int, after_iteration=None) -> None:
    """Each rank its own batches (rank-local replay), the same noise seeds on every rank."""
    rows = SMALL["batch_size"] * SMALL["updates_per_step"]
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for it in range(iterations):
        b = {k: v.to(device) for k, v in synthetic_batch(rows, generator=g, **DIMS).items()}
        torch.manual_seed(7 + it)
        learner.update(b)
        if after_iteration is not None:
            after_iteration()


def learner_run(device, mode: str, iterations: int) -> dict:
    learner = rank_learner(device, mode)
    per_iteration = []

    def compare() -> None:
        diff = rank_difference(dict(named_tensors(learner.state_dict())))
        per_iteration.append({k: v for k, v in diff.items() if v != 0.0})

    train(learner, device, iterations, compare)
    learner.release_graphs()
    return {"differing_tensors_per_iteration": per_iteration}


def apply_trace(device, iterations: int) -> list[dict]:
    """compile mode, every optimizer step between the ranks' average and the parameters:
    the ranks' largest difference in the step's inputs, in the parameters before it and after.

    The data-parallel learner takes the split update form (the all-reduce sits between loss
    and step), in which the engine compiles each network's ``apply`` on its own; the trace
    wraps each compiled ``apply`` from outside, so the compiled code is the one training runs."""
    learner = rank_learner(device, "compile")
    engine = learner.engine
    steps = {id(update.apply): (f"{name}_apply", update.params) for name, update in engine._networks.items()}
    compile_one = engine._compile
    events: list[dict] = []

    def compile_traced(fn):
        compiled = compile_one(fn)
        if id(fn) not in steps:
            return compiled
        name, param = steps[id(fn)]

        def traced(*args):
            inputs = rank_difference({f"input{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
            before = rank_difference({"param": param})["param"]
            out = compiled(*args)
            events.append({"step": name, "inputs": max(inputs.values()), "param_before": before,
                           "param_after": rank_difference({"param": param})["param"]})
            return out

        return traced

    engine._compile = compile_traced  # before the first update: the engine compiles on it
    train(learner, device, iterations)
    return events


def two_devices_one_process(iterations: int) -> dict:
    """No torch.distributed: the same learner state and batches on cuda:0 and cuda:1 in one
    process, compile mode. Differences here come from the per-device compiled code."""
    learners = []
    for index in range(2):
        device = torch.device("cuda", index)
        with torch.cuda.device(device):
            learners.append(FlashSACLearner(config("compile"), device=device, **DIMS))
    learners[1].load_state_dict(learners[0].state_dict())
    rows = SMALL["batch_size"] * SMALL["updates_per_step"]
    g = torch.Generator().manual_seed(1)
    per_iteration = []
    for it in range(iterations):
        batch = synthetic_batch(rows, generator=g, **DIMS)
        for learner in learners:
            with torch.cuda.device(learner.device):
                torch.manual_seed(7 + it)
                learner.update({k: v.to(learner.device) for k, v in batch.items()})
        s0, s1 = (dict(named_tensors(x.state_dict())) for x in learners)
        per_iteration.append({k: float((v.float() - s1[k].float().to(v.device)).abs().max()) for k, v in s0.items()
                              if v.numel() and not torch.equal(v, s1[k].to(v.device))})
    return {"differing_tensors_per_iteration": per_iteration}


def worker(rank: int, store: str, iterations: int, path: str, modes: tuple[str, ...], overrides: dict, cache_per_rank: bool) -> None:
    global DEVICE
    CONFIG_OVERRIDES.update(overrides)
    if cache_per_rank:  # each rank compiles and autotunes on its own (no shared Inductor cache)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"inductor_cache_rank{rank}_{os.getpid()}")
    os.environ.update(NCCL_NVLS_ENABLE="0")
    cuda = torch.cuda.is_available()  # without CUDA: a gloo rehearsal of the eager part
    DEVICE = device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # rendezvous through a file (no TCP port to race for), as the tests and benchmark_multigpu
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        report = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
        if cuda:
            report["captured_all_reduce"] = captured_all_reduce(device, 20)
        if not cuda:  # rehearsal: eager, and the trace through aot_eager (Inductor on CPU is slow)
            modes = tuple(m for m in modes if m in ("eager", "trace")) or ("eager",)
            CONFIG_OVERRIDES.setdefault("compile_backend", "aot_eager")
        for mode in modes:
            if mode == "trace":
                report["compile_apply_trace"] = apply_trace(device, iterations)
            else:
                report[mode] = learner_run(device, mode, iterations)
        if rank == 0:
            Path(path).write_text(json.dumps(report, indent=1))
        # both ranks leave their last collective before either tears the group down: a clean-clone
        # CI run once saw rank 0 abort in gloo's teardown ("terminate called without an active
        # exception") while rank 1 was still finishing
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--output", default="diagnose_nccl_graph.json")
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "compile", "graph", "trace"],
                        help="trace: compile mode with every optimizer step's inputs and parameters compared")
    parser.add_argument("--no-amp", action="store_true", help="fp32 throughout (default: bf16 autocast on CUDA)")
    parser.add_argument("--inductor-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. combo_kernels=False")
    parser.add_argument("--cache-per-rank", action="store_true", help="a fresh Inductor cache per rank")
    parser.add_argument("--two-devices", action="store_true", help="also: one process, cuda:0 vs cuda:1, no torch.distributed")
    args = parser.parse_args()
    overrides: dict = {"use_amp": False} if args.no_amp else {}
    if args.inductor_option:
        overrides["inductor_options"] = {k: {"True": True, "False": False}.get(v, v) for k, v in (o.split("=", 1) for o in args.inductor_option)}
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(os.path.join(tmp, "rendezvous"), args.iterations, args.output, tuple(args.modes),
                                         overrides, args.cache_per_rank), nprocs=2, start_method="spawn")
    report = json.loads(Path(args.output).read_text())
    report["environment"] = run_environment("cuda" if torch.cuda.is_available() else "cpu")
    report["command"] = " ".join(["python", *sys.argv])
    report["options"] = {"no_amp": args.no_amp, "inductor_options": overrides.get("inductor_options"), "cache_per_rank": args.cache_per_rank}
    if args.two_devices and torch.cuda.device_count() >= 2:
        CONFIG_OVERRIDES.update(overrides)
        report["two_devices_one_process"] = two_devices_one_process(args.iterations)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
