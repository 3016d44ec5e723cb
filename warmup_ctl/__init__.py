"""warmup_ctl: the sidecar that drives the warmup of inference_svc.

It imports only the contract package ``inference_api`` (never ``inference_svc``): it runs
the steps the service's Describe requires, and re-plans only as a cross-check.
"""

__version__ = "0.2.0"
