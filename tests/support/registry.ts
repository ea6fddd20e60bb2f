/**
 * A real OCI registry for pull tests: Debian's `docker-registry` binary (distribution 2.8),
 * started by the test on a loopback port of its own choosing (port 0: no port is probed free and
 * then taken by another process before the registry binds it) with a temporary config and filesystem storage
 * (never its systemd service), and images pushed to it with skopeo over plain HTTP. Test code only.
 * With `auth`, the registry asks for basic auth (its htpasswd backend, a bcrypt entry) on every
 * request: a "private" registry whose images only holders of the credentials can read.
 */
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { busyboxImageSpec, makeOciArchive } from "../fixtures/images.ts";

export const REGISTRY_BIN = "/usr/bin/docker-registry";
/** The registry answers /v2/ within ~100 ms of its start; 20 s means it will not. */
const START_TIMEOUT_MS = 20_000;

export interface LocalRegistry {
  /** `127.0.0.1:PORT`, the domain part of references. */
  host: string;
  /** Pushes an oci-archive (or any skopeo source) as `host/nameTag`, e.g. `bb:1`. */
  push(source: string, nameTag: string): Promise<void>;
  /** Access log lines so far (method and path of each request). */
  log(): string;
  /**
   * Resolves once every request the registry answered before the call is in `log()`: a marker
   * request's line is (the access log is written as each request ends). Resolves the marker;
   * throws when it is not logged within 10 s.
   */
  settled(): Promise<string>;
  stop(): Promise<void>;
}

/** The registry's log line naming the address it bound (distribution 2.8: `listening on 127.0.0.1:PORT`). */
const LISTENING = /listening on 127\.0\.0\.1:(\d+)/;

export interface RegistryUser {
  username: string;
  password: string;
}

let marks = 0;

export async function startRegistry(opts: { auth?: RegistryUser } = {}): Promise<LocalRegistry> {
  const dir = await mkdtemp(join(tmpdir(), "sbx-registry-"));
  const config = join(dir, "config.yml");
  const auth: string[] = [];
  if (opts.auth) {
    const hash = await Bun.password.hash(opts.auth.password, { algorithm: "bcrypt", cost: 4 });
    await writeFile(join(dir, "htpasswd"), `${opts.auth.username}:${hash}\n`);
    auth.push("auth:", "  htpasswd:", "    realm: sandboxd-test", `    path: ${join(dir, "htpasswd")}`);
  }
  await writeFile(
    config,
    [
      "version: 0.1",
      "log:",
      "  level: info",
      "  accesslog:",
      "    disabled: false",
      "storage:",
      "  filesystem:",
      `    rootdirectory: ${join(dir, "storage")}`,
      "  delete:",
      "    enabled: true",
      "http:",
      "  addr: 127.0.0.1:0",
      ...auth,
      "",
    ].join("\n"),
  );
  const child = spawn(REGISTRY_BIN, ["serve", config], { stdio: ["ignore", "pipe", "pipe"] });
  let out = "";
  const onData = (b: Buffer) => {
    out = (out + b.toString()).slice(-500_000);
  };
  child.stdout.on("data", onData);
  child.stderr.on("data", onData);
  let exited = false;
  child.once("exit", () => {
    exited = true;
  });
  const deadline = performance.now() + START_TIMEOUT_MS;
  let host = "";
  for (;;) {
    if (!host) {
      const port = LISTENING.exec(out)?.[1];
      if (port) host = `127.0.0.1:${port}`;
    }
    if (host) {
      try {
        const r = await fetch(`http://${host}/v2/`, { signal: AbortSignal.timeout(1000) });
        if (r.status === 200 || (opts.auth && r.status === 401)) break;
      } catch {
        // not answering yet
      }
    }
    if (exited || performance.now() > deadline) {
      child.kill("SIGKILL");
      await rm(dir, { recursive: true, force: true });
      throw new Error(`docker-registry did not start (${host || "no address yet"}):\n${out.slice(-2000)}`);
    }
    await Bun.sleep(50);
  }
  return {
    host,
    async push(source, nameTag) {
      const p = Bun.spawn(
        [
          "skopeo",
          "copy",
          "--quiet",
          "--insecure-policy",
          "--dest-tls-verify=false",
          ...(opts.auth ? ["--dest-creds", `${opts.auth.username}:${opts.auth.password}`] : []),
          source,
          `docker://${host}/${nameTag}`,
        ],
        { stdout: "pipe", stderr: "pipe" },
      );
      const [err, code] = await Promise.all([new Response(p.stderr).text(), p.exited]);
      if (code !== 0) throw new Error(`skopeo push to ${host}/${nameTag} failed: ${err}`);
    },
    log: () => out,
    async settled() {
      const mark = `log-settled-${++marks}`;
      await fetch(`http://${host}/v2/?${mark}`).then((r) => r.arrayBuffer());
      for (const end = performance.now() + 10_000; !out.includes(mark); await Bun.sleep(10)) {
        if (performance.now() > end) throw new Error(`the registry did not log ${mark} within 10 s`);
      }
      return mark;
    },
    async stop() {
      if (!exited) {
        const gone = new Promise<void>((r) => child.once("exit", () => r()));
        child.kill("SIGTERM");
        const t = setTimeout(() => child.kill("SIGKILL"), 5_000);
        await gone;
        clearTimeout(t);
      }
      await rm(dir, { recursive: true, force: true });
    },
  };
}

/**
 * A registry (plain, on loopback) holding the busybox fixture image as `nameTag` (e.g. `web/bb:1`);
 * its oci-archive is built in `work` and returned for pushing elsewhere too.
 */
export async function startBusyboxRegistry(
  work: string,
  nameTag: string,
): Promise<{ reg: LocalRegistry; archive: string }> {
  if (!existsSync(REGISTRY_BIN))
    throw new Error(`${REGISTRY_BIN} is missing: apt-get install docker-registry`);
  const reg = await startRegistry();
  const archive = join(work, "bb.tar");
  await makeOciArchive(archive, await busyboxImageSpec(work));
  await reg.push(`oci-archive:${archive}`, nameTag);
  return { reg, archive };
}
