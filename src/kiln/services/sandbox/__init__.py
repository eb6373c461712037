"""The sandbox service: isolated execution of an agent's tool calls, and the verifiers that
turn a sandbox's final state into a reward.

Backends (`interface.Sandbox`, chosen by `factory.make_sandbox` on the config's `type`):
`bubblewrap` (namespaces + cgroups, the local default) and `docker` (the Docker Engine API:
a dind sidecar in a pod, podman's socket elsewhere). Environments (terminal, swe, search,
code) live in `environments/`; sessions, pools and limits in `sessions.py`; the gRPC layer in
`servicer.py` and `main.py`; the CLI in `cli.py`.
"""
