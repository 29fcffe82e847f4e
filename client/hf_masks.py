"""The attention masks the daemon's sequences stand for. The daemon attends each row's
tokens from its first real one (after its left padding), causally, within the layer's
window or chunk; a forward whose mask says anything else (a custom 4-D mask hiding
tokens, a bidirectional block, an additive bias) is refused, naming attention_mask,
rather than answered as if the mask were the standard one: at a decode step, and at a
prefill, whose K/V would be stored under the prompt's ids for later prompts to hit. So is
a forward that does not continue the cache, or at other positions (check_continues)."""
from __future__ import annotations

import inspect

import torch

ROWS = 1024     # a prefill's query rows compared at a time: 32 MiB of temporaries a sequence at 32K


def masks_before(mask, first: int) -> bool:
    """The mask hides every key position before `first` from the last query (a prefill's
    earlier queries reach back further; check() compares every row)."""
    if not isinstance(mask, torch.Tensor) or mask.ndim < 2 or mask.shape[-1] < first:
        return False
    head = mask[..., -1:, :first]
    return not bool(head.any()) if head.dtype == torch.bool else bool((head <= torch.finfo(head.dtype).min).all())


def hides_earlier_chunks(mask, kv_len: int, c: int, pads: list[int]) -> bool:
    """The mask hides from each row's last query the keys before its chunk: chunks of c
    count from the row's first token, after its left padding (as transformers')."""
    for r, p in enumerate(pads):
        first = p + (kv_len - 1 - p) // c * c
        if first > p and not masks_before(mask if len(pads) == 1 or not isinstance(mask, torch.Tensor)
                                          or mask.shape[0] == 1 else mask[r:r + 1], first):
            return False
    return True


def standard(lo: int, hi: int, kv_len: int, pads: list[int], window: int, chunk: int,
             device) -> tuple[torch.Tensor, torch.Tensor]:
    """What the daemon attends for the queries at positions [lo, hi) of kv_len in each
    row (row b's first pads[b] positions are padding) -> (bool [B, 1, hi - lo, kv_len],
    True = attended; bool [B, 1, hi - lo, 1], True where the query is a real token)."""
    p = torch.tensor(pads, device=device).view(-1, 1, 1)
    q = torch.arange(lo, hi, device=device).view(1, hi - lo, 1)
    j = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    out = (j >= p) & (j <= q)
    if window:
        out &= j > q - window
    if chunk:
        out &= j >= p + torch.div(q - p, chunk, rounding_mode="floor") * chunk
    return out.unsqueeze(1), (q >= p).unsqueeze(1)


def check(layer: int, mask, kv_len: int, pads: list[int], window: int, chunk: int) -> None:
    """ValueError unless `mask` (the attention call's: bool, True = attend, or additive
    float with 0 and the dtype's minimum only) is the standard one on every query row
    that is a real token (a query on padding is hidden from what follows)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[-1] != kv_len:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: layer {layer} was called with a mask of {shape}, not "
                         f"[batch, heads, queries, {kv_len}]: the kvstore adapter takes "
                         "transformers' own masks only")
    n = mask.shape[-2]
    if all(_standard_rows(layer, mask[..., lo:lo + ROWS, :], kv_len - n + lo, kv_len, pads, window, chunk)
           for lo in range(0, n, ROWS)):
        return
    raise ValueError(f"attention_mask: layer {layer}'s mask differs from the causal one over each row's "
                     "tokens after its left padding (a custom 4-D mask, or bidirectional attention among "
                     "some tokens); the daemon's sequences attend every earlier token of the row"
                     + (f" within its window of {window}" if window else "")
                     + (f" and chunk of {chunk}" if chunk else ""))


def _standard_rows(layer: int, rows, lo: int, kv_len: int, pads: list[int], window: int, chunk: int) -> bool:
    """Whether the mask's rows, the queries from position lo, are the standard ones
    (those on padding not compared); ValueError for a bias."""
    if rows.dtype == torch.bool:
        seen = rows
    else:
        seen = rows == 0
        if not bool((seen | (rows <= torch.finfo(rows.dtype).min)).all()):
            raise ValueError(f"attention_mask: layer {layer}'s mask adds a bias to the scores; the kvstore "
                             "adapter takes masks that only hide or keep keys")
    want, real = standard(lo, lo + rows.shape[-2], kv_len, pads, window, chunk, rows.device)
    return bool(((seen == want) | ~real).all())


def check_continues(cache, kwargs: dict, x) -> None:
    """ValueError unless a forward of x (its input_ids or inputs_embeds) given the adapter's
    daemon cache continues it: its 2-D attention_mask (else its position_ids) starts where
    the cache's tokens end, and its position_ids, where given, number each row's tokens on
    from there. Otherwise its K/V would be appended after the wrong tokens, or the daemon,
    holding other ids there, refuses the append and no fallback could recompute what the
    caller meant. (An in-process cache after a fallback is transformers' own: not checked.)"""
    n = x.shape[1] if isinstance(x, torch.Tensor) and x.ndim >= 2 else 0
    if cache.local or n == 0:
        return
    mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
    have = cache.length
    # (the signature read only then: this runs before every decode step)
    if pos is None and max(cache.pads) > 0 and \
            "position_ids" in inspect.signature(cache.adapter.model.forward).parameters:
        raise ValueError(f"position_ids: the kvstore cache holds a left-padded batch (padding {cache.pads}) and the "
                         "forward gives none, so the model numbers each row from its padding; the daemon's "
                         "sequences start at each row's first token: pass position_ids from 0 there, as "
                         "generate() does (cache.positions(start, end))")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        start = mask.shape[-1] - n
    elif isinstance(pos, torch.Tensor) and pos.ndim == 2 and pos.shape[0] == len(cache.pads):
        # row i numbers its first real token 0 (left padding pads[i])
        rows = [i for i, p in enumerate(cache.pads) if p <= have]
        if not rows:
            return
        start = int(pos[rows[0], 0]) + cache.pads[rows[0]]
    else:
        return
    if start != have:
        raise ValueError(f"past_key_values: the forward's {n} tokens start at position {start}, but the kvstore "
                         f"cache holds {have} tokens: each forward must continue the cache (model.generate "
                         "runs the prompt past what its cache holds: give it adapter.cache_for's cache, not one "
                         "a forward of the whole prompt filled). Assisted / speculative generation "
                         "(assistant_model, prompt_lookup_num_tokens), which runs the prompt again with its "
                         "drafts, is not supported by the kvstore adapter")
    # Before the forward runs: its K/V go to the daemon under their token ids, and K/V made
    # under a mask with a hole, or at other positions, would then serve a later prompt of the
    # same ids that has none.
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[0] == len(cache.pads):
        if not torch.equal(mask.detach().cpu().to(torch.bool), _real(cache.pads, 0, mask.shape[-1])):
            raise ValueError("attention_mask: the forward's mask hides a token after a row's left padding, or "
                             f"attends its padding (the kvstore cache was made with left padding {cache.pads}); "
                             "the daemon's sequences attend every token after it: give the cache the same "
                             "attention_mask (adapter.cache_for(input_ids, attention_mask))")
    if isinstance(pos, torch.Tensor) and pos.ndim == 2 and pos.shape[0] in (1, len(cache.pads)):
        want, real = cache.positions(have, have + n), _real(cache.pads, have, have + n)
        if pos.shape[-1] == n and not bool(((pos.detach().cpu() == want) | ~real).all()):
            raise ValueError("position_ids: the forward's positions are not each row's next ones (from 0 at its "
                             f"first token after left padding {cache.pads}, one a token); the daemon's "
                             "sequences hold K/V at those positions: give the tokens in order, without gaps")


def _real(pads: list[int], lo: int, hi: int) -> torch.Tensor:
    """bool [B, hi - lo]: whether positions [lo, hi) of each row are its tokens, not its
    left padding."""
    return torch.arange(lo, hi)[None] >= torch.tensor(pads)[:, None]


def check_known_ids(cache, ids) -> None:
    """ValueError unless a forward over cache_for's cache brings, where the daemon holds
    the prompt's ids (Allocate's), those ids: embeddings instead would be stored under
    them for later prompts to hit, and other tokens (a forward that repeats what
    cache_for already ran) would be appended after the prompt's."""
    known = cache.known_ids
    if cache.local or known is None or cache.length >= known.shape[1]:
        return
    if ids is None:
        raise ValueError("inputs_embeds: the daemon holds this cache's prompt ids (adapter.cache_for(input_ids)) "
                         "and would store these embeddings' K/V under them, for later prompts of those ids to "
                         "hit: make the cache with adapter.cache_for(input_ids, reuse_prefix=False)")
    n = min(ids.shape[-1], known.shape[1] - cache.length)
    want = known[:, cache.length:cache.length + n].cpu().expand(ids.shape[0], n)
    if not torch.equal(ids[:, :n].detach().cpu(), want):
        raise ValueError(f"input_ids: the kvstore cache holds {cache.length} tokens of the prompt adapter.cache_for "
                         "was given, and the forward's are not the prompt's next ones: give it "
                         "input_ids[:, cache.length:] (as generate() does)")
