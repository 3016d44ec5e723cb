"""A DNS server on loopback for one name with several addresses, changed while it runs: what a
headless Service's name is to a client in Kubernetes, with no root and no resolver config.

    dns = DnsServer("replicas.test", ["127.0.0.1", "127.0.0.2"])   # UDP on 127.0.0.1, port 0
    target = dns.target(50051)    # dns://127.0.0.1:PORT/replicas.test:50051 for a gRPC channel
    dns.set(["127.0.0.1", "127.0.0.2", "127.0.0.3"])   # the next lookup sees three
    dns.lookups("A")              # when each A query for the name came (re-resolutions)
    dns.stop()

A queries for the name get its addresses (TTL 0: nothing caches them); AAAA and any other
type for the name get an empty answer; other names NXDOMAIN. Linux routes all of 127/8 to
the loopback device, so replicas listening on 127.0.0.2, 127.0.0.3, ... share one port.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence

TYPE_A, CLASS_IN = 1, 1
NOERROR, FORMERR, NXDOMAIN, NOTIMP = 0, 1, 3, 4
HEADER = struct.Struct("!HHHHHH")  # id, flags, question/answer/authority/additional counts


def parse_question(packet: bytes) -> tuple[str, int, int, int]:
    """(name in lower case, qtype, qclass, the offset past the question) of a query's first
    question. ValueError for a packet that is not one."""
    offset = HEADER.size
    labels = []
    while True:
        if offset >= len(packet):
            raise ValueError("truncated name")
        length = packet[offset]
        offset += 1
        if length == 0:
            break
        if length > 63:  # compression pointers have no place in a query's question
            raise ValueError("bad label")
        labels.append(packet[offset : offset + length].decode("ascii", "replace"))
        offset += length
    if offset + 4 > len(packet):
        raise ValueError("truncated question")
    qtype, qclass = struct.unpack_from("!HH", packet, offset)
    return ".".join(labels).lower(), qtype, qclass, offset + 4


def answer(packet: bytes, name: str, addresses: Sequence[str], ttl: int = 0) -> bytes:
    """The reply to ``packet`` from a server that knows only ``name`` (authoritative)."""
    qid, flags, qdcount = HEADER.unpack_from(packet)[:3]
    opcode_rd = flags & 0x7900  # the query's opcode and recursion-desired bit, echoed
    reply_flags = 0x8000 | 0x0400 | 0x0080 | opcode_rd  # QR, AA, RA
    try:
        if qdcount != 1 or flags & 0x8000:
            raise ValueError("not one question")
        qname, qtype, qclass, end = parse_question(packet)
    except ValueError:
        return HEADER.pack(qid, reply_flags | FORMERR, 0, 0, 0, 0)
    question = packet[HEADER.size : end]
    if opcode_rd & 0x7800:  # not a standard query
        return HEADER.pack(qid, reply_flags | NOTIMP, 1, 0, 0, 0) + question
    if qname != name.lower().rstrip("."):
        return HEADER.pack(qid, reply_flags | NXDOMAIN, 1, 0, 0, 0) + question
    records = b""
    if qtype == TYPE_A and qclass == CLASS_IN:
        for address in addresses:  # the name by a pointer to the question (offset 12)
            rdata = socket.inet_aton(address)
            records += struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, ttl, len(rdata)) + rdata
    count = len(addresses) if records else 0
    return HEADER.pack(qid, reply_flags | NOERROR, 1, count, 0, 0) + question + records


class DnsServer(threading.Thread):
    """Answers UDP queries on ``host`` (port 0 picks one) for ``name`` with ``addresses``."""

    def __init__(
        self, name: str, addresses: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0
    ) -> None:
        super().__init__(daemon=True, name=f"dns {name}")
        self.name = name
        self._addresses = list(addresses)
        self._lock = threading.Lock()
        self._queries: list[tuple[float, str, int]] = []  # (monotonic time, name, qtype)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.settimeout(0.1)
        self.host, self.port = self.sock.getsockname()
        self._stopped = threading.Event()
        self.start()

    @property
    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._addresses)

    def set(self, addresses: Sequence[str]) -> None:
        """What the next A query for the name is answered."""
        with self._lock:
            self._addresses = list(addresses)

    def target(self, port: int) -> str:
        """A gRPC target that resolves the name with this server (the c-ares resolver's
        authority), for a service on ``port`` at each address."""
        return f"dns://{self.host}:{self.port}/{self.name}:{port}"

    def lookups(self, qtype: str = "A", since: float = 0.0) -> list[float]:
        """When each query of ``qtype`` for the name came (time.monotonic), from ``since``."""
        code = {"A": TYPE_A, "AAAA": 28}[qtype]
        wanted = self.name.lower().rstrip(".")
        with self._lock:
            return [t for t, n, q in self._queries if n == wanted and q == code and t >= since]

    def run(self) -> None:
        while not self._stopped.is_set():
            try:
                packet, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:  # closed by stop()
                return
            if len(packet) < HEADER.size:
                continue
            with self._lock:
                addresses = list(self._addresses)
                try:
                    qname, qtype, _, _ = parse_question(packet)
                    self._queries.append((time.monotonic(), qname, qtype))
                except ValueError:
                    pass
            self.sock.sendto(answer(packet, self.name, addresses), peer)

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)
        self.sock.close()
