# The ckptstore service image: the torch-free engine and HTTP API. No torch is installed;
# the service never imports it, and neither do the `ckptstore serve` and `ckptstore db`
# commands (the client's torch side is imported only by commands that handle tensors).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CKPTSTORE_HOST=0.0.0.0 \
    CKPTSTORE_PORT=8000 \
    CKPTSTORE_HOME=/var/lib/ckptstore

RUN groupadd --system ckptstore && useradd --system --gid ckptstore --home-dir /var/lib/ckptstore ckptstore \
    && mkdir -p /var/lib/ckptstore && chown ckptstore:ckptstore /var/lib/ckptstore

WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY client ./client
COPY migrations ./migrations
RUN pip install . && python -c "import ckptstore.service.api.server, ckptstore.service.db.schema; import importlib.util as u; assert u.find_spec('torch') is None" \
    && ckptstore serve --help > /dev/null && ckptstore db upgrade --help > /dev/null

USER ckptstore
EXPOSE 8000
VOLUME ["/var/lib/ckptstore"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('CKPTSTORE_PORT', '8000')}/healthz\", timeout=4)"]
CMD ["ckptstore", "serve"]
