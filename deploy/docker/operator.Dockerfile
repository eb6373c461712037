# ghcr.io/kiln-dev/kiln-operator: the RLJob operator (kopf). No torch, vLLM or Megatron inside.
#   docker build -f deploy/docker/operator.Dockerfile -t ghcr.io/kiln-dev/kiln-operator:0.1.0 .
# The Helm chart runs it as `kiln-operator --all-namespaces --liveness ... --metrics-port 9090`.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src src
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
# The control-plane dependencies only: pydantic, grpc, prometheus-client, kopf, kubernetes.
RUN pip install "$(ls /wheels/kiln-*.whl)[operator]" && rm -rf /wheels \
 && python -c "import kiln.operator.handlers, sys; assert 'torch' not in sys.modules" \
 && useradd --uid 1000 --create-home kiln
USER 1000:1000
WORKDIR /home/kiln
EXPOSE 8080 9090
ENTRYPOINT ["kiln-operator"]
CMD ["--all-namespaces"]
