"""Metadata only: block pool, prefix hashes, sequences, names, configs. No tensors, no gRPC."""
