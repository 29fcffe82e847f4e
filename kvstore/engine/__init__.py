"""Tensors behind each cache's lock: caches, write and read paths, storage, decode graphs."""
