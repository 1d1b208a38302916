"""Wait-first Programmatic Dependent Launch (flashsac_opt/pdl.py): the source rewrite, when the
codegen hook acts, the cache keys it changes, and (on a Hopper GPU) the kernels Inductor emits."""

from __future__ import annotations

import re

import pytest
import torch

from flashsac_opt import pdl

# What Inductor's TritonKernel.codegen_kernel returns, shortened (torch 2.13's layout, with its own
# PDL placement: the load of in_ptr1, not written by the scheduler's previous node, runs before
# the wait), followed by the benchmark harness that config.benchmark_kernel appends.
POINTWISE = '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics

@triton_heuristics.pointwise(
    size_hints={'x': 1024},
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*fp32', 'in_ptr1': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'launch_pdl': True},
    inductor_meta={'kernel_name': 'triton_poi_fused_add_relu_0'},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_add_relu_0(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 1024
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tmp1 = tl.load(in_ptr1 + (x0), xmask)
    tl.extra.cuda.gdc_wait()
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tl.extra.cuda.gdc_launch_dependents()
    tmp2 = tmp0 + tmp1
    tmp3 = tl.full([1], 0, tl.int32)
    tmp4 = triton_helpers.maximum(tmp3, tmp2)
    tl.store(out_ptr0 + (x0), tmp4, xmask)

def get_args():
    from torch._dynamo.testing import rand_strided
    return [rand_strided((1024,), (1,), device='cuda:0', dtype=torch.float32)]
'''

COMBO = '''
@triton_heuristics.foreach(
    num_warps=8,
    triton_meta={'launch_pdl': True},
)
@triton.jit
def triton_poi_fused_1(in_ptr0, out_ptr0, out_ptr1, xnumel_0, xnumel_1):
    pid = tl.program_id(0)
    num_xblocks_0 = tl.cdiv(xnumel_0, XBLOCK)
    if pid < num_xblocks_0:
        tmp0 = tl.load(in_ptr0 + (x0), xmask)
        tl.store(out_ptr0 + (x0), tmp0, xmask)
    elif pid < num_xblocks_1:
        tmp1 = tl.full([XBLOCK], 0.0, tl.float32)
        tl.store(out_ptr1 + (x1), tmp1, xmask)
    else:
        pass
'''


def _kernel_body(source: str) -> list[str]:
    """The statements of the @triton.jit function, in order."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"def [\w.]+\(", line))
    body = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        if line.strip():
            body.append(line)
    return body


@pytest.mark.parametrize("source", [POINTWISE, COMBO], ids=["pointwise", "combo"])
def test_wait_first_puts_the_wait_before_every_memory_access_and_changes_nothing_else(source):
    rewritten = pdl.wait_first(source)
    body = _kernel_body(rewritten)
    assert body[0] == "    " + pdl.GDC_WAIT
    assert body[1:] == _kernel_body(source)  # every original statement kept, in order
    first_access = min(i for i, line in enumerate(body) if "tl.load(" in line or "tl.store(" in line)
    assert first_access > 0
    # nothing outside the kernel moves: the harness's get_args is untouched
    assert rewritten.replace("    " + pdl.GDC_WAIT + "\n", "", 1) == source
    assert pdl.wait_first(rewritten) == rewritten  # idempotent


@pytest.mark.parametrize("source", [POINTWISE, COMBO], ids=["pointwise", "combo"])
def test_trigger_first_launches_the_dependents_right_after_the_wait_and_nowhere_else(source):
    rewritten = pdl.wait_first(source, trigger_first=True)
    body = _kernel_body(rewritten)
    assert body[:2] == ["    " + pdl.GDC_WAIT, "    " + pdl.GDC_LAUNCH]
    assert [line.strip() for line in body].count(pdl.GDC_LAUNCH) == 1  # Inductor's later trigger dropped
    assert body[2:] == [line for line in _kernel_body(source) if line.strip() != pdl.GDC_LAUNCH]
    assert pdl.wait_first(rewritten, trigger_first=True) == rewritten  # idempotent
    # and from the wait-first form (a kernel rewritten once already) to the same result
    assert pdl.wait_first(pdl.wait_first(source), trigger_first=True) == rewritten


def test_wait_first_reads_inductors_placeholder_name_and_a_long_signature():
    # at codegen time torch 2.11 names the kernel by its placeholder, which is not Python
    source = POINTWISE.replace("def triton_poi_fused_add_relu_0(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):",
                               "def Placeholder.KERNEL_NAME(in_ptr0, in_ptr1,\n        out_ptr0, xnumel, XBLOCK : tl.constexpr):")
    assert source != POINTWISE
    rewritten = pdl.wait_first(source)
    lines = rewritten.splitlines()
    signature_end = lines.index("        out_ptr0, xnumel, XBLOCK : tl.constexpr):")
    assert lines[signature_end + 1] == "    " + pdl.GDC_WAIT
    assert lines[signature_end + 2] == "    xnumel = 1024"


@pytest.mark.parametrize("source", [
    "import triton\n\ndef get_args():\n    return []\n",  # no kernel
    COMBO + COMBO,  # two kernels
    "@triton.jit\n",  # a decorator and nothing under it
], ids=["none", "two", "truncated"])
def test_wait_first_refuses_a_module_it_cannot_read(source):
    with pytest.raises(ValueError, match="@triton.jit"):
        pdl.wait_first(source)


def test_the_hook_rewrites_only_compiles_that_carry_the_key():
    def codegen_kernel(self, name=None):
        return POINTWISE

    hooked = pdl._wrap(codegen_kernel)
    config = torch._inductor.config
    with config.patch({"triton.enable_pdl": True, "post_grad_custom_pre_pass": pdl.cache_key(trigger_first=False)}):
        assert _kernel_body(hooked(object())) == _kernel_body(pdl.wait_first(POINTWISE))  # the wait only
    with config.patch({"triton.enable_pdl": True, "post_grad_custom_pre_pass": pdl.cache_key()}):  # the default
        assert _kernel_body(hooked(object())) == _kernel_body(pdl.wait_first(POINTWISE, trigger_first=True))
        assert [line.strip() for line in _kernel_body(hooked(object()))[:2]] == [pdl.GDC_WAIT, pdl.GDC_LAUNCH]
    with config.patch({"triton.enable_pdl": True}):  # PDL without the key: Inductor's code as it is
        assert hooked(object()) == POINTWISE
    with config.patch({"triton.enable_pdl": False, "post_grad_custom_pre_pass": pdl.cache_key()}):
        assert hooked(object()) == POINTWISE


def test_install_wraps_inductors_triton_and_combo_kernels_once():
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.triton_combo_kernel import ComboKernel

    pdl.install()
    first = (TritonKernel.codegen_kernel, ComboKernel.codegen_kernel)
    pdl.install()
    assert (TritonKernel.codegen_kernel, ComboKernel.codegen_kernel) == first
    for method in first:
        assert getattr(method, pdl._INSTALLED_ATTRIBUTE)
        assert not getattr(method.__wrapped__, pdl._INSTALLED_ATTRIBUTE, False)  # one layer, not two


def test_the_key_names_this_implementation():
    key = pdl.cache_key(trigger_first=False)
    assert key is pdl.cache_key(False) is pdl.cache_key(trigger_first=0)  # one instance per placement
    assert key.uuid() == pdl._source_hash() and key.uuid().startswith("flashsac_opt-pdl-wait-first-")
    assert repr(key) == f"flashsac_opt.pdl.CacheKey({key.uuid()})"  # no address: compile_cache's key is stable
    trigger = pdl.cache_key()  # the default placement
    assert trigger is pdl.cache_key(True) is pdl.cache_key(trigger_first=True)
    assert trigger.uuid() != key.uuid() and repr(trigger) != repr(key)
    import copy
    assert [pdl.key_placement(k) for k in (key, trigger, copy.deepcopy(trigger))] == ["wait_first", "trigger_first", "trigger_first"]
    assert pdl.key_placement(lambda graph: None) is None and pdl.key_placement(None) is None
    graph = torch.fx.symbolic_trace(lambda x: x + 1).graph
    before = str(graph)
    key(graph)
    assert str(graph) == before  # the pass changes nothing


def test_the_key_separates_inductors_cache_entries():
    """A compile with the key never reuses an entry made without it, and finds its own."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_inductor_cache

    def fn(x):
        return (x * 2).relu().sum()

    def compile_once(options):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(fn, options=options, fullgraph=True)(torch.ones(8))
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    with fresh_inductor_cache():
        assert compile_once({"triton.enable_pdl": True}) == (0, 1)
        assert compile_once(pdl.inductor_options(trigger_first=False)) == (0, 1)  # not the entry without the key
        assert compile_once(pdl.inductor_options(trigger_first=False)) == (1, 0)
        assert compile_once(pdl.inductor_options()) == (0, 1)  # nor the other placement's
        assert compile_once(pdl.inductor_options()) == (1, 0)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("trigger_first", [False, True], ids=["wait_only", "trigger_first"])
def test_every_generated_kernel_waits_first_on_hopper(trigger_first):
    """Graph mode's options on the GPU (trigger_first: the default; else the wait-only
    placement asked for): every Triton kernel (combo kernels included) is launched with PDL and
    waits before anything else, trigger-first then launches its dependents; the values are eager's."""
    from torch._inductor.utils import run_and_get_code

    from flashsac_opt.engine import inductor_options

    device = torch.device("cuda", 0)
    if not pdl.supported(device):
        pytest.skip("PDL needs compute capability 9.0")

    def fn(x, w, b):
        # a GEMM, reductions and several independent small outputs (combo kernel material)
        h = torch.relu(x @ w + b)
        h = (h - h.mean(0)) * torch.rsqrt(h.var(0, correction=0) + 1e-5)
        return h.sum(1), (w * 0.5).norm(dim=1), torch.zeros(7, device=x.device) + b[:7]

    args = (torch.randn(256, 64, device=device), torch.randn(64, 64, device=device), torch.randn(64, device=device))
    torch._dynamo.reset()
    extra = None if trigger_first else {"post_grad_custom_pre_pass": pdl.cache_key(trigger_first=False)}
    compiled = torch.compile(fn, options=inductor_options("graph", device, extra, rows=256), fullgraph=True)
    result, codes = run_and_get_code(compiled, *args)
    kernels = re.findall(r"@triton\.jit\n(def triton_\w+\(.*?)(?=\n\S|\Z)", "\n".join(codes), flags=re.DOTALL)
    assert kernels, "no Triton kernel generated"
    for kernel in kernels:
        body = [line.strip() for line in _kernel_body(kernel)]
        assert body[0] == pdl.GDC_WAIT, kernel[:200]
        if trigger_first:
            assert body[1] == pdl.GDC_LAUNCH and body.count(pdl.GDC_LAUNCH) == 1, kernel[:400]
        else:
            assert body[1] != pdl.GDC_LAUNCH, kernel[:400]
    assert "'launch_pdl': True" in "\n".join(codes)
    for got, want in zip(result, fn(*args), strict=True):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()
