# One image for both halves of Huorn: the operator (`python -m huorn.cli.operator`, what the
# Helm chart runs) and the runtime in the job pods (`torchrun ... -m huorn.runtime.train` and
# `python -m huorn.runtime.store`), so the trainer always matches the operator that wrote its config.
#
#   docker build -t ghcr.io/huorn-io/huorn:0.1.0 .                      # CPU torch
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 -t ...:0.1.0-cu126 .
FROM python:3.11-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY huorn ./huorn
RUN python -m venv /opt/huorn \
 && /opt/huorn/bin/pip install --index-url "$TORCH_INDEX" "torch==2.13.0" \
 && /opt/huorn/bin/pip install .

FROM python:3.11-slim
LABEL org.opencontainers.image.title="huorn" \
      org.opencontainers.image.description="Huorn operator and runtime" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/huorn /opt/huorn
# Non-root, and nothing is written outside mounted volumes (/tmp, /var/run/huorn, /checkpoints):
# the chart runs the operator with a read-only root filesystem.
RUN groupadd --gid 10001 huorn && useradd --uid 10001 --gid huorn --no-create-home --shell /usr/sbin/nologin huorn \
 && mkdir -p /var/run/huorn /checkpoints && chown huorn:huorn /var/run/huorn /checkpoints
ENV PATH=/opt/huorn/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001:10001
# torchrun is on PATH (from torch); the default command is the operator.
ENTRYPOINT []
CMD ["python", "-m", "huorn.cli.operator", "--all-namespaces"]
