"""Non-persistent buffers recomputed by building their module again (`loading/buffers.py`):
the module's parameters are built on meta, the random number generators are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import grouped_ep
from grouped_ep import checkpoint
from grouped_ep.loading.buffers import _rebuild


class Args:
    dim, vocab = 64, 1000


class Transformer(nn.Module):
    """torchtitan's layout: `freqs_cis` non-persistent on the model itself."""

    def __init__(self, model_args):
        super().__init__()
        self.model_args = model_args
        self.embed = nn.Embedding(model_args.vocab, model_args.dim)
        self.out = nn.Linear(model_args.dim, model_args.vocab)
        freqs = torch.outer(torch.arange(16.0), torch.arange(1, 5.0))
        self.register_buffer("freqs_cis", freqs, persistent=False)


def test_rebuild_builds_parameters_on_meta_and_keeps_the_rng():
    model = Transformer(Args())
    state = torch.get_rng_state()
    fresh = _rebuild(model, torch.device("cpu"))
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.is_meta for p in fresh.parameters())
    assert torch.equal(fresh.freqs_cis, model.freqs_cis)
    # the patch is gone afterwards: a module built now has real parameters
    assert not nn.Linear(2, 2).weight.is_meta


def test_checkpoint_load_recomputes_a_top_level_buffer(tmp_path):
    torch.manual_seed(0)
    model = Transformer(Args())
    checkpoint.save(tmp_path, model)
    grouped_ep.checkpoint.export_hf(model, tmp_path / "hf")
    with torch.device("meta"):
        fresh = Transformer(Args())
    fresh.to_empty(device="cpu")
    fresh.freqs_cis.fill_(float("nan"))  # what to_empty may leave
    state = torch.get_rng_state()
    checkpoint.load(tmp_path, fresh)
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(fresh.freqs_cis, model.freqs_cis)
    assert torch.equal(fresh.out.weight, model.out.weight)
    with torch.device("meta"):
        meta = Transformer(Args())
    grouped_ep.load_sharded(meta, tmp_path / "hf", device="cpu")
    assert torch.equal(meta.freqs_cis, model.freqs_cis)
    assert torch.equal(meta.embed.weight, model.embed.weight)


def _tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=48, max_position_embeddings=40,
    )  # fmt: skip
    return BertForMaskedLM, cfg


def test_integer_buffers_set_by_init_weights(tmp_path):
    """BERT's int64 `position_ids` and `token_type_ids` are non-persistent buffers that only
    transformers' `_init_weights` sets: a meta build could not be loaded ("does not keep its
    constructor arguments"), and a resume after to_empty kept garbage positions with a
    warning. Both now take init's values: loads and logits equal from_pretrained's."""
    cls, cfg = _tiny_bert()
    torch.manual_seed(0)
    cls(cfg).save_pretrained(tmp_path / "hf")
    ref = cls.from_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        model = cls(cfg)
    grouped_ep.load_sharded(model, tmp_path / "hf", device="cpu")
    for name, value in ref.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], value), name
    ids = torch.randint(0, 64, (2, 12))
    assert torch.equal(model.eval()(ids).logits, ref(ids).logits)  # from_pretrained: eval
    checkpoint.save(tmp_path / "ck", ref)
    with torch.device("meta"):
        resumed = cls(cfg)
    resumed.to_empty(device="cpu")
    resumed.bert.embeddings.position_ids.fill_(0)
    resumed.tie_weights()
    checkpoint.load(tmp_path / "ck", resumed)
    assert torch.equal(resumed.bert.embeddings.position_ids, ref.bert.embeddings.position_ids)
    assert torch.equal(resumed.eval()(ids).logits, ref(ids).logits)


class _Scaled(nn.Module):
    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=persistent)


def test_unrecomputable_buffer_error_names_the_checkpoint_key(tmp_path):
    """A non-persistent buffer that cannot be recomputed, whose name the checkpoint holds: the
    error said "no checkpoint holds them", naming neither the key nor the checkpoint."""
    from safetensors.torch import save_file

    save_file({"lin.weight": torch.ones(4, 4), "lin.bias": torch.ones(4), "scale": torch.ones(4)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    with torch.device("meta"):
        model = _Scaled(persistent=False)
    with pytest.raises(grouped_ep.LoadError, match=r"none is read from a checkpoint.*has keys "
                       r"of these names: scale\)"):  # fmt: skip
        grouped_ep.load_sharded(model, tmp_path, device="cpu")


def test_rebuild_leaves_other_threads_parameters_alone():
    """The parameters-on-meta switch is this thread's: patching the method for the duration
    put other threads' new parameters on meta too (a review: 2447 of 5683 nn.Linear)."""
    import threading

    stop, bad, built = threading.Event(), [], [0]

    def build():
        while not stop.is_set():
            bad.append(nn.Linear(4, 4).weight.is_meta)
            built[0] += 1

    other = threading.Thread(target=build)
    other.start()
    try:
        for _ in range(200):
            _rebuild(Transformer(Args()), torch.device("cpu"))
    finally:
        stop.set()
        other.join()
    assert built[0] > 0 and not any(bad)
