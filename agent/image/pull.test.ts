/**
 * Image references (contracts/image-ref.ts), the plain-HTTP decision for registries, the registry
 * settings, and real pulls with skopeo from a real registry (Debian's docker-registry on a free
 * loopback port, tests/support/registry.ts): the first pull fetches, a second of the same digest
 * fetches no blob, an unknown tag is a readable error. A private registry (basic auth): the owner's
 * credentials pull; another caller who knows the digest but not the credentials is refused by the
 * registry and served nothing from the cache; the operator's credentials only for a shared registry.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { type AddressInfo, createServer, type Server } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { SandboxdError } from "../../contracts/errors.ts";
import { parseImageReference } from "../../contracts/image-ref.ts";
import { busyboxImageSpec, makeOciArchive } from "../../tests/fixtures/images.ts";
import { type LocalRegistry, REGISTRY_BIN, startRegistry } from "../../tests/support/registry.ts";
import {
  classifySkopeoFailure,
  isLoopbackHost,
  isSharedRegistry,
  manifestSize,
  pulledKey,
  pullImage,
  type RegistryConfig,
  registryAddress,
  registryConfigFromEnv,
  registryTlsVerify,
  skopeoReason,
} from "./pull.ts";

const NO_CONFIG: RegistryConfig = { insecureRegistries: [] };

describe("image references", () => {
  test("valid references parse into registry, path, tag and digest", () => {
    expect(parseImageReference("busybox")).toMatchObject({
      path: "busybox",
      tag: "latest",
      canonical: "busybox:latest",
    });
    expect(parseImageReference("busybox").domain).toBeUndefined();
    expect(parseImageReference("team/app:1.2")).toMatchObject({ path: "team/app", tag: "1.2" });
    expect(parseImageReference("127.0.0.1:5000/bb:1")).toMatchObject({
      domain: "127.0.0.1:5000",
      host: "127.0.0.1",
      port: 5000,
      path: "bb",
      tag: "1",
      name: "127.0.0.1:5000/bb",
    });
    expect(parseImageReference("localhost/a/b")).toMatchObject({ host: "localhost", path: "a/b" });
    expect(parseImageReference("[::1]:5000/x:y")).toMatchObject({ host: "::1", port: 5000, path: "x" });
    const d = `sha256:${"a".repeat(64)}`;
    const pinned = parseImageReference(`reg.example:443/x/y@${d}`);
    expect(pinned).toMatchObject({ digest: d, path: "x/y", host: "reg.example", port: 443 });
    expect(pinned.tag).toBeUndefined();
    expect(parseImageReference(`r.example/x:t@${d}`).canonical).toBe(`r.example/x:t@${d}`);
    expect(parseImageReference("my_org/a__b-c.d:v_1.0-rc")).toMatchObject({ path: "my_org/a__b-c.d" });
  });

  test("anything that could read as an option, a scheme or another transport is refused", () => {
    for (const bad of [
      "",
      "-x",
      "--src-creds=a:b",
      "--authfile=/etc/shadow",
      " busybox",
      "busybox ",
      "bus box",
      "busybox\n",
      "docker://busybox",
      "oci:/tmp/x",
      "docker-archive:/tmp/x.tar",
      "Busybox",
      "reg.example/UPPER",
      "reg.example//x",
      "x/",
      "/x",
      "x:",
      "x:-tag",
      "x@sha256:short",
      `x@md5:${"a".repeat(32)}`,
      "reg.example:99999/x",
      "reg.example:port/x",
      "[::1/x",
      "[zz::1]:5000/x",
      "x/[::1]",
      "a$b",
      "a;b",
      `${"a".repeat(300)}`,
    ]) {
      expect(() => parseImageReference(bad)).toThrow(/invalid image reference/);
    }
  });
});

describe("plain HTTP or TLS", () => {
  test("loopback registries are spoken to over plain HTTP, as Docker does", () => {
    for (const h of ["127.0.0.1", "127.1.2.3", "127.255.255.254", "localhost", "LOCALHOST", "::1", "[::1]"])
      expect(isLoopbackHost(h)).toBe(true);
    expect(isLoopbackHost("0:0:0:0:0:0:0:1")).toBe(true);
    for (const h of [
      "128.0.0.1",
      "10.0.0.1",
      "126.0.0.1",
      "127.0.0.1.nip.example",
      "::2",
      "reg.example",
      "localhostx",
    ])
      expect(isLoopbackHost(h)).toBe(false);
    const tls = (ref: string, cfg = NO_CONFIG) => registryTlsVerify(parseImageReference(ref), cfg);
    expect(tls("127.0.0.1:5000/x")).toBe(false);
    expect(tls("localhost:5000/x")).toBe(false);
    expect(tls("[::1]:5000/x")).toBe(false);
    expect(tls("10.0.0.5:5000/x")).toBe(true);
    expect(tls("reg.example/x")).toBe(true);
    expect(tls("busybox")).toBe(true); // the default registry: always TLS
  });

  test("other registries go without TLS only when configured, by host:port or by host", () => {
    const cfg = registryConfigFromEnv({ SANDBOXD_INSECURE_REGISTRIES: " 10.0.0.5:5000, Reg.Internal ,," });
    expect(cfg.insecureRegistries).toEqual(["10.0.0.5:5000", "reg.internal"]);
    expect(cfg.authFile).toBeUndefined();
    const tls = (ref: string) => registryTlsVerify(parseImageReference(ref), cfg);
    expect(tls("10.0.0.5:5000/x")).toBe(false);
    expect(tls("10.0.0.5:5001/x")).toBe(true); // another port of a host listed with a port
    expect(tls("reg.internal/x")).toBe(false);
    expect(tls("reg.internal:8443/x")).toBe(false); // a host listed without a port: every port
    expect(tls("reg.example/x")).toBe(true);
    expect(() => registryConfigFromEnv({ SANDBOXD_INSECURE_REGISTRIES: "http://x" })).toThrow(
      /not host or host:port/,
    );
    expect(registryConfigFromEnv({ SANDBOXD_REGISTRY_AUTH: "/etc/sandboxd/auth.json" }).authFile).toBe(
      "/etc/sandboxd/auth.json",
    );
  });

  test("host-wide credentials belong to the registries the operator shares, by host:port or by host", () => {
    const cfg = registryConfigFromEnv({
      SANDBOXD_REGISTRY_AUTH: "/etc/sandboxd/auth.json",
      SANDBOXD_SHARED_REGISTRIES: "mirror.internal:5000, Docker.io",
    });
    expect(cfg.sharedRegistries).toEqual(["mirror.internal:5000", "docker.io"]);
    const shared = (ref: string) => isSharedRegistry(parseImageReference(ref), cfg);
    expect(shared("mirror.internal:5000/x")).toBe(true);
    expect(shared("mirror.internal:5001/x")).toBe(false);
    expect(shared("busybox")).toBe(true); // the default registry is docker.io
    expect(shared("reg.example/x")).toBe(false);
    expect(isSharedRegistry(parseImageReference("busybox"), registryConfigFromEnv({}))).toBe(false);
    expect(() => registryConfigFromEnv({ SANDBOXD_SHARED_REGISTRIES: "a b" })).toThrow(
      /not host or host:port/,
    );
  });

  test("the address the egress fence checks: Docker's default registry and ports", () => {
    expect(registryAddress(parseImageReference("busybox"))).toEqual({
      host: "registry-1.docker.io",
      port: 443,
    });
    expect(registryAddress(parseImageReference("reg.example/x"))).toEqual({ host: "reg.example", port: 443 });
    expect(registryAddress(parseImageReference("127.0.0.1:5000/x"))).toEqual({
      host: "127.0.0.1",
      port: 5000,
    });
    expect(registryAddress(parseImageReference("localhost/x"))).toEqual({ host: "localhost", port: 80 });
  });

  test("skopeo's failures become a stable reason and a text that quotes nothing of skopeo's", () => {
    const line = (msg: string) => `time="2026-11-23T10:00:00Z" level=fatal msg="${msg}"`;
    const cases: Array<[string, string]> = [
      [
        "Error reading manifest sha256:ab in 10.1.2.3:5000/x: unauthorized: authentication required",
        "registry_denied",
      ],
      ["reading manifest 1 in 127.0.0.1:5000/bb: manifest unknown: manifest unknown", "image_not_found"],
      [
        'pinging container registry 10.0.0.5: Get \\"https://10.0.0.5/v2/\\": x509: certificate signed by unknown authority',
        "registry_tls",
      ],
      [
        'Get \\"http://169.254.169.254:80/v2/\\": dial tcp 169.254.169.254:80: connect: connection refused',
        "registry_unreachable",
      ],
      // The digits of a port are no status code: a refused connection stays unreachable.
      [
        'Get \\"http://127.0.0.3:40412/token\\": dial tcp 127.0.0.3:40412: connect: connection refused',
        "registry_unreachable",
      ],
      [
        'Get \\"http://127.0.0.3:34013/v2/\\": dial tcp 127.0.0.3:34013: connect: connection refused',
        "registry_unreachable",
      ],
      [
        "reading manifest 1 in 127.0.0.1:5000/bb: received unexpected HTTP status: 404 Not Found",
        "image_not_found",
      ],
      ["pinging registry: received unexpected HTTP status: 403 Forbidden", "registry_denied"],
      ["writing blob: open /var/tmp/storage123: no space left on device", "image_too_large"],
      ["something else at /var/lib/sandboxd/cache", "image_pull_failed"],
    ];
    for (const [msg, reason] of cases) {
      const [got, text] = classifySkopeoFailure(line(msg));
      expect(got).toBe(reason);
      expect(text).not.toMatch(/\/var|\/tmp|10\.|169\.254|https?:|level=|msg=/);
    }
  });

  test("skopeo's error lines are reduced to the registry's words", () => {
    expect(
      skopeoReason(
        'time="2026-11-23T10:00:00Z" level=fatal msg="Error parsing image name \\"docker://x\\": reading manifest nope in 127.0.0.1:5000/bb: manifest unknown: manifest unknown"',
      ),
    ).toBe(
      'Error parsing image name "docker://x": reading manifest nope in 127.0.0.1:5000/bb: manifest unknown: manifest unknown',
    );
    expect(skopeoReason("plain failure\n\n")).toBe("plain failure");
  });
});

describe("pull size", () => {
  const d = (size: number) => ({ mediaType: "x", digest: `sha256:${"0".repeat(64)}`, size });
  test("an image manifest's size is its config and layers as declared", () => {
    expect(manifestSize(JSON.stringify({ config: d(1000), layers: [d(10), d(20)] }))).toEqual({
      bytes: 1030,
    });
  });
  test("an index names its linux/amd64 manifest; none is a readable refusal", () => {
    const amd = `sha256:${"a".repeat(64)}`;
    const index = {
      manifests: [
        { digest: `sha256:${"b".repeat(64)}`, size: 1, platform: { os: "linux", architecture: "arm64" } },
        { digest: amd, size: 1, platform: { os: "linux", architecture: "amd64" } },
      ],
    };
    expect(manifestSize(JSON.stringify(index))).toEqual({ platform: amd });
    const arm = { manifests: [index.manifests[0]] };
    expect(() => manifestSize(JSON.stringify(arm))).toThrow(/no linux\/amd64 variant/);
  });
  test("a blob without a size, or no layers at all, is a bad manifest", () => {
    expect(() => manifestSize(JSON.stringify({ config: d(1), layers: [{ digest: "x" }] }))).toThrow(
      /no size/,
    );
    expect(() => manifestSize(JSON.stringify({ config: d(-1), layers: [] }))).toThrow(/no size/);
    expect(() => manifestSize(JSON.stringify({ schemaVersion: 1, fsLayers: [] }))).toThrow(/lists no layers/);
  });
  test("the cap is a setting", () => {
    expect(registryConfigFromEnv({}).maxPullBytes).toBeUndefined();
    expect(registryConfigFromEnv({ SANDBOXD_PULL_MAX_BYTES: "1000" }).maxPullBytes).toBe(1000);
    expect(() => registryConfigFromEnv({ SANDBOXD_PULL_MAX_BYTES: "1k" })).toThrow(/byte count/);
  });
});

describe.skipIf(!existsSync(REGISTRY_BIN))("pull from a real registry on loopback", () => {
  let reg: LocalRegistry;
  let work: string;
  beforeAll(async () => {
    work = await mkdtemp(join(tmpdir(), "sbx-pull-"));
    reg = await startRegistry();
    const archive = join(work, "bb.tar");
    await makeOciArchive(archive, await busyboxImageSpec(work));
    await reg.push(`oci-archive:${archive}`, "bb:1");
  }, 120_000);
  afterAll(async () => {
    await reg?.stop();
    if (work) await rm(work, { recursive: true, force: true });
  });

  test("first pull fetches into the cache by digest; the same digest again fetches nothing", async () => {
    const cacheDir = join(work, "cache");
    const first = await pullImage({ reference: `${reg.host}/bb:1`, cacheDir, registry: NO_CONFIG });
    expect(first.cached).toBe(false);
    expect(first.digest).toMatch(/^sha256:[a-f0-9]{64}$/);
    // Keyed by repository and digest: the registry's permission is per repository.
    expect(first.layout).toBe(join(cacheDir, "images", "pulled", pulledKey(`${reg.host}/bb`, first.digest)));
    expect(existsSync(join(first.layout, "index.json"))).toBe(true);
    expect(await readdir(join(cacheDir, "tmp"))).toEqual([]); // the work dir is gone
    const blobGets = () => (reg.log().match(/"GET \/v2\/bb\/blobs\//g) ?? []).length;
    const before = blobGets();
    expect(before).toBeGreaterThan(0);
    const again = await pullImage({ reference: `${reg.host}/bb:1`, cacheDir, registry: NO_CONFIG });
    expect(again).toMatchObject({ cached: true, digest: first.digest, layout: first.layout });
    // By digest: the registry is still asked for the manifest (it authorizes every use of the
    // cache), and still no blob is fetched.
    const manifestGets = () => (reg.log().match(/"GET \/v2\/bb\/manifests\/sha256:/g) ?? []).length;
    const manifestsBefore = manifestGets();
    const pinned = await pullImage({
      reference: `${reg.host}/bb@${first.digest}`,
      cacheDir,
      registry: NO_CONFIG,
    });
    expect(pinned.cached).toBe(true);
    await reg.settled();
    expect(blobGets()).toBe(before);
    expect(manifestGets()).toBeGreaterThan(manifestsBefore);
    console.log(
      JSON.stringify({
        pull_ms: Math.round(first.pullMs),
        cached_pull_ms: Math.round(again.pullMs),
        cached_pinned_pull_ms: Math.round(pinned.pullMs),
      }),
    );
  }, 120_000);

  test("an image over the pull cap is refused before a blob is fetched; too little disk is 507", async () => {
    const cacheDir = join(work, "cache-cap");
    const blobGets = () => (reg.log().match(/"GET \/v2\/bb\/blobs\//g) ?? []).length;
    const before = blobGets();
    const refused = (o: Parameters<typeof pullImage>[0]) =>
      pullImage(o).then(
        () => {
          throw new Error("the pull succeeded");
        },
        (e) => e as SandboxdError,
      );
    const big = await refused({
      reference: `${reg.host}/bb:1`,
      cacheDir,
      registry: { ...NO_CONFIG, maxPullBytes: 1000 },
    });
    expect(big.code).toBe("image_pull_failed");
    expect(big.details?.reason).toBe("image_too_large");
    expect(big.message).toMatch(/over the 1000-byte pull limit/);
    const full = await refused({
      reference: `${reg.host}/bb:1`,
      cacheDir,
      registry: NO_CONFIG,
      diskReserveBytes: 2 ** 50,
    });
    expect(full.code).toBe("insufficient_storage");
    await reg.settled();
    expect(blobGets()).toBe(before);
    expect(existsSync(join(cacheDir, "images", "pulled"))).toBe(false);
    expect(await readdir(join(cacheDir, "tmp"))).toEqual([]);
  }, 60_000);

  test("an unknown tag, an unknown repository and a bad reference are readable errors", async () => {
    const cacheDir = join(work, "cache2");
    const err = async (reference: string) => {
      try {
        await pullImage({ reference, cacheDir, registry: NO_CONFIG });
      } catch (e) {
        return e as SandboxdError;
      }
      throw new Error(`pull of ${reference} succeeded`);
    };
    const tag = await err(`${reg.host}/bb:nope`);
    expect(tag.code).toBe("image_pull_failed");
    expect(tag.message).toContain(`looking up ${reg.host}/bb:nope failed`);
    expect(tag.message).toMatch(/manifest unknown/);
    expect(tag.details?.reason).toBe("image_not_found");
    // What the tenant reads: their reference and a reason; no skopeo log line, no host path.
    expect(tag.message).not.toMatch(/level=|msg=|time=|\/tmp|\/var/);
    expect(tag.message).not.toContain(work);
    const repo = await err(`${reg.host}/missing/repo:1`);
    expect(repo.code).toBe("image_pull_failed");
    expect(repo.message).toMatch(/unknown|not found/i);
    const bad = await err("--src-creds=a:b");
    expect(bad.code).toBe("bad_request");
    // A missing credentials file is named (to the agent's log), before skopeo runs; only a
    // shared registry reads it.
    try {
      await pullImage({
        reference: `${reg.host}/bb:1`,
        cacheDir,
        registry: {
          insecureRegistries: [],
          sharedRegistries: [reg.host],
          authFile: join(work, "no-such-auth.json"),
        },
      });
      throw new Error("pull succeeded");
    } catch (e) {
      expect((e as SandboxdError).message).toContain("no-such-auth.json");
    }
    expect(existsSync(join(cacheDir, "images", "pulled"))).toBe(false);
  }, 120_000);
});

describe.skipIf(!existsSync(REGISTRY_BIN))("a private registry: caches never cross tenants", () => {
  const OWNER = { username: "tenant-a", password: "s3cret-of-a" };
  let reg: LocalRegistry;
  let work: string;
  let cacheDir: string;
  let digest: string;
  beforeAll(async () => {
    work = await mkdtemp(join(tmpdir(), "sbx-pull-private-"));
    cacheDir = join(work, "cache");
    reg = await startRegistry({ auth: OWNER });
    const archive = join(work, "bb.tar");
    await makeOciArchive(archive, await busyboxImageSpec(work));
    await reg.push(`oci-archive:${archive}`, "private/app:1");
  }, 120_000);
  afterAll(async () => {
    await reg?.stop();
    if (work) await rm(work, { recursive: true, force: true });
  });
  const blobGets = () => (reg.log().match(/"GET \/v2\/private\/app\/blobs\//g) ?? []).length;
  const refused = async (o: Parameters<typeof pullImage>[0]) => {
    try {
      await pullImage(o);
    } catch (e) {
      return e as SandboxdError;
    }
    throw new Error(`pull of ${o.reference} succeeded`);
  };

  test("the owner's credentials pull; the same digest without them is refused and served nothing", async () => {
    const a = await pullImage({
      reference: `${reg.host}/private/app:1`,
      cacheDir,
      registry: NO_CONFIG,
      auth: OWNER,
    });
    expect(a.cached).toBe(false);
    digest = a.digest;
    const blobs = blobGets();
    const pinned = `${reg.host}/private/app@${digest}`;
    // Another tenant who knows the digest: anonymous, then with wrong credentials.
    for (const auth of [
      undefined,
      { username: "tenant-b", password: "guess" },
      { ...OWNER, password: "nope" },
    ]) {
      const e = await refused({
        reference: pinned,
        cacheDir,
        registry: NO_CONFIG,
        ...(auth ? { auth } : {}),
      });
      expect(e.code).toBe("image_pull_failed");
      expect(e.details?.reason).toBe("registry_denied");
      expect(e.message).toBe(
        `looking up ${pinned} failed: the registry refused the credentials or access to the image`,
      );
    }
    // Host-wide credentials do not help for a registry the operator does not share.
    const hostAuth = join(work, "host-auth.json");
    await writeFile(
      hostAuth,
      JSON.stringify({
        auths: {
          [reg.host]: { auth: Buffer.from(`${OWNER.username}:${OWNER.password}`).toString("base64") },
        },
      }),
    );
    const unshared = await refused({
      reference: pinned,
      cacheDir,
      registry: { insecureRegistries: [], authFile: hostAuth },
    });
    expect(unshared.details?.reason).toBe("registry_denied");
    await reg.settled();
    expect(blobGets()).toBe(blobs); // nothing was fetched for the refused callers...
    // ...and the owner's layout is still the only one: nothing was copied for them either.
    expect(await readdir(join(cacheDir, "images", "pulled"))).toEqual([
      pulledKey(`${reg.host}/private/app`, digest),
    ]);
    expect(await readdir(join(cacheDir, "tmp"))).toEqual([]);

    // The owner's re-bake (by tag and by digest) is served from the cache: no blob fetched.
    const again = await pullImage({
      reference: `${reg.host}/private/app:1`,
      cacheDir,
      registry: NO_CONFIG,
      auth: OWNER,
    });
    const byDigest = await pullImage({ reference: pinned, cacheDir, registry: NO_CONFIG, auth: OWNER });
    expect(again).toMatchObject({ cached: true, digest, layout: a.layout });
    expect(byDigest).toMatchObject({ cached: true, digest, layout: a.layout });
    // The operator's credentials apply once the operator shares the registry.
    const shared = await pullImage({
      reference: pinned,
      cacheDir,
      registry: { insecureRegistries: [], sharedRegistries: [reg.host], authFile: hostAuth },
    });
    expect(shared.cached).toBe(true);
    await reg.settled();
    expect(blobGets()).toBe(blobs);
    console.log(
      JSON.stringify({
        private_pull_ms: Math.round(a.pullMs),
        authorized_cached_pull_ms: Math.round(again.pullMs),
        authorized_cached_pinned_pull_ms: Math.round(byDigest.pullMs),
      }),
    );
  }, 120_000);

  test("credentials never reach argv or the log", async () => {
    const lines: string[] = [];
    await pullImage({
      reference: `${reg.host}/private/app:1`,
      cacheDir,
      registry: NO_CONFIG,
      auth: OWNER,
      log: (l) => lines.push(l),
    });
    const b64 = Buffer.from(`${OWNER.username}:${OWNER.password}`).toString("base64");
    expect(lines.some((l) => l.includes("skopeo"))).toBe(true);
    for (const l of lines) {
      expect(l).not.toContain(OWNER.password);
      expect(l).not.toContain(b64);
    }
  }, 60_000);

  test("a registry address the egress fence refuses is never contacted", async () => {
    const before = reg.log().length;
    const e = await refused({
      reference: `${reg.host}/private/app:1`,
      cacheDir,
      auth: OWNER,
      registry: {
        insecureRegistries: [],
        checkDestination: (host, port) => {
          throw new Error(`refused ${host}:${port}`);
        },
      },
    });
    expect(e.details?.reason).toBe("registry_forbidden");
    expect(e.message).not.toContain("refused 127"); // the fence's own words go to the log only
    // Not one request reached the registry: its log since holds the marker's lines only.
    const mark = await reg.settled();
    const requests = reg
      .log()
      .slice(before)
      .split("\n")
      .filter((l) => l.includes("/v2/") && !l.includes(mark));
    expect(requests).toEqual([]);
  });
});

describe.skipIf(!Bun.which("skopeo"))("a registry that never answers", () => {
  // Accepts connections and says nothing: skopeo waits until our deadline or our cancel.
  let server: Server;
  let host: string;
  let work: string;
  beforeAll(async () => {
    work = await mkdtemp(join(tmpdir(), "sbx-pull-silent-"));
    server = createServer(() => {});
    await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
    host = `127.0.0.1:${(server.address() as AddressInfo).port}`;
  });
  afterAll(async () => {
    server?.close();
    if (work) await rm(work, { recursive: true, force: true });
  });

  test("the inspect deadline ends the pull with image_pull_failed", async () => {
    const started = performance.now();
    try {
      await pullImage({
        reference: `${host}/bb:1`,
        cacheDir: join(work, "cache"),
        registry: NO_CONFIG,
        inspectTimeoutMs: 1000,
      });
      throw new Error("pull succeeded");
    } catch (e) {
      expect((e as SandboxdError).code).toBe("image_pull_failed");
      expect((e as SandboxdError).message).toBe(`looking up ${host}/bb:1: no answer within 1 s`);
    }
    // Only catches a hang: the silent registry never answers; the 1 s deadline ends the pull.
    expect(performance.now() - started).toBeLessThan(15_000);
  });

  test("an abort ends the pull with gone", async () => {
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 300);
    try {
      await pullImage({
        reference: `${host}/bb:1`,
        cacheDir: join(work, "cache"),
        registry: NO_CONFIG,
        signal: ac.signal,
      });
      throw new Error("pull succeeded");
    } catch (e) {
      expect((e as SandboxdError).code).toBe("gone");
      expect((e as SandboxdError).message).toBe(`looking up ${host}/bb:1: cancelled`);
    }
  });
});
