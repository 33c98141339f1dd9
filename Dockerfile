# One image for every TurboServe service; the command picks the service.
# The default torch from PyPI is the CUDA build, which GPU workers need; CPU-only hosts can pass
#   --build-arg TORCH_SPEC="torch --index-url <your CPU wheel index>"
FROM python:3.11-slim

ARG TORCH_SPEC="torch>=2.4"
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TURBOSERVE_LOG_FORMAT=json

WORKDIR /app
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY tools ./tools
COPY lab ./lab
# /tls: where compose's certs step writes (a new volume there takes this folder's owner).
RUN pip install ".[k8s]" && useradd --create-home --uid 10001 turboserve \
    && mkdir /tls && chown turboserve:turboserve /tls
USER turboserve

ENTRYPOINT ["turboserve"]
CMD ["gateway"]
