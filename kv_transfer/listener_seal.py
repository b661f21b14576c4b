"""Sealing a gloo pair's listening socket once its pair is connected, so stray connections cannot pile up.

Each pair group's gloo device listens on an ephemeral port of the node's address for as long as the link
lives, though its one peer has connected already. gloo keeps every connection that reaches that listener
(it waits for a sequence number, and never closes a socket whose peer hung up): tried with torch 2.13,
300 connections opened and closed again left 300 sockets open in the listening process. Anything on the
network could exhaust a worker's file descriptors that way.

gloo offers no way to stop listening, and closing or shutting down its socket under it makes its event
loop fail on `accept` (gloo's loop cannot survive that). So once the pair is connected, `seal` attaches a
classic BPF socket filter that drops every packet to the listener: a new connection's SYN is dropped
before a request socket exists, so nothing is accepted and no descriptor is made (the stray's connect
times out on its side). Connections accepted before, the pair's own among them, are separate sockets
and keep working.

Finding the listener: gloo publishes its address in the store (the rank's rendezvous key); its port is
that of the one listening socket of this process on that address.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

_SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; not in Python's socket module
_BPF_RET_K = 0x06  # BPF_RET | BPF_K: return the constant k (the bytes to keep; 0 drops the packet)
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


_DROP_ALL = (_SockFilter * 1)(_SockFilter(_BPF_RET_K, 0, 0, 0))
_DROP_ALL_PROG = _SockFprog(1, _DROP_ALL)  # (module-level: the kernel copies it, but ctypes must keep it alive)


def advertised_ports(advertised: bytes, host: str) -> set[int]:
    """The ports of every socket address of `host` inside gloo's advertised address bytes (a
    `sockaddr_in`/`sockaddr_in6` in host byte order for the family, network order for port and address)."""
    ip = ipaddress.ip_address(host)
    if ip.version == 4:
        family, pattern, gap = socket.AF_INET, ip.packed, 0
    else:
        family, pattern, gap = socket.AF_INET6, ip.packed, 4  # sin6_flowinfo sits between port and address
    head = struct.pack("=H", family)
    ports, start = set(), 0
    while (i := advertised.find(head, start)) >= 0:
        start = i + 1
        addr = advertised[i + 4 + gap:i + 4 + gap + len(pattern)]
        if addr == pattern:
            ports.add(int.from_bytes(advertised[i + 2:i + 4], "big"))
    return ports


def own_listener(port: int) -> int | None:
    """A descriptor of this process's listening TCP socket on `port` (dup'ed: the caller closes it), or None."""
    inodes: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes[target[len("socket:["):-1]] = int(fd)
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != _TCP_LISTEN or int(cols[1].rsplit(":", 1)[1], 16) != port or cols[9] not in inodes:
                continue
            try:
                dup = os.dup(inodes[cols[9]])
            except OSError:
                continue
            if str(os.fstat(dup).st_ino) == cols[9]:  # the same socket still (not closed and reused meanwhile)
                return dup
            os.close(dup)
    return None


def seal(advertised: bytes, host: str) -> bool:
    """Drop every new connection to the gloo listener whose address (`host`) is in `advertised`; False
    (and a warning) when it cannot be found, e.g. gloo changed how it publishes it."""
    try:
        ports = advertised_ports(advertised, host)
    except ValueError:  # a host name, not an address
        ports = set()
    fds = [fd for fd in map(own_listener, ports) if fd is not None]
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        log.warning("KV link: cannot find the gloo listener on %s (ports %s); it stays open to strays", host,
                    sorted(ports))
        return False
    with socket.socket(fileno=fds[0]) as sock:  # (closes the dup, not gloo's socket)
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                        ctypes.string_at(ctypes.addressof(_DROP_ALL_PROG), ctypes.sizeof(_DROP_ALL_PROG)))
    return True
