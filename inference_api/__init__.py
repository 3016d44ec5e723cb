"""inference_api: the contract between inference_svc and warmup_ctl.

Both import it; neither owns it. It holds the generated gRPC stubs (``stubs``), the
names probes and manifests rely on (``names``), the warmup plan's vocabulary and
decision table (``plan``) and the one protobuf <-> plan conversion (``convert``).
It imports no torch: a sidecar or a client installs it without the model stack.
"""

__version__ = "0.2.0"
