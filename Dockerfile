# The reducer image: `redsock serve` only (numpy, no torch), non-root, slim.
#   docker build -t redsock-reducer:0.1.0 .
# deploy/reducers.yaml runs it with the same command and options as ENTRYPOINT + CMD below
# (tests/test_deploy.py checks that they agree).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[server]"

FROM python:3.11-slim
RUN groupadd --system --gid 10001 redsock \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin redsock
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "redsock[server]" && rm -rf /wheels
USER 10001:10001
EXPOSE 7700 9100
# The daemon stops cleanly on SIGTERM (Kubernetes' stop signal) within its grace period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["redsock", "serve"]
CMD ["--host", "0.0.0.0", "--port", "7700", "--token-file", "/var/run/redsock/token", "--metrics-port", "9100"]
