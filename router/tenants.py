"""Who is calling: API keys, the tenant each one belongs to, its role and its limits (`--api-keys FILE`).

The key file (YAML, or JSON, which YAML reads too) names tenants and their keys:

    tenants:
      acme:
        max_concurrent_requests: 8      # requests in flight at once
        max_queued_prompt_tokens: 16384 # prompt tokens admitted but not yet prefilled (first token not out)
        tokens_per_minute: 200000       # prompt + generated tokens, a token bucket refilled per second
        priority: 1                     # the highest priority class its requests may ask for (0 = lowest)
        cache_salt: "acme-2026"         # mixed into its prompts' block hashes; default: the tenant's name
    keys:
      - {key: "sk-acme-app", tenant: acme, role: client}
      - {key: "sk-ops", tenant: ops, role: admin}

A limit left out is unlimited; a tenant left out of `tenants` (named only by a key) has no limits. A role is
`client` (generation) or `admin` (generation and the Admin API). The file is read again when it changes
(checked at most once a second, on a request); a file that no longer parses keeps the previous keys and is
logged, so a typo does not lock every client out. The single `--api-key` is a table of one key: tenant
`default`, role admin, no limits, no salt (one tenant shares its cache with itself).

Keys are compared in constant time: the SHA-256 of the given key against every key's, all of them, with
`hmac.compare_digest`, so neither the time nor the order reveals a key or how much of it was right.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

__all__ = ["ANONYMOUS", "KeyTable", "Role", "Tenant", "TenantLimits", "parse_key_file"]

MAX_PRIORITY = 9  # priority classes are 0 (lowest, shed first) .. MAX_PRIORITY
RELOAD_CHECK_S = 1.0  # the key file's mtime is looked at no more often than this


class Role(enum.Enum):
    CLIENT = "client"  # generation and model info
    ADMIN = "admin"  # the same, and the Admin API (scale, drain, restart, list workers)


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's quotas (None: unlimited); checked at the door, before any prefill (`router.quotas`)."""

    max_concurrent_requests: int | None = None  # its requests in flight at once
    max_queued_prompt_tokens: int | None = None  # prompt tokens of its requests still waiting for a first token
    tokens_per_minute: int | None = None  # prompt + generated tokens per minute (a bucket of this size)
    priority: int = MAX_PRIORITY  # the highest priority class its requests may take

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_queued_prompt_tokens", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or left out: unlimited), got {value!r}")
        if type(self.priority) is not int or not 0 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an integer in 0..{MAX_PRIORITY}, got {self.priority!r}")


@dataclass(frozen=True)
class Tenant:
    name: str  # a label in logs and metrics (operators name tenants, so the label set stays bounded)
    role: Role
    limits: TenantLimits = field(default_factory=TenantLimits)
    # mixed into the hash of its prompts' first block (so into every block's chained hash): its cached blocks
    # never match another tenant's prompt. "" shares the cache with every other "" caller.
    cache_salt: str = ""

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


# who calls a server that has no key at all: everyone is this one tenant
ANONYMOUS = Tenant("default", Role.ADMIN)

_TENANT_FIELDS = {"max_concurrent_requests", "max_queued_prompt_tokens", "tokens_per_minute", "priority",
                  "cache_salt"}
_KEY_FIELDS = {"key", "tenant", "role"}


def parse_key_file(text: str) -> dict[str, Tenant]:
    """The key file's text -> {key: its Tenant}. ValueError names the entry and field at fault."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"not YAML or JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list) or not doc["keys"]:
        raise ValueError("keys: needs a non-empty list of keys (and optionally a mapping `tenants`)")
    extra = set(doc) - {"keys", "tenants"}
    if extra:
        raise ValueError(f"unknown top-level field(s) {sorted(extra)}")
    tenants_doc = doc.get("tenants") or {}
    if not isinstance(tenants_doc, dict):
        raise ValueError("tenants: must be a mapping of tenant name -> its limits")
    specs: dict[str, tuple[TenantLimits, str]] = {}
    for name, spec in tenants_doc.items():
        spec = spec or {}
        if not isinstance(spec, dict):
            raise ValueError(f"tenants.{name}: must be a mapping")
        unknown = set(spec) - _TENANT_FIELDS
        if unknown:
            raise ValueError(f"tenants.{name}: unknown field(s) {sorted(unknown)}")
        salt = spec.get("cache_salt", str(name))
        if not isinstance(salt, str):
            raise ValueError(f"tenants.{name}.cache_salt: must be a string")
        try:
            limits = TenantLimits(**{k: v for k, v in spec.items() if k != "cache_salt"})
        except ValueError as e:
            raise ValueError(f"tenants.{name}.{e}") from e
        specs[str(name)] = (limits, salt)
    table: dict[str, Tenant] = {}
    for i, entry in enumerate(doc["keys"]):
        if not isinstance(entry, dict) or set(entry) - _KEY_FIELDS or "key" not in entry or "tenant" not in entry:
            raise ValueError(f"keys[{i}]: must be a mapping with `key`, `tenant` and optionally `role`")
        key, tenant = entry["key"], str(entry["tenant"])
        if not isinstance(key, str) or len(key) < 8 or not all("\x21" <= ch <= "\x7e" for ch in key):
            raise ValueError(f"keys[{i}].key: must be at least 8 characters of visible ASCII")
        try:
            role = Role(entry.get("role", "client"))
        except ValueError as e:
            raise ValueError(f"keys[{i}].role: must be client or admin, got {entry.get('role')!r}") from e
        if key in table:
            raise ValueError(f"keys[{i}].key: listed twice")
        limits, salt = specs.get(tenant, (TenantLimits(), tenant))
        table[key] = Tenant(tenant, role, limits, salt)
    return table


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyTable:
    """The keys a server accepts and whose they are; `lookup` finds the caller of an Authorization header."""

    def __init__(self, keys: Mapping[str, Tenant], path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`path`: the key file to follow (reloaded when its mtime or size changes)."""
        self._entries = [(_digest(k), t) for k, t in keys.items()]
        self._fixed: list[tuple[bytes, Tenant]] = []  # added by `add`, not from the file
        self.path = path
        self.clock = clock
        self._stamp = self._file_stamp()
        self._checked = clock()

    @classmethod
    def single(cls, api_key: str) -> KeyTable:
        """`--api-key`: one key, the `default` tenant, admin, no limits and no salt."""
        return cls({api_key: Tenant("default", Role.ADMIN)})

    @classmethod
    def from_file(cls, path: str | Path, clock: Callable[[], float] = time.monotonic) -> KeyTable:
        """ValueError names the file and what is wrong with it."""
        path = Path(path)
        try:
            keys = parse_key_file(path.read_text())
        except OSError as e:
            raise ValueError(f"--api-keys {path}: cannot read it ({e.strerror})") from e
        except ValueError as e:
            raise ValueError(f"--api-keys {path}: {e}") from e
        return cls(keys, path, clock)

    def add(self, key: str, tenant: Tenant) -> None:
        """One more key, kept across reloads (`--api-key` beside `--api-keys`)."""
        self._fixed.append((_digest(key), tenant))
        self._entries.append((_digest(key), tenant))

    @property
    def tenants(self) -> list[Tenant]:
        return [t for _, t in self._entries]

    def lookup(self, authorization: str | bytes) -> Tenant | None:
        """The tenant of `Authorization: Bearer <key>`, or None (missing, malformed or unknown key)."""
        self._maybe_reload()
        raw = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
        given = _digest(raw[7:]) if raw[:7].lower() == b"bearer " else b""
        found = None
        for digest, tenant in self._entries:  # every one, no early exit: constant time in the keys
            if hmac.compare_digest(given, digest):
                found = tenant
        return found

    def _file_stamp(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _maybe_reload(self) -> None:
        if self.path is None or self.clock() - self._checked < RELOAD_CHECK_S:
            return
        self._checked = self.clock()
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            keys = parse_key_file(self.path.read_text())
        except (OSError, ValueError) as e:
            logger.error("--api-keys %s changed but cannot be used (%s); keeping the previous keys", self.path, e)
            return
        self._entries = [(_digest(k), t) for k, t in keys.items()] + self._fixed
        logger.warning("--api-keys %s reloaded: %d keys", self.path, len(self._entries))
