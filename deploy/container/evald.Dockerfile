# syntax=docker/dockerfile:1
# evald: the daemon alone, for a sidecar next to SGLang or a host service.
#
#   docker build -f deploy/container/evald.Dockerfile -t evald:0.1.0 .
#   docker run --read-only --tmpfs /tmp -v evald-state:/var/lib/evald -v evald-run:/run/evald evald:0.1.0
#
# Build context: the repository root (what it may contain is listed in /.dockerignore).
# Builder: Debian 12's own Python 3.11, so the venv it makes runs unchanged on the distroless
# runtime, whose /usr/bin/python3 is that same interpreter. The runtime has no shell, no pip and
# no package manager; everything it runs is the venv copied from the builder.
# Pin both images by digest in production (`FROM debian:12-slim@sha256:...`).
ARG BUILDER_IMAGE=debian:12-slim
ARG RUNTIME_IMAGE=gcr.io/distroless/python3-debian12:nonroot

FROM ${BUILDER_IMAGE} AS builder
# gcc and the Python headers build the native epoch ticker (evald/host/_epoch.c): deadlines that do
# not wait for the GIL. They stay in the builder; the runtime gets the compiled module only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY evald ./evald
COPY engine_adapter ./engine_adapter
COPY evaluators_wasm ./evaluators_wasm
# The wheel, not the source tree, is what gets installed: the image holds exactly what
# `pip wheel` packages (the built-in evaluators' .wasm files included), with the postgres extra
# (psycopg with its own libpq), so one image serves the embedded store and the fleet store.
RUN python3 -m venv /venv \
 && /venv/bin/pip install --no-cache-dir --upgrade pip \
 && /venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && /venv/bin/pip install --no-cache-dir "$(ls /wheels/evald-*.whl)[postgres]" \
 && /venv/bin/pip uninstall -y pip \
 && /venv/bin/python -c "import evald.host._epoch, psycopg, psycopg_pool" \
 && /venv/bin/evald --help > /dev/null
# Mount points owned by the runtime user (no shell there to make them).
RUN mkdir -p /staging/var/lib/evald /staging/run/evald /staging/etc/evald

FROM ${RUNTIME_IMAGE}
COPY --from=builder /venv /venv
COPY --from=builder --chown=65532:65532 /staging/var/lib/evald /var/lib/evald
COPY --from=builder --chown=65532:65532 /staging/run/evald /run/evald
COPY --from=builder /staging/etc/evald /etc/evald
# Bytecode was compiled at install time; a read-only root filesystem must not be written to.
ENV PATH=/venv/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    EVALD_TARGET=unix:/run/evald/evald.sock
# The distroless "nonroot" user; named numerically so Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
# State (registered modules, compiled-module cache) and the socket live outside the image.
VOLUME ["/var/lib/evald", "/run/evald"]
# Prometheus metrics, only when the config sets [server] metrics_listen = "0.0.0.0:9464".
EXPOSE 9464
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
  CMD ["evald", "health", "--target", "unix:/run/evald/evald.sock"]
ENTRYPOINT ["evald", "serve"]
# Mount a config at /etc/evald/evald.toml and append `--config /etc/evald/evald.toml`; without one
# the packaged defaults serve the token-less `local` tenant on the socket (mode 0600).
CMD ["--listen", "unix:/run/evald/evald.sock", "--state-dir", "/var/lib/evald"]
