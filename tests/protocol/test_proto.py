"""The committed stubs are what protoc generates from protos/kvstore.proto."""
import pathlib

from kvstore.tools.gen_proto import ROOT, generate


def test_stubs_are_current(tmp_path):
    generate(tmp_path)
    for name in ("kvstore_pb2.py", "kvstore_pb2_grpc.py", "kvstore_pb2.pyi"):
        fresh = (tmp_path / "kvstore" / "v1" / name).read_text()
        committed = (pathlib.Path(ROOT) / "kvstore" / "v1" / name).read_text()
        assert fresh == committed, f"kvstore/v1/{name} is stale: run `make proto`"


def test_stubs_need_at_most_grpcio_1_84():
    text = (pathlib.Path(ROOT) / "kvstore" / "v1" / "kvstore_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.84." in text
