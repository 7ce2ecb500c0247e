"""Errors of the bootstrap rendezvous."""

from __future__ import annotations


class BootstrapError(Exception):
    """A rendezvous could not be reached, answered an error, or sent a message we cannot read."""


class RendezvousRefused(BootstrapError):
    """Nothing listens at the rendezvous address any more (connection refused): the instance that hosted it is
    gone (its process died or stopped). A timeout is not this: a slow or partitioned peer may come back."""


class TLSRefused(BootstrapError):
    """The TLS handshake with a rendezvous failed for a reason that retrying does not change: its certificate
    is not one the fleet's CA signed for the dialed host, or it does not speak TLS (``bootstrap.tls``)."""
