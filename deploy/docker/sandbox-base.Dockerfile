# ghcr.io/kiln-dev/kiln-sandbox-base: the default image tool calls run in under the docker
# sandbox backend (spec.sandbox.image), started by the dind sidecar of the sandbox pod.
#   docker build -f deploy/docker/sandbox-base.Dockerfile -t ghcr.io/kiln-dev/kiln-sandbox-base:0.1.0 deploy/docker
# A shell, Python and the usual command-line tools; no network tools are needed (sandboxes run
# without a network unless the spec asks for one). Task images for SWE or terminal tasks build
# FROM it and add the repository and its dependencies.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash coreutils findutils grep sed gawk diffutils \
      patch git python3 python3-venv ca-certificates procps \
 && rm -rf /var/lib/apt/lists/*
# The sandbox service runs commands as nobody (65534) in /workspace.
RUN mkdir -p /workspace && chown 65534:65534 /workspace
WORKDIR /workspace
USER 65534:65534
CMD ["sleep", "infinity"]
