"""The error the checkpoint functions raise."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt, or does not fit the model."""

    __module__ = "grouped_ep.checkpoint"


def listed(items: list[str], first: int = 3) -> str:
    """The first `first` of `items`, comma-separated, and how many there are when more."""
    more = f", ... ({len(items)} in all)" if len(items) > first else ""
    return ", ".join(items[:first]) + more
