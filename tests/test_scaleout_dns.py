"""Client-side balancing over a DNS name with several addresses (inference_api/channel.py,
docs/scale-out.md, "Tested over a DNS name"), no balancer in between: real replicas (each a
service with its sidecar) on 127.0.0.1, 127.0.0.2, ... sharing one port, a DNS server on
loopback (harness/dns.py) answering for one name with the addresses of the replicas "in the
Service", as a headless Service's DNS does, and 32 closed-loop clients of mixed Embed,
Generate and GenerateStream on ONE channel to ``dns://<that server>/<name>:<port>`` with the
committed channel options (round_robin, retries, DNS re-resolution throttle). Every replica
runs with a short --max-connection-age, so the clients resolve the name again now and then.

One set of replicas for the module, the scenarios in order: three share the calls; a fourth
added to the name gets its share within the connection age + 5 s; the fourth taken out of the
name gets no call once the clients resolved it again, then stops; all three replaced one at a
time (new one into the name, old one out, SIGTERM) costs no Embed and no begun stream; one
killed -9 costs no Embed and ends its open streams at once. Every count is a replica's own
/metrics (the DNS server records when the clients resolved). First, the DNS server's own
answers, over UDP."""

from __future__ import annotations

import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from harness.dns import DnsServer
from harness.load import Call, Load
from harness.procs import free_port
from harness.replicas import Replica
from inference_api.channel import DNS_MIN_RESOLUTION_INTERVAL_S, channel_options
from tests.conftest import tiny_args
from tests.test_scaleout_envoy import REPLICA_ENV, SHARE, shares_over

pytestmark = [pytest.mark.proc, pytest.mark.e2e]

NAME = "inference-svc-headless.test"
AGE_S = 2.0  # every replica's --max-connection-age here (300 s by default)
AGE_GRACE_S = 30.0  # longer than any call of the load (a stream of 12 tokens: about 1 s)
# How soon a replica added to the name must have its share (the goal).
JOIN_LIMIT_S = AGE_S + 5
POLL_S = 0.25  # between reads of the replicas' /metrics
WINDOW_S = 1.0  # a share is measured over this long


@dataclass
class Cluster:
    dns: DnsServer
    port: int
    start: Callable[[Sequence[int]], list[Replica]]  # SERVING replicas on 127.0.0.<i + 1>
    replicas: list[Replica]  # SERVING and in the DNS answer
    standby: list[Replica]  # SERVING (warmed by their sidecars), not yet in the name
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    spares: Future[list[Replica]] | None = None
    load: Load = field(init=False)

    def publish(self) -> None:
        """The name now answers the replicas' addresses (what the endpoints controller does
        for a headless Service when a pod turns Ready or goes away)."""
        self.dns.set([r.svc.host for r in self.replicas])

    def start_spares(self) -> Future[list[Replica]]:
        """The three replacements for the rolling replacement, started in the background once
        (not with the first four: their start would only compete with the share measured)."""
        if self.spares is None:
            self.spares = self.pool.submit(self.start, [4, 5, 6])
        return self.spares


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_embed_dir, tiny_lm_dir) -> Iterator[Cluster]:
    """Four replicas started and warmed at once on 127.0.0.1-4 and one port: three in the
    name, the load running over it, the 4th SERVING outside it."""
    log_dir = tmp_path_factory.mktemp("dns")
    age = ("--max-connection-age", str(AGE_S), "--max-connection-age-grace", str(AGE_GRACE_S))
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, *age)
    port = free_port()  # free on 127.0.0.1, so on the rest of 127/8 too (nothing binds *:port)
    started: list[Replica] = []

    def start(ids: Sequence[int]) -> list[Replica]:
        named, hosts = [(f"r{i}", port) for i in ids], [f"127.0.0.{i + 1}" for i in ids]
        reps = Replica.start_many(log_dir, args, named, env=REPLICA_ENV, hosts=hosts)
        started.extend(reps)
        for rep in reps:
            rep.wait_serving(120)
        return reps

    dns = DnsServer(NAME)
    c = Cluster(dns, port, start, [], [])
    try:
        first = start(range(4))
        c.replicas, c.standby = first[:3], first[3:]
        c.publish()
        c.load = Load(dns.target(port), options=channel_options())
        c.load.start()
        yield c
    finally:
        if hasattr(c, "load"):
            c.load.stop()
        c.pool.shutdown()  # the spares started (or failed)
        for rep in started:
            rep.stop()
        dns.stop()


def total(rep: Replica) -> int:
    return sum(rep.requests().values())


def failed_since(load: Load, t: float, rpc: str) -> list[Call]:
    """Calls of ``rpc`` that ended at or after ``t`` with a failure, begun before it or not."""
    return [
        c for c in load.since(0.0, rpc)
        if c.end is not None and c.end >= t and c.code != grpc.StatusCode.OK
    ]  # fmt: skip


def assert_no_embed_failed(load: Load, t: float) -> None:
    failed = failed_since(load, t, "Embed")
    assert not failed, (
        f"{len(failed)} Embed failed: {sorted({(c.code, c.details) for c in failed})}"
    )


def wait_share(c: Cluster, new: Replica, since: float, limit: float) -> tuple[float, float]:
    """Seconds from ``since`` until ``new`` answered at least half the mean of all
    replicas' calls over the last WINDOW_S, and that share; AssertionError past ``limit``."""
    samples: list[tuple[float, list[int]]] = []
    while True:
        now = time.monotonic()
        samples.append((now, [total(r) for r in c.replicas]))
        start = next(s for s in samples if s[0] >= now - WINDOW_S)
        if now - start[0] >= WINDOW_S / 2:
            calls = [b - a for a, b in zip(start[1], samples[-1][1], strict=True)]
            mean = sum(calls) / len(calls)
            share = calls[c.replicas.index(new)] / mean if mean else 0.0
            if share >= 0.5:
                return now - since, round(share, 2)
        assert now - since < limit, f"{new.name} below half the mean {limit} s after: {samples}"
        time.sleep(POLL_S)


def query(server: DnsServer, name: str, qtype: int) -> tuple[int, list[tuple[str, int]]]:
    """(rcode, [(address, ttl)]) as the server answers one query over UDP."""
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    packet = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    packet += labels + b"\0" + struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(packet, (server.host, server.port))
        reply = sock.recv(4096)
    qid, flags, _, ancount, _, _ = struct.unpack_from("!HHHHHH", reply)
    assert qid == 0x1234 and flags & 0x8000, reply  # our id, a response
    offset, records = len(packet), []
    for _ in range(ancount):  # each: a name pointer, type, class, ttl, length, address
        _, rtype, _, ttl, length = struct.unpack_from("!HHHIH", reply, offset)
        offset += 12
        assert rtype == 1 and length == 4
        records.append((socket.inet_ntoa(reply[offset : offset + 4]), ttl))
        offset += 4
    return flags & 0xF, records


def test_the_dns_server_answers_like_a_headless_service() -> None:
    """Every address of the name in one A answer, TTL 0 (no resolver keeps it), the new list
    at the next query; AAAA empty, other names NXDOMAIN (the client asks those too)."""
    server = DnsServer("Replicas.Test", ["127.0.0.1", "127.0.0.2"])
    try:
        assert query(server, "replicas.test", 1) == (0, [("127.0.0.1", 0), ("127.0.0.2", 0)])
        server.set(["127.0.0.3"])
        assert query(server, "REPLICAS.test", 1) == (0, [("127.0.0.3", 0)])
        assert query(server, "replicas.test", 28) == (0, [])  # AAAA: the name, no address
        assert query(server, "other.test", 1) == (3, [])  # NXDOMAIN
        assert len(server.lookups("A")) == 2 and len(server.lookups("AAAA")) == 1
    finally:
        server.stop()


def test_three_replicas_share_the_calls(cluster: Cluster) -> None:
    t0 = time.monotonic()
    time.sleep(0.5)  # the channel connected to all three
    calls, ratios = shares_over(cluster.replicas, 3.0)
    print(f"3 replicas by DNS + round_robin, 3 s: calls {[dict(c) for c in calls]}, "
          f"share of the mean {ratios}")  # fmt: skip
    assert all(SHARE[0] <= r <= SHARE[1] for r in ratios), ratios
    assert all(c.keys() >= {"Embed", "Generate", "GenerateStream"} for c in calls), calls
    assert_no_embed_failed(cluster.load, t0)


def test_a_replica_added_to_the_name_gets_its_share_within_the_age_plus_5_s(
    cluster: Cluster,
) -> None:
    """No balancer tells the clients: a server's GOAWAY at its connection age makes the
    channel resolve the name again (no sooner than the resolution interval in the channel
    options after the last one), round_robin connects to the new address and sends it calls."""
    cluster.start_spares()
    t0 = time.monotonic()
    new = cluster.standby.pop(0)
    assert total(new) == 0
    cluster.replicas.append(new)
    added = time.monotonic()
    cluster.publish()
    took, share = wait_share(cluster, new, added, JOIN_LIMIT_S)
    resolved = [round(t - added, 2) for t in cluster.dns.lookups("A", since=added)]
    calls, ratios = shares_over(cluster.replicas, 1.0)
    print(f"4th replica into the name: resolved again at {resolved[:3]} s, half the mean at "
          f"{took:.2f} s (share {share} over {WINDOW_S} s; limit {JOIN_LIMIT_S} s = age "
          f"{AGE_S} s + 5, resolution interval {DNS_MIN_RESOLUTION_INTERVAL_S} s); then over "
          f"1 s: calls {[c.total() for c in calls]}, shares {ratios}")  # fmt: skip
    assert resolved and resolved[0] <= took
    assert all(SHARE[0] <= r <= SHARE[1] for r in ratios), ratios  # all four: a fair share
    assert_no_embed_failed(cluster.load, t0)


def test_a_replica_taken_out_of_the_name_gets_no_call_once_resolved_again(
    cluster: Cluster,
) -> None:
    """Out of the name (as when Kubernetes scales down: the endpoint goes, then SIGTERM after
    the preStop delay): once the clients resolved the name again it gets no call; then it
    stops gracefully, and no Embed failed."""
    t0 = time.monotonic()
    gone = cluster.replicas.pop()
    removed = time.monotonic()
    cluster.publish()
    last, last_change = total(gone), removed
    quiet_s = 1.5  # no call for this long: the clients no longer pick it
    while time.monotonic() - last_change < quiet_s:
        assert time.monotonic() - removed < JOIN_LIMIT_S + quiet_s, f"{gone.name} still called"
        time.sleep(POLL_S)
        if (n := total(gone)) != last:
            last, last_change = n, time.monotonic()
    resolved = [round(t - removed, 2) for t in cluster.dns.lookups("A", since=removed)]
    print(f"4th replica out of the name: resolved again at {resolved[:3]} s, its last call "
          f"seen by {last_change - removed:.2f} s, then 0 calls for {quiet_s} s")  # fmt: skip
    assert resolved and last_change - removed <= JOIN_LIMIT_S
    assert gone.stop(signal.SIGTERM) == 0, gone.svc.tail()
    assert_no_embed_failed(cluster.load, t0)


def test_a_rolling_replacement_costs_no_embed_and_no_begun_stream(cluster: Cluster) -> None:
    """Each old replica in turn: a new one (SERVING) into the name, the old one out of it and
    SIGTERM at once (no preStop delay: the clients still have its address, the server's
    GOAWAY is what moves them). The next step once the new one has calls."""
    waited = time.monotonic()
    cluster.standby += cluster.start_spares().result(timeout=180)
    waited = time.monotonic() - waited
    t0 = time.monotonic()
    load = cluster.load
    joined = []
    for old in list(cluster.replicas):
        new = cluster.standby.pop(0)
        cluster.replicas.append(new)
        cluster.replicas.remove(old)
        step = time.monotonic()
        cluster.publish()
        assert old.stop(signal.SIGTERM) == 0, old.svc.tail()
        joined.append(wait_share(cluster, new, step, JOIN_LIMIT_S)[0])
    time.sleep(0.5)
    streams = [  # every stream that had begun and ended since t0
        c for c in load.since(0.0, "GenerateStream") if c.began and c.end and c.end >= t0
    ]
    cut = [c for c in streams if c.code != grpc.StatusCode.OK]
    not_begun = failed_since(load, t0, "Generate") + [
        c for c in failed_since(load, t0, "GenerateStream") if not c.began
    ]
    print(f"rolling replacement in {time.monotonic() - t0:.1f} s: {len(load.since(t0))} calls, "
          f"{len(streams)} streams begun, {len(cut)} cut; each new replica at half the mean "
          f"after {[round(s, 2) for s in joined]} s; Generate failed before it began: "
          f"{len(not_begun)} {sorted({(c.code.name, c.details) for c in not_begun})}; "
          f"waited {waited:.1f} s for the replacements to be SERVING")  # fmt: skip
    assert not cut, [(c.code, c.details) for c in cut]
    assert_no_embed_failed(load, t0)


def test_a_replica_killed_under_load_costs_no_embed_and_ends_its_streams(
    cluster: Cluster,
) -> None:
    """kill -9 while a stream is open on it: the clients see the connection drop. Its
    address stays in the name for 0.5 s more (Kubernetes takes a moment to remove it)."""
    load = cluster.load
    victim = cluster.replicas[0]
    deadline = time.monotonic() + 10
    while (in_flight := victim.in_flight())["GenerateStream"] < 2:
        assert time.monotonic() < deadline, "no stream open on the victim in 10 s"
        time.sleep(0.01)
    open_streams = [c for c in load.since(0.0, "GenerateStream") if c.end is None]
    killed_at = time.monotonic()
    victim.stop(signal.SIGKILL)
    cluster.replicas.remove(victim)
    time.sleep(0.5)
    cluster.publish()
    time.sleep(1.5)
    ends = [(c.code.name if c.code else None, round(c.end - killed_at, 3) if c.end else None,
             c.began) for c in open_streams]  # fmt: skip
    cut = [c for c in open_streams if c.code != grpc.StatusCode.OK]
    generate_failed = failed_since(load, killed_at, "Generate")
    print(f"kill -9 with {dict(in_flight)} in flight on it: streams open then "
          f"(code, s after the kill, begun) {ends}; cut {len(cut)} "
          f"{sorted({(c.code.name, c.details) for c in cut})}; Generate failed "
          f"{len(generate_failed)}, (code, begun s after the kill, details) "
          f"{[(c.code.name, round(c.start - killed_at, 3), c.details) for c in generate_failed]}"
          )  # fmt: skip
    assert all(c.end is not None and c.end - killed_at < 1.0 for c in cut), ends
    assert cut and all(c.code == grpc.StatusCode.UNAVAILABLE for c in cut), ends
    assert all(c.code == grpc.StatusCode.UNAVAILABLE for c in generate_failed)
    assert_no_embed_failed(load, killed_at)
