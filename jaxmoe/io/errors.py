"""The one error type of the checkpoint loaders."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: the message names the file and the
    tensor, key, shape or option at fault. A `ValueError`, so callers that catch bad
    input generally catch this too."""
