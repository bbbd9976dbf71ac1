# One image for all four minirt actors; the command picks the role: `minirt actor NAME`
# (see compose.yaml). Build:
#
#   docker build -t minirt:local .                                # CPU torch
#   docker build -t minirt:cuda --build-arg TORCH=cuda .          # CUDA torch, for a GPU executor
#
# Build arguments:
#   BASE_IMAGE       a Debian-based image with python3 (>= 3.11) and its venv module.
#                    Default python:3.11-slim; where no image registry is reachable,
#                    scripts/docker-local-base makes a local one from a Debian mirror.
#   TORCH            cpu: the CPU-only wheel (torch==TORCH_VERSION+cpu);
#                    cuda: the CUDA build (PyPI's Linux wheel, or TORCH_INDEX_URL's).
#   TORCH_VERSION    default 2.13.0, the version the tests run against.
#   TORCH_INDEX_URL  extra package index searched for torch. auto (default): the PyTorch CPU
#                    index for cpu, none for cuda (e.g. https://download.pytorch.org/whl/cu128
#                    picks a CUDA version); none: no extra index (PIP_FIND_LINKS has the wheel).
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS
#                    pip settings for this build only (pip reads them from the environment);
#                    for example PIP_FIND_LINKS=http://127.0.0.1:8000/ with --network host to
#                    install a local torch wheel. Not set in the image (docker history shows them).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Metadata first: every instruction is a build step, and steps before the large layers are cheap
# (with the vfs storage driver each step copies the whole file system).
LABEL org.opencontainers.image.title="minirt" \
      org.opencontainers.image.description="minirt actors: run as minirt actor NAME"
# compose.yaml mounts the model at /model and the run directory (events) at /var/lib/minirt, and
# sets the endpoints and the user (MINIRT_UID) through MINIRT_* variables.
ENV VIRTUAL_ENV=/opt/minirt \
    PATH=/opt/minirt/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MINIRT_MODEL=/model \
    MINIRT_RUN_DIR=/var/lib/minirt
WORKDIR /var/lib/minirt
ENTRYPOINT ["minirt"]
CMD ["--help"]

ARG TORCH=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=auto
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS

# The user, the virtual environment and torch: the largest layer, and the one that changes least.
RUN set -eu; \
    useradd --uid 1000 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin minirt; \
    mkdir -p /model; \
    chown minirt:minirt /var/lib/minirt; \
    python3 -m venv "$VIRTUAL_ENV"; \
    case "$TORCH" in \
        cpu)  spec="torch==${TORCH_VERSION}+cpu"; auto_index=https://download.pytorch.org/whl/cpu ;; \
        cuda) spec="torch==${TORCH_VERSION}"; auto_index= ;; \
        *) echo "TORCH must be cpu or cuda, not '$TORCH'" >&2; exit 1 ;; \
    esac; \
    case "$TORCH_INDEX_URL" in \
        auto) index=$auto_index ;; \
        none|"") index= ;; \
        *) index=$TORCH_INDEX_URL ;; \
    esac; \
    pip install ${index:+--extra-index-url "$index"} "$spec"; \
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# C and C++ compilers: the install builds the CPU kernels (gpu/csrc, setup.py) against torch, one
# build per instruction set, so the image runs on any x86-64 CPU; a failed build fails the image.
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends gcc g++ libc6-dev >/dev/null \
    && rm -rf /var/lib/apt/lists/*

# The project's dependencies, from pyproject.toml alone (source edits do not invalidate this layer).
COPY pyproject.toml /opt/minirt-src/pyproject.toml
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/opt/minirt-src/pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "setuptools>=70.1" \
    && rm /tmp/requirements.txt

# The project itself (.dockerignore keeps the context to pyproject.toml, README.md and the code).
COPY . /opt/minirt-src/
RUN pip install --no-build-isolation --no-deps /opt/minirt-src && rm -rf /opt/minirt-src/build /opt/minirt-src/*.egg-info

USER minirt
