# The operator image: kopf + the Kubernetes client + phasesplit's operator package (no torch).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/phasesplit/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml setup.py README.md* ./
COPY runtime/ runtime/
COPY operator/ operator/
# --no-deps: the package's dependencies include the serving stack (torch); the operator needs only
# these (httpx and prometheus-client: the autoscaler scrapes pod metrics). The runtime/ sources
# ride along because the `phasesplit` entry point lives there.
RUN pip install --no-deps . \
 && pip install "kopf" "kubernetes" "pydantic>=2" "pyyaml" "httpx" "prometheus-client" \
 && rm -rf /src

# Non-root, numeric so that runAsNonRoot can verify it; the chart mounts /tmp as the only writable path.
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["phasesplit"]
CMD ["operator"]
