"""A peer that answers one server-streaming gRPC call with raw HTTP/2 frames: response headers,
one message, then either a reset of the stream (RST_STREAM, what Envoy sends a client when
the replica behind a begun stream dies) or trailers with a status of its own.

    with H2Peer(chunk_bytes, end="reset") as peer:   # or end=(13, "boom"): trailers
        channel = grpc.insecure_channel(peer.target)

Loopback, one connection at a time, in a thread. Headers are HPACK literals without Huffman
coding (RFC 7541 6.2.2), which every decoder takes.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Any

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING = 0, 1, 3, 4, 6
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INTERNAL_ERROR = 2


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK literal without indexing, new name, no Huffman (< 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class H2Peer:
    def __init__(
        self, message: bytes, end: str | tuple[int, str] = "reset", pause_s: float = 0.2
    ) -> None:
        self.message, self.end, self.pause_s = message, end, pause_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frames_sent: list[int] = []  # the kinds of frame sent on the call's stream
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> H2Peer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sock in (self.listener, *self.conns):  # wakes accept() and recv()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=5)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            with conn, contextlib.suppress(OSError, ConnectionError):
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        if reader.read(len(PREFACE)) != PREFACE:
            return
        conn.sendall(frame(SETTINGS, 0, 0))
        while True:
            head = reader.read(9)
            if len(head) < 9:
                return
            length = int.from_bytes(head[:3], "big")
            kind, flags = head[3], head[4]
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            payload = reader.read(length)
            if kind == SETTINGS and not flags & ACK:
                conn.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                conn.sendall(frame(PING, ACK, 0, payload))
            elif kind in (HEADERS, DATA) and flags & END_STREAM:  # the whole request is in
                self._respond(conn, stream)

    def _respond(self, conn: socket.socket, stream: int) -> None:
        headers = b"\x88" + literal(b"content-type", b"application/grpc")  # 0x88: :status 200
        message = b"\x00" + struct.pack(">I", len(self.message)) + self.message
        sent = [frame(HEADERS, END_HEADERS, stream, headers), frame(DATA, 0, stream, message)]
        conn.sendall(b"".join(sent))
        # The end comes later, as a replica's death does: a gRPC client that reads the reset in
        # the same read as the message may drop the message (grpc.aio does).
        time.sleep(self.pause_s)
        if self.end == "reset":
            sent.append(frame(RST_STREAM, 0, stream, struct.pack(">I", INTERNAL_ERROR)))
        else:
            code, text = self.end
            trailers = literal(b"grpc-status", str(code).encode()) + literal(
                b"grpc-message", text.encode()
            )
            sent.append(frame(HEADERS, END_HEADERS | END_STREAM, stream, trailers))
        conn.sendall(sent[-1])
        self.frames_sent += [f[3] for f in sent]
