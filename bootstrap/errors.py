"""Errors of the bootstrap rendezvous."""

from __future__ import annotations


class BootstrapError(Exception):
    """The bootstrap service could not be reached, answered an error, or sent a message we cannot read."""
