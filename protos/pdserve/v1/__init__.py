"""Protobuf package `pdserve.v1`: `generation_pb2` (messages) and `generation_pb2_grpc` (the service)."""
