/**
 * The web console (`/console`) in a real Chromium (Debian's /usr/bin/chromium driven by
 * Playwright) against the real service (`bin/sandboxd up`, real VMs under TCG, a busybox
 * template): the page's files carry a strict Content-Security-Policy; a Pro key entered once
 * shows the tenant's two sandboxes with their states, the usage chart by day and the template's
 * bake phases; a label holding markup renders as text (no element, no script); a terminal typed
 * into with `echo $((6*7))` shows `42` in the xterm screen; the Fork and Delete buttons fork one
 * sandbox and delete the other (checked through the API after); a bake started while the page is
 * open shows its phase and is followed to Live; a snapshot taken with the Snapshot button is
 * listed, the sandbox is rolled back to it with Restore… (a file written after it reads as before),
 * a new sandbox is started from it and it is deleted; a sessions API key is told what it can see. The pty WebSocket's key-as-subprotocol (what the page uses) is checked directly too:
 * the server answers with the marker, never the key, and refuses a wrong key or a key offered
 * first with 401 before the upgrade. Screenshots go to `.data/test-artifacts/console/` (kept by
 * the run, paths printed).
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdir, mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { Browser, Page } from "playwright-core";
import WebSocket from "ws";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { CONSOLE_CSP } from "../../gateway/routes/console.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { CHROMIUM_FLAGS, CHROMIUM_PATH } from "../support/chromium.ts";
import { expectOk, REPO, uploadTemplate } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** One template build (import, boot, snapshot: ~10-60 s under TCG) once `up` runs. */
const SETUP_TIMEOUT_MS = 240_000;
/** A template build: the image import, one boot and the snapshot; generous for a loaded host. */
const BUILD_TIMEOUT_MS = 180_000;
/** The browser test: a Chromium start, a page, a terminal, a fork (one VM) and a delete. */
const TEST_TIMEOUT_MS = 300_000;
/** A harness wait for the page to show what the API answered (a loaded host, an emulated guest). */
const UI_WAIT_MS = 60_000;
const TEMPLATE = "console";
/** Baked while the page is open, from the same image. */
const SECOND_TEMPLATE = "console-2";
const XSS_LABEL = `<img src=x onerror="window.__xss=1">`;
const ARTIFACTS = join(REPO, ".data", "test-artifacts", "console");

let imgDir = "";
let image = new Uint8Array();
const ids: string[] = [];

afterAll(async () => {
  if (imgDir) await rm(imgDir, { recursive: true, force: true });
});

const fx = useService({
  prefix: "sbx-e2e-console-",
  python: false,
  keys: {
    pro: ["acme", "pro"],
    scale: ["acme", "scale"],
    live: ["acme", "live"],
  },
});

// Before the fixture stops `up`: the sandboxes go while `up` still runs.
fx.beforeStop(async () => {
  if (!keys) return;
  const list = await fx.api.get<{ sandboxes: { id: string }[] }>("/v1/sandboxes", { key: keys.pro });
  for (const { id } of list.body?.sandboxes ?? [])
    await fx.api.delete(`/v1/sandboxes/${id}`, { key: keys.pro }).catch(() => {});
});

let keys: Record<"pro" | "scale" | "live", string>;
const service = () => fx.svc;
const api = () => service().api;

beforeAll(async () => {
  keys = fx.keys;
  imgDir = await mkdtemp(join(tmpdir(), "sbx-console-img-"));
  const archive = await makeDockerArchive(join(imgDir, "busybox.tar"), await busyboxImageSpec(imgDir));
  image = new Uint8Array(await readFile(archive.path));
  await uploadTemplate(service(), keys.scale, TEMPLATE, image, BUILD_TIMEOUT_MS);
  for (const labels of [{ label: XSS_LABEL }, { label: "second" }]) {
    const res = await api().post("/v1/sandboxes", { key: keys.pro, json: { template: TEMPLATE, labels } });
    ids.push(expectOk(res, 201, B.CreateSandboxResponse).id);
  }
  await mkdir(ARTIFACTS, { recursive: true });
}, SETUP_TIMEOUT_MS);

async function shot(page: Page, name: string): Promise<void> {
  const path = join(ARTIFACTS, name);
  await page.screenshot({ path, fullPage: true });
  console.log(`screenshot ${path}`);
}

/** Debian's Chromium, headless (Playwright adds --no-sandbox and a fresh profile of its own). */
async function launchChromium(): Promise<Browser> {
  const { chromium } = await import("playwright-core");
  // Chromium's own temp dirs (org.chromium.Chromium.*) go under this file's temp dir, removed with it.
  const tmp = join(imgDir, "chromium-tmp");
  await mkdir(tmp, { recursive: true });
  return chromium.launch({
    executablePath: CHROMIUM_PATH,
    headless: true,
    args: CHROMIUM_FLAGS,
    env: { ...process.env, TMPDIR: tmp },
  });
}

/** A page at /console with its console errors and CSP reports collected. */
async function openConsole(browser: Browser): Promise<{ page: Page; problems: string[] }> {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  const problems: string[] = [];
  page.on("pageerror", (err) => problems.push(`pageerror: ${err.message}`));
  page.on("console", (m) => {
    if (m.type() === "error") problems.push(`console: ${m.text()}`);
  });
  page.on("dialog", (d) => void d.accept());
  await page.goto(`${service().url}/console`);
  return { page, problems };
}

async function signIn(page: Page, key: string): Promise<void> {
  await page.fill("#key-input", key);
  await page.press("#key-input", "Enter");
}

/** The xterm screen as lines of text (the DOM renderer: one element per row). */
function screenLines(page: Page): Promise<string[]> {
  return page.$$eval(".xterm-rows > *", (rows) => rows.map((r) => r.textContent ?? ""));
}

/** Polls the xterm screen until `cond` holds (a harness wait: the guest answers when it can). */
async function waitForScreen(page: Page, cond: (lines: string[]) => boolean): Promise<void> {
  const deadline = performance.now() + UI_WAIT_MS;
  let lines: string[] = [];
  while (performance.now() < deadline) {
    lines = await screenLines(page);
    if (cond(lines)) return;
    await Bun.sleep(200);
  }
  throw new Error(`the terminal screen did not show what was expected:\n${lines.join("\n")}`);
}

describe("web console", () => {
  test("the page and its files are served without a key, with a strict CSP", async () => {
    const base = service().url;
    for (const [path, type] of [
      ["/console", "text/html"],
      ["/console/", "text/html"],
      ["/console/app.js", "text/javascript"],
      ["/console/vendor/xterm.mjs", "text/javascript"],
      ["/console/vendor/addon-fit.mjs", "text/javascript"],
      ["/console/vendor/xterm.css", "text/css"],
    ] as const) {
      const res = await fetch(`${base}${path}`);
      expect(`${path} ${res.status}`).toBe(`${path} 200`);
      expect(res.headers.get("content-type")).toStartWith(type);
      expect(res.headers.get("content-security-policy")).toBe(CONSOLE_CSP);
      expect(res.headers.get("x-content-type-options")).toBe("nosniff");
      await res.arrayBuffer();
    }
    expect(CONSOLE_CSP).toContain("script-src 'self'");
    expect(CONSOLE_CSP).toContain("default-src 'none'");
    expect(CONSOLE_CSP).not.toContain("unsafe-eval");
    expect(CONSOLE_CSP).toContain("frame-ancestors 'none'");
    // Only the files the route names: nothing else of the tree, however the path is spelt.
    for (const path of [
      "/console/package.json",
      "/console/..%2f..%2fpackage.json",
      "/console/vendor/xterm.js",
    ]) {
      const res = await fetch(`${base}${path}`);
      expect(`${path} ${res.status}`).toBe(`${path} 404`);
      await res.arrayBuffer();
    }
  });

  test("the pty WebSocket takes the key as a subprotocol after the marker, and never echoes it", async () => {
    const url = `${service().url.replace("http:", "ws:")}/v1/sandboxes/${ids[1]}/pty`;
    const refused = (protocols: string[]) =>
      new Promise<number>((done, fail) => {
        const ws = new WebSocket(url, protocols);
        ws.on("unexpected-response", (_req, res) => {
          done(res.statusCode ?? 0);
          res.resume();
          ws.terminate();
        });
        ws.on("open", () => fail(new Error(`opened with ${protocols.join(",")}`)));
        ws.on("error", () => {});
      });
    expect(await refused(["sandboxd", "sandboxd.key.svc_pro_aaaaaaaaaaaa_wrongwrongwrongwrong"])).toBe(401);
    expect(await refused([`sandboxd.key.${keys.pro}`, "sandboxd"])).toBe(401); // marker not first
    expect(await refused(["sandboxd"])).toBe(401); // no key at all
    const opened = await new Promise<{ protocol: string; header: string }>((done, fail) => {
      const ws = new WebSocket(url, ["sandboxd", `sandboxd.key.${keys.pro}`]);
      let header = "";
      ws.on("upgrade", (res) => {
        header = JSON.stringify(res.headers);
      });
      ws.on("open", () => {
        done({ protocol: ws.protocol, header });
        ws.close(1000);
      });
      ws.on("unexpected-response", (_req, res) => fail(new Error(`HTTP ${res.statusCode}`)));
      ws.on("error", fail);
    });
    expect(opened.protocol).toBe("sandboxd");
    expect(opened.header).not.toContain(keys.pro);
  });

  test(
    "a Pro key sees both sandboxes, usage by day and bake phases; terminal, fork and delete work",
    async () => {
      const [first, second] = ids as [string, string];
      const browser = await launchChromium();
      try {
        const { page, problems } = await openConsole(browser);
        await signIn(page, keys.pro);
        const row = (id: string) => page.locator(`tr[data-sandbox="${id}"]`);
        for (const id of ids) {
          await row(id).waitFor({ timeout: UI_WAIT_MS });
          expect(await row(id).locator(".state").textContent()).toBe("running");
        }
        // The markup in the label is text: shown as typed, no element made, no script run.
        await row(first).locator("td.labels", { hasText: "label=" }).waitFor({ timeout: UI_WAIT_MS });
        expect(await row(first).locator("td.labels").textContent()).toBe(`label=${XSS_LABEL}`);
        expect(await page.locator("main img").count()).toBe(0);
        expect(await page.evaluate("typeof window.__xss")).toBe("undefined");
        // Usage: 14 days, today's bars drawn (two sandboxes have been running for a while).
        await page.locator("#usage-chart svg g[data-day]").nth(13).waitFor({ timeout: UI_WAIT_MS });
        expect(await page.locator("#usage-chart svg g[data-day]").count()).toBe(14);
        const today = new Date().toISOString().slice(0, 10);
        const todayBar = page.locator(`#usage-chart g[data-day="${today}"] rect.bar-cpu`);
        expect(Number(await todayBar.getAttribute("height"))).toBeGreaterThan(0);
        // The template, baked before the page opened: every phase done, its telemetry shown.
        const tpl = page.locator(`tr[data-template="${TEMPLATE}"]`);
        await tpl.waitFor({ timeout: UI_WAIT_MS });
        expect(await tpl.locator(".state").textContent()).toBe("Live");
        expect(await tpl.locator(".phases li.done").count()).toBe(4);
        expect(await tpl.locator(".telemetry").textContent()).toContain("total");
        // The key is in sessionStorage, not in the URL.
        expect(page.url()).not.toContain(keys.pro);
        expect(await page.evaluate(() => sessionStorage.getItem("sandboxd.console.key"))).toBe(keys.pro);
        await shot(page, "sandboxes-and-usage.png");

        // The terminal: type into xterm.js, read the answer off its screen.
        await row(first).getByRole("button", { name: "Terminal" }).click();
        await page.locator(".xterm-rows").waitFor({ timeout: UI_WAIT_MS });
        // The shell's prompt first, then the command and its answer.
        await waitForScreen(page, (lines) => lines.some((l) => l.trim().length > 0));
        await page.locator(".xterm-helper-textarea").focus();
        await page.keyboard.type("echo $((6*7))");
        await page.keyboard.press("Enter");
        await waitForScreen(page, (lines) => lines.some((l) => l.trim() === "42"));
        const lines = (await screenLines(page)).map((l) => l.trimEnd()).filter((l) => l.length > 0);
        console.log(`terminal screen:\n${lines.join("\n")}`);
        expect(lines.some((l) => l.includes("echo $((6*7))"))).toBe(true);
        await shot(page, "terminal.png");

        // Live metrics of the first sandbox: the figures and the chart's samples (the service
        // samples every 2 s, so a second poll shows at least two points).
        await row(first).getByRole("button", { name: "Metrics" }).click();
        await page.locator("#metrics-chart svg circle.point").nth(1).waitFor({ timeout: UI_WAIT_MS });
        expect(await page.locator("#metrics-now").textContent()).toMatch(
          /^running: CPU .*memory [0-9.]+ MiB of [0-9.]+ MiB, disk [0-9.]+ MiB/,
        );
        await shot(page, "metrics.png");
        await page.locator("#metrics-close").click();

        // Fork the second sandbox with its button: a third row appears, and the API agrees.
        await row(second).getByRole("button", { name: "Fork" }).click();
        await page.locator("tr[data-sandbox]").nth(2).waitFor({ timeout: UI_WAIT_MS });
        const afterFork = expectOk(await api().get("/v1/sandboxes", { key: keys.pro }), 200, B.SandboxList);
        const child = afterFork.sandboxes.map((s) => s.id).find((id) => !ids.includes(id));
        expect(child).toBeDefined();
        expect(afterFork.sandboxes).toHaveLength(3);
        await row(child!).waitFor({ timeout: UI_WAIT_MS });

        // Delete the first (its terminal open) with its button (the confirm is accepted).
        await row(first).getByRole("button", { name: "Delete" }).click();
        await row(first).waitFor({ state: "detached", timeout: UI_WAIT_MS });
        const gone = await api().get(`/v1/sandboxes/${first}`, { key: keys.pro });
        expect(gone.status).toBe(404);
        const left = expectOk(await api().get("/v1/sandboxes", { key: keys.pro }), 200, B.SandboxList);
        expect(left.sandboxes.map((s) => s.id).sort()).toEqual([second, child!].sort());
        await shot(page, "after-fork-and-delete.png");

        // A bake started while the page is open: Refresh shows it in its phase, and the page
        // follows it to Live by itself (it polls while a template bakes).
        const upload = await api().post("/v1/templates", {
          key: keys.scale,
          query: { id: SECOND_TEMPLATE },
          raw: image,
          headers: { "content-type": "application/octet-stream" },
        });
        expect(upload.status).toBe(202);
        await page.locator("#refresh").click();
        const baking = page.locator(`tr[data-template="${SECOND_TEMPLATE}"]`);
        await baking.waitFor({ timeout: UI_WAIT_MS });
        const seen = [await baking.locator(".state").textContent()];
        if (seen[0] !== "Live") await shot(page, "bake-in-progress.png");
        const deadline = performance.now() + BUILD_TIMEOUT_MS;
        while (seen.at(-1) !== "Live" && seen.at(-1) !== "Failed" && performance.now() < deadline) {
          await Bun.sleep(100);
          const phase = await baking.locator(".state").textContent();
          if (phase !== seen.at(-1)) seen.push(phase);
        }
        console.log(`bake phases the page showed: ${seen.join(" -> ")}`);
        expect(seen.at(-1)).toBe("Live");
        expect(await baking.locator(".phases li.done").count()).toBe(4);

        expect(problems).toEqual([]);
        // Nothing the service logged names the key (its id prefix may appear; the secret never).
        expect(service().logTail(100_000)).not.toContain(keys.pro.split("_").at(-1)!);
      } finally {
        await browser.close();
      }
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "Snapshot, Restore… and the Snapshots view: take one, see it, roll back to it, start from it, delete it",
    async () => {
      const second = ids[1]!;
      const exec = async (id: string, command: string) =>
        expectOk(
          await api().post(`/v1/sandboxes/${id}/exec`, { key: keys.pro, json: { command } }),
          200,
          B.ExecResponseB,
        ).stdout;
      const snapshots = async () =>
        expectOk(await api().get("/v1/snapshots", { key: keys.pro }), 200, B.SnapshotList).snapshots;
      await exec(second, "echo before > /tmp/mark");
      const browser = await launchChromium();
      try {
        const { page, problems } = await openConsole(browser);
        await signIn(page, keys.pro);
        const row = page.locator(`tr[data-sandbox="${second}"]`);
        await row.waitFor({ timeout: UI_WAIT_MS });
        await row.getByRole("button", { name: "Snapshot" }).click();
        const snapRow = page.locator("#snapshots tr[data-snapshot]");
        await snapRow.first().waitFor({ timeout: UI_WAIT_MS });
        const listed = await snapshots();
        expect(listed).toHaveLength(1);
        const snap = listed[0]!;
        expect(snap).toMatchObject({ state: "ready", source_sandbox: second, template: TEMPLATE });
        expect(await snapRow.getAttribute("data-snapshot")).toBe(snap.id);
        expect(await snapRow.locator(".state").textContent()).toBe("ready");
        expect(await snapRow.textContent()).toContain(second);
        expect(await snapRow.textContent()).toMatch(/[0-9.]+ MiB/);
        await shot(page, "snapshots.png");

        // Restore…: the panel offers the sandbox's own snapshot; the file written after it reverts.
        await exec(second, "echo after > /tmp/mark");
        await row.getByRole("button", { name: "Restore…" }).click();
        await page.locator(`#restore-snapshot option[value="${snap.id}"]`).waitFor({
          state: "attached",
          timeout: UI_WAIT_MS,
        });
        await page.selectOption("#restore-snapshot", snap.id);
        await shot(page, "restore.png");
        await page.locator("#restore-go").click();
        await page
          .locator("#status", { hasText: `Restored ${second} to ${snap.id} in` })
          .waitFor({ timeout: UI_WAIT_MS });
        expect(await page.locator("#restore-section").isHidden()).toBe(true);
        expect(await exec(second, "cat /tmp/mark")).toBe("before\n");

        // New sandbox from it: one more sandbox, with the snapshot's files.
        const before = expectOk(await api().get("/v1/sandboxes", { key: keys.pro }), 200, B.SandboxList);
        await snapRow.getByRole("button", { name: "New sandbox" }).click();
        // The status reads "Created <id> from <snap>" once the create answered (not "Creating…").
        await page
          .locator("#status", { hasText: new RegExp(`^Created sbx_\\w+ from ${snap.id}$`) })
          .waitFor({ timeout: UI_WAIT_MS });
        const after = expectOk(await api().get("/v1/sandboxes", { key: keys.pro }), 200, B.SandboxList);
        const made = after.sandboxes.find((s) => !before.sandboxes.some((b) => b.id === s.id));
        expect(made).toBeDefined();
        await page.locator(`tr[data-sandbox="${made!.id}"]`).waitFor({ timeout: UI_WAIT_MS });
        expect(await exec(made!.id, "cat /tmp/mark")).toBe("before\n");

        // Delete (the confirm is accepted): gone from the view and the API.
        await snapRow.getByRole("button", { name: "Delete" }).click();
        await snapRow.waitFor({ state: "detached", timeout: UI_WAIT_MS });
        expect(await snapshots()).toEqual([]);
        expect(await page.locator("#snapshots-empty").isVisible()).toBe(true);
        expect(problems).toEqual([]);
      } finally {
        await browser.close();
      }
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a sessions API key is told what it sees: its templates, no sandboxes or usage",
    async () => {
      const browser = await launchChromium();
      try {
        const { page, problems } = await openConsole(browser);
        await signIn(page, keys.live);
        await page.locator("#notice").waitFor({ state: "visible", timeout: UI_WAIT_MS });
        expect(await page.locator("#notice").textContent()).toContain("This is a sessions API key");
        await page.locator(`tr[data-template="${TEMPLATE}"]`).waitFor({ timeout: UI_WAIT_MS });
        expect(await page.locator(`tr[data-template="${TEMPLATE}"] .state`).textContent()).toBe("ready");
        expect(await page.locator("#sandboxes-section").isHidden()).toBe(true);
        expect(await page.locator("#usage-section").isHidden()).toBe(true);
        expect(await page.locator("#snapshots-section").isHidden()).toBe(true);
        await shot(page, "sessions-api-key.png");
        // The API's 403s for sandboxes and usage show in the console log as failed loads: expected.
        expect(problems.filter((p) => !p.includes("403"))).toEqual([]);
      } finally {
        await browser.close();
      }
    },
    TEST_TIMEOUT_MS,
  );
});
