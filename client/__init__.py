"""kvstore.client: the thin client model workers use."""
from .client import KVStoreClient, Reservation

__all__ = ["KVStoreClient", "Reservation"]
