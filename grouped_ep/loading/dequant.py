"""Reading and dequantizing quantized targets (planned in quant.py).

Per target, one native `read_ranges` call fills two CPU buffers, the quantized bytes this rank
owns and the scale blocks that cover them; then each piece is dequantized into its box of the
fresh tensor: by `torch.ops.grouped_ep.dequantize` (csrc/io/dequant.cpp, `threads` threads) on CPU
destinations, by the same arithmetic in torch ops on the device after the copy on GPU ones.
Both compute float(value) * float(scale) in fp32 and round once to the model's dtype, as
transformers' Fp8Dequantize and convert_moe_packed_tensors do.
"""

from __future__ import annotations

import numpy as np
import torch

from grouped_ep.loading.plan import Target
from grouped_ep.loading.quant import QuantPiece
from grouped_ep.loading.read import read_ranges

# E2M1 values by nibble, the low nibble of a byte holding the even column.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def _scales(raw: torch.Tensor, method: str, qp: QuantPiece) -> torch.Tensor:
    n = int(np.prod(qp.scale_shape)) * qp.scale.dtype.itemsize
    s = raw[qp.scale_at : qp.scale_at + n].view(qp.scale.dtype).reshape(qp.scale_shape)
    # mxfp4: the uint8 E8M0 exponents themselves (2^(e - 127) is applied with ldexp: no float32
    # holds 2^128, the scale of exponent 255).
    return s.contiguous() if method == "mxfp4" else s.to(torch.float32)


def _views(target: Target, data: torch.Tensor, qp: QuantPiece) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's quantized bytes and destination box, each as [A, R, C] (C packed for mxfp4)."""
    plan = target.quant
    pack = 2 if plan.method == "mxfp4" else 1
    box = qp.box
    dbox = box[:-1] + (slice(box[-1].start // pack, box[-1].stop // pack),)
    q = data.view(plan.data_shape)[dbox]
    out = (target.fresh.transpose(-1, -2) if plan.transposed else target.fresh)[box]
    if out.ndim == 2:
        q, out = q.unsqueeze(0), out.unsqueeze(0)
    return q, out


def dequantize_torch(
    q: torch.Tensor,
    scale: torch.Tensor,
    row_block: torch.Tensor,
    col_block: torch.Tensor,
    method: str,
    out: torch.Tensor,
) -> None:
    """out[a, i, j] = value(q, a, i, j) * scale[a, row_block[i], col_block[j]] in fp32, on any
    device. q: [A, R, C] uint8 (fp8 bytes) or [A, R, C / 2] (FP4 pairs); out: [A, R, C]. mxfp4's
    scale may be uint8 E8M0 exponents e, applied as ldexp(value, e - 127) like transformers."""
    s = scale.index_select(1, row_block).index_select(2, col_block)
    if method == "mxfp4":
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=q.device)
        vals = torch.stack([lut[(q & 0xF).long()], lut[(q >> 4).long()]], dim=-1).flatten(-2)
        if s.dtype == torch.uint8:
            out.copy_(torch.ldexp(vals, s.to(torch.int32) - 127))
            return
    else:
        vals = q.view(torch.float8_e4m3fn).to(torch.float32)
    out.copy_(vals * s)


def read_quantized(targets: list[Target], files, threads: int, progress) -> tuple[int, int]:
    """Read and dequantize `targets` into fresh tensors. Returns (quantized, scale) bytes read."""
    qbytes = sbytes = 0
    # One read buffer each for codes and scales, the largest target's size, reused: a fresh
    # pair per tensor, between the fresh model tensors, fragmented the heap (a review: the peak
    # grew with the expert count, up to +36% of the model; now bounded by the largest tensor).
    data_buf = torch.empty(max((t.quant.data_bytes for t in targets), default=0), dtype=torch.uint8)
    scale_buf = torch.empty(
        max((t.quant.scale_bytes for t in targets), default=0), dtype=torch.uint8
    )
    for target in targets:
        plan = target.quant
        data, scales = data_buf[: plan.data_bytes], scale_buf[: plan.scale_bytes]
        n = read_ranges(files, [data, scales], plan.rows, threads)
        progress.add(n)
        qbytes += int(plan.rows[plan.rows[:, 1] == 0, 4].sum())
        sbytes += int(plan.rows[plan.rows[:, 1] == 1, 4].sum())
        target.fresh = torch.empty(
            target.local_shape, dtype=target.tensor.dtype, device=target.device
        )
        cuda = target.device.type != "cpu"
        if cuda:
            data = data.to(target.device, non_blocking=False)
        for qp in plan.pieces:
            q, out = _views(target, data, qp)
            s = _scales(scales, plan.method, qp)
            rb, cb = (torch.from_numpy(b) for b in qp.blocks())
            if cuda:
                s, rb, cb = (x.to(target.device) for x in (s, rb, cb))
                dequantize_torch(q, s, rb, cb, plan.method, out)
            else:
                torch.ops.grouped_ep.dequantize(q, s, rb, cb, out, plan.method, threads)
    return qbytes, sbytes
