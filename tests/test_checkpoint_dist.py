"""Multi-process checkpoint tests (gloo, CPU): resharding, resume, rank reassignment, a rank
killed mid-save, compact files, export from a sharded model.

One world-4 run (a module fixture) trains and saves under several layouts; the tests then load
those checkpoints at world 4, 2 and 1 and compare element for element. The toy MoE has a
stacked expert weight sharded on the expert dim over "ep" and on an inner dim over "dp" (the
mixed sharding of EP x FSDP), dense weights sharded over the whole world and a replicated norm.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist import RankError, run_ranks
from torch import nn

from grouped_ep import checkpoint as ck

V, H, INTER, E = 32, 16, 6, 6  # E=6 does not divide by 4: uneven shards
N_TOKENS = 24
STEPS, SAVE_AT = 10, 5
W_SHAPE = (6, 10, 7)  # the stacked 3D weight of the shard-dim regression


@dataclass(frozen=True)
class Layout:
    """How the toy model is sharded: a (dp, ep) mesh; experts Shard(0) on ep, Shard(inner) on dp.

    `column_major` assigns ranks to the mesh column by column: the same shapes, other groups.
    """

    dp: int = 1
    ep: int = 1
    inner: int = 1
    column_major: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.ep


_MESHES: dict = {}


def _meshes(layout: Layout):
    """(moe_mesh ("dp","ep"), world_mesh ("world",)), built once per process and layout."""
    from torch.distributed.device_mesh import DeviceMesh

    if layout not in _MESHES:
        ranks = torch.arange(layout.world)
        grid = (
            ranks.reshape(layout.ep, layout.dp).T
            if layout.column_major
            else ranks.reshape(layout.dp, layout.ep)
        )
        _MESHES[layout] = (
            DeviceMesh("cpu", grid, mesh_dim_names=("dp", "ep")),
            DeviceMesh("cpu", ranks, mesh_dim_names=("world",)),
        )
    return _MESHES[layout]


def _place(name: str, full: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """`full` as this rank holds it under `layout` (None: a plain tensor, no process group)."""
    if layout is None:
        return full.clone()
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    moe_mesh, world_mesh = _meshes(layout)
    if name in ("gate_up_proj", "down_proj"):
        placements = [
            Shard(layout.inner) if layout.dp > 1 else Replicate(),
            Shard(0) if layout.ep > 1 else Replicate(),
        ]
        return distribute_tensor(full, moe_mesh, placements, src_data_rank=None)
    placements = [Replicate()] if full.dim() == 1 else [Shard(0)]
    return distribute_tensor(full, world_mesh, placements, src_data_rank=None)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class ToyMoE(nn.Module):
    """Soft MoE: every token through every expert, mixed by router probabilities.

    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; forward runs on the full
    (gathered, differentiable) weights so that every layout computes the same numbers.
    """

    def __init__(self, layout: Layout | None, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        shapes = {
            "embed": (V, H),
            "norm": (H,),
            "router": (E, H),
            "gate_up_proj": (E, 2 * INTER, H),
            "down_proj": (E, H, INTER),
            "head": (V, H),
        }
        for name, shape in shapes.items():
            full = torch.randn(shape, generator=g) * 0.3 + (1.0 if name == "norm" else 0.0)
            setattr(self, name, nn.Parameter(_place(name, full, layout)))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, _full(self.embed)) * _full(self.norm)  # [N, H]
        probs = torch.softmax(x @ _full(self.router).T, dim=-1)  # [N, E]
        gate, up = torch.einsum("nh,eoh->neo", x, _full(self.gate_up_proj)).chunk(2, dim=-1)
        y = torch.einsum("nei,ehi->neh", F.silu(gate) * up, _full(self.down_proj))  # [N, E, H]
        x = x + (probs.unsqueeze(-1) * y).sum(1)
        return F.cross_entropy(x @ _full(self.head).T, targets)


class OneWeight(nn.Module):
    """A single stacked expert weight `w` [E, A, B] with the given placements on a mesh."""

    def __init__(self, placements: tuple | None, dims: tuple[int, ...] | None = None):
        super().__init__()
        full = torch.arange(float(torch.Size(W_SHAPE).numel())).reshape(W_SHAPE)
        if placements is None:
            w = full
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import distribute_tensor

            dims = dims or (torch.distributed.get_world_size(),)
            if dims not in _MESHES:  # new process groups are slow to make: once per shape
                _MESHES[dims] = init_device_mesh("cpu", dims)
            mesh = _MESHES[dims]
            w = distribute_tensor(full, mesh, placements, src_data_rank=None)
        self.w = nn.Parameter(w)


def _train(model: ToyMoE, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """Train on data drawn from the global RNG (restored from `extra` on resume)."""
    losses = []
    for _ in steps:
        tokens = torch.randint(0, V, (N_TOKENS,))
        targets = (tokens * 7 + 3) % V  # learnable: the loss falls
        loss = model(tokens, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _resume(root: str, layout: Layout | None) -> list[float]:
    model = ToyMoE(layout, seed=99)  # other init: everything must come from the checkpoint
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    extra = ck.load(root, model, opt)
    with torch.random.fork_rng():
        torch.set_rng_state(extra["rng"])
        return _train(model, opt, range(extra["step"], STEPS))


def _shard_cases(world: int) -> dict[str, tuple]:
    """name -> (placements, mesh dims) for the stacked weight; Shard(d) on every dim."""
    from torch.distributed.tensor import Shard

    cases = {f"shard{d}": ((Shard(d),), (world,)) for d in range(3)}
    if world == 4:
        cases["ep2_inner1"] = ((Shard(1), Shard(0)), (2, 2))
        cases["ep2_inner2"] = ((Shard(2), Shard(0)), (2, 2))
    return cases


def _load_shard_cases(root: str, world: int, every: bool = True) -> dict[str, bool]:
    """Load each saved stacked weight under every other sharding (`every`) or the next one in
    the list; True where all elements equal the original."""
    expected = OneWeight(None).w.detach()
    ok = {}
    cases = list((_shard_cases(world) if world > 1 else {"plain": (None, None)}).items())
    saved_dirs = sorted(d for d in os.listdir(root) if d.startswith("w-"))
    for i, saved in enumerate(saved_dirs):
        targets = cases if every or world == 1 else [cases[(i + 1) % len(cases)]]
        for name, (placements, dims) in targets:
            if world > 1 and saved == f"w-{name}":
                continue
            model = OneWeight(placements, dims)
            with torch.no_grad():
                model.w.zero_()
            ck.load(os.path.join(root, saved), model)
            ok[f"{saved}->{name}@{world}"] = torch.equal(_full(model.w.detach()), expected)
    return ok


def _world4(rank: int, world: int, root: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    out: dict = {}
    for tag, layout in {"ep2xdp2": Layout(2, 2, inner=1), "ep4": Layout(1, 4)}.items():
        torch.manual_seed(0)
        model = ToyMoE(layout)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = _train(model, opt, range(SAVE_AT))
        ck.save(f"{root}/{tag}", model, opt, extra={"step": SAVE_AT, "rng": torch.get_rng_state()})
        losses += _train(model, opt, range(SAVE_AT, STEPS))  # the uninterrupted run
        out[f"losses_{tag}"] = losses
        if tag == "ep2xdp2":
            # Other rank assignment and inner shard dim: every param and Adam state must match.
            other = ToyMoE(Layout(2, 2, inner=2, column_major=True), seed=99)
            other_opt = torch.optim.Adam(other.parameters(), lr=1e-2)
            state = {n: _full(p.detach()) for n, p in model.named_parameters()}
            state |= {
                f"{n}.{k}": _full(v)
                for n, p in model.named_parameters()
                for k, v in opt.state[p].items()
            }
            ck.save(f"{root}/after", model, opt)
            ck.load(f"{root}/after", other, other_opt)
            got = {n: _full(p.detach()) for n, p in other.named_parameters()}
            got |= {
                f"{n}.{k}": _full(v)
                for n, p in other.named_parameters()
                for k, v in other_opt.state[p].items()
            }
            out["reassign_equal"] = {k: torch.equal(state[k], got[k]) for k in state}
            out["reassign_coords"] = (
                _meshes(Layout(2, 2))[0].get_coordinate(),
                _meshes(Layout(2, 2, 2, True))[0].get_coordinate(),
            )

    for name, (placements, dims) in _shard_cases(world).items():
        ck.save(f"{root}/w-{name}", OneWeight(placements, dims))
    out["shard_loads"] = _load_shard_cases(root, world, every=False)

    # FSDP2 shards are views of padded buffers: the files must still hold only the shard bytes.
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(1001, 997), nn.ReLU(), nn.Linear(997, 1003))
    for layer in (mlp[0], mlp[2], mlp):
        fully_shard(layer)
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    mlp(torch.randn(4, 1001)).sum().backward()
    opt.step()
    out["fsdp_view"] = any(
        p.to_local().untyped_storage().nbytes() > p.to_local().nbytes for p in mlp.parameters()
    )
    out["fsdp_unique_bytes"] = sum(p.numel() * p.element_size() for p in mlp.parameters()) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
    )
    out["fsdp_dir"] = str(ck.save(f"{root}/fsdp", mlp, opt))
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("ckpt_w4")
    return root, run_ranks(_world4, 4, str(root), timeout=150)


def _world2(rank: int, world: int, root: str, export_dir: str) -> dict:
    out = {tag: _resume(f"{root}/{tag}", Layout(1, 2)) for tag in ("ep2xdp2", "ep4")}
    out["shard_loads"] = _load_shard_cases(root, world)
    _export_sharded_qwen(export_dir)
    return out


def tiny_qwen3_moe(seed: int, **config_overrides) -> nn.Module:
    """A tiny transformers Qwen3-MoE (4 experts, 2 layers) with seeded, non-trivial weights;
    `config_overrides` go to its config (e.g. tie_word_embeddings=True)."""
    from transformers import Qwen3MoeForCausalLM

    from grouped_ep.demo.model import tiny_qwen3_moe_config

    config = tiny_qwen3_moe_config(
        **{
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "moe_intermediate_size": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "num_experts": 4,
            "max_position_embeddings": 64,
            **config_overrides,
        }
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():  # beyond init's std 0.02: routing and logits vary
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _export_sharded_qwen(export_dir: str) -> None:
    """Shard a tiny Qwen3-MoE's params as DTensors (experts Shard(0)) and export it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = tiny_qwen3_moe(seed=0)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if p.dim() >= 2 else Replicate()
            sharded = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None)
            setattr(module, name, nn.Parameter(sharded))
    ck.export_hf(model, export_dir, max_shard_size="10KB")


def test_resume_at_world_2_and_1_matches_uninterrupted_run(world4, tmp_path) -> None:
    root, (r4, *_) = world4
    export_dir = tmp_path / "hf"
    r2 = run_ranks(_world2, 2, str(root), str(export_dir), timeout=150)
    for tag in ("ep2xdp2", "ep4"):
        expected = r4[f"losses_{tag}"][SAVE_AT:]
        for rank in (0, 1):
            assert r2[rank][tag] == pytest.approx(expected, abs=1e-6, rel=0), (tag, rank)
        resumed_1 = _resume(str(root / tag), None)  # this process: no process group
        assert resumed_1 == pytest.approx(expected, abs=1e-6, rel=0), tag
    # Losses fall: the run trains (a resume from a wrong state would not match anyway).
    assert r4["losses_ep2xdp2"][-1] < r4["losses_ep2xdp2"][0]
    bad = {k: v for k, v in r2[0]["shard_loads"].items() if not v}
    assert not bad and len(r2[0]["shard_loads"]) == 3 * 2 + 2 * 3, r2[0]["shard_loads"]
    _check_export(export_dir)


def _check_export(export_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = tiny_qwen3_moe(seed=0)
    loaded = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32)
    assert len(list(export_dir.glob("model-*-of-*.safetensors"))) > 1  # max_shard_size honoured
    tokens = torch.randint(0, reference.config.vocab_size, (2, 9), generator=torch.Generator())
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-5
        )


def test_shard_dims_of_stacked_weight_reshard_exactly(world4) -> None:
    root, (r4, *_) = world4
    loads = dict(r4["shard_loads"])
    loads |= _load_shard_cases(str(root), 1)
    assert len(loads) == 5 + 5, sorted(loads)
    assert all(loads.values()), {k: v for k, v in loads.items() if not v}


def test_mixed_sharding_resumes_with_other_rank_assignment(world4) -> None:
    _, results = world4
    moved = [r["reassign_coords"][0] != r["reassign_coords"][1] for r in results]
    assert moved == [False, True, True, False]  # ranks 1 and 2 swap places in the (dp, ep) mesh
    r4 = results[0]
    assert len(r4["reassign_equal"]) == 6 * 4  # 6 params; Adam's step, exp_avg, exp_avg_sq
    assert all(r4["reassign_equal"].values()), r4["reassign_equal"]


def test_files_hold_each_element_once(world4) -> None:
    root, results = world4
    r4 = results[0]
    # 1001 and 997 rows over 4 ranks: the last rank's shard is a view of a padded buffer.
    assert any(r["fsdp_view"] for r in results), "expected an FSDP2 shard that is a view"
    info = ck.describe(r4["fsdp_dir"])
    assert not info.problems, info.problems
    assert info.disk_bytes <= 1.02 * r4["fsdp_unique_bytes"], (info.disk_bytes, r4)
    # The replicated norm (and Adam's step counters) are written once, not once per rank.
    toy = ck.describe(ck.resolve(root / "ep2xdp2"))
    assert not toy.problems, toy.problems
    assert len(toy.tensors["model.norm"].chunks) == 1
    assert len(toy.tensors["optim.state.norm.exp_avg"].chunks) == 1
    assert len(toy.tensors["model.gate_up_proj"].chunks) == 4
    assert len(toy.files) == 4  # one per rank


def _killed_mid_save(rank: int, world: int, root: str) -> None:
    from torch.distributed.tensor import Shard

    model = OneWeight((Shard(1),))
    ck.save(root, model, extra={"step": 1})
    with torch.no_grad():
        model.w.mul_(-1)
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter as writer

        def die(self, plan, planner):
            with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                f.write(b"half a shard")
            os._exit(17)

        writer.write_data = die
    ck.save(root, model, extra={"step": 2})


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path) -> None:
    with pytest.raises(RankError):
        run_ranks(_killed_mid_save, 2, str(tmp_path), timeout=60)
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert (tmp_path / ".tmp-step-00000002").is_dir()  # the dead save's leftovers
    assert not (tmp_path / "step-00000002").exists()
    assert ck.resolve(tmp_path) == tmp_path / "step-00000001"
    model = OneWeight(None)
    with torch.no_grad():
        model.w.zero_()
    assert ck.load(tmp_path, model) == {"step": 1}
    assert torch.equal(model.w, OneWeight(None).w)
    # The next save clears the leftovers and becomes the latest.
    ck.save(tmp_path, model, extra={"step": 2})
    assert not (tmp_path / ".tmp-step-00000002").exists()
    assert ck.resolve(tmp_path) == tmp_path / "step-00000002"


def _bad_step_on_rank0_only(rank: int, world_size: int, root: str) -> list[str]:
    model = OneWeight(None)
    errors = []
    for extra, kwargs in [({"step": 1.5}, {}), ({"step": -3}, {}), (None, {"keep_last": 0})]:
        try:  # extra (or keep_last) on rank 0 only, as the README allows for extra
            ck.save(
                root, model, extra=extra if rank == 0 else None, **(kwargs if rank == 0 else {})
            )
        except ck.CheckpointError as e:
            errors.append(str(e))
    for extra in ({"step": 10 + rank}, {"step": 10} if rank == 1 else None):
        try:  # rank 0's (or the next number) named the directory, each resumed with its own
            ck.save(root, model, extra=extra)
        except ck.CheckpointError as e:
            errors.append(str(e))
    ck.save(root, model, extra={"step": 4})  # the ranks are still in step: a good save works
    return errors


def test_bad_step_on_rank_0_only_raises_on_every_rank(tmp_path) -> None:
    """A bad extra["step"] or keep_last that only rank 0 passes used to raise there before the
    first collective: the other ranks waited in it until the process group's timeout."""
    results = run_ranks(_bad_step_on_rank0_only, 2, str(tmp_path), timeout=120)
    for errors in results:
        assert len(errors) == 5, errors
        assert "failed on rank(s) [0]" in errors[0] or "failed on rank 0" in errors[0]
        assert 'extra["step"]' in errors[0] and 'extra["step"]' in errors[1]
        assert "keep_last" in errors[2]
        assert 'save: extra["step"] differs between ranks (rank 0: 10; rank 1: 11)' in errors[3]
        assert 'save: extra["step"] is given on rank(s) [1] but not on rank 0' in errors[4]
    assert ck.resolve(tmp_path) == tmp_path / "step-00000004"
    assert not (tmp_path / "step-00000010").exists()


def test_inspect_names_a_missing_rank_file(world4, tmp_path, capsys) -> None:
    from grouped_ep.__main__ import main as cli

    root, _ = world4
    ckpt = tmp_path / "copy"
    shutil.copytree(ck.resolve(root / "ep2xdp2"), ckpt)
    assert cli(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "model.gate_up_proj  float32  [6, 12, 16]" in out and "4 chunk(s)" in out
    (ckpt / "__2_0.distcp").unlink()
    assert cli(["inspect", str(ckpt)]) == 1
    assert "data file __2_0.distcp is missing" in capsys.readouterr().out
    with pytest.raises(ck.CheckpointError, match="__2_0.distcp is missing"):
        ck.load(ckpt, ToyMoE(None))
