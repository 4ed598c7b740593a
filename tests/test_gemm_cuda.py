"""GPU tests of the CUDA grouped GEMM (csrc/cuda): forward, both gradients, every backend.

Every test runs once per requested backend (the autouse `backend` fixture: cutlass, torch,
fallback; see csrc/cuda/gemm_cuda.cpp). A case the requested backend cannot run (fp32, K or N
not a multiple of 8; torch: anything but bf16 on sm 9.0/10.0) takes the tiled fallback, so each
run covers the requested backend where it applies and the fallback elsewhere. Outputs are
allocated from a NaN-poisoned pool, so an element that no kernel writes shows up as NaN.
Skipped without a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from _cuda_helpers import (
    PATTERNS,
    assert_close_to,
    assert_in_poisoned,
    clamp_offs,
    group_sizes,
    make_offs,
    poisoned_pool,
    reference_gemm,
    reference_wgrad,
)

import grouped_ep

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BACKENDS = ["cutlass", "torch", "fallback"]


@pytest.fixture(params=BACKENDS, autouse=True)
def backend(request, monkeypatch):
    """Runs the test with this backend requested (also in subprocesses, by the env var)."""
    grouped_ep.set_backend(request.param)
    monkeypatch.setenv("GROUPED_EP_BACKEND", request.param)
    yield request.param
    grouped_ep.set_backend(None)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TAIL = 5  # rows past offs[-1], which must come out as exact zeros


def _inputs(sizes, k, n, dtype, trans_w, seed=0, tail=TAIL, offs_dtype=torch.int32):
    """x [T, K] (T = sum(sizes) + tail), w [E, K, N] or [E, N, K], offs. Unit-scale outputs."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(sizes) + tail
    x = torch.randn(t, k, device=DEV, generator=gen).to(dtype)
    shape = (len(sizes), n, k) if trans_w else (len(sizes), k, n)
    w = (torch.randn(shape, device=DEV, generator=gen) / max(k, 1) ** 0.5).to(dtype)
    return x, w, make_offs(sizes, DEV, offs_dtype)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("trans_w", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward(dtype, trans_w, pattern):
    rng = random.Random(f"fwd-{pattern}-{trans_w}")
    groups = 256 if pattern in ("skewed", "one_row") else 7
    sizes = group_sizes(pattern, groups, rng)
    x, w, offs = _inputs(sizes, 64, 48, dtype, trans_w, seed=len(sizes))
    with poisoned_pool(DEV) as spans:
        out = grouped_ep.gemm(x, w, offs, trans_w=trans_w)
        assert_in_poisoned(out, spans)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "some output elements were never written (NaN poison)"
    used = sum(sizes)
    assert (out[used:] == 0).all(), "rows past offs[-1] must be exact zeros"
    assert_close_to(out, reference_gemm(x, w, offs, trans_w), dtype, "gemm")


def _check_backward(sizes, k, n, dtype, trans_w, seed=0, offs_dtype=torch.int32):
    x, w, offs = _inputs(sizes, k, n, dtype, trans_w, seed=seed, offs_dtype=offs_dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    with poisoned_pool(DEV) as spans:
        out = grouped_ep.gemm(x, w, offs, trans_w=trans_w)
        assert_in_poisoned(out, spans)
    # The backward runs on autograd's device thread, outside the pool: test_forward and
    # test_wgrad_direct_empty_groups cover the poisoned gradient kernels.
    dy = torch.randn_like(out)
    out.backward(dy)
    torch.cuda.synchronize()
    xd, wd = x.detach(), w.detach()
    assert_close_to(out.detach(), reference_gemm(xd, wd, offs, trans_w), dtype, "gemm")
    # dx_g = dy_g w_g^T (the forward op with trans_w flipped); dw = the ragged-K product.
    assert_close_to(x.grad, reference_gemm(dy, wd, offs, not trans_w), dtype, "dx")
    assert_close_to(w.grad, reference_wgrad(xd, dy, offs, trans_w), dtype, "dw")
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    used = sum(sizes)
    assert (x.grad[used:] == 0).all(), "dx rows past offs[-1] must be exact zeros"
    for g, s in enumerate(sizes):
        if s == 0:
            assert (w.grad[g] == 0).all(), f"dw of empty group {g} must be exact zeros"


@pytest.mark.parametrize("pattern", ["empty_group", "odd", "skewed", "random"])
@pytest.mark.parametrize("trans_w", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward(dtype, trans_w, pattern):
    rng = random.Random(f"bwd-{pattern}-{trans_w}")
    groups = 64 if pattern == "skewed" else 9
    _check_backward(group_sizes(pattern, groups, rng), 128, 96, dtype, trans_w, seed=groups)


# Expert projections of real models, so that every tile and pipeline path runs: K up to 2048
# (the K-stage ring of the CUTLASS mainloop wraps many times), N up to 2048 and N = 520 (several
# 256-wide tiles, the last one partial), groups of up to 700 rows (several 128-row tiles, both
# CTAs of a 2x1 cluster, partial tiles), and the ragged-K weight gradient with P, Q up to 2048.
MODEL_SHAPES = {
    "qwen3_up": (2048, 1536),  # hidden -> 2 x moe_intermediate (gate_up)
    "qwen3_down": (768, 2048),  # moe_intermediate -> hidden
    "odd_n": (1024, 520),
}
MODEL_SIZES = [0, 1, 129, 700, 255, 256, 3, 0, 513, 64, 17, 128]


@pytest.mark.parametrize("shape", list(MODEL_SHAPES), ids=list(MODEL_SHAPES))
@pytest.mark.parametrize("trans_w", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_model_shapes(dtype, trans_w, shape):
    k, n = MODEL_SHAPES[shape]
    _check_backward(MODEL_SIZES, k, n, dtype, trans_w, seed=k + n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_many_experts_top8(dtype):
    """128 experts, routing like Qwen3-30B-A3B at 512 tokens x top-8: many small and empty
    groups in one launch (the persistent scheduler switches group on nearly every tile)."""
    rng = random.Random(128)
    sizes = [rng.choice((0, 0, 1, 7, 31, 32, 33, 64, 100)) for _ in range(128)]
    _check_backward(sizes, 256, 384, dtype, trans_w=True, seed=128)


@pytest.mark.parametrize("kn", [(13, 48), (64, 20), (7, 5)], ids=["k13", "n20", "k7_n5"])
@pytest.mark.parametrize("trans_w", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_unaligned_fallback(dtype, trans_w, kn):
    """K or N not a multiple of 8: the fallback kernel, forward and both gradients."""
    k, n = kn
    _check_backward([5, 0, 17, 1, 33, 0], k, n, dtype, trans_w)


def test_wgrad_direct_empty_groups():
    """gemm_wgrad called directly, both layouts, groups of 0 rows in every position."""
    sizes = [0, 3, 0, 0, 70, 1, 0]
    for dtype in DTYPES:
        x, _, offs = _inputs(sizes, 40, 24, dtype, False, tail=0)
        dy = torch.randn(x.shape[0], 24, device=DEV).to(dtype)
        for trans_w in (False, True):
            with poisoned_pool(DEV) as spans:
                out = grouped_ep.gemm_wgrad(x, dy, offs, trans_w=trans_w)
                assert_in_poisoned(out, spans)
            torch.cuda.synchronize()
            assert_close_to(out, reference_wgrad(x, dy, offs, trans_w), dtype, "gemm_wgrad")
            assert (out[[0, 2, 3, 6]] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int64_offs(dtype):
    _check_backward([10, 0, 31, 8], 32, 16, dtype, trans_w=True, offs_dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_non_contiguous_inputs(dtype):
    sizes = [12, 0, 9]
    x_big, w, offs = _inputs(sizes, 64, 32, dtype, trans_w=False)
    x = x_big[:, ::2]  # [T, 32], row stride 64
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 64, 32] viewed, N-major storage
    w_use = w_t[:, ::2, :]  # [E, 32, 32]
    out = grouped_ep.gemm(x, w_use, offs)
    assert_close_to(out, reference_gemm(x, w_use, offs), dtype, "gemm on strided inputs")
    dy = torch.randn(x.shape[0], 32, device=DEV).to(dtype)[:, :].t().contiguous().t()
    dw = grouped_ep.gemm_wgrad(x, dy, offs)
    assert_close_to(dw, reference_wgrad(x, dy, offs), dtype, "gemm_wgrad on strided inputs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bad_offs_are_clamped(dtype):
    """CUDA cannot validate offs without a sync: decreasing / negative / past-T offsets are
    clamped (running max, then [0, T]) and never read or write out of bounds."""
    x, w, _ = _inputs([8, 8, 8], 32, 16, dtype, False, tail=0)  # T = 24
    for bad in ([5, 3, 30], [-4, 10, 9], [30, 40, 50]):
        offs = torch.tensor(bad, dtype=torch.int32, device=DEV)
        clamped = clamp_offs(offs, x.shape[0])
        out = grouped_ep.gemm(x, w, offs)
        assert_close_to(out, reference_gemm(x, w, clamped), dtype, f"gemm with offs={bad}")
        dy = torch.randn(x.shape[0], 16, device=DEV).to(dtype)
        dw = grouped_ep.gemm_wgrad(x, dy, offs)
        assert_close_to(dw, reference_wgrad(x, dy, clamped), dtype, f"wgrad with offs={bad}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replay_with_new_routing(dtype):
    """Capture forward + backward once; change offs and x in place; replay; compare."""
    groups, k, n, t = 8, 64, 32, 300
    rng = random.Random(0)
    x = torch.randn(t, k, device=DEV).to(dtype)
    w = (torch.randn(groups, n, k, device=DEV) / k**0.5).to(dtype).requires_grad_(True)
    offs = make_offs(group_sizes("random", groups, rng), DEV)
    offs.clamp_(max=t)
    dy = torch.randn(t, n, device=DEV).to(dtype)
    x_in = x.clone().requires_grad_(True)

    def step():
        out = grouped_ep.gemm(x_in, w, offs, trans_w=True)
        dx, dw = torch.autograd.grad(out, (x_in, w), dy)
        return out, dx, dw

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up (per-device caches, cuBLAS-free, but allocator and attributes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    for trial in range(3):
        sizes = group_sizes(("skewed", "empty_group", "odd")[trial], groups, rng)
        while sum(sizes) > t:
            sizes[sizes.index(max(sizes))] //= 2
        offs.copy_(make_offs(sizes, DEV))
        with torch.no_grad():
            x_in.copy_(torch.randn(t, k, device=DEV).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        xd, wd = x_in.detach(), w.detach()
        out, dx, dw = outs
        assert_close_to(out, reference_gemm(xd, wd, offs, True), dtype, f"replay {trial}: out")
        assert_close_to(dx, reference_gemm(dy, wd, offs, False), dtype, f"replay {trial}: dx")
        assert_close_to(dw, reference_wgrad(xd, dy, offs, True), dtype, f"replay {trial}: dw")
        assert (out[sum(sizes) :] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("trans_w", [False, True], ids=["w_kn", "w_nk"])
def test_opcheck(dtype, trans_w):
    x, w, offs = _inputs([4, 0, 9, 3], 16, 24, dtype, trans_w)
    torch.library.opcheck(torch.ops.grouped_ep.gemm.default, (x, w, offs), {"trans_w": trans_w})
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.grouped_ep.gemm.default, (xg, wg, offs), {"trans_w": trans_w})
    dy = torch.randn(x.shape[0], 24, device=DEV).to(dtype)
    torch.library.opcheck(
        torch.ops.grouped_ep.gemm_wgrad.default, (x, dy, offs), {"trans_w": trans_w}
    )


def _kernel_names(fn) -> str:
    """Names of the CUDA kernels `fn` launches (CUPTI demangles them), one string."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return "\n".join(e.key for e in prof.key_averages())


def test_dispatch_path(backend):
    """The kernel each dtype/shape runs with the requested backend on this device: the one
    grouped_ep.backend.backend_for names (see csrc/cuda/gemm_cuda.cpp)."""
    from grouped_ep.backend import backend_for

    cases = {
        "aligned bf16": (torch.bfloat16, 64, 32),
        "aligned fp16": (torch.float16, 64, 32),
        "fp32": (torch.float32, 64, 32),
        "unaligned bf16": (torch.bfloat16, 60, 32),
    }
    ours = ("fwd_kernel", "sm80::grouped_kernel")
    cutlass_kernels = grouped_ep.backend_info().devices[torch.cuda.current_device()].cutlass_kernels
    for name, (dtype, k, n) in cases.items():
        x, w, offs = _inputs([30, 0, 50], k, n, dtype, trans_w=False)
        names = _kernel_names(lambda x=x, w=w, offs=offs: grouped_ep.gemm(x, w, offs))
        ran, reason = backend_for(dtype, k, n)
        if name.startswith("unaligned") or dtype == torch.float32:
            assert ran == "fallback", (name, ran, reason)
        elif backend == "fallback":
            assert ran == "fallback", (name, ran, reason)
        if ran == "fallback":
            expected = ["fwd_kernel"]
        elif ran == "cutlass" and cutlass_kernels == "sm90a":
            expected = ["GemmUniversal"]  # cutlass::device_kernel<...GemmUniversal<...>>
        elif ran == "cutlass":
            expected = ["sm80::grouped_kernel"]
        else:  # torch: its own kernel, none of ours but the offs clamp and the zero fill
            expected = ["zero_tail_rows"]
            assert not any(k in names for k in ours), names
            assert "setup_kernel" not in names, names
        for kernel in expected:
            assert kernel in names, (
                f"{name}: expected a kernel {kernel!r} ({reason}), ran:\n{names}"
            )
        assert "clamp_offs" in names or "setup_kernel" in names, names


@pytest.mark.xdist_group("over_2_31")  # under pytest-xdist, one worker: 15-30 GB each
@pytest.mark.parametrize(
    "dtype,k,n",
    [(torch.bfloat16, 128, 128), (torch.float32, 127, 127)],
    ids=["cutlass", "fallback"],
)
def test_more_than_2_31_elements(dtype, k, n):
    """x, out and dy over 2^31 elements: groups that start past element 2^31 are correct."""
    tail_sizes = [1000, 2000]
    t = (1 << 31) // k + 4096
    elem = torch.empty((), dtype=dtype).element_size()
    # x [t, k] lives throughout; out [t, n] and then dy [t, n] (out is freed first, but count
    # both), plus 1 GiB for dw, workspaces, the fp64 slices and the CUDA context.
    need = t * k * elem + 2 * t * n * elem + (1 << 30)
    total = torch.cuda.get_device_properties(DEV).total_memory
    if total < need:  # only a missing GPU skips; our GPUs have 80-140 GB
        pytest.fail(
            f"needs {need / 2**30:.1f} GiB of GPU memory for >2^31-element tensors, but "
            f"{torch.cuda.get_device_name(DEV)} has {total / 2**30:.1f} GiB in total"
        )
    sizes = [t - sum(tail_sizes)] + tail_sizes
    offs = make_offs(sizes, DEV)
    x = torch.empty(t, k, device=DEV, dtype=dtype).normal_()
    w = (torch.randn(3, k, n, device=DEV) / k**0.5).to(dtype)
    assert x.numel() > 2**31
    out = grouped_ep.gemm(x, w, offs)
    assert out.numel() > 2**31
    s = sizes[0]
    for g in (1, 2):
        e = s + sizes[g]
        assert_close_to(out[s:e], (x[s:e].double() @ w[g].double()), dtype, f"gemm group {g}")
        s = e
    assert_close_to(out[:64], x[:64].double() @ w[0].double(), dtype, "gemm group 0 head")
    del out
    dy = torch.empty(t, n, device=DEV, dtype=dtype).normal_()
    dw = grouped_ep.gemm_wgrad(x, dy, offs)
    s = sizes[0]
    for g in (1, 2):
        e = s + sizes[g]
        ref = x[s:e].double().t() @ dy[s:e].double()
        # [1, K, N] slices, so the tolerance is scaled per expert (as for a whole dw).
        assert_close_to(dw[g : g + 1], ref[None], dtype, f"wgrad group {g}")
        s = e
