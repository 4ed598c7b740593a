"""Grouped GEMM: grouped_ep vs torch._grouped_mm, a per-expert torch.mm loop, and dense torch.mm
at equal FLOPs, forward and forward+backward, balanced and Zipf-skewed routing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import grouped_ep
from suites._timing import interleaved_medians

TITLE = "grouped GEMM (GFLOP/s; *_x = grouped_ep speed / baseline speed)"


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    k: int
    n: int
    rows: int  # routed token rows (tokens x top-k)
    trans_w: bool = True  # the Hugging Face layout [E, N, K]


# Scaled for a 2-core CPU; the shapes of issue 15 (a few wide experts, middle cases, many small
# groups), plus one in the [E, K, N] layout.
CPU_CASES = [
    Case("E8-K1024-N1024", 8, 1024, 1024, 4096),
    Case("E32-K768-N512", 32, 768, 512, 4096),
    Case("E64-K512-N256", 64, 512, 256, 8192),
    Case("E128-K256-N128", 128, 256, 128, 8192),
    Case("E64-K256-N256-KN", 64, 256, 256, 8192, trans_w=False),
]
CPU_QUICK = [CPU_CASES[0], CPU_CASES[3]]


# Expert projections of real MoE models (gate_up: K=hidden, N=2*inter; down: K=inter, N=hidden).
def _gpu_cases(quick: bool) -> list[Case]:
    models = [
        ("qwen3-30b-a3b", 128, 2048, 768, 8),
        ("deepseek-v3-ep8", 32, 7168, 2048, 1),  # 256 experts top-8 over EP=8: 32 local, ~T rows
        ("mixtral-8x7b", 8, 4096, 14336, 2),
        ("gpt-oss-120b", 128, 2880, 2880, 4),
    ]
    tokens = [4096, 16384] if quick else [4096, 16384, 65536]
    out = []
    for name, e, hidden, inter, top_k in models:
        for t in tokens:
            rows = t * top_k
            out.append(Case(f"{name}-up-T{t}", e, hidden, 2 * inter, rows))
            out.append(Case(f"{name}-down-T{t}", e, inter, hidden, rows))
    return out


def group_sizes(rows: int, experts: int, routing: str, seed: int = 0) -> list[int]:
    if routing == "balanced":
        return [rows // experts + (1 if i < rows % experts else 0) for i in range(experts)]
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([1.0 / (i + 1) ** 1.2 for i in range(experts)])
    p = p[torch.randperm(experts, generator=g)]
    picks = torch.multinomial(p, rows, replacement=True, generator=g)
    return torch.bincount(picks, minlength=experts).tolist()


def _impls(offs, sizes, trans_w):
    """name -> callable(x, w) returning [T, N]. `dense` gets the [K, N] weight as its `w`."""

    def ours(x, w):
        return grouped_ep.gemm(x, w, offs, trans_w=trans_w)

    def grouped_mm(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2) if trans_w else w, offs=offs)

    def loop(x, w):
        # split/unbind: one cat/stack in backward (indexing per group would build a full-size
        # zero gradient per group and make the baseline look slower than it need be).
        pairs = zip(x.split(sizes), w.unbind(0))
        return torch.cat([xg @ (wg.t() if trans_w else wg) for xg, wg in pairs])

    def dense(x, w):
        return x @ w

    return {"grouped_ep": ours, "grouped_mm": grouped_mm, "loop": loop, "dense": dense}


_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _check(impls, x, w, dy, backward: bool) -> float:
    """Largest relative error of grouped_ep's output (and dx, dw) against the fp32 loop."""
    xi, wi = (t.detach().requires_grad_(backward) for t in (x, w))
    xr, wr = (t.detach().float().requires_grad_(backward) for t in (x, w))
    got, want = impls["grouped_ep"](xi, wi), impls["loop"](xr, wr)
    pairs = [(got, want)]
    if backward:
        got.backward(dy)
        want.backward(dy.float())
        pairs += [(xi.grad, xr.grad), (wi.grad, wr.grad)]
    return max(
        float(
            (a.detach().float() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30)
        )
        for a, b in pairs
    )


def _measure(case: Case, routing: str, dtype, device: str, backward: bool, reps: int) -> dict:
    sizes = group_sizes(case.rows, case.experts, routing)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    x = (torch.randn(case.rows, case.k, device=device) / math.sqrt(case.k)).to(dtype)
    wshape = (case.experts, case.n, case.k) if case.trans_w else (case.experts, case.k, case.n)
    w = torch.randn(wshape, device=device).to(dtype)
    dense_w = torch.randn(case.k, case.n, device=device).to(dtype)
    dy = torch.randn(case.rows, case.n, device=device).to(dtype)
    flops = 2.0 * case.rows * case.k * case.n * (3 if backward else 1)
    impls = _impls(offs, sizes, case.trans_w)
    row = {
        "case": case.name,
        "routing": routing,
        "dtype": str(dtype).replace("torch.", ""),
        "pass": "fwd+bwd" if backward else "fwd",
        "max_group": max(sizes),
        "empty_groups": sum(1 for s in sizes if s == 0),
    }
    if device.startswith("cuda"):
        # The backend grouped_ep ran (GROUPED_EP_BACKEND picks it).
        row["backend"] = grouped_ep.backend.backend_for(dtype, case.k, case.n)[0]
    # What is timed must be right: grouped_ep's output (and for fwd+bwd its dx and dw) against
    # the per-expert loop in fp32, max |ours - loop| / max |loop|; over the tolerance the run
    # fails (a wrong product was timed and reported with ratios; a review).
    row["rel_err_vs_loop"] = _check(impls, x, w, dy, backward)
    if not row["rel_err_vs_loop"] <= _TOL[dtype]:
        raise RuntimeError(
            f"{case.name} {routing} {row['dtype']} {row['pass']}: grouped_ep differs from the "
            f"per-expert loop by {row['rel_err_vs_loop']:.3g} (tolerance {_TOL[dtype]}): not timed"
        )
    gflops = {}
    # A baseline with no fast kernel on this CPU (fp16 matmul without AVX512-FP16/AMX) can take
    # minutes per call: time it fewer times rather than not at all.
    budget_s = None if device.startswith("cuda") else 20.0
    # Fast rows get more rounds (up to 60): their medians are what the targets are read from.
    min_s = None if device.startswith("cuda") else 0.1 * reps
    steps = {}
    for name, fn in impls.items():
        xi = x.detach().requires_grad_(backward)
        wi = (dense_w if name == "dense" else w).detach().requires_grad_(backward)

        def step(fn=fn, xi=xi, wi=wi):
            out = fn(xi, wi)
            if backward:
                xi.grad = wi.grad = None
                out.backward(dy)

        steps[name] = step
    # Every method timed in the same rounds: a slow spell of the machine hits all of them.
    for name, got in interleaved_medians(
        steps, device, reps=reps, warmup=2, budget_s=budget_s, min_s=min_s
    ).items():
        if isinstance(got, Exception):  # a baseline that refuses the inputs
            if name == "grouped_ep":  # not a baseline: the run fails
                raise RuntimeError(f"{case.name}: grouped_ep failed: {got}") from got
            gflops[name] = float("nan")
            row.setdefault("note", f"{name}: {str(got).splitlines()[0][:60]}")
        else:
            gflops[name] = flops / got / 1e9
    for name, v in gflops.items():
        row[f"{name}_gflops"] = v
    for base in ("grouped_mm", "loop", "dense"):
        row[f"vs_{base}_x"] = (
            gflops["grouped_ep"] / gflops[base] if gflops[base] > 0 else float("nan")
        )
    return row


def cpu_paths() -> dict[str, str]:
    """dtype -> what grouped_ep's CPU gemm does for it on this CPU (chosen at run time)."""
    return {
        str(d).replace("torch.", ""): torch.ops.grouped_ep.cpu_gemm_path(d)
        for d in (torch.float32, torch.bfloat16, torch.float16)
    }


def run(device: str, quick: bool, log, rows: list | None = None) -> list[dict]:
    if device.startswith("cuda"):
        cases, dtypes, reps = (
            _gpu_cases(quick),
            [torch.bfloat16, torch.float16],
            10 if quick else 20,
        )
        paths = {}
    else:
        cases = CPU_QUICK if quick else CPU_CASES
        dtypes, reps = [torch.float32, torch.bfloat16, torch.float16], 3 if quick else 5
        paths = cpu_paths()
        log(f"CPU capability (torch): {torch.backends.cpu.get_cpu_capability()}")
        for dtype, path in paths.items():
            log(f"grouped_ep CPU gemm path for {dtype}: {path}")
    rows = [] if rows is None else rows  # the runner's list: rows finished so far survive a stop
    plan = [
        (c, r, d, b)
        for c in cases
        for r in ("balanced", "zipf")
        for d in dtypes
        for b in (False, True)
    ]
    for i, (case, routing, dtype, backward) in enumerate(plan, 1):
        log(f"{i}/{len(plan)} {case.name} {routing} {dtype} {'fwd+bwd' if backward else 'fwd'}")
        row = _measure(case, routing, dtype, device, backward, reps)
        if row["dtype"] in paths:
            row["path"] = paths[row["dtype"]].split(":")[0]
        rows.append(row)
    return rows
