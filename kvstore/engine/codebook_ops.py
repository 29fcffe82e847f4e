"""The engine's codebook requests: set, read back, train (kept apart from
engine.py, which holds the per-request paths; Engine inherits them)."""
from __future__ import annotations

import torch

from kvstore.codec.codebooks import Codebooks, train_codebooks
from kvstore.errors import FailedPrecondition, quote

from . import checks


class CodebookOps:
    """Needs the Engine's cache() and _locked()."""

    def set_codebooks(self, name: str, cb: Codebooks, may_replace=None) -> str:
        """The cache's own codebooks again change nothing (its prefix blocks stay
        findable). may_replace(name) raises where the caller may not replace the
        codebooks a cache has (the servicer's tenant rule)."""
        sha = cb.sha256()
        with self._locked(name) as cache:
            if cache.codebooks is not None:
                if cache.codebooks_sha == sha:
                    return sha
                if may_replace is not None:
                    may_replace(name)
            cache.set_codebooks(cb)
        return sha

    def require_pq(self, name: str) -> None:
        """FailedPrecondition for an fp16 cache: checked before a request's codebooks
        are read, so that it is the answer whatever they hold."""
        if not self.cache(name).is_pq:
            raise FailedPrecondition("codebooks", f"cache {quote(name)} uses the fp16 codec")

    def codebooks(self, name: str) -> Codebooks:
        """The codebooks a cache uses (FailedPrecondition: fp16, or none yet)."""
        self.require_pq(name)
        with self._locked(name) as cache:
            if cache.codebooks is None:
                raise FailedPrecondition("codebooks", f"cache {quote(name)} has no codebooks yet")
            return cache.codebooks

    def train_codebooks(self, name: str, k: torch.Tensor, v: torch.Tensor, niter: int = 20, may_replace=None) -> str:
        cache = self.cache(name)
        g = cache.cfg.geometry
        for field, t, limit in (("k_samples", k, g.qk_limit), ("v_samples", v, None)):
            # Centroids are means of samples: samples the cache dtype holds give centroids it holds.
            checks.request_tensor(cache.cfg, t, field, (None,) * t.dim(), limit)
        if cache.codebooks is not None and may_replace is not None:
            may_replace(name)                                # before the training, not after
        cb = train_codebooks(cache.cfg, k, v, niter=niter)   # slow: outside the lock
        return self.set_codebooks(name, cb, may_replace)
