"""The doorbell's packet formats, shared by the daemon (service/doorbell.py) and the
client (client/doorbell.py). Little-endian structs on a SOCK_SEQPACKET socket,
one packet per message, so no framing.

    hello     client -> daemon   b"KVB1" + the 32-byte token of RegisterBufferReply
    request   client -> daemon   REQUEST, then n_seqs u16 lengths, then the
                                 buffer id, cache and sequence ids (UTF-8);
                                 op 2 then n_ids i64 token ids and TOKENS last
    reply     daemon -> client   REPLY, then the error message (UTF-8)

A request is an AppendAttend whose k, v, q and out are byte ranges of one
registered buffer (k, v, q dense rank-3 tensors of one dtype). Op 1 is one new token
per sequence without ids; op 2 also carries query_tokens and token_ids, so that a
prefill chunk after a prefix hit (T new tokens a sequence, their ids hashed as their
blocks seal) takes this lane too. TOKENS sits at the packet's end, so the daemon finds
the ids without parsing the rest and keeps one decoded request for the packets that
differ only in them. The reply's code is the gRPC status code AppendAttend would have
ended with (0: OK; the output, of the reply's dtype and q's shape, is in the buffer),
and the message names the field, as its details would. The hello's reply is a REPLY
with call id 0.
"""
from __future__ import annotations

import struct

HELLO_MAGIC = b"KVB1"
TOKEN_BYTES = 32
HELLO = struct.Struct(f"<4s{TOKEN_BYTES}s")
OP_APPEND_ATTEND = 1
OP_APPEND_ATTEND_TOKENS = 2
# call id, op, dtype (pb.DType), layer, scale, k/v/q/out offsets, k/v/q shapes,
# buffer id length, cache name length, number of sequences
REQUEST = struct.Struct("<IHHifQQQQ9IHHH")
# call id, status code, dtype of the output (pb.DType), the handler's time in µs
# (for breakdowns), message length
REPLY = struct.Struct("<IHHIH")
# op 2, the packet's last bytes: query tokens a sequence, number of token ids before it
TOKENS = struct.Struct("<HI")
MAX_PACKET = 1 << 16            # a request of 8 sequences with 256-character ids is ~2.2 KB
MAX_MESSAGE = 4000              # bytes of an error message kept in a reply


def is_op2(query_tokens: int, token_ids) -> bool:
    """Whether a call needs op 2: more than one query token, or token ids."""
    return query_tokens != 1 or len(token_ids) > 0


def pack_head(call: int, op: int, dtype: int, layer: int, scale: float, offsets: tuple[int, int, int, int],
              shapes: tuple, buffer_id: bytes, cache: bytes, seq_ids: list[bytes]) -> bytes:
    """A request up to its sequence ids (all of op 1); shapes: the 9 dims of k, v, q."""
    return b"".join((REQUEST.pack(call, op, dtype, layer, scale, *offsets, *shapes, len(buffer_id), len(cache),
                                  len(seq_ids)),
                     struct.pack(f"<{len(seq_ids)}H", *map(len, seq_ids)), buffer_id, cache, *seq_ids))


def pack_tokens(query_tokens: int, token_ids) -> bytes:
    """Op 2's end, after pack_head: the token ids, then TOKENS."""
    return struct.pack(f"<{len(token_ids)}q", *token_ids) + TOKENS.pack(query_tokens, len(token_ids))


def pack_request(call: int, dtype: int, layer: int, scale: float, offsets: tuple[int, int, int, int],
                 shapes: tuple, buffer_id: bytes, cache: bytes, seq_ids: list[bytes],
                 query_tokens: int = 1, token_ids=()) -> bytes:
    """A whole request: op 1, or op 2 where is_op2."""
    if not is_op2(query_tokens, token_ids):
        return pack_head(call, OP_APPEND_ATTEND, dtype, layer, scale, offsets, shapes, buffer_id, cache, seq_ids)
    return pack_head(call, OP_APPEND_ATTEND_TOKENS, dtype, layer, scale, offsets, shapes, buffer_id, cache,
                     seq_ids) + pack_tokens(query_tokens, token_ids)


def pack_reply(call: int, code: int, handler_us: int, message: str = "", dtype: int = 0) -> bytes:
    m = message.encode("utf-8", "replace")[:MAX_MESSAGE]
    return REPLY.pack(call, code, dtype, min(handler_us, 0xFFFFFFFF), len(m)) + m
