"""What the client checks before a call reaches the daemon: an `out` the result cannot go
in, counts and ranges protobuf cannot carry, and token ids in whatever form a model loop
has them (a list, a tensor, an array), the same on every lane. A refused call changes
nothing on the daemon."""
import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient

G = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, codec="fp16", block_size=8, num_blocks=64)
LANES = {"doorbell": dict(), "stream": dict(doorbell=False), "unary": dict(doorbell=False, stream=False),
         "inline": dict(doorbell=False, stream=False, transport="inline")}


def client(daemon, lane) -> KVStoreClient:
    kv = KVStoreClient(daemon, heartbeat=False, **LANES[lane])
    kv.create_cache("c", "m", exist_ok=True, **G)
    return kv


def state(kv, sid="s"):
    info = kv.sequence_info("c", sid)
    return info.length, list(info.pending)


@pytest.mark.parametrize("lane", list(LANES))
def test_an_out_the_result_cannot_go_in_is_refused_before_the_call(daemon, lane):
    with client(daemon, lane) as kv:
        kv.allocate("c", "s", [])
        kv.append("c", ["s"], torch.randn(2, 5, 2, 16).half(), torch.randn(2, 5, 2, 16).half())
        k, q = torch.randn(2, 2, 16).half(), torch.randn(2, 4, 16).half()
        kv.allocate("c", "t", [])
        kv.append("c", ["t"], torch.randn(2, 5, 2, 16).half(), torch.randn(2, 5, 2, 16).half())
        before = state(kv), state(kv, "t")
        bufs = kv.step_buffers("c", 1, device="cpu")           # a batch of 1's, for a call of 2
        for out, err, match in ((torch.empty(2, 4, 8).half(), ValueError, r"^out: shape \[2, 4, 8\], the call's q"),
                                (torch.empty(2, 4, 16, dtype=torch.int8), TypeError, "^out: a floating-point"),
                                (bufs.out, ValueError, r"^out: shape \[1, 4, 16\]")):
            with pytest.raises(err, match=match):
                kv.append_attend("c", 0, ["s", "t"], k, k, q, out=out)
        assert (state(kv), state(kv, "t")) == before
        out = torch.empty(2, 4, 16, dtype=torch.float32)
        got = kv.append_attend("c", 0, ["s", "t"], k, k, q, out=out)
        assert got is out and torch.equal(out, kv.attend("c", 0, ["s", "t"], q).float())


@pytest.mark.parametrize("lane", list(LANES))
def test_token_ids_as_a_list_a_tensor_or_an_array_on_every_lane(daemon, lane):
    """A batch's ids as the model loop has them: the daemon hashes them all the same, so
    the sequences' blocks are found by a later prompt of those ids."""
    with client(daemon, lane) as kv:
        prompt = list(range(100, 108))
        for n, form in enumerate((list, torch.tensor, np.array, lambda x: torch.tensor(x)[:, None])):
            sids = [f"a{n}", f"b{n}"]
            for sid in sids:
                kv.allocate("c", sid, prompt)
            kv.append("c", sids, torch.randn(2, 16, 2, 16).half(), torch.randn(2, 16, 2, 16).half(),
                      token_ids=[form(prompt), form(prompt)])
            for t in range(8):
                for layer in range(2):
                    kv.append_attend("c", layer, sids, torch.randn(2, 2, 16).half(), torch.randn(2, 2, 16).half(),
                                     torch.randn(2, 4, 16).half(),
                                     token_ids=form([200 + t, 300 + t]) if layer == 0 else None)
            assert state(kv, sids[0]) == state(kv, sids[1]) == (16, [0, 0])
        # the generated blocks' ids were taken: a prompt of all 16 ids hits both blocks
        for second in (200, 300):
            assert kv.allocate("c", f"hit{second}", prompt + list(range(second, second + 8)) + [9]) == 16


@pytest.mark.parametrize("lane", ["doorbell", "unary"])
def test_counts_ranges_and_ids_protobuf_cannot_carry_name_their_field(daemon, lane):
    with client(daemon, lane) as kv:
        kv.allocate("c", "s", [])
        kv.allocate("c", "t", [])
        k = torch.randn(2, 5, 2, 16).half()
        cases = ((lambda: kv.append("c", ["s", "t"], k, k), r"^counts: 5 tokens do not split evenly over 2"),
                 (lambda: kv.append("c", ["s", "t"], k, k, counts=[6, -1]), r"^counts: -1 outside"),
                 (lambda: kv.append("c", ["s"], k, k, token_ids=[[1, 2, 3, 4, 2 ** 63]]), r"^token_ids: 9223"),
                 (lambda: kv.retrieve("c", "s", start=-5), r"^start: must be >= 0, got -5"),
                 (lambda: kv.allocate("c", "u", [2 ** 63 + 5]), r"^prompt_token_ids: 9223372036854775813 outside"))
        for call, match in cases:
            with pytest.raises(ValueError, match=match):
                call()
        assert state(kv) == state(kv, "t") == (0, [0, 0])
        assert [i.sequence_id for i in kv.list_sequences("c")] == ["s", "t"]


def test_ids_a_batch_row_contradicts_are_refused_naming_its_sequence(daemon):
    """One row of a batch whose ids differ from those its Allocate gave: the whole call is
    refused (nothing appended to any row), and the message says which sequence."""
    import grpc
    with client(daemon, "unary") as kv:
        kv.allocate("c", "s", list(range(10, 18)))
        kv.allocate("c", "t", list(range(20, 28)))
        k = torch.randn(2, 16, 2, 16).half()
        with pytest.raises(grpc.RpcError) as e:
            kv.append("c", ["s", "t"], k, k, token_ids=[list(range(10, 18)), list(range(20, 27)) + [5]])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("token_ids: differ from the ids already known") and "'t'" in \
            e.value.details()
        assert state(kv) == state(kv, "t") == (0, [0, 0])
