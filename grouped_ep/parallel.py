"""Expert parallel and FSDP2 for MoE models: meshes, expert sharding, `fully_shard` placements.

The layout (as in torchtitan, EP carved out of data parallel):

- `make_mesh(dp, ep)`: a 2-D mesh `("dp", "ep")` over `dp * ep` ranks. Every rank is a
  data-parallel rank with its own tokens.
- Experts: DTensor `Shard(0)` on `"ep"` (rank r of an EP group owns experts
  `[r*E/ep, (r+1)*E/ep)`), then FSDP over `"dp"`: on dim 0 when the local experts split evenly
  over dp, else on dim 1 (e.g. when dp * ep > E).
- Every other weight: FSDP over all `dp * ep` ranks (the flattened `"dp_ep"` mesh).

Gradient scale. The loss is the mean over ranks of each rank's own loss. A dense weight's
gradient is averaged by FSDP over `dp * ep` ranks: right. An expert's local gradient already
sums the contributions of the tokens of all `ep` ranks of its group (the all-to-all backward
brings them home), and FSDP then reduces over `dp` only, so the expert modules divide by
`dp * ep` (`set_gradient_divide_factor`), not by `dp`. tests/test_parallel_dist.py checks both
against single-process training.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from grouped_ep._clip_grad import clip_grad_norm_
from grouped_ep._expert_units import expert_placement, experts_reshard, single_rank_reduce
from grouped_ep._inference_mode import guard_first_forward
from grouped_ep._mixed_dtypes import check_dtypes, split_dtypes
from grouped_ep._replaced import noting_gathered, noting_replaced
from grouped_ep._reshard import reshard_after_gradless_forward
from grouped_ep._save_pretrained import guard_save_pretrained
from grouped_ep._validate import check_module, is_int, is_numpy_bool
from grouped_ep.moe import GroupedExperts

__all__ = [
    "apply_expert_parallel",
    "check_mesh",
    "check_shardable",
    "clip_grad_norm_",
    "dense_mesh",
    "experts_modules",
    "fully_shard_moe",
    "is_experts_module",
    "make_mesh",
    "uses_experts_interface",
]

DENSE_DIM = "dp_ep"


def make_mesh(dp: int, ep: int, device_type: str | None = None) -> DeviceMesh:
    """The 2-D `("dp", "ep")` mesh over `dp * ep` ranks.

    Call on every rank after `torch.distributed.init_process_group` (NCCL for `cuda`, gloo for
    `cpu`). Ranks `[d*ep, (d+1)*ep)` form EP group d. `dense_mesh(mesh)`, the flattened
    `"dp_ep"` dim, is created here too. `device_type`: default `"cuda"` when a GPU is present
    (set the rank's device first, `torch.cuda.set_device(local_rank)`), else `"cpu"`.
    """
    import torch.distributed as dist

    if any(not is_int(v) or v < 1 for v in (dp, ep)):
        raise ValueError(f"make_mesh: dp and ep must be ints >= 1, got dp={dp!r}, ep={ep!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cpu", "cuda") or (
        device_type == "cuda" and not torch.cuda.is_available()
    ):
        raise ValueError(
            f"make_mesh: device_type must be 'cpu' or 'cuda' (on a machine with a GPU), got "
            f"{device_type!r}"
        )
    world = dist.get_world_size()
    if dp * ep != world:
        raise ValueError(f"make_mesh: dp*ep = {dp}*{ep} = {dp * ep} but the world size is {world}")
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    mesh._flatten(DENSE_DIM)
    return mesh


def is_experts_module(module: nn.Module) -> bool:
    """A `GroupedExperts`, or a module with the same stacked layout (transformers v5's
    `@use_experts_implementation` classes: `Qwen3MoeExperts`, `GptOssExperts`, ...): an int
    `num_experts`, a 3-D `gate_up_proj` (or `up_proj`, experts without a gate) and a 3-D
    `down_proj` parameter. Per-expert biases `[E, N]` next to them are expert parameters too."""
    if isinstance(module, GroupedExperts):
        return True
    params = dict(module.named_parameters(recurse=False))
    first = params.get("gate_up_proj", params.get("up_proj"))
    down = params.get("down_proj")
    return (
        isinstance(getattr(module, "num_experts", None), int)
        and first is not None
        and down is not None
        and first.dim() == 3
        and down.dim() == 3
    )


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every experts module of `model` (see `is_experts_module`), in module order."""
    return [m for m in model.modules() if is_experts_module(m)]


def _expert_params(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    # Every direct parameter stacked over experts (weights, and biases [E, N] if any).
    for name, param in module.named_parameters(recurse=False):
        if param.dim() >= 1 and param.shape[0] == module.num_experts:
            yield name, param


def _is_ep_sharded(param: torch.Tensor, ep_mesh: DeviceMesh) -> bool:
    return (
        isinstance(param, DTensor)
        and param.device_mesh == ep_mesh
        and tuple(param.placements) == (Shard(0),)
    )


def uses_experts_interface(module: nn.Module) -> bool:
    """A transformers v5 experts module (`@use_experts_implementation`): its forward is the
    function registered under `config._experts_implementation`."""
    own = vars(module)  # the attributes the decorator's __init__ sets on every instance
    return all(k in own for k in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


def check_shardable(
    model: nn.Module, ep_mesh: DeviceMesh, caller: str, with_fsdp: bool = False
) -> list[nn.Module]:
    """Every experts module of `model`, after checking that EP over `ep_mesh` can shard each one,
    so that a refusal (raised as `caller: ...`) comes before anything is changed: `num_experts`
    divisible by the EP degree, stacked weights plain tensors or already EP-sharded on
    `ep_mesh`, and (`with_fsdp`: for `fully_shard_moe` and what calls it) no parameter held by
    an experts module itself that is not stacked over its experts."""
    ep = ep_mesh.size()
    if with_fsdp and isinstance(model, FSDPModule):
        raise ValueError(
            f"{caller}: {type(model).__name__} is already sharded with FSDP2 (by parallelize, "
            "fully_shard_moe or torch's fully_shard); shard the unsharded model, once"
        )
    found = []
    for prefix, module in model.named_modules():
        if not is_experts_module(module):
            continue
        where = prefix or "model"
        parent, _, attr = prefix.rpartition(".")
        wrapper = model.get_submodule(parent) if attr == "base_layer" else None
        if wrapper is not None and hasattr(wrapper, "lora_A"):
            raise NotImplementedError(
                f"{caller}: {where} is wrapped by {type(wrapper).__name__} at {parent} (peft's "
                "LoRA on the expert weights, target_parameters): its adapter spans every expert "
                "as plain tensors, which cannot compute with EP-sharded expert weights (the "
                "first forward failed inside peft). Put LoRA on other modules, or merge it "
                "(merge_and_unload) before sharding"
            )
        if module.num_experts % ep != 0:
            raise ValueError(
                f"{caller}: {where} has num_experts={module.num_experts}, "
                f"not divisible by the EP degree {ep}"
            )
        for name, param in _expert_params(module):
            if isinstance(param, DTensor) and not _is_ep_sharded(param, ep_mesh):
                raise ValueError(
                    f"{caller}: {where}.{name} is already a DTensor with placements "
                    f"{tuple(param.placements)} on {param.device_mesh}; expected a plain tensor "
                    "(the model was sharded already: shard the unsharded model, once)"
                )
        if with_fsdp:
            _refuse_shared_direct_params(module, where, caller)
        found.append(module)
    if with_fsdp:
        check_dtypes(model)  # one dtype per module, else a refusal part-way through sharding
    return found


def _require_grouped_ep(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of an EP-sharded transformers experts module: only the `"grouped_ep"`
    implementation computes on its sharded weights (any other fails deep inside with a mix of
    tensors and DTensors). Loading and saving work whatever the implementation."""
    chosen = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if chosen != "grouped_ep":
        raise RuntimeError(
            f"{type(module).__name__}: its expert weights are EP-sharded DTensors, but it runs "
            f"experts_implementation={chosen!r}, which cannot compute on them. Use "
            "grouped_ep.hf.parallelize(model, mesh), which switches it, or `import "
            "grouped_ep.hf` and call model.set_experts_implementation('grouped_ep')"
        )


def _shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard `module`'s stacked weights over `ep_mesh` (`check_shardable` has passed)."""
    local = module.num_experts // ep_mesh.size()
    start = ep_mesh.get_local_rank() * local
    for name, param in list(_expert_params(module)):
        if _is_ep_sharded(param, ep_mesh):
            continue
        # Slice, don't broadcast: each rank keeps its own experts, and the clone drops the
        # other experts' storage (a view would keep it alive and bloat checkpoints).
        shard = param.detach()[start : start + local].clone()
        dtensor = DTensor.from_local(
            shard, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
        )
        setattr(module, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
    module.ep_mesh = ep_mesh
    if uses_experts_interface(module) and not getattr(module, "_grouped_ep_hooked", False):
        module.register_forward_pre_hook(_require_grouped_ep)
        module._grouped_ep_hooked = True


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every experts module's weights over `ep_mesh` and make its MoE dispatch over it.

    Each stacked expert weight `[E, ...]` becomes a DTensor `Shard(0)` on `ep_mesh` holding this
    rank's `E / ep` experts, sliced from the full local tensor (no communication; a meta model
    stays on meta). Sets `module.ep_mesh`. Idempotent. Returns `model`.
    """
    check_module(model, "apply_expert_parallel")
    if not isinstance(ep_mesh, DeviceMesh):
        raise TypeError(
            "apply_expert_parallel: ep_mesh must be a 1-D DeviceMesh (e.g. make_mesh(dp, ep)"
            f"['ep']), got {type(ep_mesh).__name__}"
        )
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"apply_expert_parallel: ep_mesh must be 1-D (e.g. mesh['ep']), got "
            f"{ep_mesh.ndim}-D {ep_mesh.mesh_dim_names}"
        )
    experts = check_shardable(model, ep_mesh, "apply_expert_parallel")
    with noting_replaced(model, "apply_expert_parallel"):
        for module in experts:
            _shard_experts(module, ep_mesh)
    if not experts:
        raise ValueError(
            f"apply_expert_parallel: {type(model).__name__} has no experts module "
            "(GroupedExperts or a module with num_experts, gate_up_proj and down_proj)"
        )
    guard_save_pretrained(model)  # transformers' save_pretrained cannot write DTensors
    return model


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of all `dp * ep` ranks of a `make_mesh` mesh (dense weights live on it)."""
    return mesh._flatten(DENSE_DIM)  # idempotent: returns the existing one after the first call


def _blocks(model: nn.Module) -> tuple[list[nn.Module], set[int]]:
    """The repeated blocks to shard one by one: the elements of the outermost ModuleLists that
    hold experts (a transformer's layers, dense layers between MoE layers included). An element
    that is itself a ModuleList or ModuleDict (no forward, which `fully_shard` refuses) gives its
    elements instead, at any depth. Also the ids of the last block of each list."""
    blocks: list[nn.Module] = []
    last: set[int] = set()
    inside: set[int] = set()

    def add(module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            for child in module.children():
                add(child)
        elif not is_experts_module(module):  # those are sharded on their own, over "dp"
            blocks.append(module)

    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        if any(is_experts_module(m) for m in module.modules()):
            count = len(blocks)
            add(module)
            if len(blocks) > count:
                last.add(id(blocks[-1]))
            inside.update(id(m) for m in module.modules())
    return blocks, last


def _refuse_shared_direct_params(module: nn.Module, prefix: str, caller: str) -> None:
    stacked = {id(p) for _, p in _expert_params(module)}
    direct = [n for n, p in module.named_parameters(recurse=False) if id(p) not in stacked]
    if direct:
        raise NotImplementedError(
            f"{caller}: {prefix}.{direct[0]} is a parameter of the experts module that is "
            f"not stacked over its {module.num_experts} experts; EP cannot shard it"
        )


def _shard_shared_params(module: nn.Module, prefix: str, flat_mesh: DeviceMesh, kwargs) -> None:
    """Parameters inside an experts module that are not stacked over experts (muse_spark's
    `post_expert_norm`) are one tensor shared by every expert: FSDP over `"dp"` alone would
    reduce their gradients over dp only, each EP rank would step its own copy with its own
    tokens' gradients, and the copies would drift apart. Their submodules are sharded over all
    ranks instead (see `_refuse_shared_direct_params` for one held by the module itself)."""
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=flat_mesh, **kwargs)


def check_mesh(mesh: DeviceMesh, caller: str) -> None:
    """Raise `caller: ...` unless `mesh` is the 2-D ("dp", "ep") mesh of `make_mesh`."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{caller}: mesh must be the DeviceMesh of make_mesh(dp, ep), got {type(mesh).__name__}"
        )
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ())[:2] != ("dp", "ep"):
        raise ValueError(
            f"{caller}: mesh must be the 2-D ('dp', 'ep') mesh of make_mesh, got "
            f"{mesh.ndim}-D {mesh.mesh_dim_names}"
        )


def check_policy(mp_policy: object, op: str) -> None:
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{op}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
            f"got {mp_policy!r}"
        )


def check_reshard(reshard_after_forward: bool | int, mesh: DeviceMesh, op: str) -> bool | int:
    """`reshard_after_forward` as a bool, or an int that divides both FSDP group sizes of
    `fully_shard_moe`: anything else refused before anything is sharded (torch refused a string
    only at the experts' fully_shard, the model half converted and a retry refused as "already
    a DTensor"; a review)."""
    n = reshard_after_forward
    if n is None:  # torch's default: the root not resharded, every other unit resharded
        return None
    if isinstance(n, bool) or is_numpy_bool(n):
        return bool(n)
    if not isinstance(n, numbers.Integral):
        raise ValueError(
            f"{op}: reshard_after_forward must be True, False, None or an int, got {n!r}"
        )
    n = int(n)
    dp, ep = mesh.size(0), mesh.size(1)
    if n < 1 or dp % n or (dp * ep) % n:
        raise ValueError(
            f"{op}: reshard_after_forward={n} must divide the size of every FSDP group it "
            f"applies to: the experts' 'dp' group ({dp} rank(s)) and the dense weights' 'dp' x "
            f"'ep' group ({dp * ep}); pass True or False, or an int that divides both"
        )
    return n


def fully_shard_moe(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Expert parallel plus FSDP2 on a MoE model, on a `make_mesh` mesh `("dp", "ep")`.

    Applies `apply_expert_parallel(model, mesh["ep"])` where not done yet (a model already
    loaded with `load_sharded` after it keeps its weights), then `fully_shard`s each experts
    module over `"dp"` (gradients divided by `dp * ep`; a submodule inside it that is shared by
    all experts, e.g. a post-expert norm, over `"dp_ep"`), each block of the outermost ModuleList
    holding experts over `"dp_ep"` (the last one of each list not resharded after its forward),
    and the root over `"dp_ep"`. A module whose parameters are
    in another dtype than the rest of its block's (an fp32 router that transformers keeps in a
    bf16 model) is a unit of its own, never cast (`_mixed_dtypes.py`). Afterwards every
    parameter is a DTensor. Returns `model` (now an FSDPModule).

    `reshard_after_forward` as `fully_shard` takes it; an int must divide both FSDP group sizes
    here, `dp` (the experts) and `dp * ep` (the rest), else it is a ValueError. The experts'
    units take an int between 1 and `dp` as True (FSDP2 cannot reshard their DTensor weights
    to a smaller mesh).
    """
    check_module(model, "fully_shard_moe")
    check_policy(mp_policy, "fully_shard_moe")
    check_mesh(mesh, "fully_shard_moe")
    reshard_after_forward = check_reshard(reshard_after_forward, mesh, "fully_shard_moe")
    experts = check_shardable(model, mesh["ep"], "fully_shard_moe", with_fsdp=True)  # first
    if not experts:
        raise ValueError(f"fully_shard_moe: {type(model).__name__} has no experts module")
    kwargs = {
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
    }
    names = {id(m): n for n, m in model.named_modules()}
    blocks, last_blocks = _blocks(model)
    _refuse_shared_across_blocks(model, [names[id(b)] for b in blocks])
    with noting_replaced(model, "fully_shard_moe"):
        _fully_shard_moe(model, experts, blocks, last_blocks, names, mesh, kwargs)
    noting_gathered(model)  # an optimizer built after a training forward: refused at step()
    guard_first_forward(model)  # a first forward under inference_mode broke FSDP2 for good
    reshard_after_gradless_forward(model)  # else an optimizer built next holds gathered tensors
    guard_save_pretrained(model)
    return model


def _fully_shard_moe(model, experts, blocks, last_blocks, names, mesh, kwargs) -> None:
    """fully_shard_moe's sharding, once its checks passed."""
    dp, ep = mesh.size(0), mesh.size(1)
    ep_mesh, dp_mesh, flat_mesh = mesh["ep"], mesh["dp"], dense_mesh(mesh)
    # A divide factor other than the group size makes FSDP reduce with PREMUL_SUM, which gloo
    # lacks: on CPU, sum and then divide instead.
    sum_only = mesh.device_type == "cpu"
    for module in experts:
        _shard_experts(module, ep_mesh)
        _shard_shared_params(module, names[id(module)], flat_mesh, kwargs)
        fully_shard(
            module,
            mesh=dp_mesh,
            shard_placement_fn=expert_placement(module.num_experts // ep, dp),
            **experts_reshard(single_rank_reduce(module, dp, kwargs), dp),
        )
        module.set_gradient_divide_factor(float(dp * ep))
        # torch 2.14 divides twice when the FSDP group has one rank and sums are forced
        # (once in the single-rank copy, once as the post-divide): force only when dp > 1.
        if sum_only and dp > 1:
            module.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        # The last block of a list stays gathered after its forward: backward starts with it
        # anyway, and a last block whose output reaches the loss only through a cache (an
        # encoder feeding its decoder's KV cache, diffusion_gemma) is never gathered again in
        # backward: autograd read its freed weights (a segfault).
        unit = {**kwargs, "reshard_after_forward": False} if id(block) in last_blocks else kwargs
        split_dtypes(block, names[id(block)], flat_mesh, unit)  # fp32 routers of bf16 models
        fully_shard(block, mesh=flat_mesh, **unit)
    split_dtypes(model, "", flat_mesh, kwargs)
    fully_shard(model, mesh=flat_mesh, **kwargs)


def _refuse_shared_across_blocks(model: nn.Module, blocks: list[str]) -> None:
    """A parameter reachable from two blocks (or from a block and the rest of the model), each
    its own FSDP unit, would be sharded twice: torch's error came only at the first forward, or
    as "Cannot concatenate overlapping meshes", naming no parameter."""
    units: dict[int, dict[str, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = next((b for b in blocks if name.startswith(b + ".")), "the model outside its blocks")
        units.setdefault(id(param), {}).setdefault(unit, name)
    shared = [" = ".join(u.values()) for u in units.values() if len(u) > 1]
    if shared:
        raise ValueError(
            "fully_shard_moe: these parameters are shared by blocks that become separate FSDP "
            f"units: {'; '.join(shared)}; give each block its own parameter, or shard the model "
            "with fully_shard yourself, putting the sharing blocks in one unit"
        )
