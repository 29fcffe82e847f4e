"""A codebooks file for the HF adapter: loaded, and checked against the model it is
meant for (kvstore-calibrate's output, or GetCodebooks' bytes)."""
from __future__ import annotations

import os


def fitting_codebooks(codebooks, transform, model_id: str, explicit: bool, geometry: tuple[int, int, int, int]):
    """-> (Codebooks, Transform or None) of a codebooks file (bytes or a path),
    refused (ValueError naming the field) unless it fits the model: its id, and
    geometry (layers that keep K/V, query heads, KV heads, head_dim)."""
    num_layers, num_q_heads, num_kv_heads, head_dim = geometry
    from kvstore.codec.codebooks import CONVERT, Codebooks
    from kvstore.codec.transform import load_codebooks, transform_of
    if isinstance(codebooks, str):
        cb, beside = load_codebooks(codebooks)
    else:
        cb, beside = Codebooks.from_bytes(codebooks), None
    info = cb.info
    # A model loaded from a local folder or file is named by its path, which
    # says nothing of which model it is: its id is checked only when the
    # caller gives one (model_id=). Geometry is checked always.
    local = not explicit and (not model_id or os.path.exists(model_id))
    cb.check_fits(info.model_id if local and info is not None else model_id,
                  num_layers, num_q_heads, num_kv_heads, head_dim)
    if info is not None:
        says = "none" if cb.transform_k is None else "included"
        if transform is not None and not (isinstance(transform, str) and transform == says == "none"):
            raise ValueError(f"transform: the codebooks file says its own (transform {says}); "
                             "leave transform unset")
        return cb, transform_of(cb)
    if cb.k.shape[0] != num_layers or cb.k.shape[1] != num_kv_heads \
            or cb.k.shape[2] * cb.k.shape[4] != head_dim:
        raise ValueError(f"codebooks: shape {tuple(cb.k.shape)} does not fit the model's "
                         f"[{num_layers}, {num_kv_heads}, M, 256, {head_dim} / M]")
    if transform is None:
        transform = beside
    if transform is None:
        raise ValueError("transform: a codebooks file of the old format does not say whether it was "
                         "calibrated after a transform (without it the output is fluent nonsense); pass "
                         f"transform= (a Transform, or 'none'), or convert the file: {CONVERT}")
    return cb, None if transform == "none" else (transform if not isinstance(transform, str)
                                                 else bad_transform(transform))

def bad_transform(value: str):
    raise ValueError(f"transform: {value!r} is not a Transform or 'none'")
