"""Names on the wire that other parts (probes, manifests, the sidecar) rely on."""

# grpc.health.v1 service names.
HEALTH_OVERALL = ""
HEALTH_INFERENCE = "inference.v1.Inference"
HEALTH_LIVENESS = "liveness"
# NOT_SERVING from process start until MarkServing; liveness SERVING once listening.
GATED_HEALTH_NAMES = (HEALTH_OVERALL, HEALTH_INFERENCE)

DEFAULT_PORT = 50051
DEFAULT_ADMIN_PORT = 50052
DEFAULT_ADMIN_HOST = "127.0.0.1"
# Prometheus /metrics (off unless --metrics-port; compose and Kubernetes turn it on).
DEFAULT_METRICS_PORT = 9100

# Admin calls carry the shared token (when one is set) as this metadata: "Bearer <token>".
ADMIN_TOKEN_METADATA = "authorization"

# Fully qualified gRPC service names (reflection lists the public ones).
INFERENCE_SERVICE = "inference.v1.Inference"
ADMIN_SERVICE = "inference.v1.WarmupAdmin"
