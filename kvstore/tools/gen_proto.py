"""Generate the gRPC stubs in kvstore/v1 from protos/kvstore.proto.

protoc sees the file as kvstore/v1/kvstore.proto, so the generated modules
import each other as `kvstore.v1.*` rather than as bare top-level names.
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def generate(out_dir: pathlib.Path = ROOT) -> None:
    from grpc_tools import protoc
    import grpc_tools
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-Ikvstore/v1={ROOT / 'protos'}", f"-I{include}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}",
            "kvstore/v1/kvstore.proto"]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


if __name__ == "__main__":
    generate()
