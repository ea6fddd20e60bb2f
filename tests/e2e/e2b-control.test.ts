/**
 * E2B's control plane in a running service (`bin/sandboxd up`, real VMs of the python catalog
 * template, a Debian minbase with bash) driven by E2B's SDK, unmodified (`e2b` 2.45.0): create
 * with metadata and a timeout, getInfo, list with a metadata filter and paging, setTimeout, pause
 * and connect (the resume of a real suspended VM), kill; unknown and other tenants' ids are
 * SandboxNotFoundError, an unknown key AuthenticationError. The rules in detail, with the
 * in-memory agent: tests/integration/e2b-control.test.ts.
 */
import { beforeAll, expect, test } from "bun:test";
import { AuthenticationError, Sandbox, SandboxNotFoundError } from "e2b";
import { E2B_ENVD_VERSION, e2bKeyOf } from "../../contracts/e2b/ids.ts";
import { useService } from "../support/service.ts";

/** A template with /bin/bash until a `base` template lands (the SDK's default). */
const TEMPLATE = "python";
/** Creates, a suspend to disk and a resume under TCG on a loaded 2-core host: a minute each at most. */
const TEST_TIMEOUT_MS = 300_000;

const fx = useService({ keys: { pro: ["acme", "pro"], other: ["globex", "pro"] } });
let apiUrl = "";
const opts = (key = fx.keys.pro) => ({ apiKey: e2bKeyOf(key) });
beforeAll(() => {
  apiUrl = `${fx.svc.url}/e2b`;
  // How E2B's users point the SDK elsewhere.
  process.env.E2B_API_URL = apiUrl;
});

async function create(metadata: Record<string, string>, timeoutMs = 120_000): Promise<Sandbox> {
  const sbx = await Sandbox.create(TEMPLATE, { ...opts(), metadata, timeoutMs });
  fx.cleanup(() => Sandbox.kill(sbx.sandboxId, opts()));
  return sbx;
}

test(
  "create, getInfo, list by metadata in pages, setTimeout, pause and connect, kill",
  async () => {
    const a = await create({ suite: "e2b", n: "0" });
    const b = await create({ suite: "e2b", n: "1" });
    const info = await a.getInfo();
    expect(info).toMatchObject({
      sandboxId: a.sandboxId,
      templateId: TEMPLATE,
      metadata: { suite: "e2b", n: "0" },
      state: "running",
      envdVersion: E2B_ENVD_VERSION,
    });
    expect(info.cpuCount).toBeGreaterThan(0);
    expect(info.memoryMB).toBeGreaterThan(0);
    expect(info.endAt.getTime()).toBeGreaterThan(Date.now());

    const pager = Sandbox.list({ ...opts(), query: { metadata: { suite: "e2b" } }, limit: 1 });
    const seen: string[] = [];
    while (pager.hasNext) seen.push(...(await pager.nextItems()).map((s) => s.sandboxId));
    expect(seen).toEqual([a.sandboxId, b.sandboxId]);
    expect(await Sandbox.list({ ...opts(fx.keys.other) }).nextItems()).toEqual([]);

    await a.setTimeout(600_000);
    expect((await a.getInfo()).endAt.getTime() - Date.now()).toBeGreaterThan(500_000);

    expect(await a.pause()).toBe(true);
    expect((await a.getInfo()).state).toBe("paused");
    expect(await a.pause()).toBe(false);
    const back = await Sandbox.connect(a.sandboxId, { ...opts(), timeoutMs: 300_000 });
    expect(back.sandboxId).toBe(a.sandboxId);
    const after = await back.getInfo();
    expect(after.state).toBe("running");
    expect(after.metadata).toEqual({ suite: "e2b", n: "0" });

    expect(await b.kill()).toBe(true);
    expect(await Sandbox.kill(b.sandboxId, opts())).toBe(false);
    await expect(Sandbox.getInfo(b.sandboxId, opts())).rejects.toBeInstanceOf(SandboxNotFoundError);
    const left = await Sandbox.list({ ...opts(), query: { metadata: { suite: "e2b" } } }).nextItems();
    expect(left.map((s) => s.sandboxId)).toEqual([a.sandboxId]);
  },
  TEST_TIMEOUT_MS,
);

test(
  "another tenant's id and unknown ids are SandboxNotFoundError; an unknown key AuthenticationError",
  async () => {
    const mine = await create({ suite: "e2b-ids" });
    await expect(Sandbox.getInfo(mine.sandboxId, opts(fx.keys.other))).rejects.toBeInstanceOf(
      SandboxNotFoundError,
    );
    expect(await Sandbox.kill(mine.sandboxId, opts(fx.keys.other))).toBe(false);
    await expect(Sandbox.connect("zzzzzzzzzzzzzzzzzzzz", opts())).rejects.toBeInstanceOf(
      SandboxNotFoundError,
    );
    await expect(Sandbox.getInfo("Not_An-Id", opts())).rejects.toBeInstanceOf(SandboxNotFoundError);
    expect((await mine.getInfo()).state).toBe("running");
    await expect(
      Sandbox.create(TEMPLATE, { apiKey: e2bKeyOf("svc_pro_nosuchkey000_x") }),
    ).rejects.toBeInstanceOf(AuthenticationError);
  },
  TEST_TIMEOUT_MS,
);

test(
  "the sandbox's own envs reach every command under the command's own, and outlive a pause",
  async () => {
    const sandboxUrl = `${fx.svc.url}/e2b/envd`;
    const sbx = await Sandbox.create(TEMPLATE, {
      ...opts(),
      sandboxUrl,
      envs: { FOO: "bar", BOTH: "sandbox" },
      timeoutMs: 120_000,
    });
    fx.cleanup(() => Sandbox.kill(sbx.sandboxId, opts()));
    const run = async (s: Sandbox, cmd: string, envs?: Record<string, string>) =>
      (await s.commands.run(cmd, envs ? { envs } : {})).stdout.trim();
    expect(await run(sbx, "echo $FOO-$BOTH")).toBe("bar-sandbox");
    expect(await run(sbx, "echo $FOO-$BOTH", { BOTH: "call" })).toBe("bar-call");
    // Kept in the sandbox, root's alone: not a file its user reads or replaces.
    expect(await run(sbx, "stat -c %U:%a /etc/sandboxd/e2b-envs.json")).toMatch(/^root:/);
    expect(await sbx.pause()).toBe(true);
    const back = await Sandbox.connect(sbx.sandboxId, { ...opts(), sandboxUrl });
    expect(await run(back, "echo $FOO")).toBe("bar");
    // A sandbox made without envs has none of another's.
    const plain = await Sandbox.create(TEMPLATE, { ...opts(), sandboxUrl, timeoutMs: 120_000 });
    fx.cleanup(() => Sandbox.kill(plain.sandboxId, opts()));
    expect(await run(plain, "echo x$FOO")).toBe("x");
  },
  TEST_TIMEOUT_MS,
);

test("every sandbox killed through E2B's API is gone: no QEMU, no VM directory", async () => {
  await fx.expectNoVms();
});
