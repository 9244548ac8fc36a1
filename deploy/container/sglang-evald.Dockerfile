# syntax=docker/dockerfile:1
# SGLang 0.5.23 with the evald adapter installed as an SGLang plugin (entry-point group
# `sglang.srt.plugins`), which SGLang loads in every one of its processes.
#
#   docker build -f deploy/container/sglang-evald.Dockerfile -t sglang-evald:0.5.23-0.1.0 .
#
# The adapter is enabled at run time by EVALD_TARGET (e.g. unix:/run/evald/evald.sock) and
# EVALD_TOKEN; the daemon itself runs in its own container (evald.Dockerfile) or as a host service.
# SGLang's CUDA 13 images are tagged vX.Y.Z-cu130; pin by digest in production.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130
ARG SGLANG_VERSION=0.5.23

# The evald wheel is pure Python (py3-none-any) here: this image runs only the engine adapter, so
# the daemon's native epoch ticker is left out (EVALD_PURE=1) and any Python builds it.
FROM python:3.12-slim-bookworm AS wheel
ENV EVALD_PURE=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY evald ./evald
COPY engine_adapter ./engine_adapter
COPY evaluators_wasm ./evaluators_wasm
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${SGLANG_IMAGE}
ARG SGLANG_VERSION
COPY --from=wheel /wheels /tmp/evald-wheels
# Refuse a base image whose SGLang is not the version the adapter's hooks were written against,
# then install the adapter without letting pip move SGLang, torch or xgrammar, and check that
# SGLang will find the plugin.
RUN python3 -c "import sglang, sys; v = sglang.__version__; sys.exit(0 if v == '${SGLANG_VERSION}' else f'base image has sglang {v}, expected ${SGLANG_VERSION}')" \
 && python3 -m pip install --no-cache-dir "$(ls /tmp/evald-wheels/evald-*.whl)[sglang]" "sglang==${SGLANG_VERSION}" \
 && rm -rf /tmp/evald-wheels \
 && python3 -c "from importlib.metadata import entry_points; import sys; eps = [e.value for e in entry_points(group='sglang.srt.plugins')]; sys.exit(0 if any(v.split('.')[0] in ('evald', 'engine_adapter') for v in eps) else f'no evald plugin among sglang.srt.plugins: {eps}')" \
 && useradd --uid 10001 --user-group --create-home --home-dir /home/sglang sglang
ENV EVALD_TARGET=unix:/run/evald/evald.sock \
    HOME=/home/sglang \
    USER=sglang
USER 10001:10001
EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=5).status == 200 else 1)"]
ENTRYPOINT ["python3", "-m", "sglang.launch_server"]
CMD ["--host", "0.0.0.0", "--port", "30000", "--grammar-backend", "xgrammar"]
