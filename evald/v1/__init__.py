"""Generated protobuf and gRPC stubs for the evald.v1 contract.

DO NOT EDIT the ``evald_pb2*`` files: regenerate them from ``proto/evald/v1/evald.proto`` with
``make proto`` (``python -m evald._protogen``). ``tests/evald/contract/test_protogen.py`` fails when
they are stale.
"""
