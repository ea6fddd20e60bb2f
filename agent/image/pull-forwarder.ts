/**
 * Runs INSIDE skopeo's network namespace (skopeo.ts `pullNamespaceArgv`), a namespace whose only
 * interface is `lo`: the one way out is the pull proxy's unix socket (pull-proxy.ts), a file,
 * which network namespaces do not separate.
 *
 *   bun pull-forwarder.ts <proxy socket> <port> [<loopback host:port>...] -- <command> [args...]
 *
 * - Listens on 127.0.0.1:<port> and relays each connection, byte for byte, to the proxy; the
 *   command inherits HTTP_PROXY and HTTPS_PROXY pointing there and NO_PROXY empty (skopeo.ts sets
 *   them: the namespace is new, so the port is free unless a tunnel below takes it, which the
 *   caller avoids).
 * - Go (skopeo) never uses a proxy for a loopback destination, so for a loopback registry the
 *   forwarder also listens on that same address and port inside the namespace and asks the proxy
 *   for `CONNECT host:port` per connection: the proxy checks it with the fence like any other.
 *   Any other loopback address (a redirect to 127.0.0.3) has nothing behind it in the namespace.
 *
 * Writes nothing to stdout (skopeo's output is read from it) and exits with the command's status.
 */
import { spawn } from "node:child_process";
import { connect, createServer, type Socket } from "node:net";

/** A relay's proxy handshake: the proxy answers within its own connect bound (10 s) plus slack. */
const HANDSHAKE_TIMEOUT_MS = 30_000;

function fail(msg: string): never {
  process.stderr.write(`pull-forwarder: ${msg}\n`);
  process.exit(125);
}

const argv = process.argv.slice(2);
const sep = argv.indexOf("--");
if (sep < 2 || sep === argv.length - 1) fail("usage: <socket> <port> [host:port...] -- command [args...]");
const [socketPath, portText, ...tunnels] = argv.slice(0, sep) as [string, string, ...string[]];
const command = argv.slice(sep + 1);

function relay(a: Socket, b: Socket): void {
  // A reset on one side resets the other; a close ENDS the other, which first writes what it
  // still buffers (destroying it would cut off the tail of a blob).
  a.on("error", () => b.destroy());
  b.on("error", () => a.destroy());
  a.on("close", () => b.end());
  b.on("close", () => a.end());
  a.pipe(b);
  b.pipe(a);
}

function listen(host: string, port: number, onConn: (c: Socket) => void): Promise<number> {
  return new Promise((ok, no) => {
    const server = createServer(onConn);
    server.once("error", no);
    server.listen({ host, port, exclusive: true }, () => {
      const a = server.address();
      ok(typeof a === "object" && a ? a.port : 0);
    });
  });
}

/** One tunnelled connection: CONNECT through the proxy, then raw bytes. */
function tunnel(client: Socket, authority: string): void {
  client.pause();
  const up = connect(socketPath);
  let buf = Buffer.alloc(0);
  const timer = setTimeout(() => up.destroy(), HANDSHAKE_TIMEOUT_MS);
  up.once("error", () => client.destroy());
  up.write(`CONNECT ${authority} HTTP/1.1\r\nHost: ${authority}\r\n\r\n`);
  const onData = (chunk: Buffer) => {
    buf = Buffer.concat([buf, chunk]);
    const end = buf.indexOf("\r\n\r\n");
    if (end < 0) {
      if (buf.length > 64 * 1024) up.destroy(); // the proxy's heads are a line or two
      return;
    }
    clearTimeout(timer);
    up.off("data", onData);
    if (!/^HTTP\/1\.[01] 200 /.test(buf.toString("latin1", 0, end))) {
      // Refused: skopeo sees its connection reset, the proxy has recorded why.
      up.destroy();
      client.destroy();
      return;
    }
    const rest = buf.subarray(end + 4);
    if (rest.length > 0) client.write(rest);
    relay(client, up);
    client.resume();
  };
  up.on("data", onData);
  up.once("close", () => client.end());
}

await listen("127.0.0.1", Number(portText), (c) => relay(c, connect(socketPath))).catch((e: Error) =>
  fail(`cannot listen on 127.0.0.1: ${e.message}`),
);
for (const t of tunnels) {
  const m = /^(\[[0-9a-f:.]+\]|[a-z0-9.-]+):([0-9]{1,5})$/i.exec(t);
  if (!m) fail(`${t} is not host:port`);
  const host = m[1]!.replace(/^\[|\]$/g, "");
  const bind = host === "localhost" ? "127.0.0.1" : host;
  await listen(bind, Number(m[2]), (c) => tunnel(c, t)).catch((e: Error) =>
    fail(`cannot listen on ${t}: ${e.message}`),
  );
}
const child = spawn(command[0]!, command.slice(1), { stdio: "inherit" });
child.once("error", (e) => fail(`cannot run ${command[0]}: ${e.message}`));
child.once("exit", (code, signal) => process.exit(code ?? (signal ? 128 + 9 : 1)));
