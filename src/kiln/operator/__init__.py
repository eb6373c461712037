"""The Kiln operator: reconciles RLJobs into the services that run them (kopf).

Entry point `kiln.operator.main`; handlers in `handlers`; child manifests in `children` and
`workloads` (pure functions); status in `status`. Imports no torch, vLLM, Megatron or
`kiln.services`.
"""
