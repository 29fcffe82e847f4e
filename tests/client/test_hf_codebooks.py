"""Codebooks files through the client and the adapter: GetCodebooks reads
back what a cache uses (trained in the daemon: saved, then restored
elsewhere with the same sha256), SetCodebooks refuses a file made for
another cache naming the field, and the adapter refuses, at construction,
a file that does not fit its model or that cannot say whether it needs a
transform."""
import grpc
import pytest
import torch

from kvstore.client.client import KVStoreClient
from kvstore.codec.codebooks import Codebooks
from kvstore.client import hf_variants

GEOM = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)


def samples(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n, 2, 16, generator=g).half(), torch.randn(2, n, 2, 16, generator=g).half()


def test_trained_codebooks_saved_and_restored(daemon):
    kv = KVStoreClient(daemon)
    kv.create_cache("a", "org/model", codec="pq", num_blocks=16, sink_tokens=16, **GEOM)
    sha = kv.train_codebooks("a", *samples(), niter=2)
    data = kv.get_codebooks("a")
    cb = Codebooks.from_bytes(data)
    assert cb.sha256() == sha == kv.get_cache("a").codebooks_sha256
    assert cb.info.model_id == "org/model" and cb.info.sink_tokens == 16 and cb.info.bits == 4
    assert "TrainCodebooks" in cb.info.calibrated_on and "300" in cb.info.calibrated_on
    kv.create_cache("b", "org/model", codec="pq", num_blocks=16, sink_tokens=16, **GEOM)
    assert kv.set_codebooks("b", data) == sha
    assert kv.get_cache("b").fingerprint == kv.get_cache("a").fingerprint    # same block hashes: prefixes carry over
    kv.create_cache("other", "org/another", codec="pq", num_blocks=16, **GEOM)
    with pytest.raises(grpc.RpcError) as e:
        kv.set_codebooks("other", data)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("codebooks.model_id")
    assert not kv.get_cache("other").has_codebooks
    kv.create_cache("two-bit", "org/model", codec="pq", num_subvectors=4, num_blocks=16, **GEOM)
    with pytest.raises(grpc.RpcError) as e:
        kv.set_codebooks("two-bit", data)
    assert e.value.details().startswith("codebooks.bits")
    kv.close()


# ------------------------------------------------------------------ adapter
transformers = pytest.importorskip("transformers")


def adapter(daemon, codebooks, **kw):
    from kvstore.client.hf import KVStoreAdapter
    from test_hf_adapter import tiny_llama
    return KVStoreAdapter(tiny_llama(), daemon, cache="c", codec="pq", codebooks=codebooks, block_size=8,
                          residual=8, **kw)


def books(layers=2, transform=False):
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(layers, 2, 8, 256, 2, generator=g), v=torch.randn(layers, 2, 8, 256, 2, generator=g))
    if transform:
        a = torch.eye(16).expand(layers, 2, 16, 16).contiguous()
        cb.transform_k, cb.transform_v = a, a.clone()
    return cb


@pytest.mark.parametrize("field, cb, kw", [
    ("codebooks.num_layers", books(layers=3).describe(), {}),
    ("codebooks.model_id", books().describe(model_id="org/model"), dict(model_id="org/another")),
    ("transform", books(transform=True).describe(), dict(transform="none")),
])
def test_adapter_refuses_a_file_that_does_not_fit(daemon, field, cb, kw):
    with pytest.raises(ValueError, match=f"^{field}"):
        adapter(daemon, cb.to_bytes(), **kw)


def test_adapter_refuses_an_old_file_without_its_transform(daemon, tmp_path):
    with pytest.raises(ValueError, match="^transform: .*kvstore.tools.codebooks convert"):
        adapter(daemon, books().to_bytes())
    ad = adapter(daemon, books().to_bytes(), transform="none")     # said explicitly: taken
    assert ad.transform is None
    with pytest.raises(ValueError, match=r"^codebooks: shape \(3,"):
        adapter(daemon, books(layers=3).to_bytes(), transform="none")


def test_adapter_takes_the_files_sinks_and_labels_a_local_model_by_its_weights(daemon, tmp_path):
    """A model with no hub name (built here, or loaded from a folder) is labelled by its
    weights even where the file names a model: a file fits any weights of its geometry,
    and its name would put other weights of that geometry in the same cache."""
    cb = books(transform=True).describe(model_id="org/model", sink_tokens=48)
    path = str(tmp_path / "cb.safetensors")
    cb.save(path)
    ad = adapter(daemon, path)
    assert ad.transform is not None and torch.equal(ad.transform.k, cb.transform_k)
    assert ad.spec["model_id"].endswith(hf_variants.weights_id(ad.model).split("@")[1])
    assert ad.spec["sink_tokens"] == 48
    info = ad.client().get_cache("c")
    assert info.codebooks_sha256 == cb.sha256() and info.spec.model_id == ad.spec["model_id"]


def test_adapter_never_replaces_a_caches_codebooks_and_notices_when_they_are(daemon):
    """A cache holding codebooks other than the adapter's file is refused, naming
    both, empty or not: another worker may be storing through them. An adapter
    whose cache's codebooks were replaced between its requests (SetCodebooks on
    the idle cache) takes them again before the next one: with a file it refuses,
    without one it takes their transform; it never stores through codebooks it
    did not check."""
    from test_hf_adapter import GEN, prompt
    first = books(transform=True).describe()
    other = Codebooks(k=first.k * 2, v=first.v, transform_k=first.transform_k * 1.5,
                      transform_v=first.transform_v).describe()
    a = adapter(daemon, first.to_bytes())
    assert a.client().get_cache("c").codebooks_sha256 == first.sha256()
    with pytest.raises(ValueError, match=rf"^codebooks: kvstore cache 'c' holds other codebooks \(sha256 "
                                         rf"{first.sha256()[:16]}\) than the file given has \(sha256 "
                                         rf"{other.sha256()[:16]}\)"):
        adapter(daemon, other.to_bytes()).client()
    reader = adapter(daemon, None, calibrate_tokens=256)          # takes the cache's, and their transform
    with torch.no_grad():
        reader.generate(prompt(40), **GEN)
    assert torch.equal(reader.transform.k, first.transform_k)
    kv = KVStoreClient(daemon)
    kv.set_codebooks("c", other.to_bytes())                       # the default tenant, on the idle cache
    with pytest.raises(ValueError, match="^codebooks: kvstore cache 'c' holds other codebooks"):
        with torch.no_grad():
            a.generate(prompt(40), **GEN)
    with torch.no_grad():
        reader.generate(prompt(40), **GEN)
    assert torch.equal(reader.transform.k, other.transform_k)
    kv.close()


def test_adapter_without_a_file_takes_the_transform_of_the_caches_codebooks(daemon):
    """Codebooks calibrated after a transform expect K/V through it: an adapter
    given no file (it calibrates, or uses what the cache has) takes the cache's
    transform, and generates what an adapter given the file generates."""
    from test_hf_adapter import GEN, prompt
    g = torch.Generator().manual_seed(3)
    cb = books()
    a = torch.eye(16) + 0.3 * torch.randn(2, 2, 16, 16, generator=g)
    cb.transform_k, cb.transform_v = a, a.transpose(-1, -2).contiguous()
    with_file = adapter(daemon, cb.describe().to_bytes())
    with torch.no_grad():
        want = with_file.generate(prompt(40), **GEN)
    without = adapter(daemon, None, calibrate_tokens=256)
    without.client()
    assert without.transform is not None and torch.equal(without.transform.k, a)
    with torch.no_grad():
        assert torch.equal(without.generate(prompt(40), **GEN), want)
    with pytest.raises(ValueError, match="^transform: not the one the cache's codebooks were calibrated after"):
        adapter(daemon, None, calibrate_tokens=256, transform=_eye()).client()


def _eye():
    from kvstore.codec.transform import Transform
    e = torch.eye(16).expand(2, 2, 16, 16).contiguous()
    return Transform(k=e, v=e.clone())


def test_adapter_of_a_model_named_by_its_path_is_named_by_its_weights(daemon, tmp_path):
    """A model loaded from a local folder is named by the folder, which says nothing of
    which model it is: an adapter given no file and no model_id names it by its weights,
    so the cache a worker that knew the model's id made (model_id=, which the file
    names too) is refused it, naming model_id; given that model_id it takes the cache,
    its codebooks, and generates what that worker generates. A model_id given, or a hub
    id, is checked against the cache's."""
    from kvstore.client.hf import KVStoreAdapter
    from test_hf_adapter import GEN, prompt, tiny_llama
    with_file = adapter(daemon, books(transform=True).describe(model_id="org/model").to_bytes(), model_id="org/model")
    with torch.no_grad():
        want = with_file.generate(prompt(40), **GEN)
    local = tiny_llama()
    local.config._name_or_path = str(tmp_path)
    unnamed = KVStoreAdapter(local, daemon, cache="c", codec="pq", block_size=8, residual=8, calibrate_tokens=256)
    with pytest.raises(ValueError, match=r"model_id 'org/model' \(existing\) vs 'LlamaForCausalLM@weights-.*named "
                                         r"by its weights"):
        unnamed.client()
    named = KVStoreAdapter(local, daemon, cache="c", codec="pq", block_size=8, residual=8, calibrate_tokens=256,
                           model_id="org/model")
    with torch.no_grad():
        assert torch.equal(named.generate(prompt(40), **GEN), want)
    assert named.fallbacks == 0
    for kw in (dict(model_id="org/another"), {}):
        other = tiny_llama()
        other.config._name_or_path = "org/another"
        with pytest.raises(ValueError, match="model_id"):
            KVStoreAdapter(other, daemon, cache="c", codec="pq", block_size=8, residual=8, calibrate_tokens=256,
                           **kw).client()


def test_a_cache_of_one_layer_group_holding_other_codebooks_names_the_whole_files_hash(daemon):
    """A model with several layer groups gives each group's cache its slice of the file:
    the refusal names the slice's hash and the whole file's, which kvstore-calibrate
    printed."""
    from kvstore.client.hf import KVStoreAdapter
    from test_hf_models import build
    model = build("gemma2")
    c = model.config
    m = c.head_dim // 2

    def file(seed):
        g = torch.Generator().manual_seed(seed)
        return Codebooks(k=torch.randn(c.num_hidden_layers, c.num_key_value_heads, m, 256, 2, generator=g),
                         v=torch.randn(c.num_hidden_layers, c.num_key_value_heads, m, 256, 2, generator=g)).describe()
    first, other = file(0), file(1)
    make = lambda cb: KVStoreAdapter(model, daemon, cache="groups", codec="pq", codebooks=cb.to_bytes(),  # noqa: E731
                                     transform="none", block_size=8, residual=8)
    a = make(first)
    a.client()
    assert len(a.groups) == 2
    slice_sha = other.layers(a.groups.groups[0].layers).sha256()
    with pytest.raises(ValueError, match=rf"one of 2 \(sha256 {slice_sha[:16]} of those layers; the whole "
                                         rf"file's is {other.sha256()[:16]}\)"):
        make(other).client()
    a.close()


def test_adapter_given_no_file_joins_the_cache_with_its_codebooks_bit_width_and_sinks(daemon):
    """A second worker's adapter, given no codebooks file and no calibrate_tokens, takes
    the cache's codebooks: their bit width and sink tokens come from the cache (2-bit
    codebooks, 16 sinks here), and it generates what the worker given the file does. A
    cache that does not exist, or holds no codebooks yet, is refused naming codebooks,
    before anything is made; codebooks replaced since it joined are refused, as a file's."""
    from test_hf_adapter import GEN, prompt
    g = torch.Generator().manual_seed(4)
    two_bit = Codebooks(k=torch.randn(2, 2, 4, 256, 4, generator=g), v=torch.randn(2, 2, 4, 256, 4, generator=g))
    with pytest.raises(ValueError, match=r"^codebooks: kvstore cache 'c' does not exist: codec 'pq' takes"):
        adapter(daemon, None).client()
    kv = KVStoreClient(daemon)
    with pytest.raises(grpc.RpcError) as e:
        kv.get_cache("c")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    adapter(daemon, None, calibrate_tokens=256).client()          # made, without codebooks yet
    with pytest.raises(ValueError, match=r"^codebooks: kvstore cache 'c' holds no codebooks"):
        adapter(daemon, None).client()
    kv.delete_cache("c")
    with_file = adapter(daemon, two_bit.describe(sink_tokens=16).to_bytes())
    with torch.no_grad():
        with_file.generate(prompt(40), **GEN)
        want = with_file.generate(prompt(40), **GEN)        # as the next one: over the cached prompt
    joined = adapter(daemon, None)
    with torch.no_grad():
        assert torch.equal(joined.generate(prompt(40), **GEN), want)
    assert joined.spec["num_subvectors"] == 4 and joined.spec["sink_tokens"] == 16
    assert kv.get_cache("c").spec.num_subvectors == 4
    kv.delete_cache("c")                     # made again by another worker, with other codebooks
    other = Codebooks(k=two_bit.k * 2, v=two_bit.v).describe(sink_tokens=16)
    adapter(daemon, other.to_bytes()).client()
    with pytest.raises(ValueError, match=rf"^codebooks: kvstore cache 'c' holds other codebooks \(sha256 "
                                         rf"{other.sha256()[:16]}\) than the adapter took from it when it first"):
        with torch.no_grad():
            joined.generate(prompt(40), **GEN)
    kv.close()
