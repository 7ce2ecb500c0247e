"""Bootstrap rendezvous: prefill/decode instances register here, and decode tells prefill where to write.

No project imports. ``python -m bootstrap`` runs it as its own process; ``BootstrapServer`` runs it on a
thread (tests, or embedded in another process).
"""

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError
from bootstrap.messages import PROTOCOL_VERSION, Destination, PostResult, Registration, RoomReleased
from bootstrap.registry import Registry, RegistryConfig
from bootstrap.server import BootstrapServer, ServerConfig

__all__ = ["PROTOCOL_VERSION", "BootstrapClient", "BootstrapError", "BootstrapServer", "Destination",
           "PostResult", "Registration", "Registry", "RegistryConfig", "RoomReleased", "ServerConfig"]
