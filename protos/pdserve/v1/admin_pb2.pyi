# ruff: noqa
from protos.pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]

class MigrationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_METHOD_UNSPECIFIED: _ClassVar[MigrationMethod]
    MIGRATION_METHOD_KV: _ClassVar[MigrationMethod]
    MIGRATION_METHOD_RECOMPUTE: _ClassVar[MigrationMethod]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState
MIGRATION_METHOD_UNSPECIFIED: MigrationMethod
MIGRATION_METHOD_KV: MigrationMethod
MIGRATION_METHOD_RECOMPUTE: MigrationMethod

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "pool", "state", "node_id", "node_ip", "pid", "num_running", "num_waiting", "queued_prefill_tokens", "free_blocks", "total_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: _generation_pb2.PoolKind
    state: WorkerState
    node_id: str
    node_ip: str
    pid: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[_Union[_generation_pb2.PoolKind, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., node_id: _Optional[str] = ..., node_ip: _Optional[str] = ..., pid: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "target", "serving", "draining", "starting")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    pool: _generation_pb2.PoolKind
    target: int
    serving: int
    draining: int
    starting: int
    def __init__(self, pool: _Optional[_Union[_generation_pb2.PoolKind, str]] = ..., target: _Optional[int] = ..., serving: _Optional[int] = ..., draining: _Optional[int] = ..., starting: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "pools")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("pool", "num_workers", "method", "timeout_seconds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool: _generation_pb2.PoolKind
    num_workers: int
    method: MigrationMethod
    timeout_seconds: float
    def __init__(self, pool: _Optional[_Union[_generation_pb2.PoolKind, str]] = ..., num_workers: _Optional[int] = ..., method: _Optional[_Union[MigrationMethod, str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("pool", "started", "retired")
    POOL_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    pool: PoolStatus
    started: _containers.RepeatedScalarFieldContainer[str]
    retired: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[_Union[PoolStatus, _Mapping]] = ..., started: _Optional[_Iterable[str]] = ..., retired: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "method", "replace", "timeout_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    method: MigrationMethod
    replace: bool
    timeout_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., method: _Optional[_Union[MigrationMethod, str]] = ..., replace: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "moved_kv", "moved_recompute", "clean", "replacement", "seconds", "blocks_held_at_exit")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MOVED_KV_FIELD_NUMBER: _ClassVar[int]
    MOVED_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HELD_AT_EXIT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    moved_kv: int
    moved_recompute: int
    clean: bool
    replacement: str
    seconds: float
    blocks_held_at_exit: int
    def __init__(self, worker_id: _Optional[str] = ..., moved_kv: _Optional[int] = ..., moved_recompute: _Optional[int] = ..., clean: _Optional[bool] = ..., replacement: _Optional[str] = ..., seconds: _Optional[float] = ..., blocks_held_at_exit: _Optional[int] = ...) -> None: ...

class RestartPoolRequest(_message.Message):
    __slots__ = ("pool", "method", "timeout_seconds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool: _generation_pb2.PoolKind
    method: MigrationMethod
    timeout_seconds: float
    def __init__(self, pool: _Optional[_Union[_generation_pb2.PoolKind, str]] = ..., method: _Optional[_Union[MigrationMethod, str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RestartPoolResponse(_message.Message):
    __slots__ = ("drained",)
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    drained: _containers.RepeatedCompositeFieldContainer[DrainWorkerResponse]
    def __init__(self, drained: _Optional[_Iterable[_Union[DrainWorkerResponse, _Mapping]]] = ...) -> None: ...
