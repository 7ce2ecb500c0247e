"""Rendezvous of the PD instances: each instance hosts its own (``Rendezvous``, on a thread of its process),
where peers fetch its registration and decode posts room destinations to prefill. No project imports.
"""

from bootstrap.client import BootstrapClient, ClientPool
from bootstrap.errors import BootstrapError, RendezvousRefused
from bootstrap.messages import PROTOCOL_VERSION, Destination, PostResult, Registration, RoomReleased
from bootstrap.registry import Registry, RegistryConfig
from bootstrap.rendezvous import Rendezvous, RendezvousConfig

__all__ = ["PROTOCOL_VERSION", "BootstrapClient", "BootstrapError", "ClientPool", "Destination", "PostResult",
           "Registration", "Registry", "RegistryConfig", "Rendezvous", "RendezvousConfig",
           "RendezvousRefused",
           "RoomReleased"]
