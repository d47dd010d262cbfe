# The compose file's "prometheus" service for the docker tier: prom/prometheus cannot be pulled on
# the test machines, so this image carries Debian's Prometheus (the test machine's binary, from
# the "prometheus" package) with the same command line interface. Built by tests/docker/engine.py.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY prometheus /usr/bin/prometheus
RUN mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
