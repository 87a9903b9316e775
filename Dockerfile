# Sluice: the gateway (and, with another command, its simulated upstream) in one slim image.
#   docker build -t sluice .
#   docker run -p 8080:8080 sluice                      # the quickstart config: a simulated backend
#   docker run -p 8080:8080 -v $PWD/my.yaml:/etc/sluice/gateway.yaml:ro sluice
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY plugins ./plugins
RUN pip install . && rm -rf /src

COPY config/gateway.yaml /etc/sluice/gateway.yaml
RUN useradd --system --no-create-home sluice
USER sluice
WORKDIR /tmp

EXPOSE 8080
CMD ["sluice", "serve", "-c", "/etc/sluice/gateway.yaml", "--host", "0.0.0.0"]
