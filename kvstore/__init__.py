"""kvstore: a GPU KV-cache sidecar (see README.md)."""
import os as _os

# Run from a source checkout without installing (`python server.py`, the GPU
# box): the card's top-level kernels/ and client/ folders are this package's
# kernels and client subpackages, as pyproject.toml maps them when installed.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "protos", "kvstore.proto")) and _root not in __path__:
    __path__.append(_root)
