"""Every type that crosses a process in pdserve: torch-free, standard library only.

The router, the control plane and the workers exchange these (Ray pickles them), so all of them import
this package and none of them has to load the model to do so. Strings appear only at the edges (protobuf,
metrics labels, JSON); inside, every field is typed with the enums below.

- `protocol.kinds`: `PoolKind`, `FinishReason`, `Path`, `Cause`, `Method`.
- `protocol.block_hash`: the chained block hashes that key the prefix cache on both sides.
- `protocol.messages`: what workers and the router say to each other, and `PeerAddress`.
- `protocol.node`: which Ray node a process runs on.
"""

from protocol.kinds import Cause, FinishReason, Method, Path, PoolKind

__all__ = ["Cause", "FinishReason", "Method", "Path", "PoolKind"]
