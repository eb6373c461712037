# ghcr.io/kiln-dev/kiln:<version>-cuda: the five Kiln services and the `kiln` CLI for NVIDIA GPUs
# (vLLM's CUDA wheel, torch's CUDA build, megatron-core, Triton for Kiln's DSA kernels).
#   docker build -f deploy/docker/services-cuda.Dockerfile -t ghcr.io/kiln-dev/kiln:0.1.0-cuda .
# Set an RLJob's spec.image to it for GPU pods (deploy/examples/cluster-rljob.yaml does). The
# CUDA user-space libraries come as pip wheels (nvidia-*); the driver comes from the node (the
# NVIDIA container toolkit or GPU operator mounts it), so the base stays a plain Python image.
FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# bubblewrap, libseccomp2 (its syscall filter), util-linux (setpriv, mount) and e2fsprogs (the
# workspace quota's ext4 image): the sandbox service's bubblewrap backend; git: SWE tasks;
# gcc and libc headers: Triton compiles each kernel's small C launcher when it first runs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap libseccomp2 util-linux mount e2fsprogs git ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# vLLM's wheel pins the CUDA torch it was built against; every later install keeps that torch.
RUN pip install vllm==0.32.0 \
 && pip install torch==2.13.0 megatron-core==0.16.1 \
 && python -c "import torch, triton, vllm; assert torch.version.cuda, 'not a CUDA build of torch'"
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
# gRPC, metrics, and the trainer ranks' rendezvous (torch.distributed).
EXPOSE 50051 9090 29500
# No ENTRYPOINT: each workload runs its own `kiln-<service> --job /etc/kiln/job.yaml ...`.
CMD ["kiln", "--help"]
