"""Generated protobuf and gRPC stubs for the evald.v1 contract.

DO NOT EDIT the ``evald_pb2*`` files: regenerate them from ``proto/evald/v1/evald.proto`` with
``make proto`` (``python tools/generate_proto.py``). ``tests/evald/contract/test_protogen.py`` fails when
they are stale.
"""
