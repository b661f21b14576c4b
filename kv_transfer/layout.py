"""The KV layout on the wire: one descriptor per transfer, then one packed buffer per layer.

The cache is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (see `engine.kv_cache`). A layer
message carries the K and V of the shipped blocks for one layer, or for a few consecutive layers when they
were all ready at once, gathered into one contiguous [k, 2, n, block_size, num_kv_heads, head_dim] buffer
(one `index_select`, one send) and scattered on arrival into the receiver's own, non-contiguous block ids
(one `index_copy_`). The descriptor goes first so the receiver can refuse a cache it cannot hold before any
byte lands.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import torch

from engine.kv_cache import KVCacheSpec, index_copy

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"KV cache dtype {dtype} cannot be shipped; supported: {sorted(DTYPES)}")
    return name


class LayoutMismatch(ValueError):
    """The sender's KV layout does not fit the receiver's cache; `field` names what differs."""

    def __init__(self, field: str, sender: object, receiver: object) -> None:
        super().__init__(f"KV layout mismatch on {field}: sender has {sender}, receiver has {receiver}")
        self.field = field


@dataclass(frozen=True)
class TransferDescriptor:
    """What one transfer carries. Sent once, ahead of its layers, as JSON."""

    request_id: str
    num_blocks: int  # blocks shipped per layer (those the receiver holds in its prefix cache are left out)
    layer_start: int  # layers [layer_start, layer_stop) are shipped, one message each
    layer_stop: int
    num_layers: int  # the sender cache's layer count
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES
    # where the receiver should put them, as the sender was told; it must equal what the receiver reserved
    dst_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_block_ids", tuple(self.dst_block_ids))  # JSON gives a list
        if not self.request_id:
            raise ValueError("TransferDescriptor.request_id must not be empty")
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransferDescriptor.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.layer_start < self.layer_stop <= self.num_layers:
            raise ValueError(f"TransferDescriptor layer range [{self.layer_start}, {self.layer_stop}) must be a "
                             f"non-empty part of [0, {self.num_layers})")
        if self.dtype not in DTYPES:
            raise ValueError(f"TransferDescriptor.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if len(self.dst_block_ids) != self.num_blocks:
            raise ValueError(f"TransferDescriptor.dst_block_ids has {len(self.dst_block_ids)} ids for "
                             f"{self.num_blocks} blocks")

    @classmethod
    def for_spec(cls, request_id: str, spec: KVCacheSpec, dst_block_ids: tuple[int, ...]) -> TransferDescriptor:
        return cls(request_id=request_id, num_blocks=len(dst_block_ids), layer_start=0,
                   layer_stop=spec.num_layers, num_layers=spec.num_layers, block_size=spec.block_size,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype_name(spec.dtype),
                   dst_block_ids=dst_block_ids)

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        """One layer message: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def layer_nbytes(self) -> int:
        n = 1
        for d in self.layer_shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def check_fits(self, spec: KVCacheSpec, dst_block_ids: tuple[int, ...]) -> None:
        """Raise LayoutMismatch naming the first field on which this transfer and the receiver (its cache
        spec and the blocks it reserved) disagree."""
        mine = TransferDescriptor.for_spec(self.request_id, spec, dst_block_ids)
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "num_blocks",
                     "dst_block_ids"):
            if getattr(self, name) != getattr(mine, name):
                raise LayoutMismatch(name, getattr(self, name), getattr(mine, name))

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TransferDescriptor:
        try:
            fields = json.loads(raw.decode())
            return cls(**fields)
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"malformed transfer descriptor: {e}") from e


def pack_layers(cache: torch.Tensor, first: int, count: int, block_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather layers [first, first + count) of `block_ids` into one contiguous buffer (`out` when given).

    cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; block_ids: [n] int64, same device.
    Returns [count, 2, n, block_size, num_kv_heads, head_dim].
    """
    if out is None:
        return cache[first:first + count].index_select(2, block_ids)
    return torch.index_select(cache[first:first + count], 2, block_ids, out=out)


def scatter_layers(cache: torch.Tensor, first: int, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Write packed layers ([count, 2, n, block_size, num_kv_heads, head_dim]) from layer `first` on into
    `block_ids` of `cache`."""
    dest = cache[first:first + packed.shape[0]]
    if dest.device.type != "cpu" or not dest.is_contiguous():  # a GPU, or a view of another engine's layout
        index_copy(dest, 2, block_ids, packed)
        return
    # NOTE: on CPU, torch's index_copy_ moves element by element (11.7 ms for a 2,048-token SmolLM2 request,
    # 94 MB); numpy's fancy assignment over rows of whole blocks moves each block with one memcpy (4.6 ms),
    # and releases the GIL while it does. Byte rows, so every dtype (bf16 and fp8 too) takes the same path.
    planes, blocks = dest.shape[0] * dest.shape[1], dest.shape[2]
    rows = (np.arange(planes)[:, None] * blocks + block_ids.numpy()[None, :]).reshape(-1)
    _block_rows(dest)[rows] = _block_rows(packed)


def _block_rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous [layers, 2, blocks, block_size, heads, head_dim] CPU tensor as uint8 rows, one per
    block (of one layer's K or V)."""
    return as_bytes(t).numpy().reshape(-1, t[0, 0, 0].numel() * t.element_size())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (what goes on the wire, whatever the dtype)."""
    assert t.is_contiguous(), "only contiguous tensors go on the wire"
    return t.reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, desc: TransferDescriptor) -> torch.Tensor:
    """Received layers' bytes (a multiple of layer_nbytes, uint8) viewed as [count, 2, n, block_size,
    num_kv_heads, head_dim]."""
    assert buf.numel() % desc.layer_nbytes == 0, f"{buf.numel()} bytes is no whole number of layers"
    return buf.view(desc.torch_dtype).view(-1, *desc.layer_shape)
