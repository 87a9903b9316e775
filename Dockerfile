# Sluice: the gateway (and, with another command, its simulated upstream) in one slim image.
#   docker build -t sluice .
#   docker run -p 8080:8080 sluice                      # the quickstart config: a simulated backend
#   docker run -p 8080:8080 -v $PWD/my.yaml:/etc/sluice/gateway.yaml:ro sluice
# It runs as a numeric non-root user (so Kubernetes' runAsNonRoot can verify it) and writes nothing outside /tmp:
# with a read-only root filesystem, mount a writable /tmp (deploy/kubernetes uses an emptyDir), which is where
# `--workers N` keeps the Prometheus multiprocess files.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY plugins ./plugins
COPY tools ./tools
RUN pip install . && rm -rf /src

COPY config/gateway.yaml /etc/sluice/gateway.yaml
RUN useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin sluice
USER 10001:10001
WORKDIR /tmp

EXPOSE 8080
CMD ["sluice", "serve", "-c", "/etc/sluice/gateway.yaml", "--host", "0.0.0.0"]
