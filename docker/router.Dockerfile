# The cache-aware router (the SGLang Model Gateway, `sglang-router` on PyPI) as its own image, for
# compose.yaml's `router` service (profile scale-out). minirt's image does not contain it: the
# router is a separate program with its own dependencies. See docs/scale-out.md.
#
#   docker build -f docker/router.Dockerfile -t minirt-router:local .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG ROUTER_VERSION=0.3.2
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
RUN python3 -m venv /opt/router \
    && /opt/router/bin/pip install --no-cache-dir "sglang-router==${ROUTER_VERSION}" \
    && /opt/router/bin/python -c "import sglang_router.sglang_router_rs" \
    && useradd --uid 1000 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin router
USER router
ENTRYPOINT ["/opt/router/bin/python", "-m", "sglang_router.launch_router"]
CMD ["--help"]
