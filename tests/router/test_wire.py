"""Bytes that do not parse as the request message get INVALID_ARGUMENT naming the cause (grpc-python's own
answer is UNKNOWN, with a traceback in the server's log), on a real aio server over loopback; good requests
are untouched."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.wire import add_parsing_safely

NOT_UTF8 = b"\x12\x04\xff\xfeab"  # field 2 (prompt, a string) holding bytes that are not UTF-8
GARBAGE = b"\xff\xff\xff\xff\xff"


class Servicer(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        yield pb.GenerateResponse(request_id=request.request_id, text=request.prompt)

    async def GetModelInfo(self, request, context):
        self.calls += 1
        return pb.ModelInfo(model_name="m")


async def _exchange():
    servicer = Servicer()
    server = grpc.aio.server()
    add_parsing_safely(pb_grpc.add_GenerationServicer_to_server, servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    outcomes = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            generate = channel.unary_stream("/pdserve.v1.Generation/Generate",
                                            response_deserializer=pb.GenerateResponse.FromString)
            info = channel.unary_unary("/pdserve.v1.Generation/GetModelInfo",
                                       response_deserializer=pb.ModelInfo.FromString)
            calls = {"Generate": lambda d: _drain(generate(d, timeout=10)), "GetModelInfo": lambda d: info(d, timeout=10)}
            # (GetModelInfoRequest has no field 2: the non-UTF-8 bytes are an unknown field to it, and parse)
            for name, method, data in (("not utf-8", "Generate", NOT_UTF8), ("garbage", "Generate", GARBAGE),
                                       ("garbage", "GetModelInfo", GARBAGE)):
                try:
                    await calls[method](data)
                    outcomes[name, method] = None
                except grpc.aio.AioRpcError as e:
                    outcomes[name, method] = (e.code(), e.details())
            good = await _drain(generate(pb.GenerateRequest(request_id="r", prompt="hi").SerializeToString(),
                                         timeout=10))
            model = await info(pb.GetModelInfoRequest().SerializeToString(), timeout=10)
    finally:
        await server.stop(grace=None)
    return outcomes, good, model, servicer.calls


async def _drain(call) -> list:
    return [r async for r in call]


def test_a_request_that_does_not_parse_is_refused_as_invalid_argument_before_any_method_code_runs():
    outcomes, good, model, calls = asyncio.run(asyncio.wait_for(_exchange(), 30))
    assert len(outcomes) == 3
    for key, outcome in outcomes.items():
        assert outcome is not None, f"{key} was served"
        code, details = outcome
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (key, code, details)
        assert details.startswith("request: not a valid protobuf message"), details
    assert [(r.request_id, r.text) for r in good] == [("r", "hi")] and model.model_name == "m"
    assert calls == 2  # only the good requests reached the servicer


@pytest.mark.parametrize("data", [NOT_UTF8, GARBAGE])
def test_the_bytes_really_do_not_parse(data):
    with pytest.raises(Exception, match="(?i)utf-8|parse|truncated|corrupt|decode"):
        pb.GenerateRequest.FromString(data)
