"""`load_sharded`: each rank reads its own slice of a safetensors checkpoint, nothing more.

safetensors.py  the format: strict header parsing, a checkpoint's key -> tensor table
keys.py         checkpoint keys -> model tensors (per-expert keys stacked, `key_map`)
plan.py         DTensor placements -> owned indices -> coalesced byte ranges
read.py         the native parallel reads (csrc/io/reader.cpp), staging, progress
quant.py        quantized formats (block FP8, MXFP4): scales, covering blocks, byte ranges
dequant.py      reading quantized tensors and dequantizing them (csrc/io/dequant.cpp on CPU)
load.py         `load_sharded` and its `LoadReport`: plan, read, swap into the model
"""

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.load import LoadReport, load_sharded

__all__ = ["LoadError", "LoadReport", "load_sharded"]
