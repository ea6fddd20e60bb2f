/**
 * End to end over real HTTP with real VMs: files in exec (both APIs), `wait_secs`, and the
 * upload bounds the gateway shares with the agent. The real service (`bin/sandboxd up
 * --no-catalog` as a subprocess), keys made in-process through its operator socket, a busybox image uploaded
 * as a sessions API template, VMs under TCG.
 *
 * - A 5 MiB text file and binary (base64) files arrive byte-exact: sha256 computed in the guest.
 * - A file the guest refuses (a path through a regular file, the sandbox's disk full mid-stream)
 *   is 400 `invalid_file` with the reason; the refused file leaves nothing half-written, the files
 *   before it stay, nothing after it runs.
 * - `wait_secs` bounds the build's bring-up: 1 s fails a build under TCG (a cold boot takes
 *   seconds), a generous one builds.
 * - `mem_mib` 65,537 on an upload is 400 before the body is read: the answer comes while almost
 *   all of a declared 1 GiB body is still unsent, and no upload file is made.
 *
 * Tests run in order and share one service; the last one stops it and checks no QEMU is left.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { createHash, randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdtemp, readdir, rm } from "node:fs/promises";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { MAX_MEM_MIB } from "../../contracts/api/limits.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { expectError, expectOk } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** A handful of VMs per test (~1-3 s each under TCG) and a few MiB through the guest channel. */
const TEST_TIMEOUT_MS = 240_000;
/** The busybox image archive, made once `up` runs. */
const SETUP_TIMEOUT_MS = 120_000;
/** A template build (import + boot + freeze) on a loaded TCG host. */
const BUILD_WAIT_MS = 180_000;
const TEMPLATE = "e2e-files";

let imgDir = "";
let image: Uint8Array;
const liveSessions = new Set<string>();
const liveSandboxes = new Set<string>();
const liveTemplates = new Set<string>();

afterAll(async () => {
  if (imgDir) await rm(imgDir, { recursive: true, force: true });
});

// Guest artifacts only (no python catalog): `up --no-catalog` builds nothing at start.
const fx = useService({
  prefix: "sbx-e2e-files-",
  python: false,
  keys: {
    live: ["acme", "live"],
    scale: ["acme", "scale"],
    pro: ["acme", "pro"],
  },
});

// Before the fixture stops `up`: what the tests made goes while `up` still runs.
fx.beforeStop(async () => {
  if (!keys || !fx.running) return; // the last test deleted everything and stopped `up`
  for (const id of liveSessions)
    await fx.api.delete(`/v1/sessions/${id}`, { key: keys.live, query: { force: "true" } }).catch(() => {});
  for (const id of liveSandboxes)
    await fx.api.delete(`/v1/sandboxes/${id}`, { key: keys.pro, query: { force: "true" } }).catch(() => {});
  for (const id of liveTemplates)
    await fx.api.delete(`/v1/templates/${id}`, { key: keys.scale }).catch(() => {});
});

let keys: Record<"live" | "scale" | "pro", string>;
const service = () => fx.svc;

const api = () => service().api;
const sha256 = (b: Uint8Array | string) => createHash("sha256").update(b).digest("hex");

beforeAll(async () => {
  keys = fx.keys;
  imgDir = await mkdtemp(join(tmpdir(), "sbx-e2e-files-img-"));
  const archive = await makeDockerArchive(join(imgDir, "busybox.tar"), await busyboxImageSpec(imgDir));
  image = new Uint8Array(await Bun.file(archive.path).arrayBuffer());
}, SETUP_TIMEOUT_MS);

function upload(id: string, query: Record<string, string> = {}) {
  return api().post("/v1/templates", {
    key: keys.scale,
    query: { id, ...query },
    raw: image,
    headers: { "content-type": "application/octet-stream" },
  });
}

/** Polls the template until it leaves `building`. */
async function settled(id: string): Promise<A.TemplateA> {
  let t: A.TemplateA = { id, status: "building" };
  const deadline = performance.now() + BUILD_WAIT_MS;
  while (t.status === "building" && performance.now() < deadline) {
    await Bun.sleep(250);
    t = expectOk(await api().get(`/v1/templates/${id}`, { key: keys.scale }), 200, A.TemplateA);
  }
  return t;
}

async function sessionExec(id: string, body: Record<string, unknown>) {
  return api().post(`/v1/sessions/${id}/exec`, { key: keys.live, json: body, timeoutMs: 180_000 });
}

function errorMessage(res: { body: unknown }): string {
  return (res.body as { message?: string } | undefined)?.message ?? "";
}

/**
 * `POST /v1/templates?QUERY` over a raw socket declaring a 1 GiB body, of which `bodyBytes` are
 * sent and the rest never: what comes back first (a status line and, for an error, its JSON).
 */
async function rawUpload(
  query: string,
  o: { expectContinue: boolean; bodyBytes: number },
): Promise<{ head: string; body: { code: string; message: string }; ms: number }> {
  const url = new URL(service().url);
  const t0 = performance.now();
  const text = await new Promise<string>((resolve, reject) => {
    const sock = connect({ host: url.hostname, port: Number(url.port) });
    let got = "";
    const timer = setTimeout(() => {
      sock.destroy();
      reject(new Error(`no answer within 30 s with the body unsent; got ${JSON.stringify(got)}`));
    }, 30_000);
    const done = () => {
      clearTimeout(timer);
      sock.destroy();
      resolve(got);
    };
    sock.on("data", (b) => {
      got += b.toString("latin1");
      if (/\r\n\r\n[\s\S]*\}/.test(got)) done();
    });
    sock.on("error", (err) => {
      clearTimeout(timer);
      reject(err);
    });
    sock.on("connect", () => {
      const head = [
        `POST /v1/templates?${query} HTTP/1.1`,
        `Host: ${url.host}`,
        `Authorization: Bearer ${keys.scale}`,
        "Content-Type: application/octet-stream",
        `Content-Length: ${1024 ** 3}`,
        ...(o.expectContinue ? ["Expect: 100-continue"] : []),
      ];
      sock.write(`${head.join("\r\n")}\r\n\r\n`);
      if (o.bodyBytes > 0) sock.write(Buffer.alloc(o.bodyBytes, 1));
    });
  });
  // An interim `100 Continue` (if the server sends one) is not the answer.
  const final = text.replace(/^(HTTP\/1\.1 100 [^\r]*\r\n\r\n)+/, "");
  const split = final.indexOf("\r\n\r\n");
  const rest = final.slice(split + 4);
  const json = rest.slice(rest.indexOf("{"), rest.lastIndexOf("}") + 1);
  return {
    head: final.slice(0, split),
    body: json ? (JSON.parse(json) as { code: string; message: string }) : { code: "", message: "" },
    ms: Math.round(performance.now() - t0),
  };
}

describe("upload bounds and wait_secs", () => {
  test(
    "mem_mib 65,537 is 400 before the body is read: with Expect: 100-continue no body byte is ever sent",
    async () => {
      const over = MAX_MEM_MIB + 1;
      // curl's way for a large body: headers with `Expect: 100-continue`, then wait. The gateway
      // answers from the query alone (it never drains a body the client holds back).
      const early = await rawUpload(`id=too-big&mem_mib=${over}`, { expectContinue: true, bodyBytes: 0 });
      // Without it the client starts sending: the answer still comes while almost all of the
      // declared 1 GiB is unsent (after the gateway's bounded lingering drain,
      // gateway/runtime/early-answer.ts), with `Connection: close`.
      const sending = await rawUpload(`id=too-big&mem_mib=${over}`, {
        expectContinue: false,
        bodyBytes: 64 * 1024,
      });
      console.log(
        JSON.stringify({ memMibRefusedMs: { expectContinue: early.ms, bodySent64KiB: sending.ms } }),
      );
      for (const a of [early, sending]) {
        expect(a.head).toMatch(/^HTTP\/1\.1 400 /);
        expect(a.body.code).toBe("bad_request");
        expect(a.body.message).toContain("mem_mib");
      }
      expect(sending.head.toLowerCase()).toContain("connection: close");
      // No upload was started: nothing staged, no template row.
      const staged = existsSync(join(fx.dataDir, "uploads"))
        ? await readdir(join(fx.dataDir, "uploads"), { recursive: true })
        : [];
      expect(staged.filter((f) => String(f).includes("too-big"))).toEqual([]);
      expectError(await api().get("/v1/templates/too-big", { key: keys.scale }), 404, "not_found");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "wait_secs bounds the build's bring-up: 1 s fails the build (bringup_timeout), 600 s builds",
    async () => {
      // Both builds at once: they share the agent's two build slots.
      expect(
        expectOk(await upload("e2e-wait-1", { wait_secs: "1" }), 202, A.RegisterTemplateResponse).status,
      ).toBe("building");
      liveTemplates.add("e2e-wait-1");
      expect(
        expectOk(await upload(TEMPLATE, { wait_secs: "600" }), 202, A.RegisterTemplateResponse).status,
      ).toBe("building");
      liveTemplates.add(TEMPLATE);
      const [short, long] = await Promise.all([settled("e2e-wait-1"), settled(TEMPLATE)]);
      expect(long.status).toBe("ready");
      // A cold boot under TCG takes seconds (docs/measured-hosts.md); under KVM it may fit in 1 s.
      if (/\(kvm\)/.test(service().logTail(400))) {
        console.warn("KVM host: a 1 s bring-up may succeed; the failing case is not asserted");
      } else {
        expect(short.status).toBe("failed");
        expect(short.error).toStartWith("bringup_timeout: ");
        expect(short.error).toContain("wait_secs");
      }
      expect((await api().delete("/v1/templates/e2e-wait-1", { key: keys.scale })).status).toBe(204);
      liveTemplates.delete("e2e-wait-1");
    },
    TEST_TIMEOUT_MS,
  );
});

describe("files in exec", () => {
  test(
    "Sessions API: a 5 MiB file and binary base64 files arrive byte-exact (sha256 in the guest)",
    async () => {
      const created = expectOk(
        await api().post("/v1/sessions", { key: keys.live, json: { template_id: TEMPLATE } }),
        201,
        A.CreateSessionResponse,
      );
      const id = created.session_id;
      liveSessions.add(id);
      // 5 MiB of text: streamed to the guest in chunks (over one guest frame).
      const text = randomBytes((5 * 1024 * 1024) / 2).toString("hex");
      let res = await sessionExec(id, {
        files: [{ path: "/root/big.txt", content: text }],
        commands: [["sh", "-c", "sha256sum /root/big.txt; stat -c %s /root/big.txt"]],
      });
      let r = expectOk(res, 200, A.ExecResultA);
      expect(r.stdout).toBe(`${sha256(text)}  /root/big.txt\n${text.length}\n`);
      // Binary: every byte value (one frame) and 2 MiB of random bytes (streamed), as base64.
      const allBytes = Buffer.from(Array.from({ length: 256 }, (_, i) => i));
      const random = randomBytes(2 * 1024 * 1024 + 3);
      res = await sessionExec(id, {
        files: [
          { path: "/root/all.bin", content: allBytes.toString("base64"), encoding: "base64" },
          { path: "bin/random.bin", content: random.toString("base64"), encoding: "base64" },
          { path: "/root/plain.txt", content: "héllo\n", encoding: "utf8" },
        ],
        commands: [
          [
            "sh",
            "-c",
            "sha256sum /root/all.bin /app/bin/random.bin /root/plain.txt; ls -A /root; ls -A /app/bin",
          ],
        ],
      });
      r = expectOk(res, 200, A.ExecResultA);
      // `ls -A` shows dot files too: no temp file is left beside a written one.
      expect(r.stdout).toBe(
        [
          `${sha256(allBytes)}  /root/all.bin`,
          `${sha256(random)}  /app/bin/random.bin`, // a relative path is from the image's WorkingDir
          `${sha256("héllo\n")}  /root/plain.txt`,
          "all.bin",
          "big.txt",
          "plain.txt",
          "random.bin",
          "",
        ].join("\n"),
      );
      // Bad base64 is refused by the schema before anything is written.
      expectError(
        await sessionExec(id, {
          files: [{ path: "/root/x.bin", content: "not base64!", encoding: "base64" }],
        }),
        400,
        "bad_request",
      );
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "Sessions API: a refused file is 400 invalid_file with the reason; nothing half-written, nothing after it runs",
    async () => {
      const id = [...liveSessions][0]!;
      // A path through a regular file: refused before any content is written.
      let res = await sessionExec(id, {
        files: [
          { path: "/root/first.txt", content: "first" },
          { path: "/app/hello.txt/inside", content: "x" },
          { path: "/root/third.txt", content: "third" },
        ],
        commands: [["touch", "/root/ran"]],
      });
      expectError(res, 400, "invalid_file");
      expect(errorMessage(res)).toContain("files[1] (/app/hello.txt/inside)");
      expect(errorMessage(res)).toContain("Not a directory");
      // The sandbox's disk full halfway through a streamed file: a 1 MiB tmpfs and 3 MiB of content.
      let r = expectOk(
        await sessionExec(id, {
          commands: [
            [
              "sh",
              "-c",
              "mkdir -p /mnt/small && mount -t tmpfs -o size=1m tmpfs /mnt/small && printf old > /mnt/small/keep",
            ],
          ],
        }),
        200,
        A.ExecResultA,
      );
      expect(r.exit_code).toBe(0);
      res = await sessionExec(id, {
        files: [{ path: "/mnt/small/keep", content: "y".repeat(3 * 1024 * 1024) }],
        commands: [["touch", "/root/ran"]],
      });
      expectError(res, 400, "invalid_file");
      expect(errorMessage(res)).toContain("files[0] (/mnt/small/keep)");
      expect(errorMessage(res)).toContain("No space left on device");
      // What stayed: the file before the refused one; the old file intact, no temp file; no command ran.
      r = expectOk(
        await sessionExec(id, {
          commands: [
            [
              "sh",
              "-c",
              "cat /root/first.txt; echo; ls -A /mnt/small; cat /mnt/small/keep; echo; ls /root/third.txt /root/ran 2>&1 | wc -l; df -k /mnt/small | tail -1 | awk '{print $3}'",
            ],
          ],
        }),
        200,
        A.ExecResultA,
      );
      const [first, listing, keep, missing, usedKb] = r.stdout.trimEnd().split("\n");
      expect({ first, listing, keep, missing }).toEqual({
        first: "first",
        listing: "keep",
        keep: "old",
        missing: "2",
      });
      expect(Number(usedKb)).toBeLessThan(16); // the partial temp file's blocks were freed
      expect(r.stdout).not.toContain("sbx-tmp");
      expect((await api().delete(`/v1/sessions/${id}`, { key: keys.live })).status).toBe(204);
      liveSessions.delete(id);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "sandboxes API: a binary base64 file is byte-exact, a refused one is 400 invalid_file",
    async () => {
      const sb = expectOk(
        await api().post("/v1/sandboxes", { key: keys.pro, json: { template: TEMPLATE } }),
        201,
        B.CreateSandboxResponse,
      );
      liveSandboxes.add(sb.id);
      const bytes = randomBytes(1536 * 1024);
      let res = await api().post(`/v1/sandboxes/${sb.id}/exec`, {
        key: keys.pro,
        json: {
          files: [{ path: "/tmp/b.bin", content: bytes.toString("base64"), encoding: "base64" }],
          command: "sha256sum /tmp/b.bin",
        },
        timeoutMs: 180_000,
      });
      const r = expectOk(res, 200, B.ExecResponseB);
      expect(r.stdout).toBe(`${sha256(bytes)}  /tmp/b.bin\n`);
      res = await api().post(`/v1/sandboxes/${sb.id}/exec`, {
        key: keys.pro,
        json: { files: [{ path: "/tmp", content: "x" }], command: "true" }, // a directory is there
        timeoutMs: 180_000,
      });
      expectError(res, 400, "invalid_file");
      expect(errorMessage(res)).toContain("files[0] (/tmp)");
      expect(errorMessage(res)).toContain("Is a directory");
      expect((await api().delete(`/v1/sandboxes/${sb.id}`, { key: keys.pro })).status).toBe(200);
      liveSandboxes.delete(sb.id);
    },
    TEST_TIMEOUT_MS,
  );
});

test(
  "stopping the service leaves no QEMU",
  async () => {
    const s = service();
    for (const id of liveTemplates) await s.api.delete(`/v1/templates/${id}`, { key: keys.scale });
    liveTemplates.clear();
    const { exit, qemus } = await fx.stop();
    expect(exit).toBe(0);
    expect(qemus).toEqual([]);
  },
  TEST_TIMEOUT_MS,
);
