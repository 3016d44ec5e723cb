"""The admin port's shared token: read from a file (never a flag value), required on every
admin call when set, and carried by the sidecar. Real processes, tiny models, mode NONE."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from harness.procs import ServiceProc, sidecar
from inference_api.names import ADMIN_TOKEN_METADATA
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import admin_pb2_grpc, inference_pb2_grpc
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import tiny_args

pytestmark = [pytest.mark.proc, pytest.mark.e2e]
TOKEN = "s3cret-token-for-the-test"


def describe(port: int, token: str | None) -> apb.DescribeResponse:
    metadata = [(ADMIN_TOKEN_METADATA, f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = admin_pb2_grpc.WarmupAdminStub(channel)
        return stub.Describe(apb.DescribeRequest(), metadata=metadata, timeout=30)


def test_the_token_guards_every_admin_call_and_the_sidecar_carries_it(
    tmp_path: Path, tiny_embed_dir, tiny_lm_dir
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--kv-cache-tokens", "192")
    svc = ServiceProc(tmp_path, [*args, "--admin-token-file", str(token_file)])
    try:
        for token in (None, "wrong", TOKEN[:-1]):
            with pytest.raises(grpc.RpcError) as info:
                describe(svc.admin_port, token)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
            assert "shared token" in info.value.details()
        assert describe(svc.admin_port, TOKEN).boot_id

        # A sidecar without the token cannot warm it, and says why.
        lost = sidecar(tmp_path, svc, "--once", "--connect-timeout", "5", name="no-token")
        assert lost.popen.wait(timeout=120) == 1
        assert "UNAUTHENTICATED" in lost.text()

        # With it (from a file, as compose and Kubernetes mount it), the service turns SERVING.
        ctl = sidecar(tmp_path, svc, "--once", "--admin-token-file", str(token_file))
        assert ctl.popen.wait(timeout=300) == 0, ctl.tail()
        assert TOKEN not in ctl.text() and TOKEN not in svc.text()
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as channel:  # public: no token
            reply = inference_pb2_grpc.InferenceStub(channel).Embed(
                pb.EmbedRequest(inputs=["hello"]), timeout=30
            )
        assert len(reply.embeddings) == 1
    finally:
        svc.stop()


def test_an_unreadable_token_file_fails_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    svc_args = ["--port", "0", "--admin-token-file", str(missing)]
    proc = subprocess.run(
        [sys.executable, "-m", "inference_svc", *svc_args], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--admin-token-file" in proc.stderr and "absent" in proc.stderr
