"""Typed errors of model loading."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded: the one error type ``load_model`` raises for a bad model.

    Attributes:
        path: the file or folder at fault (``None`` when no file is involved, e.g. an unknown model name).
        reason: what is wrong, in words (missing file, unknown architecture, missing tensor, shape mismatch).
    """

    def __init__(self, path: str | None, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path is not None else reason)
