"""The error `load_sharded` raises."""


class LoadError(ValueError):
    """A checkpoint cannot be loaded into the model; the message names the file and key."""

    __module__ = "grouped_ep.loading"
