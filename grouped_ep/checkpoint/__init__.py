"""Distributed checkpoints for sharded MoE models: save, load (resharding), export to Hugging Face.

dcp.py      `save`: atomic, compact DCP checkpoints, every rank's shards in one step directory
resume.py   `load`: a checkpoint into the model as it is sharded now (resharding), checked first
direct_reader.py  DCP's reader, but large chunks read straight into their destination
layout.py   the root's layout: `step-N/` directories, `latest`, atomic renames; `resolve`
inspect.py  `describe`: read and check a checkpoint without loading it (CLI: `inspect`)
async_save.py  the handle of a background save and the wait for it
collective.py  process-group helpers (work without a process group)
export.py   `export_hf`: the Hugging Face safetensors layout with per-expert keys, from every rank
safetensors_writer.py  a safetensors file written one tensor at a time
"""

from grouped_ep.checkpoint.async_save import AsyncSave
from grouped_ep.checkpoint.dcp import save
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.export import export_hf
from grouped_ep.checkpoint.inspect import CheckpointInfo, describe
from grouped_ep.checkpoint.layout import resolve
from grouped_ep.checkpoint.resume import load

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointInfo",
    "describe",
    "export_hf",
    "load",
    "resolve",
    "save",
]
