"""The attention masks the daemon's sequences stand for. The daemon attends each row's
tokens from its first real one (after its left padding), causally, within the layer's
window or chunk; a forward whose mask says anything else (a custom 4-D mask hiding
tokens, a bidirectional block, an additive bias) is refused, naming attention_mask,
rather than answered as if the mask were the standard one: at a decode step, and at a
prefill, whose K/V would be stored under the prompt's ids for later prompts to hit."""
from __future__ import annotations

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
