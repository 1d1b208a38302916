"""What AOTAutograd's partitioner keeps for a backward: a recording torch.compile backend.

The partitioner Inductor uses (min-cut rematerialization) decides which forward values the
backward reads back. ``recording_backend`` runs it on whatever the learner compiles, runs the
resulting graphs eagerly (nothing is generated), and records every backward graph's saved
tensors (shape, dtype, bytes) and the GEMMs of both graphs. Used by
experiments/bench/saved_activations.py and by the tests of the options that change what is saved.
"""

from __future__ import annotations

import torch

GEMM_OPS = ("mm", "bmm", "addmm", "baddbmm")


def gemm_count(graph: torch.fx.GraphModule) -> int:
    """GEMM nodes in a graph: a backward with more than the default has recomputed some."""
    return sum(1 for n in graph.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in GEMM_OPS)


def saved_tensors(bw_graph: torch.fx.GraphModule) -> list[dict]:
    """The backward graph's inputs that are not incoming gradients: what the forward saved."""
    saved = []
    for node in bw_graph.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # symbolic sizes, RNG seeds as ints
        saved.append(
            {"name": node.name, "shape": list(val.shape), "dtype": str(val.dtype).removeprefix("torch."),
             "bytes": val.numel() * val.element_size()}
        )
    return saved


def recording_backend(graphs: list[dict]):
    """A torch.compile backend: AOTAutograd with Inductor's partitioner, graphs run eagerly;
    appends {"saved": saved_tensors, "forward_gemms", "backward_gemms"} per backward graph."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    forward_gemms: list[int] = []

    def fw_compiler(gm, example_inputs):
        forward_gemms.append(gemm_count(gm))
        return make_boxed_func(gm.forward)

    def bw_compiler(gm, example_inputs):
        # A loss's backward is compiled at its first autograd.grad, before the next loss's forward.
        graphs.append({"saved": saved_tensors(gm), "forward_gemms": forward_gemms[-1], "backward_gemms": gemm_count(gm)})
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=min_cut_rematerialization_partition)


def saved_bytes(graph: dict) -> int:
    """The bytes one recorded backward graph takes from its forward."""
    return sum(t["bytes"] for t in graph["saved"])
