"""TLS on the public port, with a CA made in the test (openssl): plaintext clients are
refused, TLS clients that trust the CA are served, client certificates are required when a
client CA is configured, and inference-cli and the sidecar's health check speak TLS. The
admin port stays loopback."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc
from inference_cli import cli
from tests.conftest import tiny_args
from tests.rpc import serving
from warmup_ctl import driver
from warmup_ctl.config import Config

pytestmark = [
    pytest.mark.rpc,
    pytest.mark.skipif(not shutil.which("openssl"), reason="needs the openssl command"),
]


ROOT = Path(__file__).resolve().parents[1]


def make_pki(d: Path) -> Path:
    """The operators' script: ca.pem, server.pem/-key.pem (localhost, 127.0.0.1, ...),
    client.pem/-key.pem."""
    script = ROOT / "deploy" / "tls" / "make-dev-certs.sh"
    subprocess.run(["bash", str(script), str(d)], check=True, capture_output=True, timeout=60)
    return d


def tls_channel(port: int, pki: Path, client_cert: bool = False) -> grpc.aio.Channel:
    key = (pki / "client-key.pem").read_bytes() if client_cert else None
    cert = (pki / "client.pem").read_bytes() if client_cert else None
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), key, cert)
    return grpc.aio.secure_channel(f"localhost:{port}", creds)


async def health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    req = health_pb2.HealthCheckRequest(service="inference.v1.Inference")
    return (await stub.Check(req, timeout=10)).status


async def test_tls_and_mutual_tls_on_the_public_port(tmp_path, tiny_embed_dir, tiny_lm_dir, caplog):
    pki = make_pki(tmp_path)
    tls = [
        "--tls-cert-file",
        str(pki / "server.pem"),
        "--tls-key-file",
        str(pki / "server-key.pem"),
    ]
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir, *tls), loaded=True) as (service, c):
        await c.warm_and_serve()  # the admin port: plaintext on loopback
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health(c.channel)  # a plaintext client on the TLS port
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with tls_channel(service.port, pki) as channel:
            assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
            reply = await inference_pb2_grpc.InferenceStub(channel).Embed(
                pb.EmbedRequest(inputs=["over TLS"]), timeout=30
            )
            assert len(reply.embeddings) == 1
        argv = ["health", "--addr", f"localhost:{service.port}", "--tls-ca", str(pki / "ca.pem")]
        assert await asyncio.to_thread(cli.main, argv) == 0
        assert await asyncio.to_thread(cli.main, argv[:3]) == 2  # plaintext: cannot connect

    mutual = [*tls, "--tls-client-ca-file", str(pki / "ca.pem")]
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir, *mutual)) as (service, c):
        async with tls_channel(service.port, pki) as channel:  # no client certificate
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with tls_channel(service.port, pki, client_cert=True) as channel:
            assert await health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        # The sidecar warms over the loopback admin port and checks public health over mTLS.
        sidecar = Config(
            admin=f"127.0.0.1:{service.admin_port}", public=f"localhost:{service.port}",
            once=True, public_tls_ca=str(pki / "ca.pem"),
            public_tls_cert=str(pki / "client.pem"), public_tls_key=str(pki / "client-key.pem"),
        )  # fmt: skip
        caplog.set_level(logging.INFO, logger="warmup_ctl")
        assert await driver.run(sidecar) == 0
        assert "public health SERVING" in caplog.text
        async with tls_channel(service.port, pki, client_cert=True) as channel:
            assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
