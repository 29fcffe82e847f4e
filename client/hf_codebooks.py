"""A codebooks file for the HF adapter: loaded, and checked against the model it is
meant for (kvstore-calibrate's output, or GetCodebooks' bytes)."""
from __future__ import annotations

import os

import torch


def fitting_codebooks(codebooks, transform, model_id: str, explicit: bool, geometry: tuple[int, int, int, int]):
    """-> (Codebooks, Transform or None) of a codebooks file (bytes or a path),
    refused (ValueError naming the field) unless it fits the model: its id, and
    geometry (layers that keep K/V, query heads, KV heads, head_dim)."""
    from kvstore.codec.codebooks import Codebooks
    from kvstore.codec.transform import load_codebooks
    if isinstance(codebooks, str):
        cb, beside = load_codebooks(codebooks)
    else:
        cb, beside = Codebooks.from_bytes(codebooks), None
    # A model loaded from a local folder or file is named by its path, which
    # says nothing of which model it is: its id is checked only when the
    # caller gives one (model_id=). Geometry is checked always.
    check_model(cb, model_id, not explicit and (not model_id or os.path.exists(model_id)), geometry)
    return cb, chosen_transform(cb, beside, transform)


def check_model(cb, model_id: str, local: bool, geometry: tuple[int, int, int, int]) -> None:
    """InvalidArgument (codebooks.<field>) or ValueError (codebooks: its shape)
    unless the codebooks fit the model's geometry and, unless local (a model
    named by its path), its id."""
    num_layers, num_q_heads, num_kv_heads, head_dim = geometry
    cb.check_fits(cb.info.model_id if local and cb.info is not None else model_id,
                  num_layers, num_q_heads, num_kv_heads, head_dim)
    if cb.k.shape[0] != num_layers or cb.k.shape[1] != num_kv_heads \
            or cb.k.shape[2] * cb.k.shape[4] != head_dim:
        raise ValueError(f"codebooks: shape {tuple(cb.k.shape)} does not fit the model's "
                         f"[{num_layers}, {num_kv_heads}, M, 256, {head_dim} / M]")


def chosen_transform(cb, beside, transform):
    """-> the Transform (or None) to store K/V through with these codebooks.
    transform: None (the file's own, or for a file of the old format the one
    beside it), 'none', or a Transform. A file that describes itself says its
    own and takes none given (but 'none' where it has none); one of the old
    format must have one beside it or given: ValueError naming transform."""
    from kvstore.codec.codebooks import CONVERT
    from kvstore.codec.transform import transform_of
    if cb.info is not None:
        says = "none" if cb.transform_k is None else "included"
        if transform is not None and not (isinstance(transform, str) and transform == says == "none"):
            raise ValueError(f"transform: the codebooks file says its own (transform {says}); "
                             "leave transform unset")
        return transform_of(cb)
    if transform is None:
        transform = beside
    if transform is None:
        raise ValueError("transform: a codebooks file of the old format does not say whether it was "
                         "calibrated after a transform (without it the output is fluent nonsense); pass "
                         f"transform= (a Transform, or 'none'), or convert the file: {CONVERT}")
    return None if transform == "none" else (transform if not isinstance(transform, str)
                                             else bad_transform(transform))


def bad_transform(value: str):
    raise ValueError(f"transform: {value!r} is not a Transform or 'none'")


class CacheBooks:
    """The adapter's codebooks against its caches' (one a layer group).

    files: the adapter's codebooks per group (Codebooks), or None (it uses the caches').
    A cache without codebooks gets its file. One holding others is a ValueError
    naming both: the adapter never replaces a cache's codebooks, which another
    worker may be storing through (the daemon refuses while a sequence is live,
    not between requests). Without files, the caches' codebooks say whether they
    were calibrated after a transform, and the adapter takes theirs: K/V stored
    without the transform they expect would decode to nonsense. changed() tells
    a cache whose codebooks were replaced since (SetCodebooks between requests):
    the adapter reconciles again before its next request."""

    def __init__(self, files: list | None, transform, whole: str = ""):
        self.files, self.given = files, transform
        self.whole = whole          # the file's own sha256 (kvstore-calibrate prints it) when files are its slices
        self.mine = None if files is None else [f.sha256() for f in files]
        self.seen: list[str] | None = None      # the caches' sha256 as last reconciled
        self.joined = False         # files: the codebooks the caches held when the adapter first met them

    def join(self, kv, groups, spec: dict, sinks_given: bool) -> None:
        """No file, no calibration: every group's cache must exist with codebooks, whose
        bit width (and, unless given, sink tokens) the spec takes, so that create_cache
        finds the cache as made; ValueError naming codebooks before anything is made.
        The codebooks taken then stand for the file: a restarted daemon gets them again."""
        import grpc

        from kvstore.codec.codebooks import Codebooks
        for g in groups:
            try:
                info = kv.get_cache(g.cache)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                info = None
            if info is None or not info.has_codebooks:
                raise ValueError(f"codebooks: kvstore cache {g.cache!r} " + ("does not exist" if info is None else
                                 "holds no codebooks") + ": codec 'pq' takes a codebooks file (kvstore-calibrate "
                                 "output), the cache's own, or calibrate_tokens >= 256 to let the daemon train them")
            spec["num_subvectors"] = info.spec.num_subvectors
            if not sinks_given:
                spec["sink_tokens"] = info.spec.sink_tokens
        files = [Codebooks.from_bytes(kv.get_codebooks(g.cache)) for g in groups]
        self.given = self._transform({i: f for i, f in enumerate(files) if f.info is not None}, groups)
        self.files, self.mine, self.joined = files, [f.sha256() for f in files], True

    def changed(self, kv, groups) -> bool:
        return [kv.get_cache(g.cache).codebooks_sha256 for g in groups] != self.seen

    def reconcile(self, kv, groups):
        """-> (whether every cache has codebooks, the transform to store K/V through)."""
        import grpc

        from kvstore.codec.codebooks import Codebooks
        ready, found, seen = True, {}, []
        for i, g in enumerate(groups):
            info = kv.get_cache(g.cache)
            theirs = info.codebooks_sha256
            if self.files is not None and theirs != self.mine[i]:
                mine = f"(sha256 {self.mine[i][:16]})" if len(groups) == 1 else \
                    f"for the layers of that cache, one of {len(groups)} (sha256 {self.mine[i][:16]} of those " \
                    f"layers; the whole file's is {self.whole[:16]})"
                given = "the adapter took from it when it first met it" if self.joined else "the file given has"
                if theirs:
                    raise ValueError(f"codebooks: kvstore cache {g.cache!r} holds other codebooks (sha256 "
                                     f"{theirs[:16]}) than {given} {mine}; "
                                     "use another cache name, or delete that cache (kvstore-admin delete-cache) "
                                     "once no worker uses it")
                try:
                    theirs = kv.set_codebooks(g.cache, self.files[i].to_bytes())
                except grpc.RpcError as e:          # another worker set other ones first
                    if e.code() != grpc.StatusCode.PERMISSION_DENIED:
                        raise
                    raise ValueError(f"codebooks: kvstore cache {g.cache!r}: {e.details()}") from None
            elif self.files is None and not theirs:
                ready = False
            elif self.files is None:
                cb = Codebooks.from_bytes(kv.get_codebooks(g.cache))
                if cb.info is not None:         # a file of the old format says nothing of a transform
                    found[i] = cb
            seen.append(theirs)
        self.seen = seen
        return ready, self.given if self.files is not None else self._transform(found, groups)

    def _transform(self, found: dict, groups):
        transform = self.given
        if not found:
            return transform
        from kvstore.codec.transform import Transform
        with_t = [i for i, cb in found.items() if cb.transform_k is not None]
        if not with_t:
            if transform is not None:
                raise ValueError(f"transform: kvstore cache {groups[next(iter(found))].cache!r} holds codebooks "
                                 "calibrated without a transform; leave transform unset")
            return None
        if len(with_t) < len(groups):
            raise ValueError("transform: the codebooks of caches " + ", ".join(repr(g.cache) for g in groups)
                             + " disagree on a transform, or some have none yet; pass the codebooks file")
        n = 1 + max(layer for g in groups for layer in g.layers)
        k = found[0].transform_k.new_zeros((n, *found[0].transform_k.shape[1:]))
        v = k.clone()
        for i, g in enumerate(groups):
            k[list(g.layers)], v[list(g.layers)] = found[i].transform_k, found[i].transform_v
        if transform is not None and not (torch.equal(transform.k, k) and torch.equal(transform.v, v)):
            raise ValueError("transform: not the one the cache's codebooks were calibrated after; leave it unset")
        return Transform(k=k, v=v)
