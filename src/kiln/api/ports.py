"""The ports Kiln's pods listen on, defined once: the operator builds its containers, probes,
Services and NetworkPolicies from them, and the spec refuses a user port that collides with one
(`rollout.openaiPort` on 50051 would open the gRPC port to whoever the endpoint admits)."""
from __future__ import annotations

GRPC_PORT = 50051
"""Every service's gRPC port (mutual TLS)."""
HEALTH_PORT = 50050
"""The plain-text, health-only port the kubelet's gRPC probes use."""
METRICS_PORT = 9090
"""Prometheus metrics."""
RENDEZVOUS_PORT = 29500
"""Where the trainer's ranks meet (torch.distributed's customary port)."""

RESERVED = {GRPC_PORT: "the services' gRPC port", HEALTH_PORT: "the health-probe port",
            METRICS_PORT: "the metrics port", RENDEZVOUS_PORT: "the trainer's rendezvous port"}
