"""The wire contract: generated code matches the .proto, and the .proto matches the agreed contract."""

from __future__ import annotations

import ast
import re
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from protos import generate as gen
from protos.pdserve.v1 import admin_pb2 as admin_pb
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

pytest.importorskip("grpc_tools", reason="grpcio-tools regenerates the code to compare against")

V1 = gen.PROTO_ROOT / "pdserve" / "v1"
GENERATED = [f"{name}{suffix}" for name in ("admin", "generation") for suffix in gen.GENERATED_SUFFIXES]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    written = gen.generate(out)
    assert sorted(p.name for p in written) == sorted(GENERATED)
    return out / "pdserve" / "v1"


def _serialized_descriptor(pb2_source: str) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto a generated *_pb2.py registers (the bytes passed to AddSerializedFile)."""
    for node in ast.walk(ast.parse(pb2_source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "AddSerializedFile":
            return descriptor_pb2.FileDescriptorProto.FromString(node.args[0].value)
    raise AssertionError("no AddSerializedFile call in the generated module")


def _generator_versions(directory: Path) -> tuple[str, str]:
    pb2 = (directory / "generation_pb2.py").read_text()
    grpc_py = (directory / "generation_pb2_grpc.py").read_text()
    protobuf = re.search(r"^# Protobuf Python Version: (\S+)$", pb2, re.MULTILINE)
    grpc_version = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", grpc_py, re.MULTILINE)
    assert protobuf and grpc_version
    return protobuf.group(1), grpc_version.group(1)


@pytest.mark.parametrize("module", [pb, admin_pb], ids=["generation", "admin"])
def test_committed_descriptor_matches_the_proto(fresh: Path, module) -> None:
    """Holds with any grpcio-tools version: what the committed module registers is what the .proto says."""
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    regenerated = _serialized_descriptor((fresh / Path(module.__file__).name).read_text())
    assert committed == regenerated, "generated code is stale: run `python -m protos.generate`"


def test_committed_files_are_byte_identical_to_regenerated(fresh: Path) -> None:
    if _generator_versions(fresh) != _generator_versions(V1):
        pytest.skip(f"installed generator {_generator_versions(fresh)} differs from the one that wrote the "
                    f"committed code {_generator_versions(V1)}")
    for name in GENERATED:
        assert (V1 / name).read_text() == (fresh / name).read_text(), \
            f"{name} is stale: run `python -m protos.generate`"


def test_generated_imports_are_rooted_in_protos() -> None:
    for name in GENERATED:
        text = (V1 / name).read_text()
        assert not re.search(r"^\s*(from|import) pdserve\b", text, re.MULTILINE), name
    assert "from protos.pdserve.v1 import generation_pb2" in (V1 / "generation_pb2_grpc.py").read_text()
    # admin.proto imports generation.proto (PoolKind): that import is rooted too
    assert "from protos.pdserve.v1 import generation_pb2" in (V1 / "admin_pb2.py").read_text()


def test_import_rewrite_covers_nested_packages() -> None:
    text = "from pdserve.v1 import a_pb2 as _a\n    from pdserve import b_pb2\nfrom pdservex import c\n"
    assert gen._root_imports(text, {"pdserve"}) == (
        "from protos.pdserve.v1 import a_pb2 as _a\n    from protos.pdserve import b_pb2\nfrom pdservex import c\n")


# --- the contract -----------------------------------------------------------------------------------------

T = FieldDescriptor
OPT, REP, ONEOF = "optional", "repeated", "oneof"
SINGULAR = "singular"  # proto3 implicit presence

CONTRACT: dict[str, dict[str, tuple[int, int, str, str | None]]] = {
    # message: field -> (number, type, cardinality, message/enum type name)
    "GenerateRequest": {
        "request_id": (1, T.TYPE_STRING, SINGULAR, None),
        "prompt": (2, T.TYPE_STRING, ONEOF, None),
        "prompt_token_ids": (3, T.TYPE_MESSAGE, ONEOF, "TokenIds"),
        "messages": (4, T.TYPE_MESSAGE, ONEOF, "ChatMessages"),
        "sampling": (5, T.TYPE_MESSAGE, SINGULAR, "SamplingParams"),
        "cache_salt": (6, T.TYPE_STRING, SINGULAR, None),
        "priority": (7, T.TYPE_UINT32, OPT, None),
    },
    "TokenIds": {"ids": (1, T.TYPE_UINT32, REP, None)},
    "ChatMessages": {"messages": (1, T.TYPE_MESSAGE, REP, "ChatMessage")},
    "ChatMessage": {"role": (1, T.TYPE_STRING, SINGULAR, None), "content": (2, T.TYPE_STRING, SINGULAR, None)},
    "SamplingParams": {
        "max_tokens": (1, T.TYPE_UINT32, SINGULAR, None),
        "temperature": (2, T.TYPE_FLOAT, OPT, None),
        "top_p": (3, T.TYPE_FLOAT, OPT, None),
        "top_k": (4, T.TYPE_UINT32, OPT, None),
        "seed": (5, T.TYPE_UINT64, OPT, None),
        "stop": (6, T.TYPE_STRING, REP, None),
        "ignore_eos": (7, T.TYPE_BOOL, SINGULAR, None),
        "stop_token_ids": (8, T.TYPE_UINT32, REP, None),
        "disable_speculation": (9, T.TYPE_BOOL, SINGULAR, None),
    },
    "GenerateResponse": {
        "request_id": (1, T.TYPE_STRING, SINGULAR, None),
        "token_ids": (2, T.TYPE_UINT32, REP, None),
        "text": (3, T.TYPE_STRING, SINGULAR, None),
        "finish_reason": (4, T.TYPE_ENUM, SINGULAR, "FinishReason"),
        "usage": (5, T.TYPE_MESSAGE, SINGULAR, "Usage"),
        "prefill_worker_id": (6, T.TYPE_STRING, SINGULAR, None),
        "decode_worker_id": (7, T.TYPE_STRING, SINGULAR, None),
        "timing": (8, T.TYPE_MESSAGE, SINGULAR, "Timing"),
    },
    "Usage": {
        "prompt_tokens": (1, T.TYPE_UINT32, SINGULAR, None),
        "completion_tokens": (2, T.TYPE_UINT32, SINGULAR, None),
        "cached_prompt_tokens": (3, T.TYPE_UINT32, SINGULAR, None),
    },
    "Timing": {
        "queue_seconds": (1, T.TYPE_DOUBLE, SINGULAR, None),
        "prefill_seconds": (2, T.TYPE_DOUBLE, SINGULAR, None),
        "kv_transfer_seconds": (3, T.TYPE_DOUBLE, SINGULAR, None),
        "first_decode_step_seconds": (4, T.TYPE_DOUBLE, SINGULAR, None),
        "placement": (5, T.TYPE_STRING, SINGULAR, None),
    },
    "GetModelInfoRequest": {},
    "ModelInfo": {
        "model_name": (1, T.TYPE_STRING, SINGULAR, None),
        "max_model_len": (2, T.TYPE_UINT32, SINGULAR, None),
        "vocab_size": (3, T.TYPE_UINT32, SINGULAR, None),
        "block_size": (4, T.TYPE_UINT32, SINGULAR, None),
        "pools": (5, T.TYPE_MESSAGE, REP, "Pool"),
    },
    "Pool": {
        "kind": (1, T.TYPE_ENUM, SINGULAR, "PoolKind"),
        "name": (2, T.TYPE_STRING, SINGULAR, None),
        "workers": (3, T.TYPE_MESSAGE, REP, "Worker"),
    },
    "Worker": {"worker_id": (1, T.TYPE_STRING, SINGULAR, None), "node_id": (2, T.TYPE_STRING, SINGULAR, None)},
}


def _cardinality(field: FieldDescriptor) -> str:
    if field.is_repeated:
        return REP
    oneof = field.containing_oneof
    if oneof is not None:
        # proto3 `optional` is a synthetic one-field oneof named after the field
        return OPT if oneof.name == f"_{field.name}" else ONEOF
    return SINGULAR


def test_package_and_file_name() -> None:
    assert pb.DESCRIPTOR.package == "pdserve.v1"
    assert pb.DESCRIPTOR.name == "pdserve/v1/generation.proto"


@pytest.mark.parametrize("message", sorted(CONTRACT))
def test_message_fields_match_the_contract(message: str) -> None:
    descriptor = pb.DESCRIPTOR.message_types_by_name[message]
    actual = {
        f.name: (f.number, f.type, _cardinality(f),
                 (f.message_type or f.enum_type).name if (f.message_type or f.enum_type) else None)
        for f in descriptor.fields
    }
    assert actual == CONTRACT[message]


def test_input_is_one_oneof() -> None:
    oneof = pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert [f.name for f in oneof.fields] == ["prompt", "prompt_token_ids", "messages"]


def test_enums() -> None:
    assert dict(pb.FinishReason.items()) == {
        "FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1, "FINISH_REASON_LENGTH": 2}
    assert dict(pb.PoolKind.items()) == {
        "POOL_KIND_UNSPECIFIED": 0, "POOL_KIND_PREFILL": 1, "POOL_KIND_DECODE": 2, "POOL_KIND_COLOCATED": 3}


def test_service_methods() -> None:
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "pdserve.v1.Generation"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "GetModelInfo"}
    generate, info = methods["Generate"], methods["GetModelInfo"]
    assert (generate.input_type.name, generate.output_type.name) == ("GenerateRequest", "GenerateResponse")
    assert (generate.client_streaming, generate.server_streaming) == (False, True)
    assert (info.input_type.name, info.output_type.name) == ("GetModelInfoRequest", "ModelInfo")
    assert (info.client_streaming, info.server_streaming) == (False, False)


def test_unset_optional_sampling_fields_are_distinguishable_from_zero() -> None:
    sampling = pb.SamplingParams()
    assert not any(sampling.HasField(f) for f in ("temperature", "top_p", "top_k", "seed"))
    sampling.temperature = 0.0
    assert sampling.HasField("temperature")


def test_stubs_exist_for_the_messages() -> None:
    stub = (V1 / "generation_pb2.pyi").read_text()
    for message in CONTRACT:
        assert f"class {message}(_message.Message):" in stub


def test_generated_service_round_trips_over_a_real_channel() -> None:
    """The generated stub and servicer talk to each other (in-process server on a loopback port)."""

    class Servicer(pb_grpc.GenerationServicer):
        def Generate(self, request, context):
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[1], text="a")
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[2], text="b",
                                      finish_reason=pb.FINISH_REASON_LENGTH,
                                      usage=pb.Usage(prompt_tokens=3, completion_tokens=2))

        def GetModelInfo(self, request, context):
            return pb.ModelInfo(model_name="m", pools=[pb.Pool(kind=pb.POOL_KIND_DECODE, workers=[
                pb.Worker(worker_id="d0", node_id="n0")])])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            responses = list(stub.Generate(pb.GenerateRequest(request_id="r1", prompt="hi"), timeout=10))
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    finally:
        server.stop(grace=None)
    assert [(r.request_id, list(r.token_ids), r.text) for r in responses] == [("r1", [1], "a"), ("r1", [2], "b")]
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH and responses[-1].usage.completion_tokens == 2
    assert info.pools[0].workers[0].node_id == "n0"


def test_admin_service_methods() -> None:
    assert admin_pb.DESCRIPTOR.name == "pdserve/v1/admin.proto"
    service = admin_pb.DESCRIPTOR.services_by_name["Admin"]
    assert service.full_name == "pdserve.v1.Admin"
    assert {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods} == {
        "ListWorkers": ("ListWorkersRequest", "ListWorkersResponse", False),
        "ScalePool": ("ScalePoolRequest", "ScalePoolResponse", False),
        "DrainWorker": ("DrainWorkerRequest", "DrainWorkerResponse", False),
        "RestartPool": ("RestartPoolRequest", "RestartPoolResponse", False),
    }
    # the pool is the Generation contract's PoolKind, not a second enum
    assert admin_pb.WorkerStatus.DESCRIPTOR.fields_by_name["pool"].enum_type is pb.PoolKind.DESCRIPTOR
    assert dict(admin_pb.MigrationMethod.items()) == {
        "MIGRATION_METHOD_UNSPECIFIED": 0, "MIGRATION_METHOD_KV": 1, "MIGRATION_METHOD_RECOMPUTE": 2}
