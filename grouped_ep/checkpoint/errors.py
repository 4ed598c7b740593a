"""The error the checkpoint functions raise."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt, or does not fit the model."""

    __module__ = "grouped_ep.checkpoint"
