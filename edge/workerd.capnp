# The edge on a self-hosted workerd (docs/edge.md "workerd, self-hosted"). Next to this file:
# worker.js, the bundle of edge/worker.ts:
#   bun build --target=browser --format=esm edge/worker.ts --outfile DIR/worker.js
# then, from the environment (edge/config.ts):
#   SANDBOXD_EDGE_REGIONS='{"eu":["https://gw1.eu.internal"],"us":["https://gw1.us.internal"]}' \
#   SANDBOXD_EDGE_DEFAULT_REGION=eu SANDBOXD_EDGE_CLIENT_IP_HEADER=x-real-ip \
#   workerd serve DIR/workerd.capnp [--socket-addr http=0.0.0.0:8080]
using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  services = [
    (name = "edge", worker = .edge),
    # The gateways' network. workerd refuses private and loopback addresses to a worker unless its
    # outbound network allows them, and a region's gateways usually live on a private network.
    (name = "gateways", network = (allow = ["public", "private", "local"])),
  ],
  sockets = [
    # Plain HTTP, for the TLS terminator in front of it; its X-Forwarded-Proto becomes the
    # request's scheme, which the edge passes on.
    (name = "http", address = "*:8080", http = (forwardedProtoHeader = "X-Forwarded-Proto"), service = "edge"),
  ],
);

const edge :Workerd.Worker = (
  modules = [(name = "worker.js", esModule = embed "worker.js")],
  compatibilityDate = "2025-01-01",
  bindings = [
    (name = "SANDBOXD_EDGE_REGIONS", fromEnvironment = "SANDBOXD_EDGE_REGIONS"),
    (name = "SANDBOXD_EDGE_DEFAULT_REGION", fromEnvironment = "SANDBOXD_EDGE_DEFAULT_REGION"),
    (name = "SANDBOXD_EDGE_CLIENT_IP_HEADER", fromEnvironment = "SANDBOXD_EDGE_CLIENT_IP_HEADER"),
  ],
  globalOutbound = "gateways",
);
