"""kvstore.client: the thin client model workers use."""
from .arena import StepBuffers
from .client import KVStoreClient, Reservation

__all__ = ["KVStoreClient", "Reservation", "StepBuffers"]
