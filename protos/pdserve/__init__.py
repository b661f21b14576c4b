"""Protobuf package `pdserve`."""
