"""Codebooks files that describe themselves (format kvstore.pq.v2): what
they hold survives a round trip, a file that does not fit a cache is refused
naming the field, a damaged or self-contradicting one is refused, and files
of the old format still load (with their transform from beside them)."""
import json

import pytest
import torch

from kvstore.codec.codebooks import FORMAT, LEGACY_FORMAT, Codebooks, fingerprint
from kvstore.codec.transform import Transform, load_codebooks, transform_path
from kvstore.errors import InvalidArgument
from tests.helpers import config


def books(transform=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    cb = Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g), v=torch.randn(2, 2, 8, 256, 2, generator=g))
    if transform:
        a = torch.eye(16) + 0.1 * torch.randn(2, 2, 16, 16, generator=g)
        cb.transform_k, cb.transform_v = a, a.transpose(-1, -2).contiguous()
    return cb


def meta(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])["__metadata__"]


def test_described_file_round_trip():
    cfg = config()
    cb = books(transform=True).describe(model_id="test-model", num_q_heads=4, sink_tokens=32,
                                        calibrated_on="python3.11-doc, 32 windows of 2048 tokens")
    data = cb.to_bytes()
    m = meta(data)
    assert m["format"] == FORMAT and m["transform"] == "included" and m["model_id"] == "test-model"
    assert json.loads(m["geometry"]) == {"num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    assert m["bits"] == "4" and m["sink_tokens"] == "32" and m["sha256"] == cb.sha256()
    back = Codebooks.from_bytes(data)
    assert back.info == cb.info and back.sha256() == cb.sha256()
    assert torch.equal(back.transform_k, cb.transform_k) and torch.equal(back.transform_v, cb.transform_v)
    back.validate(cfg)
    # The transform is part of what the cache stores: it changes the fingerprint.
    assert fingerprint(cfg, back) != fingerprint(cfg, books())


def test_codebooks_without_transform_hash_as_before():
    """sha256 (and so fingerprints, disk keys) of plain codebooks is unchanged by a description."""
    cb = books()
    assert cb.describe(model_id="x").sha256() == cb.sha256()
    assert Codebooks.from_bytes(cb.to_bytes()).sha256() == cb.sha256()
    assert meta(cb.to_bytes())["format"] == LEGACY_FORMAT


@pytest.mark.parametrize("field, kw", [
    ("codebooks.model_id", dict(model_id="other/model")),
    ("codebooks.num_q_heads", dict(num_q_heads=8)),
])
def test_file_for_another_model_is_refused(field, kw):
    cb = Codebooks.from_bytes(books().describe(**{"model_id": "test-model", **kw}).to_bytes())
    with pytest.raises(InvalidArgument) as e:
        cb.validate(config())
    assert e.value.field == field


@pytest.mark.parametrize("field, cfg", [
    ("codebooks.num_layers", dict(num_layers=3)),
    ("codebooks.num_kv_heads", dict(num_kv_heads=1, num_q_heads=4)),
    ("codebooks.head_dim", dict(head_dim=32)),
    ("codebooks.bits", dict(m=4)),                  # a 2-bit cache (M = d/4), a 4-bit file
])
def test_file_that_does_not_fit_the_cache_names_the_field(field, cfg):
    cb = Codebooks.from_bytes(books().describe(model_id="test-model").to_bytes())
    with pytest.raises(InvalidArgument) as e:
        cb.validate(config(**cfg))
    assert e.value.field == field


def test_damaged_or_contradicting_files_are_refused():
    from safetensors.torch import save
    cb = books(transform=True).describe(model_id="test-model")
    data = bytearray(cb.to_bytes())
    data[-1] ^= 0xFF                                # a flipped bit in the last tensor
    with pytest.raises(InvalidArgument) as e:
        Codebooks.from_bytes(bytes(data))
    assert e.value.field == "codebooks.sha256"
    m = meta(cb.to_bytes())
    tensors = {"k": cb.k, "v": cb.v}                # says "included", carries none
    with pytest.raises(InvalidArgument, match="transform"):
        Codebooks.from_bytes(save(tensors, metadata=m))
    bad = {**m, "geometry": json.dumps({"num_layers": 5, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16})}
    with pytest.raises(InvalidArgument) as e:
        Codebooks.from_bytes(save({**tensors, "transform.k": cb.transform_k, "transform.v": cb.transform_v},
                                  metadata=bad))
    assert e.value.field == "codebooks.num_layers"
    with pytest.raises(InvalidArgument) as e:
        Codebooks.from_bytes(save(tensors, metadata={**m, "format": "kvstore.pq.v9"}))
    assert e.value.field == "codebooks.format"


@pytest.mark.parametrize("fmt", ["v1", "v2"])
def test_tensors_that_are_not_floats_are_refused_by_name(fmt):
    from safetensors.torch import save
    cb = books().describe(model_id="test-model")
    m = meta(cb.to_bytes()) if fmt == "v2" else {}
    with pytest.raises(InvalidArgument) as e:
        Codebooks.from_bytes(save({"k": cb.k.to(torch.int32), "v": cb.v}, metadata=m))
    assert e.value.field == "codebooks.k" and "int32" in e.value.message
    for dt in (torch.float16, torch.bfloat16):        # read as fp32
        assert Codebooks.from_bytes(save({"k": cb.k.to(dt), "v": cb.v.to(dt)})).k.dtype == torch.float32


def test_a_long_value_in_a_broken_header_is_quoted_short():
    header = json.dumps({"k": {"dtype": "F" * 5000, "shape": [1], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(InvalidArgument) as e:
        Codebooks.from_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    assert e.value.field == "codebooks" and len(str(e.value)) < 200 and "F" * 65 not in str(e.value)


def test_an_old_format_file_is_checked_against_the_sha256_it_carries():
    """A file of the old format (no description) that carries a sha256 is refused when its
    tensors no longer match it; one that carries none is taken, as old files were written."""
    from safetensors.torch import save
    cb = books()
    data = bytearray(cb.to_bytes())
    assert meta(bytes(data))["format"] == LEGACY_FORMAT
    data[-1] ^= 0xFF
    with pytest.raises(InvalidArgument) as e:
        Codebooks.from_bytes(bytes(data))
    assert e.value.field == "codebooks.sha256"
    with pytest.raises(InvalidArgument) as e:
        Codebooks.from_bytes(save({"k": cb.k, "v": cb.v}, metadata={"sha256": "0" * 64}))
    assert e.value.field == "codebooks.sha256"
    assert Codebooks.from_bytes(save({"k": cb.k, "v": cb.v})).sha256() == cb.sha256()
    half = {"k": cb.k.half(), "v": cb.v.half()}       # fp16 tensors, hashed as they were stored
    sha = Codebooks(**half).sha256()
    assert torch.equal(Codebooks.from_bytes(save(half, metadata={"sha256": sha})).k, cb.k.half().float())


def test_old_files_load_with_the_transform_beside_them(tmp_path):
    cb = books()
    path = str(tmp_path / "old.safetensors")
    cb.save(path)
    got, tr = load_codebooks(path)
    assert got.info is None and tr is None and got.sha256() == cb.sha256()
    a = torch.eye(16).expand(2, 2, 16, 16) * 2.0
    Transform(k=a.contiguous(), v=a.clone().contiguous()).save(transform_path(path))
    got, tr = load_codebooks(path)
    assert tr is not None and torch.equal(tr.k, a)
    new = str(tmp_path / "new.safetensors")
    Codebooks(got.k, got.v, tr.k, tr.v).describe(model_id="m").save(new)
    got, tr = load_codebooks(new)                   # one file: the transform comes from inside
    assert got.info.model_id == "m" and torch.equal(tr.k, a)
