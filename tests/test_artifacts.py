"""Kept compiled artifacts (--compile-cache-dir): a restart loads what the first start
compiled and skips the compiler; corrupt, stale and foreign artifacts are each refused with
a log line naming the reason, and the service compiles instead. 0 late compiles either way.

Real processes on the tiny embedding model (one compiled function: a cold compile takes
seconds), warmed by the real sidecar."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from harness.procs import BIN, Proc, ServiceProc, sidecar
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import admin_pb2_grpc, inference_pb2_grpc
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.engine import artifacts
from inference_svc.engine.artifact_key import MANIFEST, ArtifactKey, verify
from inference_svc.engine.artifacts import CompileArtifacts, _refused_marker
from tests.conftest import TORCH_COMPILE

pytestmark = [pytest.mark.proc, pytest.mark.timeout(600)]
TEXTS = ["kept artifacts", "a restart in seconds"]


def start(tmp: Path, embed_dir: Path, cache: Path, name: str, *extra: str) -> ServiceProc:
    args = ["--port", "0", "--admin-port", "0", "--embed-model", str(embed_dir)]
    args += ["--lm-model", "none", "--embed-max-batch", "4", "--compilation-mode", "default"]
    args += TORCH_COMPILE
    return ServiceProc(tmp, [*args, "--compile-cache-dir", str(cache), *extra], name=name)


def describe(svc: ServiceProc) -> apb.DescribeResponse:
    with grpc.insecure_channel(f"127.0.0.1:{svc.admin_port}") as ch:
        stub = admin_pb2_grpc.WarmupAdminStub(ch)
        while True:
            d = stub.Describe(apb.DescribeRequest(), timeout=60, wait_for_ready=True)
            if d.models_loaded:
                return d


def warm(tmp: Path, svc: ServiceProc, name: str) -> str:
    """Warm with the sidecar (--once); its log."""
    ctl = sidecar(tmp, svc, "--once", name=f"{name}-ctl")
    assert ctl.popen.wait(timeout=500) == 0, ctl.tail()
    ctl.stop()
    return ctl.text()


def embed_and_info(svc: ServiceProc) -> tuple[list[bytes], int]:
    with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        reply = stub.Embed(pb.EmbedRequest(inputs=TEXTS), timeout=60)
        info = stub.Info(pb.InfoRequest(), timeout=10)
    return [e.SerializeToString() for e in reply.embeddings], info.late_compile_events


def compile_events(ctl_log: str) -> int:
    """Compile events of the COMPILE step, from the sidecar's step line."""
    line = next(x for x in ctl_log.splitlines() if "COMPILE embedding" in x and "compile ev" in x)
    return int(line.split(" s, ")[1].split()[0])


def kept(cache: Path) -> Path:
    """The one kept directory (published by the last warmup step)."""
    for _ in range(300):
        entries = [p for p in cache.iterdir() if (p / MANIFEST).is_file()] if cache.is_dir() else []
        if entries:
            (entry,) = entries
            return entry
        time.sleep(0.1)
    raise AssertionError(f"nothing kept in {cache}")


def test_restart_loads_kept_artifacts_and_bad_ones_fall_back(tmp_path, tiny_embed_dir):
    cache = tmp_path / "compile-cache"
    # 1. Cold: compiles, serves, keeps its artifacts.
    svc = start(tmp_path, tiny_embed_dir, cache, "cold")
    try:
        assert [m.artifacts for m in describe(svc).models] == ["compiled"]
        cold_log = warm(tmp_path, svc, "cold")
        assert compile_events(cold_log) > 0
        cold_vectors, late = embed_and_info(svc)
        assert late == 0
        entry = kept(cache)
    finally:
        assert svc.stop() == 0
    assert "compiled artifacts: kept in" in svc.text()

    # 2. Restart: loaded, COMPILE runs every bucket and compiles nothing, same answers.
    svc = start(tmp_path, tiny_embed_dir, cache, "warm")
    try:
        assert [m.artifacts for m in describe(svc).models] == ["loaded"]
        warm_log = warm(tmp_path, svc, "warm")
        assert "from kept artifacts" in warm_log  # the sidecar's plan says so
        assert "graphs from kept artifacts" in warm_log  # and the COMPILE step's report
        assert compile_events(warm_log) == 0
        vectors, late = embed_and_info(svc)
        assert late == 0 and vectors == cold_vectors
    finally:
        svc.stop()

    # 3. Corrupt: one byte of one file changed. Refused by name, compiled, served, kept again.
    manifest = json.loads((entry / MANIFEST).read_text())
    victim = next(name for name in manifest["files"] if name.startswith("dynamo/"))
    data = bytearray((entry / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (entry / victim).write_bytes(bytes(data))
    svc = start(tmp_path, tiny_embed_dir, cache, "corrupt")
    try:
        assert [m.artifacts for m in describe(svc).models] == ["compiled"]
        assert f"file {victim} is corrupt" in svc.text()
        log = warm(tmp_path, svc, "corrupt")
        assert compile_events(log) > 0
        assert embed_and_info(svc) == (cold_vectors, 0)
    finally:
        svc.stop()
    assert verify(kept(cache), ArtifactKey(manifest["key"])) is None  # replaced by a good one

    # 4. Stale: made by another torch version (the manifest says so). Refused by name.
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["key"]["torch"] = "2.12.0+cpu"
    (entry / MANIFEST).write_text(json.dumps(manifest))
    svc = start(tmp_path, tiny_embed_dir, cache, "stale")
    try:
        assert [m.artifacts for m in describe(svc).models] == ["compiled"]
        assert "torch version (2.12.0+cpu there" in svc.text()
        assert compile_events(warm(tmp_path, svc, "stale")) > 0
        assert embed_and_info(svc)[1] == 0
    finally:
        svc.stop()


def key(**changes: str) -> ArtifactKey:
    fields = {"torch": "2.13.0+cpu", "cpu": "AVX512-abc", "threads": "2", "weights:embedding": "w1"}
    return ArtifactKey({**fields, **changes})


def keep(root: Path, k: ArtifactKey) -> Path:
    """A kept directory for key ``k`` with one file, as publish writes it."""
    entry = root / k.digest
    (entry / "dynamo").mkdir(parents=True)
    (entry / "dynamo" / "pkg").write_bytes(b"package")
    files = {"dynamo/pkg": hashlib.sha256(b"package").hexdigest()}
    (entry / MANIFEST).write_text(json.dumps({"format": 1, "key": k.fields, "files": files}))
    return entry


@pytest.mark.parametrize(
    "other, reason",
    [
        (key(cpu="AVX2-def"), "CPU capabilities (AVX2-def there, AVX512-abc here)"),
        (key(threads="8"), "thread count (8 there, 2 here)"),
        (key(**{"weights:embedding": "w0"}), "weights of embedding (w0 there, w1 here)"),
        (key(torch="2.12.0+cpu"), "torch version (2.12.0+cpu there, 2.13.0+cpu here)"),
        (
            key(headers="/tmp/torchinductor_root/precompiled_headers"),
            "precompiled-header directory (per user: $TMPDIR/torchinductor_<user>) "
            "(/tmp/torchinductor_root/precompiled_headers there, None here)",
        ),
    ],
)
def test_artifacts_for_another_key_are_not_used_and_the_log_says_why(
    tmp_path: Path, other: ArtifactKey, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    keep(tmp_path, other)
    chosen = CompileArtifacts(tmp_path, key())
    try:
        chosen.choose()
        assert not chosen.loaded
        assert reason in chosen.reason and reason in caplog.text
        assert not any(chosen.staging.iterdir())  # nothing copied
    finally:
        chosen.close()


# CompileArtifacts.open in a fresh interpreter (inductor caches its ISA checks per process):
# a start that loads kept artifacts, one that compiles for a GPU, one that compiles for the
# CPU; prints the libraries then in inductor's own directory and in the start's private one.
ISA_CHECKS = """
import os, sys
from pathlib import Path
from inference_svc.engine.artifacts import CompileArtifacts
from tests.test_artifacts import keep, key
root, inductor = Path(sys.argv[1]), Path(sys.argv[2])
libraries = lambda d: len(list(d.rglob("*.so")))
keep(root / "kept", key())
for name in ("kept", "gpu", "new"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)  # as the user set it
    start = CompileArtifacts(root / name, key(), cpu=name != "gpu")
    start.open()
    print(name, start.loaded, libraries(inductor), libraries(start.staging))
    start.close()
"""


def test_a_compiling_start_runs_inductors_isa_checks_in_its_lasting_directory(
    tmp_path: Path,
) -> None:
    """Inductor test-builds a library per vector ISA the first time a process compiles,
    into its cache directory: a start that compiles runs them in inductor's directory (where
    the next start finds them), not in its own empty one; a start from kept artifacts, or
    one whose models run on a GPU, runs none."""
    inductor = tmp_path / "inductor"
    run = subprocess.run(
        [sys.executable, "-c", ISA_CHECKS, str(tmp_path), str(inductor)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    kept, gpu, new = (line.split() for line in run.stdout.splitlines()[-3:])
    assert kept == ["kept", "True", "0", "0"] and gpu == ["gpu", "False", "0", "0"], run.stdout
    assert new[:2] == ["new", "False"] and int(new[2]) > 0 and new[3] == "0", run.stdout


def test_a_matching_directory_is_copied_and_a_truncated_one_refused(tmp_path: Path) -> None:
    entry = keep(tmp_path, key())
    good = CompileArtifacts(tmp_path, key())
    try:
        good.choose()
        assert good.loaded and (good.staging / "dynamo" / "pkg").read_bytes() == b"package"
    finally:
        good.close()
    (entry / "dynamo" / "pkg").write_bytes(b"pack")  # truncated
    bad = CompileArtifacts(tmp_path, key())
    try:
        bad.choose()
        assert not bad.loaded and "file dynamo/pkg is corrupt" in bad.reason
    finally:
        bad.close()
    (entry / MANIFEST).write_text('{"format": 1, "key": ')  # a torn manifest
    assert "unreadable manifest" in (verify(entry, key()) or "")
    shutil.rmtree(entry / "dynamo")
    (entry / MANIFEST).unlink()
    assert verify(entry, key()) == "no manifest (an unfinished or foreign directory)"


def test_generative_restart_compiles_nothing_and_gives_the_same_tokens(
    tmp_path, tiny_embed_dir, tiny_lm_dir
):
    """The generative model (prefill, decode, the sampler's four functions) loads from kept
    artifacts: no compile in PROFILE, COMPILE or SAMPLER, none after SERVING, same tokens."""
    cache = tmp_path / "compile-cache"
    args = ["--port", "0", "--admin-port", "0", "--embed-model", "none"]
    args += ["--lm-model", str(tiny_lm_dir), "--max-input-tokens", "32", "--max-new-tokens", "16"]
    args += ["--compilation-mode", "default", "--compile-cache-dir", str(cache), *TORCH_COMPILE]
    prompts = ["a", "a longer prompt of several words to cross a chunk bucket or two"]
    answers, events = [], []
    for name in ("cold", "warm"):
        svc = ServiceProc(tmp_path, args, name=name)
        try:
            log = warm(tmp_path, svc, name)
            events.append([int(x) for x in re.findall(r" s, (\d+) compile event", log)])
            with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
                stub = inference_pb2_grpc.InferenceStub(ch)
                sampling = pb.SamplingParams(max_tokens=12, temperature=0.0)
                replies = [
                    stub.Generate(pb.GenerateRequest(prompt=p, sampling=sampling), timeout=60)
                    for p in prompts
                ]
                answers.append([list(r.token_ids) for r in replies])
                assert stub.Info(pb.InfoRequest(), timeout=10).late_compile_events == 0
            if name == "cold":
                kept(cache)
        finally:
            svc.stop()
    assert sum(events[0]) > 0 and events[1] == [0] * len(events[1]), events
    assert answers[0] == answers[1]


def test_precompile_fills_the_cache_a_service_then_loads(tmp_path, tiny_embed_dir):
    """`inference-svc precompile` (an image build stage, a Kubernetes Job) with the service's
    flags: exit 0, artifacts kept; the service started later loads them."""
    cache = tmp_path / "compile-cache"
    flags = ["--embed-model", str(tiny_embed_dir), "--lm-model", "none", *TORCH_COMPILE]
    flags += ["--embed-max-batch", "4", "--compilation-mode", "default"]
    flags += ["--compile-cache-dir", str(cache)]
    pre = Proc([str(BIN / "inference-svc"), "precompile", *flags], tmp_path / "precompile.log")
    assert pre.popen.wait(timeout=500) == 0, pre.tail()
    pre.stop()
    assert "precompile: done" in pre.text()
    kept(cache)
    svc = ServiceProc(tmp_path, ["--port", "0", "--admin-port", "0", *flags], name="after")
    try:
        assert [m.artifacts for m in describe(svc).models] == ["loaded"]
        assert compile_events(warm(tmp_path, svc, "after")) == 0
    finally:
        svc.stop()
    none = Proc([str(BIN / "inference-svc"), "precompile", *flags[:-4]], tmp_path / "none.log")
    assert none.popen.wait(timeout=120) == 1  # mode none: nothing to compile, a clear error
    none.stop()
    assert "compiles nothing" in none.text()


def test_artifacts_that_broke_a_step_are_set_aside(tmp_path: Path) -> None:
    """What the engine does when loaded artifacts make a warmup step fail: the directory is
    renamed aside (kept for a post-mortem) and the next start of the key compiles."""
    entry = keep(tmp_path, key())
    loaded = CompileArtifacts(tmp_path, key())
    try:
        loaded.choose()
        assert loaded.loaded
        aside = loaded.discard("COMPILE embedding failed with them: IndexError()")
    finally:
        loaded.close()
    assert aside is not None and aside.name.startswith(".bad-") and not entry.exists()
    after = CompileArtifacts(tmp_path, key())
    try:
        after.choose()
        assert not after.loaded and after.reason == "none kept yet"
    finally:
        after.close()
    # A read-only volume cannot be renamed: the refusal is remembered on this machine.
    keep(tmp_path, key())
    again = CompileArtifacts(tmp_path, key())
    try:
        again.choose()
        assert not again.loaded and "it failed on this machine before" in again.reason
        assert "IndexError" in again.reason
    finally:
        again.close()
        _refused_marker(key()).unlink()


def test_the_key_names_the_users_kernel_header_directory(tmp_path: Path) -> None:
    # Seen in a container: artifacts kept by root (the image build) and loaded by the
    # service's user missed every C++ kernel (their compile command names a per-user header
    # directory) and recompiling one beside the loaded graphs failed. The key tells them apart.
    def headers(user: str) -> str:
        code = "from inference_svc.engine.artifact_key import header_dir; print(header_dir())"
        env = {**os.environ, "USER": user, "LOGNAME": user, "TMPDIR": str(tmp_path)}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    root, app = headers("root"), headers("app")
    assert root != app and "torchinductor_app" in app and app.startswith(str(tmp_path))


def test_a_noexec_temp_directory_is_not_where_kernels_are_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Docker mounts a tmpfs /tmp noexec: compiled kernels there fail to load ("failed to map
    # segment from shared object"). The working directory then goes in the cache directory.
    tmp, root = tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(artifacts, "_executable", lambda d: Path(d) != tmp)
    chosen = CompileArtifacts(root, key())
    try:
        assert chosen.staging.parent == root and chosen.staging.name.startswith(".")
        assert "is mounted noexec" in caplog.text
    finally:
        chosen.close()
    monkeypatch.setattr(artifacts, "_executable", lambda d: False)
    with pytest.raises(OSError, match=r"mount .* with exec"):
        CompileArtifacts(root, key())
