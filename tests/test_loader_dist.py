"""load_sharded on 2 and 4 gloo ranks, against transformers' own save_pretrained/from_pretrained.

Each multi-process run does several scenarios (spawning ranks is the slow part on a small CI
machine); every scenario's load runs under a collective counter that must stay at zero.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _ckpt_helpers import (
    from_pretrained_state,
    meta_model,
    save_hf,
    tiny_qwen3_moe_config,
)
from _dist import run_ranks

EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "scatter", "gather", "gather_object", "scatter_object_list", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip


class CollectiveCounter:
    """Counts collectives: Python-level torch.distributed calls (patched) and dispatcher-level
    c10d / functional collectives (CommDebugMode, which sees what DTensor issues)."""

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch.distributed.tensor.debug import CommDebugMode

        self.calls: list[str] = []
        self._saved = []
        for mod in (dist, c10d):
            for name in _COLLECTIVES:
                fn = getattr(mod, name, None)
                if fn is None:
                    continue

                def wrapper(*a, __fn=fn, __name=name, **k):
                    self.calls.append(__name)
                    return __fn(*a, **k)

                self._saved.append((mod, name, fn))
                setattr(mod, name, wrapper)
        self._mode = CommDebugMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for mod, name, fn in self._saved:
            setattr(mod, name, fn)

    @property
    def count(self) -> int:
        return len(self.calls) + self._mode.get_total_counts()


def _ep_model(config, ep_mesh, dtype=torch.float32):
    """transformers' model on meta, expert params as DTensor Shard(0) on the EP mesh."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    model = meta_model(config, dtype)
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            for attr in ("gate_up_proj", "down_proj"):
                p = getattr(module, attr)
                d = distribute_tensor(p, ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(module, attr, nn.Parameter(d))
    return model


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _counted_load(model, path, **kw):
    """load_sharded under the collective counter; also the I/O the kernel counted for it.

    The I/O is measured independently of LoadReport.bytes_read (the library's own counter, equal
    to bytes_owned by construction of its plan): /proc/self/io sums every thread of the process,
    the native pread() pool included, and rchar counts every byte read()/pread() returned (page
    cache or not). read_bytes is the storage-layer part (0 when the files are cached, as here
    right after writing them). Barriers on both sides keep other ranks' gloo traffic (socket
    reads count in rchar too) out of the window; the barriers themselves are not counted.
    """
    import torch.distributed as dist

    from grouped_ep import load_sharded  # imported outside the window: .py/.pyc reads count too

    dist.barrier()
    with CollectiveCounter() as counter:
        io0 = _proc_io()
        report = load_sharded(model, path, **kw)
        io1 = _proc_io()
    dist.barrier()
    return report, counter.count, {k: io1[k] - io0[k] for k in ("rchar", "read_bytes")}


def _locals(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _two_rank_body(rank: int, world: int, ckpt: str, bf16_ckpt: str, config) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    experts = config.num_experts
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))

    # Positive control: the counter does see a collective.
    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(1))
    out["control_count"] = counter.count

    # 1. EP=world experts, everything else replicated, meta model.
    model = _ep_model(config, mesh)
    out["ep_report"], out["ep_count"], out["ep_io"] = _counted_load(model, ckpt)
    out["ep"] = _locals(model)
    out["ep_is_dtensor"] = all(
        isinstance(p, DTensor) for n, p in model.named_parameters() if n.endswith(EXPERT_PARAMS)
    )

    # 2. The regression: rank 0 reads the full checkpoint, cuts the shard it knows (its own),
    #    broadcasts it, and every rank wraps what it received as its expert shard.
    full = {}
    if rank == 0:
        import glob

        for f in sorted(glob.glob(f"{ckpt}/*.safetensors")):
            full.update(load_file(f))
    bcast = {}
    local_e = -(-experts // world)
    for name, p in _ep_model(config, mesh).named_parameters():
        if not name.endswith(EXPERT_PARAMS):
            continue
        layer = name.split(".mlp.")[0]
        t = torch.empty(p.to_local().shape)
        if rank == 0:
            if name.endswith("gate_up_proj"):
                rows = [
                    torch.cat(
                        [
                            full[f"{layer}.mlp.experts.{i}.{w}.weight"]
                            for w in ("gate_proj", "up_proj")
                        ]
                    )
                    for i in range(local_e)
                ]
            else:
                rows = [full[f"{layer}.mlp.experts.{i}.down_proj.weight"] for i in range(local_e)]
            t.copy_(torch.stack(rows))
        dist.broadcast(t, src=0)
        bcast[name] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False).to_local()
    out["broadcast"] = bcast

    # 3. FSDP Shard(0) of every param after fully_shard on a meta model (65 vocab rows: the
    #    last shard is uneven).
    fsdp_model = meta_model(config)
    for layer in fsdp_model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp_model, mesh=mesh)
    out["fsdp_report"], out["fsdp_count"], out["fsdp_io"] = _counted_load(fsdp_model, ckpt)
    out["fsdp"] = _locals(fsdp_model)
    out["fsdp_full"] = {k: v.full_tensor() for k, v in fsdp_model.state_dict().items()}

    # 4. A bf16 file into an fp32 EP model that is already materialized (in place).
    model = _ep_model(config, mesh)
    model.to_empty(device="cpu")
    out["bf16_report"], out["bf16_count"], out["bf16_io"] = _counted_load(model, bf16_ckpt)
    out["bf16"] = _locals(model)
    out["bf16_dtypes"] = {str(v.dtype) for v in out["bf16"].values()}
    return out


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(v.nbytes for v in state.values())


def _expected_ep(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in full.items():
        if k.endswith(EXPERT_PARAMS):
            out[k] = torch.chunk(v, world)[rank] if rank < len(torch.chunk(v, world)) else v[:0]
        else:
            out[k] = v
    return out


def _metadata_bytes(ckpt) -> tuple[int, int]:
    """(headers, allowance): the bytes of every file's 8-byte length + JSON header, which every
    rank parses, and what reading them may cost in read() bytes: the index file, plus each header
    as Python's buffered reader fetches it (whole st_blksize blocks from the start of the file,
    at most the file), plus 1 KiB for reading /proc/self/io itself."""
    ckpt = Path(ckpt)
    headers = 0
    allowance = (ckpt / "model.safetensors.index.json").stat().st_size + 1024
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = 8 + int.from_bytes(fh.read(8), "little")
        st = f.stat()
        headers += n
        allowance += min(st.st_size, -(-n // st.st_blksize) * st.st_blksize)
    return headers, allowance


def _check_load(out: dict, key: str, owned: int, ckpt, what) -> None:
    """One load on one rank: the report's byte counts equal `owned` (computed by the caller from
    shapes), and the kernel's count of bytes the load read (rchar) is at least `owned` plus every
    header and at most `owned` plus the metadata allowance. read_bytes (storage reads,
    page-granular and with readahead) is only shown: it is 0 for these freshly written, cached
    files and has no tight bound when it is not."""
    report, io = out[f"{key}_report"], out[f"{key}_io"]
    assert report.bytes_read == report.bytes_owned == owned, (what, report, owned)
    assert out[f"{key}_count"] == 0, what
    headers, allowance = _metadata_bytes(ckpt)
    low, high = owned + headers, owned + allowance
    assert low <= io["rchar"] <= high, (what, io, low, high)


@pytest.fixture(scope="module")
def hf_ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    config = tiny_qwen3_moe_config(experts=8)
    config.vocab_size = 65  # FSDP Shard(0) of embed / lm_head rows is uneven on 2 and 4 ranks
    fp32 = save_hf(base / "fp32", config, seed=1)
    bf16 = save_hf(base / "bf16", config, seed=2, dtype=torch.bfloat16)
    assert len(list(fp32.glob("*.safetensors"))) > 2  # several shard files
    return config, fp32, bf16, from_pretrained_state(fp32), from_pretrained_state(bf16)


@pytest.mark.slow
def test_two_ranks_ep_regression_fsdp_bf16(hf_ckpts):
    config, fp32, bf16, ref, ref_bf16 = hf_ckpts
    results = run_ranks(_two_rank_body, 2, str(fp32), str(bf16), config, timeout=180)
    for rank, out in enumerate(results):
        assert out["control_count"] >= 1
        # EP: each rank's experts are its own slice of from_pretrained's, dense params whole.
        want = _expected_ep(ref, rank, 2)
        assert out["ep_is_dtensor"]
        assert out["ep"].keys() == want.keys()
        for k in want:
            assert torch.equal(out["ep"][k], want[k]), (rank, k)
        assert out["ep_report"].missing == [] and out["ep_report"].unused_keys == []
        _check_load(out, "ep", _nbytes(want), fp32, ("ep", rank))
        # Regression: the broadcast path hands everyone rank 0's experts; load_sharded does not.
        for k, t in out["broadcast"].items():
            assert torch.equal(t, _expected_ep(ref, 0, 2)[k]), k
            if rank == 1:
                assert not torch.equal(t, want[k]), k
                assert not torch.equal(out["ep"][k], t), k
        # FSDP after fully_shard: rows this rank owns, uneven last shard, whole model identical.
        for k, v in ref.items():
            assert torch.equal(out["fsdp"][k], torch.chunk(v, 2)[rank]), (rank, k)
            assert torch.equal(out["fsdp_full"][k], v), k
        assert out["fsdp"]["lm_head.weight"].shape[0] == (33, 32)[rank]
        fsdp_owned = sum(torch.chunk(v, 2)[rank].nbytes for v in ref.values())
        _check_load(out, "fsdp", fsdp_owned, fp32, ("fsdp", rank))
        # bf16 file into an fp32 model: exact widening of from_pretrained's bf16 values.
        assert out["bf16_dtypes"] == {"torch.float32"}
        want_bf16 = _expected_ep(ref_bf16, rank, 2)
        for k in want_bf16:
            assert torch.equal(out["bf16"][k], want_bf16[k].float()), (rank, k)
        _check_load(out, "bf16", _nbytes(want_bf16), bf16, ("bf16", rank))  # bf16 bytes read
    # Reading only its own experts: every dense byte and exactly half of the expert bytes.
    dense = sum(v.nbytes for k, v in ref.items() if not k.endswith(EXPERT_PARAMS))
    expert = sum(v.nbytes for k, v in ref.items() if k.endswith(EXPERT_PARAMS))
    assert [r["ep_report"].bytes_read for r in results] == [dense + expert // 2] * 2


def _four_rank_body(rank: int, world: int, ckpt: str, config) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = _ep_model(config, ep_mesh)
    out["ep_report"], out["ep_count"], out["ep_io"] = _counted_load(model, ckpt)
    out["ep"] = _locals(model)

    # Experts on a 2-D (dp, ep) mesh: load before fully_shard, or after it; same model.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))

    def build():
        m = _ep_model(config, mesh["ep"])
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        return m

    after = build()
    out["after_report"], out["after_count"], out["after_io"] = _counted_load(after, ckpt)
    before = _ep_model(config, mesh["ep"])
    out["before_report"], out["before_count"], out["before_io"] = _counted_load(before, ckpt)
    for layer in before.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(before, mesh=mesh["dp"])

    out["placements"] = {}
    out["match_torch"] = {}
    out["full_after"], out["full_before"] = {}, {}
    for (k, a), b in zip(after.state_dict().items(), before.state_dict().values()):
        assert isinstance(a, DTensor) and isinstance(b, DTensor)
        out["placements"][k] = str(a.placements)
        # What torch itself computes as this rank's part (src_data_rank=None: no communication).
        full = a.full_tensor()
        expect = distribute_tensor(full, a.device_mesh, a.placements, src_data_rank=None)
        out["match_torch"][k] = torch.equal(a.to_local(), expect.to_local())
        out["full_after"][k] = full
        out["full_before"][k] = b.full_tensor()
    return out


@pytest.mark.slow
def test_four_ranks_ep_and_2d_mesh(hf_ckpts):
    config, fp32, _, ref, _ = hf_ckpts
    results = run_ranks(_four_rank_body, 4, str(fp32), config, timeout=240)
    for rank, out in enumerate(results):
        want = _expected_ep(ref, rank, 4)
        for k in want:
            assert torch.equal(out["ep"][k], want[k]), (rank, k)
        # 2-D mesh: rank = dp * 2 + ep. After fully_shard a rank owns its dp half of the rows of
        # every dense param and its (ep, then dp) quarter of the experts; before it, its ep half
        # of the experts and every dense param whole.
        dp, ep = divmod(rank, 2)
        after_owned = sum(
            torch.chunk(torch.chunk(v, 2)[ep] if k.endswith(EXPERT_PARAMS) else v, 2)[dp].nbytes
            for k, v in ref.items()
        )
        _check_load(out, "ep", _nbytes(want), fp32, ("ep", rank))
        _check_load(out, "after", after_owned, fp32, ("after", rank))
        _check_load(out, "before", _nbytes(_expected_ep(ref, ep, 2)), fp32, ("before", rank))
        assert "_StridedShard" in out["placements"]["model.layers.0.mlp.experts.gate_up_proj"]
        assert all(out["match_torch"].values()), out["match_torch"]
        for k, v in ref.items():
            assert torch.equal(out["full_after"][k], v), k
            assert torch.equal(out["full_before"][k], v), k
    # 8 experts over ep=4, and over dp=2 x ep=2 after fully_shard: each rank reads exactly a
    # quarter of the expert bytes (plus all dense bytes, or its dp half of their rows).
    dense = sum(v.nbytes for k, v in ref.items() if not k.endswith(EXPERT_PARAMS))
    dense_dp = [
        sum(torch.chunk(v, 2)[dp].nbytes for k, v in ref.items() if not k.endswith(EXPERT_PARAMS))
        for dp in (0, 1)
    ]
    expert = sum(v.nbytes for k, v in ref.items() if k.endswith(EXPERT_PARAMS))
    assert [r["ep_report"].bytes_read for r in results] == [dense + expert // 4] * 4
    assert [r["after_report"].bytes_read for r in results] == [
        dense_dp[rank // 2] + expert // 4 for rank in range(4)
    ]
