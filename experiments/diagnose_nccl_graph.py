"""Where do two NCCL ranks of a data-parallel learner stop being bit-identical? (issue 7)

Two processes, one GPU each. (1) A captured all-reduce on its own: a graph holding
cat -> all_reduce -> /2 -> copy, replayed on new inputs; the ranks' outputs compared after
every replay. (2) The data-parallel learner in eager and graph mode: after every iteration
the ranks' parameters are gathered (outside any graph) and compared; prints the first
iteration and tensor that differ, and by how much.
    python experiments/diagnose_nccl_graph.py [--iterations 6] > diagnose.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashsac_opt.config import FlashSACConfig  # noqa: E402
from flashsac_opt.data_parallel import named_tensors  # noqa: E402
from flashsac_opt.learner import FlashSACLearner  # noqa: E402
from flashsac_opt.oracle import synthetic_batch  # noqa: E402

DIMS = {"obs_dim": 12, "critic_obs_dim": 15, "action_dim": 4}
DEVICE = torch.device("cpu")  # set per rank
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


def learner_run(device, mode: str, iterations: int) -> dict:
    torch.manual_seed(100 + dist.get_rank())
    learner = FlashSACLearner(FlashSACConfig(**SMALL, learner_mode=mode), process_group=True, device=device, **DIMS)
    rows = SMALL["batch_size"] * SMALL["updates_per_step"]
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    per_iteration = []
    for it in range(iterations):
        b = {k: v.to(device) for k, v in synthetic_batch(rows, generator=g, **DIMS).items()}
        torch.manual_seed(7 + it)
        learner.update(b)
        diff = rank_difference(dict(named_tensors(learner.state_dict())))
        per_iteration.append({k: v for k, v in diff.items() if v != 0.0})
    learner.release_graphs()
    return {"differing_tensors_per_iteration": per_iteration}


def worker(rank: int, port: int, iterations: int, path: str, modes: tuple[str, ...]) -> None:
    global DEVICE
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    cuda = torch.cuda.is_available()  # without CUDA: a gloo rehearsal of the eager part
    DEVICE = device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2)
    try:
        report = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
        if cuda:
            report["captured_all_reduce"] = captured_all_reduce(device, 20)
        for mode in modes if cuda else ("eager",):
            report[mode] = learner_run(device, mode, iterations)
        if rank == 0:
            Path(path).write_text(json.dumps(report, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--output", default="diagnose_nccl_graph.json")
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "compile", "graph"])
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, args.iterations, args.output, tuple(args.modes)), nprocs=2, start_method="spawn")
    print(Path(args.output).read_text())
