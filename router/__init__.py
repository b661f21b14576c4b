"""The router: gRPC front door, request validation, placement over the prefill and decode pools.

Pure parts, importable without Ray or gRPC servers: `validation` (GenerateRequest -> ValidatedRequest),
`prefix_index` (which worker caches which block hashes), `placement` (which workers serve a request),
`stop` (stop strings over streamed text).
"""
