# The operator image: kopf + the Kubernetes client + phasesplit's operator package (no torch).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/phasesplit/operator:0.1.0 .
# BASE: any image with python3 (>= 3.10) and its venv module; hack/images.sh passes a locally
# bootstrapped Debian where no registry is reachable.
ARG BASE=python:3.11-slim
FROM ${BASE}

# pip's cache: a throwaway directory each step removes, unless the build mounts a persistent one
# elsewhere and points PIP_CACHE_DIR there (hack/images.sh reuses ~/.cache/phasesplit/pip).
ARG PIP_CACHE_DIR=/tmp/pip-cache
# A CA bundle for networks that intercept TLS (hack/images.sh mounts the host's); unset elsewhere.
ARG PIP_CERT
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# Its dependencies first, in a layer of their own (a code change rebuilds only the layer below):
# only these (httpx and prometheus-client: the autoscaler scrapes pod metrics), not the package's
# whole list, which includes the serving stack (torch); and the build backend, so that the code
# installs without network; at the versions of constraints.txt (what CI passed with). A venv:
# Debian's python3 refuses system-wide pip installs (PEP 668).
COPY constraints.txt /tmp/constraints.txt
RUN python3 -m venv /opt/venv \
 && pip install -c /tmp/constraints.txt "kopf" "kubernetes" "pydantic>=2" "pyyaml" "httpx" "prometheus-client" "setuptools>=68" "wheel" \
 && rm -rf /tmp/pip-cache

# Non-root, numeric so that runAsNonRoot can verify it; the chart mounts /tmp as the only writable path.
# The uid needs a passwd entry: kopf names its identity after getpass.getuser(), which raises
# KeyError ('getpwuid(): uid not found: 65532') without one, and the operator would crash-loop.
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /tmp phasesplit
# The runtime/ sources ride along because the `phasesplit` entry point lives there.
WORKDIR /src
COPY pyproject.toml setup.py README.md* ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip install --no-deps --no-build-isolation . && rm -rf /src/* /src/build /tmp/pip-cache

USER 65532:65532
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["phasesplit"]
CMD ["operator"]
