"""Weight sync: moves policy version N from the trainer to every rollout replica.

`buckets` (checksummed byte buckets and manifests), `store` (the service's versions and replica
acknowledgements), `receiver` (a replica's verify-and-apply loop) know nothing of gRPC;
`servicer` and `main` are the service, `client` holds `publish` and `subscribe_and_apply`;
`broadcast` moves the same buckets as one torch.distributed collective (gloo, NCCL).
"""
