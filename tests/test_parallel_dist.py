"""Expert parallel + FSDP2 on gloo ranks against single-process runs (CPU, fp32).

- EP dispatch of one MoE layer under crafted routings: uneven, a rank that receives nothing,
  an expert with no tokens, a rank with no tokens of its own.
- 10 AdamW steps of a small MoE model with `fully_shard_moe`, each rank on its own batch, vs
  one process training on all ranks' batches: the loss at every step and the final weights.
- `load_sharded` into an EP model before `fully_shard_moe`: each rank holds its own experts.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

from grouped_ep.nn import MoE

TIMEOUT = 150
TOL = 1e-5


# ---- a small MoE language model ------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.moe = MoE(hidden, intermediate, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class TinyMoELM(nn.Module):
    def __init__(self, num_experts: int = 4, vocab: int = 32, hidden: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, 24, num_experts, 2) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make_model(num_experts: int, hidden: int = 16) -> TinyMoELM:
    torch.manual_seed(0)
    model = TinyMoELM(num_experts, hidden=hidden)
    with torch.no_grad():  # a router strong enough that routing changes while training
        for layer in model.layers:
            layer.moe.router.weight.mul_(4.0)
    return model


def batches(world: int, steps: int) -> torch.Tensor:
    """`[steps, world, 2, 9]` token ids: rank r's batch at step s is `[s, r]`. Sequences follow
    `next = 5 * id + 3 (mod 32)` from a random start, so there is something to learn."""
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 32, (steps, world, 2, 1), generator=g)
    seq = [start]
    for _ in range(8):
        seq.append((seq[-1] * 5 + 3) % 32)
    return torch.cat(seq, dim=-1)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[..., :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[..., 1:].reshape(-1))


def train_reference(
    num_experts: int, world: int, steps: int, clip: float | None = None, hidden: int = 16
) -> tuple[list[float], dict, dict]:
    model = make_model(num_experts, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses, grads = [], {}
    for step_ids in batches(world, steps):
        loss = lm_loss(model, step_ids.reshape(-1, step_ids.shape[-1]))
        loss.backward()
        if not grads:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if clip is not None:
            grads.setdefault("total_norm", []).append(
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            )
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_rank(
    rank: int,
    world: int,
    dp: int,
    ep: int,
    configs: list[int],
    steps: int,
    clip: float | None,
    reshard: bool | int = True,
):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from grouped_ep.parallel import clip_grad_norm_, fully_shard_moe, make_mesh

    mesh = make_mesh(dp, ep)
    out = {}
    for config in configs:
        num_experts, hidden = (config, 16) if isinstance(config, int) else config
        model = fully_shard_moe(
            make_model(num_experts, hidden), mesh, reshard_after_forward=reshard
        )
        params = dict(model.named_parameters())
        not_dtensor = [n for n, p in params.items() if not isinstance(p, DTensor)]
        assert not not_dtensor, f"plain tensors after fully_shard_moe: {not_dtensor}"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        losses, grads = [], {}
        for step_ids in batches(world, steps):
            loss = lm_loss(model, step_ids[rank])
            loss.backward()
            if not grads:  # the first step's gradients, reduced by FSDP (divide factors!)
                grads = {n: p.grad.full_tensor() for n, p in params.items()}
            if clip is not None:  # experts' and dense gradients on two meshes
                grads.setdefault("total_norm", []).append(clip_grad_norm_(model, clip))
            opt.step()
            opt.zero_grad()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            losses.append(global_loss.item() / world)
        state = {n: p.full_tensor() for n, p in params.items()}
        placements = {  # (mesh dims, sharded tensor dim per mesh dim) of the expert weights
            n: (
                p.device_mesh.mesh_dim_names,
                tuple(getattr(pl, "dim", None) for pl in p.placements),
            )
            for n, p in params.items()
            if "experts" in n
        }
        out[config] = (losses, grads, state, placements)
    return out if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize(
    "dp,ep,configs,clip,reshard",
    [
        (1, 2, [4], None, True),
        (2, 2, [4, 2], None, True),
        (1, 2, [4], 0.5, True),
        (2, 1, [(3, 13)], None, True),
        (4, 1, [4], None, 2),
    ],
    ids=[
        "world2_dp1_ep2",
        "world4_dp2_ep2_experts4_and_2",
        "world2_dp1_ep2_clip_grad_norm",
        # 3 experts over dp 2: FSDP on dim 1, except down_proj [3, 13, 24], whose dim 1 is odd
        # (torch's NotImplementedError "uneven sharding on dim 1" mid-way, before): dim 0.
        "world2_dp2_experts3_hidden13",
        # An int between 1 and dp: the experts' DTensor weights cannot be resharded to a smaller
        # mesh (torch's NotImplementedError at the first forward, before); they take True.
        "world4_dp4_reshard_after_forward_2",
    ],
)
def test_fsdp_ep_training_matches_single_process(dp, ep, configs, clip, reshard):
    steps, world = 10, dp * ep
    got = run_ranks(_train_rank, world, dp, ep, configs, steps, clip, reshard, timeout=TIMEOUT)[0]
    for config in configs:
        num_experts, hidden = (config, 16) if isinstance(config, int) else config
        losses, grads, state, placements = got[config]
        ref_losses, ref_grads, ref_state = train_reference(num_experts, world, steps, clip, hidden)
        if clip is not None:  # grouped_ep.parallel.clip_grad_norm_ against torch's, every step
            norms, ref_norms = grads.pop("total_norm"), ref_grads.pop("total_norm")
            torch.testing.assert_close(
                torch.stack(norms), torch.stack(ref_norms), rtol=1e-5, atol=0
            )
            assert max(ref_norms) > clip, "the reference run should clip"
        # Adam hides a gradient scale error; the first step's gradients do not.
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-4, msg=name)
        assert ref_losses[-1] < ref_losses[0] - 0.05, "the reference run should learn something"
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= TOL, f"step {step}: loss {a} vs single-process {b}"
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, atol=TOL, rtol=0, msg=name)
        local = num_experts // ep
        assert len(placements) == 4
        for name, (mesh_dims, dims) in placements.items():
            rows = ref_state[name].shape[1]
            fsdp_dim = 0 if local % dp == 0 or rows % dp else 1
            # FSDP over dp on dim 0 or 1, experts split over ep on dim 0
            assert mesh_dims == ("dp", "ep") and dims == (fsdp_dim, 0), (name, mesh_dims, dims)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf"), 0.0])
def test_clip_grad_norm_equals_torch_on_plain_tensors(norm_type):
    from grouped_ep.parallel import clip_grad_norm_

    ours, ref = make_model(4), make_model(4)
    for model in (ours, ref):
        lm_loss(model, batches(1, 1)[0, 0]).backward()
    ours.layers[0].norm.weight.grad = None  # a parameter without a gradient is skipped
    ref.layers[0].norm.weight.grad = None
    got = clip_grad_norm_(ours, 0.1, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=name)


# ---- EP dispatch under crafted routings -----------------------------------------------------------

E, H = 4, 8
# Per rank, each token's (first, second) expert. Rank r owns experts {2r, 2r+1}.
ROUTINGS = {
    "uneven": ([(2, 3)] * 6, [(0, 3), (1, 2), (3, 0), (2, 1), (0, 1)]),
    "rank1_receives_nothing": ([(0, 1), (1, 0), (0, 1)], [(1, 0), (0, 1)]),
    "expert1_empty": ([(0, 2), (2, 3), (3, 0)], [(3, 2), (0, 3), (2, 0)]),
    "rank1_has_no_tokens": ([(1, 2), (3, 0), (2, 1)], []),
}


def _tokens(pairs: list[tuple[int, int]], seed: int) -> torch.Tensor:
    """`[T, H]` tokens that a router with weight `10 * I` sends to exactly `pairs`."""
    g = torch.Generator().manual_seed(seed)
    x = 0.1 * torch.randn(len(pairs), H, generator=g)
    for t, (a, b) in enumerate(pairs):
        x[t, a] += 3.0
        x[t, b] += 2.0
    return x


def _routing_rank(rank: int, world: int):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from grouped_ep.nn import route
    from grouped_ep.parallel import apply_expert_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    ref = MoE(H, 12, E, top_k=2)
    with torch.no_grad():
        ref.router.weight.copy_(10 * torch.eye(E, H))
    moe = apply_expert_parallel(copy.deepcopy(ref), mesh)
    assert isinstance(moe.experts.gate_up_proj, DTensor)
    assert moe.experts.gate_up_proj.to_local().shape == (E // world, 24, H)

    for name, per_rank in ROUTINGS.items():
        xs = [_tokens(p, seed=10 * r + 1) for r, p in enumerate(per_rank)]
        dys = [
            torch.randn(x.shape, generator=torch.Generator().manual_seed(r))
            for r, x in enumerate(xs)
        ]
        for x, pairs in zip(xs, per_rank):  # the routing is the one the case is named for
            _, _, ids = route(x, ref.router.weight, 2)
            assert ids.tolist() == [list(p) for p in pairs], name
        # Reference: every rank's tokens through the unsharded layer in one process.
        ref.zero_grad()
        x_all = torch.cat(xs).requires_grad_(True)
        y_all = ref(x_all)
        (y_all * torch.cat(dys)).sum().backward()
        lo = sum(len(p) for p in per_rank[:rank])
        hi = lo + len(per_rank[rank])

        moe.zero_grad()
        x = xs[rank].clone().requires_grad_(True)
        y = moe(x)
        (y * dys[rank]).sum().backward()
        torch.testing.assert_close(y, y_all[lo:hi], atol=1e-6, rtol=0, msg=f"{name}: out")
        torch.testing.assert_close(x.grad, x_all.grad[lo:hi], atol=1e-6, rtol=0, msg=f"{name}: dx")
        local = E // world
        for pname in ("gate_up_proj", "down_proj"):
            grad = getattr(moe.experts, pname).grad
            assert (
                isinstance(grad, DTensor) and grad.placements == moe.experts.gate_up_proj.placements
            )
            want = getattr(ref.experts, pname).grad[rank * local : (rank + 1) * local]
            torch.testing.assert_close(
                grad.to_local(), want, atol=1e-6, rtol=0, msg=f"{name}: {pname}"
            )
        router_grad = moe.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # each rank holds its own tokens' part
        torch.testing.assert_close(router_grad, ref.router.weight.grad, atol=1e-6, rtol=0, msg=name)

    with pytest.raises(ValueError, match="num_experts=3"):
        apply_expert_parallel(MoE(H, 12, 3, top_k=2), mesh)

    # A meta model stays on meta, with the right global and local shapes.
    with torch.device("meta"):
        meta = MoE(H, 12, E, top_k=2)
    apply_expert_parallel(meta, mesh)
    w = meta.experts.down_proj
    assert w.is_meta and isinstance(w, DTensor) and w.shape == (E, H, 12)
    assert w.to_local().shape == (E // world, H, 12)
    return True


@pytest.mark.slow
def test_ep_dispatch_edge_routings():
    assert run_ranks(_routing_rank, 2, timeout=TIMEOUT) == [True, True]


# ---- load_sharded, then fully_shard_moe -----------------------------------------------------------


def _load_rank(rank: int, world: int, path: str):
    import torch.distributed as dist

    from grouped_ep import load_sharded
    from grouped_ep.parallel import apply_expert_parallel, fully_shard_moe, make_mesh

    dp, ep = world // 2, 2
    mesh = make_mesh(dp, ep)
    with torch.device("meta"):
        torch.manual_seed(123)  # different from the checkpoint's weights
        model = TinyMoELM(num_experts=4)
    apply_expert_parallel(model, mesh["ep"])
    load_sharded(model, path)
    experts = model.layers[0].moe.experts.gate_up_proj
    assert not experts.is_meta
    ep_local = experts.to_local().clone()  # this rank's 2 experts, as loaded
    fully_shard_moe(model, mesh)
    local = model.layers[0].moe.experts.gate_up_proj.to_local().clone()
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    loss = lm_loss(model, batches(world, 1)[0, rank])
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return ep_local, gathered, full, loss.item() / world


@pytest.mark.slow
def test_load_sharded_then_fully_shard_keeps_each_ranks_experts(tmp_path):
    from safetensors.torch import save_file

    world = 4
    model = make_model(4)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    got = run_ranks(_load_rank, world, str(path), timeout=TIMEOUT)

    full_experts = state["layers.0.moe.experts.gate_up_proj"]
    for rank, (ep_local, gathered, full, loss) in enumerate(got):
        ep_rank = rank % 2
        # Each EP rank read its own experts, not rank 0's (the silent-overwrite bug).
        torch.testing.assert_close(
            ep_local, full_experts[2 * ep_rank : 2 * ep_rank + 2], atol=0, rtol=0
        )
        # After FSDP, the four local shards are four different pieces of the experts.
        for a in range(world):
            for b in range(a + 1, world):
                assert not torch.equal(gathered[a], gathered[b]), (rank, a, b)
        for name, ref in state.items():
            torch.testing.assert_close(full[name], ref, atol=0, rtol=0, msg=name)
        with torch.no_grad():
            ref_loss = lm_loss(model, batches(world, 1)[0].reshape(-1, 9)).item()
        assert abs(loss - ref_loss) <= TOL


# ---- layers inside containers without forward ----------------------------------------------------


class DictLayersLM(TinyMoELM):
    """TinyMoELM with each block inside a ModuleDict, which `fully_shard` refuses to wrap."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"block": b}) for b in self.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer["block"](x)
        return self.head(self.norm(x))


def _dict_layers_rank(rank: int, world: int):
    from torch.distributed.tensor import DTensor

    from grouped_ep.parallel import fully_shard_moe, make_mesh

    torch.manual_seed(0)
    model = fully_shard_moe(DictLayersLM(), make_mesh(1, world))
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    with torch.no_grad():
        return plain, lm_loss(model, batches(1, 1)[0][0]).item()


def test_fully_shard_moe_shards_blocks_inside_containers():
    # The blocks inside each ModuleDict are sharded one by one; the model computes as before.
    torch.manual_seed(0)
    ref = DictLayersLM()
    with torch.no_grad():
        ref_loss = lm_loss(ref, batches(1, 1)[0][0]).item()
    for plain, loss in run_ranks(_dict_layers_rank, 2, timeout=TIMEOUT):
        assert plain == [] and abs(loss - ref_loss) <= TOL


def test_make_mesh_sizes_must_be_ints():
    from grouped_ep.parallel import make_mesh

    for dp, ep in ((1.0, 2), (1, True), (0, 2)):
        with pytest.raises(ValueError, match="dp and ep must be ints >= 1"):
            make_mesh(dp, ep)


def test_mesh_and_policy_arguments_of_the_wrong_kind_are_named():
    # Checked before any process group is needed: none exists in this process.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from grouped_ep.parallel import apply_expert_parallel, fully_shard_moe, make_mesh

    bad = ["tpu", "gpu", "", 0] + ([] if torch.cuda.is_available() else ["cuda"])
    for device_type in bad:
        with pytest.raises(ValueError, match="make_mesh: device_type must be 'cpu' or 'cuda'"):
            make_mesh(1, 1, device_type=device_type)
    for mesh in ("ep", None, [0, 1]):
        with pytest.raises(TypeError, match="apply_expert_parallel: ep_mesh must be a 1-D"):
            apply_expert_parallel(nn.Linear(2, 2), mesh)
    # An optimizer or a string as the model: named, not an AttributeError from inside.
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="apply_expert_parallel: model must be an nn.Module"):
        apply_expert_parallel(opt, None)
    with pytest.raises(TypeError, match="fully_shard_moe: model must be an nn.Module, got SGD"):
        fully_shard_moe(opt, None)
    for policy in ("bf16", torch.bfloat16, {"param_dtype": torch.bfloat16}):
        with pytest.raises(TypeError, match="fully_shard_moe: mp_policy must be a .*"):
            fully_shard_moe(nn.Linear(2, 2), None, mp_policy=policy)
    with pytest.raises(TypeError, match="fully_shard_moe: mesh must be the DeviceMesh"):
        fully_shard_moe(nn.Linear(2, 2), None, mp_policy=MixedPrecisionPolicy())


def _nan_on_one_rank(rank: int, world: int):
    from grouped_ep.parallel import clip_grad_norm_, fully_shard_moe, make_mesh

    model = fully_shard_moe(make_model(4), make_mesh(1, 2))
    lm_loss(model, batches(world, 1)[0, rank]).backward()
    if rank == 1:  # an overflow in one expert's gradient, on the second rank only
        model.layers[0].moe.experts.down_proj.grad.to_local().view(-1)[0] = float("nan")
    out = {}
    for norm_type in (2.0, float("inf"), -float("inf")):
        try:
            clip_grad_norm_(model, 1.0, norm_type, error_if_nonfinite=True)
            out[norm_type] = "no error"
        except RuntimeError as e:
            out[norm_type] = str(e)
    out["total"] = clip_grad_norm_(model, 1.0, float("inf")).item()
    out["named"] = clip_grad_norm_(model, 1.0, "inf").item()  # a config's string, as torch's
    return out


def test_clip_grad_norm_sees_a_nan_on_any_rank():
    """The inf-norm is reduced with MAX, and gloo's MAX drops a NaN held by a rank other than
    the first: the total came out finite on every rank, error_if_nonfinite raised nothing, and
    the next step wrote the NaN into an expert (a review). One process raises (torch)."""
    for rank, got in enumerate(run_ranks(_nan_on_one_rank, 2, timeout=TIMEOUT)):
        for norm_type in (2.0, float("inf"), -float("inf")):
            assert f"total {norm_type}-norm of the gradients is nan" in got[norm_type], (rank, got)
        assert got["total"] != got["total"], (rank, got)  # NaN, as torch gives one process
        assert got["named"] != got["named"], (rank, got)  # "inf" is float("inf"), DTensors too


def test_clip_grad_norm_takes_torchs_arguments():
    # A drop-in for torch's: norm_type and error_if_nonfinite positionally, and foreach.
    from grouped_ep.parallel import clip_grad_norm_

    ref, ours = nn.Linear(5, 3), nn.Linear(5, 3)
    ours.load_state_dict(ref.state_dict())
    for m in (ref, ours):
        m(torch.ones(2, 5)).square().sum().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, 2.0, False, foreach=True)
    got = clip_grad_norm_(ours.parameters(), 0.1, 2.0, False, foreach=True)
    torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match="clip_grad_norm_: norm_type must be a number, got 'l2'"):
        clip_grad_norm_(ours.parameters(), 0.1, "l2")
    with pytest.raises(TypeError, match="clip_grad_norm_: parameters must be a module, a tensor"):
        clip_grad_norm_(torch.optim.SGD(ours.parameters()), 0.1)
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_int_reshard_after_forward_must_divide_both_fsdp_groups():
    """An int went to the experts' dp group too, where torch refused it in its own words
    ('it should be a factor of 1, not 2') after the experts were already sharded."""
    from grouped_ep.parallel import check_reshard

    class Mesh:  # the sizes of a ("dp", "ep") mesh
        def __init__(self, dp, ep):
            self.sizes = (dp, ep)

        def size(self, dim):
            return self.sizes[dim]

    for dp, ep, n in ((1, 2, 2), (2, 2, 4), (2, 2, 0)):
        with pytest.raises(
            ValueError, match=rf"reshard_after_forward={n} must divide .*'dp' group \({dp} rank"
        ):
            check_reshard(n, Mesh(dp, ep), "fully_shard_moe")
    for dp, ep, n in ((2, 2, 2), (4, 2, 2), (2, 1, True), (1, 2, False)):
        assert check_reshard(n, Mesh(dp, ep), "fully_shard_moe") is n
    assert check_reshard(np.int64(2), Mesh(2, 2), "fully_shard_moe") == 2
    # Neither a bool nor an int: torch refused it only after the experts were sharded (the
    # model half converted, a retry refused as "already a DTensor"; a review).
    for n in ("yes", 0.5):
        with pytest.raises(ValueError, match=r"reshard_after_forward must be True, False, None"):
            check_reshard(n, Mesh(2, 2), "fully_shard_moe")
    assert check_reshard(None, Mesh(2, 2), "fully_shard_moe") is None  # torch's default
    assert check_reshard(np.True_, Mesh(2, 2), "fully_shard_moe") is True  # numpy 2's np.bool


class _ReadsChildWeight(nn.Module):
    """A block whose fp32 child is never called: the block reads its weight (as Mamba-style
    mixers read `conv1d.weight`), next to a bf16 Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.gate = nn.Linear(8, 8, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.nn.functional.linear(x.float(), self.gate.weight).sigmoid()
        return self.proj(x) * g.to(x.dtype)


def _split_units_rank(rank: int, world: int):
    from torch.distributed.fsdp import fully_shard

    from grouped_ep._mixed_dtypes import split_dtypes
    from grouped_ep.parallel import make_mesh

    torch.manual_seed(0)
    model = nn.Sequential(_ReadsChildWeight(), _ReadsChildWeight())
    ref = copy.deepcopy(model)
    mesh = make_mesh(world, 1)["dp"]
    for i, block in enumerate(model):
        split_dtypes(block, str(i), mesh, {})
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rank))
    out = []
    for _ in range(2):  # the second step gathers again after the final callback resharded
        y = model(x)
        y.float().square().mean().backward()
        out.append((y.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
        model.zero_grad()
    with torch.no_grad():
        out.append(model(x))
    return out, ref


def test_split_unit_that_its_block_never_calls_is_gathered():
    """FSDP2 gathers a unit in its own forward: a split fp32 child whose block reads its weight
    without calling it stayed sharded ("mixed torch.Tensor and DTensor")."""
    results = run_ranks(_split_units_rank, 2, timeout=TIMEOUT)
    ref = results[0][1]
    grads = None
    for rank, (out, _) in enumerate(results):
        x = torch.randn(4, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rank))
        want = ref(x)
        (want.float().square().mean() / 2).backward()
        for y, g in out[:2]:
            torch.testing.assert_close(y, want.detach())
            grads = g
        torch.testing.assert_close(out[2], want.detach())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            grads[name].float(), p.grad.float(), rtol=2e-2, atol=1e-3, msg=name
        )


class _SharedRouterLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MoE(8, 16, 4, 2) for _ in range(2)])
        self.layers[1].router = self.layers[0].router  # one router for both blocks


def _shared_router_rank(rank: int, world: int) -> tuple[str, bool]:
    from torch.distributed.tensor import DTensor

    from grouped_ep.parallel import fully_shard_moe, make_mesh

    model = _SharedRouterLM()
    try:
        fully_shard_moe(model, make_mesh(1, world))
    except ValueError as e:
        return str(e), any(isinstance(p, DTensor) for p in model.parameters())
    return "", True


def test_parameter_shared_by_two_blocks_is_refused_before_sharding():
    """Each block is its own FSDP unit: a router shared by two blocks was sharded twice, and
    torch's error came at the first forward (or "Cannot concatenate overlapping meshes")."""
    for message, sharded in run_ranks(_shared_router_rank, 2, timeout=TIMEOUT):
        assert "layers.0.router.weight = layers.1.router.weight" in message, message
        assert not sharded


def _optimizer_after_eval_rank(rank: int, world: int, root: str) -> tuple[int, int, str]:
    from torch.distributed.tensor import DTensor

    from grouped_ep import checkpoint
    from grouped_ep.parallel import fully_shard_moe, make_mesh

    model = fully_shard_moe(make_model(4), make_mesh(1, world))
    ids = batches(world, 1)[0][rank]
    with torch.no_grad():  # an evaluation first: the root and the last block stayed gathered
        model(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    lm_loss(model, ids).backward()
    opt.step()
    unchanged = sum(torch.equal(before[n], p.full_tensor()) for n, p in model.named_parameters())
    model(ids)  # gradients on, no backward: units stay gathered, this optimizer is built wrong
    wrong = torch.optim.AdamW(model.parameters())
    try:
        wrong.step()  # refused before it steps: it would never change the gathered block
        stepped = ""
    except RuntimeError as e:
        stepped = str(e)
    try:
        checkpoint.save(root, model, wrong)
        message = ""
    except checkpoint.CheckpointError as e:
        message = str(e)
    plain = sum(not isinstance(p, DTensor) for p in model.parameters())
    opt.step()  # the right optimizer still steps
    return unchanged, plain, message, stepped


def test_optimizer_built_after_an_evaluation_trains_every_parameter(tmp_path):
    """After a no-grad forward the root and the last block stayed gathered: an optimizer built
    then held their gathered tensors, and training left those parameters unchanged, silently (a
    review: 9 of 25); save with it crashed the process. Now units are resharded after such a
    forward, and save refuses an optimizer that holds tensors not the model's. An optimizer
    built after a training forward holds the root's and the last block's gathered tensors: its
    first step() is refused, naming them (it stepped, and the block never trained; a review)."""
    for unchanged, plain, message, stepped in run_ranks(
        _optimizer_after_eval_rank, 2, str(tmp_path), timeout=TIMEOUT
    ):
        assert unchanged == 0
        assert plain == 0  # save resharded what the grad-enabled forward left gathered
        assert "optimizer holds tensors that are not the model's parameters" in message
        assert "AdamW.step: the optimizer holds" in stepped
        assert "gathered FSDP tensor(s)" in stepped and "layers.1." in stepped, stepped


def _frozen_forward_rank(rank: int, world: int) -> tuple[int, int, int]:
    from torch.distributed.tensor import DTensor

    from grouped_ep.parallel import fully_shard_moe, make_mesh

    model = fully_shard_moe(make_model(4), make_mesh(1, world))
    ids = batches(world, 1)[0][rank]
    model.requires_grad_(False)
    model(ids)  # gradients on, nothing to backward through: a frozen model's forward
    plain = sum(not isinstance(p, DTensor) for p in model.parameters())
    routers = [p for n, p in model.named_parameters() if "router" in n]
    for p in routers:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(routers, lr=1e-2)
    before = [p.full_tensor().clone() for p in routers]
    lm_loss(model, ids).backward()
    opt.step()
    unchanged = sum(torch.equal(b, p.full_tensor()) for b, p in zip(before, routers))
    return plain, unchanged, len(routers)


def test_parameters_unfrozen_after_a_frozen_forward_train(tmp_path):
    """A grad-enabled forward of a frozen model (a baseline loss before unfreezing, a frozen
    teacher) left the root and the last block gathered: the routers unfrozen next were their
    gathered copies, and the last block's router never trained, silently (a review)."""
    for plain, unchanged, routers in run_ranks(_frozen_forward_rank, 2, timeout=TIMEOUT):
        assert plain == 0 and routers >= 2
        assert unchanged == 0


def _optimizer_before_load_rank(rank: int, world: int, path: str) -> tuple[int, int, bool]:
    from grouped_ep import load_sharded
    from grouped_ep.parallel import fully_shard_moe, make_mesh

    with torch.device("meta"):
        model = TinyMoELM(num_experts=4)
    fully_shard_moe(model, make_mesh(1, world))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # FSDP2's order: right after wrapping
    held = [p for group in opt.param_groups for p in group["params"]]
    load_sharded(model, path, device="cpu")
    same = all(a is b for a, b in zip(held, model.parameters()))
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    lm_loss(model, batches(world, 1)[0][rank]).backward()
    opt.step()
    unchanged = sum(torch.equal(before[n], p.full_tensor()) for n, p in model.named_parameters())
    return unchanged, len(before), same


def test_optimizer_built_before_load_sharded_trains_every_parameter(tmp_path):
    """load_sharded into a meta model put new tensors into the model's slots: an optimizer built
    right after fully_shard (FSDP2's order) held the meta ones and trained nothing, silently (a
    review: losses flat, 0 of 36 parameters changed). Now the loaded data is swapped into the
    same objects, as Module.to_empty does."""
    from safetensors.torch import save_file

    save_file(make_model(4).state_dict(), str(tmp_path / "model.safetensors"))
    for unchanged, total, same in run_ranks(
        _optimizer_before_load_rank, 2, str(tmp_path), timeout=TIMEOUT
    ):
        assert same and total >= 10
        assert unchanged == 0


def _optimizer_before_sharding_rank(rank: int, world: int, root: str, how: str):
    from grouped_ep import checkpoint
    from grouped_ep.parallel import apply_expert_parallel, fully_shard_moe, make_mesh

    model = make_model(4)
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before sharding: the old tensors
    mesh = make_mesh(1, world)
    if how == "fully_shard_moe":
        fully_shard_moe(model, mesh)
    else:
        apply_expert_parallel(model, mesh["ep"])
    lm_loss(model, batches(world, 1)[0][rank]).backward()
    try:
        early.step()
        stepped = ""
    except RuntimeError as e:
        stepped = str(e)
    try:
        checkpoint.save(root, model, early)
        saved = ""
    except checkpoint.CheckpointError as e:
        saved = str(e)
    good = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after: steps as usual
    before = [p.detach().clone() for p in model.parameters()]
    good.step()
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    return stepped, saved, changed


@pytest.mark.parametrize("how", ["fully_shard_moe", "apply_expert_parallel"])
def test_optimizer_built_before_sharding_is_refused_at_its_step(tmp_path, how):
    """An optimizer built before parallelize / fully_shard_moe holds the parameters they
    replaced: every step changed nothing, silently (a review: 3 steps, 0 of 25 tensors changed),
    and save blamed a forward without backward. Its step now says so, naming a parameter."""
    for stepped, saved, changed in run_ranks(
        _optimizer_before_sharding_rank, 2, str(tmp_path), how, timeout=TIMEOUT
    ):
        assert f"{how} replaced with sharded ones" in stepped, stepped
        assert "built before the model was sharded" in saved, saved
        assert f"{how} replaced with sharded ones" in saved
        assert changed > 0


def _sharded_twice_rank(rank: int, world: int) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    from grouped_ep.parallel import fully_shard_moe, make_mesh

    mesh = make_mesh(1, world)
    messages = []
    for first in (lambda m: fully_shard_moe(m, mesh), lambda m: fully_shard(m)):
        model = first(make_model(4))
        try:
            fully_shard_moe(model, mesh)
            messages.append("")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_sharding_a_sharded_model_says_so():
    """fully_shard_moe (or parallelize) twice, or after torch's fully_shard, said 'already a
    DTensor with placements ...; expected a plain tensor' (a review)."""
    for messages in run_ranks(_sharded_twice_rank, 2, timeout=TIMEOUT):
        for message in messages:
            assert "is already sharded with FSDP2" in message, message


def _unit_added_after_wrapping_rank(rank: int, world: int) -> int:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from grouped_ep.parallel import dense_mesh, fully_shard_moe, make_mesh

    mesh = make_mesh(1, world)
    model = fully_shard_moe(make_model(4), mesh)
    model.head = nn.Linear(16, 32, bias=False)  # a new head, sharded by hand, kept gathered
    fully_shard(model.head, mesh=dense_mesh(mesh), reshard_after_forward=False)
    with torch.no_grad():
        model(batches(world, 1)[0][rank])
    return sum(not isinstance(p, DTensor) for p in model.parameters())


def test_unit_added_after_wrapping_is_resharded_after_an_evaluation():
    """The units to shard again after a gradless forward were listed when the model was
    wrapped: one added later (a new head with reshard_after_forward=False) stayed gathered,
    and an optimizer built then never trained it (a review)."""
    for plain in run_ranks(_unit_added_after_wrapping_rank, 2, timeout=TIMEOUT):
        assert plain == 0
