"""The control plane: the serve process (`server`), the router replicas and their mailbox (`mailbox`,
`shared`, `follower`, `replica_set`, `processes`, `messages`), the Admin API (`admin`, `admin_servicer`),
the worker launcher (`launcher`) and the CLIs (`cli`, `admin_cli`).

It starts, watches and stops what the data plane (`router`) routes over; the router never imports it.
Torch-free at import: where the serve process needs torch-side code (the worker classes, the KV
rendezvous store, writing a built-in checkpoint) it runs in another process (see pyproject.toml's
import contracts).
"""
