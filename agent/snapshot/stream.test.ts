import { afterAll, describe, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { createConnection, createServer, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { migrationStream, pageRec, part } from "../../tests/fixtures/migration-stream.ts";
import type { QmpClient } from "../qemu/qmp/client.ts";
import { SnapshotError } from "./errors.ts";
import {
  LOAD_SOCKET,
  loadFromFile,
  migrationByteCap,
  SAVE_SOCKET,
  type StreamVm,
  saveToFile,
  startSave,
} from "./stream.ts";

const root = mkdtempSync(join(tmpdir(), "stream-test-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));
let n = 0;
const vmDir = () => {
  const d = join(root, `vm${n++}`);
  Bun.spawnSync(["mkdir", "-p", d]);
  return d;
};

/**
 * The QEMU side of the migration socket, without QEMU: `migrate` / `migrate-incoming` call the
 * hooks with the socket path, `query-migrate` answers `status`.
 */
class FakeQemu {
  status = "none";
  errorDesc: string | undefined;
  commands: string[] = [];
  onMigrate: (path: string) => void = () => {};
  onIncoming: (path: string) => void = () => {};
  constructor(readonly dir: string) {}
  vm(extra: Partial<StreamVm> = {}): StreamVm {
    const qmp = {
      execute: async (command: string, args?: { uri?: string }) => {
        this.commands.push(command);
        const uri = args?.uri ?? "";
        if (command === "migrate" || command === "migrate-incoming") {
          expect(uri.startsWith("unix:")).toBe(true);
          this.status = "active";
          (command === "migrate" ? this.onMigrate : this.onIncoming)(uri.slice("unix:".length));
          return {};
        }
        if (command === "query-migrate")
          return { status: this.status, ...(this.errorDesc ? { "error-desc": this.errorDesc } : {}) };
        if (command === "migrate_cancel") {
          this.status = "cancelled";
          return {};
        }
        throw new Error(`unexpected ${command}`);
      },
      on: () => () => {},
    } as unknown as QmpClient;
    return {
      pid: 1,
      dir: this.dir,
      qmp,
      exited: new Promise(() => {}),
      kill: async () => {},
      isAlive: () => true,
      stderrTail: () => "",
      ...extra,
    };
  }
}

function connect(path: string): Promise<Socket> {
  return new Promise((resolve, reject) => {
    const s = createConnection({ path });
    s.once("connect", () => resolve(s));
    s.once("error", reject);
  });
}

/** Sends `data` the way QEMU does (many writes), then reports `completed` and closes. */
function qemuSends(q: FakeQemu, data: Buffer, o: { close?: boolean; status?: string } = {}) {
  q.onMigrate = (path) => {
    void (async () => {
      const s = await connect(path);
      for (let off = 0; off < data.length; off += 32 * 1024) {
        if (!s.write(data.subarray(off, off + 32 * 1024))) await new Promise((r) => s.once("drain", r));
      }
      q.status = o.status ?? "completed";
      if (o.close !== false) s.end();
    })();
  };
}

async function rejection(p: Promise<unknown>): Promise<SnapshotError> {
  try {
    await p;
  } catch (err) {
    expect(err).toBeInstanceOf(SnapshotError);
    return err as SnapshotError;
  }
  throw new Error("expected a rejection");
}

describe("saveToFile", () => {
  test("streams what QEMU sends into the file and removes the socket", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    const data = randomBytes(3 * 1024 * 1024 + 17);
    qemuSends(q, data);
    const path = join(dir, "state");
    const bytes = await saveToFile(q.vm(), { path, maxBytes: 8 << 20, timeoutMs: 10_000, fsync: true });
    expect(bytes).toBe(data.length);
    expect(readFileSync(path).equals(data)).toBe(true);
    expect(statSync(path).mode & 0o777).toBe(0o600);
    expect(existsSync(join(dir, SAVE_SOCKET))).toBe(false);
    expect(q.commands).toContain("migrate");
  });

  test("the socket carries the mode (and owner) the VM asks for", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    let mode = -1;
    let uid = -1;
    const inner = () => qemuSends(q, Buffer.from("x"));
    inner();
    const send = q.onMigrate;
    q.onMigrate = (path) => {
      const st = statSync(path);
      mode = st.mode & 0o777;
      uid = st.uid;
      send(path);
    };
    const me = process.getuid?.() ?? 0;
    await saveToFile(q.vm({ migrationSocket: { mode: 0o666, uid: me } }), {
      path: join(dir, "state"),
      maxBytes: 1024,
      timeoutMs: 10_000,
    });
    expect(mode).toBe(0o666);
    expect(uid).toBe(me);
  });

  test("past the byte cap the save fails and leaves no file", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    qemuSends(q, randomBytes(2 << 20), { status: "active", close: false });
    const path = join(dir, "state");
    const e = await rejection(saveToFile(q.vm(), { path, maxBytes: 1 << 20, timeoutMs: 10_000 }));
    expect(e.code).toBe("migration_failed");
    expect(e.message).toContain("cap");
    expect(existsSync(path)).toBe(false);
    expect(existsSync(join(dir, SAVE_SOCKET))).toBe(false);
  });

  test("drainOnError: past the cap the rest of QEMU's stream is read and dropped, then the save fails", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    qemuSends(q, randomBytes(3 << 20));
    const path = join(dir, "state");
    const e = await rejection(
      saveToFile(q.vm(), { path, maxBytes: 1 << 20, timeoutMs: 10_000, drainOnError: true }),
    );
    expect(e.message).toContain("cap");
    // QEMU's side ran to its end: it sent everything and saw `completed` (a cut socket would
    // have failed its migration midway).
    expect(q.status).toBe("completed");
    expect(q.commands).not.toContain("migrate_cancel");
    expect(existsSync(path)).toBe(false);
    expect(existsSync(join(dir, SAVE_SOCKET))).toBe(false);
  });

  test("QEMU never connects: the deadline fails it and nothing stays behind", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    const path = join(dir, "state");
    const t0 = performance.now();
    const e = await rejection(saveToFile(q.vm(), { path, maxBytes: 1024, timeoutMs: 300 }));
    expect(performance.now() - t0).toBeLessThan(5_000);
    expect(e.code).toBe("migration_failed");
    expect(existsSync(path)).toBe(false);
    expect(existsSync(join(dir, SAVE_SOCKET))).toBe(false);
  });

  test("`completed` without EOF is not a whole file: the deadline fails it", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    qemuSends(q, Buffer.from("partial"), { close: false });
    const path = join(dir, "state");
    const e = await rejection(saveToFile(q.vm(), { path, maxBytes: 1024, timeoutMs: 300 }));
    expect(e.message).toContain("did not finish");
    expect(existsSync(path)).toBe(false);
  });

  test("a failed migration is QEMU's reason, and the partial file is removed", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    q.errorDesc = "disk on fire";
    qemuSends(q, Buffer.from("some"), { status: "failed" });
    const path = join(dir, "state");
    const e = await rejection(saveToFile(q.vm(), { path, maxBytes: 1024, timeoutMs: 10_000 }));
    expect(e.message).toContain("disk on fire");
    expect(existsSync(path)).toBe(false);
  });

  test("a second connection is refused: only QEMU's stream is written", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    let second: string | undefined;
    q.onMigrate = (path) => {
      void (async () => {
        const s = await connect(path);
        s.write("mine");
        second = await connect(path).then(
          (o) => {
            o.destroy();
            return "connected";
          },
          () => "refused",
        );
        q.status = "completed";
        s.end();
      })();
    };
    const path = join(dir, "state");
    await saveToFile(q.vm(), { path, maxBytes: 1024, timeoutMs: 10_000 });
    expect(second).toBe("refused");
    expect(readFileSync(path, "utf8")).toBe("mine");
  });

  test("pre-switchover: the caller drives the statuses, finish waits for the rest", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    let sock: Socket | undefined;
    q.onMigrate = (path) => {
      void connect(path).then((s) => {
        sock = s;
        s.write("precopy;");
        q.status = "pre-switchover";
      });
    };
    const path = join(dir, "state");
    const save = await startSave(q.vm(), { path, maxBytes: 1024, timeoutMs: 10_000 });
    expect((await save.waitFor(["pre-switchover"])).status).toBe("pre-switchover");
    sock?.end("switchover");
    q.status = "completed";
    expect(await save.finish()).toBe("precopy;switchover".length);
    expect(readFileSync(path, "utf8")).toBe("precopy;switchover");
  });

  test("abort removes the file and the socket", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    const path = join(dir, "state");
    const save = await startSave(q.vm(), { path, maxBytes: 1024, timeoutMs: 10_000 });
    expect(existsSync(join(dir, SAVE_SOCKET))).toBe(true);
    await save.abort();
    await save.abort();
    expect(existsSync(path)).toBe(false);
    expect(existsSync(join(dir, SAVE_SOCKET))).toBe(false);
  });
});

/** QEMU's listening side: collects what the agent sends, `completed` at EOF. */
function qemuReceives(q: FakeQemu, o: { delayMs?: number; status?: string } = {}): Promise<Buffer> {
  return new Promise((resolve) => {
    q.onIncoming = (path) => {
      setTimeout(() => {
        const server = createServer((c) => {
          const parts: Buffer[] = [];
          c.on("data", (d: Buffer) => parts.push(d));
          c.on("end", () => {
            q.status = o.status ?? "completed";
            server.close();
            c.end();
            resolve(Buffer.concat(parts));
          });
        });
        server.listen(path);
      }, o.delayMs ?? 0);
    };
  });
}

describe("split saves (ram-split.ts through the socket)", () => {
  /** 48 MiB of pages, more than the 32 MiB the splitter may hold unparsed: the socket pauses. */
  const PAGES = 12288;
  const RAM = PAGES * 4096;
  const fill = (i: number) => (i * 7 + 1) & 0xff;
  const pages = Array.from({ length: PAGES }, (_, i) =>
    pageRec(i === 0 ? "mem" : undefined, i * 4096, fill(i)),
  );
  const data = migrationStream([["mem", RAM]], part(...pages));

  test("a fork point: every page lands at its offset in the RAM file, the state is the rest", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    qemuSends(q, data);
    const path = join(dir, "point.state");
    const ramPath = join(dir, "point.mem");
    const bytes = await saveToFile(q.vm(), {
      path,
      split: { ramBlock: "mem", ramBytes: RAM, ramPath, statePath: path },
      maxBytes: migrationByteCap(RAM / 2 ** 20),
      timeoutMs: 30_000,
    });
    expect(bytes).toBe(data.length);
    const ram = readFileSync(ramPath);
    for (const i of [0, 1, 4095, 8192, PAGES - 1]) expect(ram[i * 4096 + 17]).toBe(fill(i));
    expect(readFileSync(path).equals(migrationStream([["mem", RAM]], part()))).toBe(true);
  });

  test("a stream the splitter refuses fails the save and leaves neither file; drained to its end when asked", async () => {
    for (const drainOnError of [false, true]) {
      const dir = vmDir();
      const q = new FakeQemu(dir);
      // A page past the block's end, early in a long stream.
      const bad = migrationStream([["mem", RAM]], part(pageRec("mem", RAM, 1), ...pages));
      qemuSends(q, bad);
      const path = join(dir, "point.state");
      const ramPath = join(dir, "point.mem");
      const e = await rejection(
        saveToFile(q.vm(), {
          path,
          split: { ramBlock: "mem", ramBytes: RAM, ramPath, statePath: path },
          maxBytes: migrationByteCap(RAM / 2 ** 20),
          timeoutMs: 30_000,
          drainOnError,
        }),
      );
      expect(e.message).toContain("past the end");
      expect(existsSync(path)).toBe(false);
      expect(existsSync(ramPath)).toBe(false);
    }
  });
});

describe("loadFromFile", () => {
  test("streams the state file into QEMU's socket and waits for completed", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    const data = randomBytes(5 * 1024 * 1024 + 3);
    const path = join(dir, "state");
    writeFileSync(path, data);
    const got = qemuReceives(q, { delayMs: 30 });
    const info = await loadFromFile(q.vm(), path, 10_000);
    expect(info.status).toBe("completed");
    expect((await got).equals(data)).toBe(true);
    expect(existsSync(join(dir, LOAD_SOCKET))).toBe(false);
    expect(q.commands).toContain("migrate-incoming");
  });

  test("a missing state file fails before QEMU is asked anything", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    const e = await rejection(loadFromFile(q.vm(), join(dir, "nope"), 1_000));
    expect(e.code).toBe("migration_failed");
    expect(q.commands).toEqual([]);
  });

  test("a socket that never appears fails at the deadline", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    const path = join(dir, "state");
    writeFileSync(path, "x");
    const t0 = performance.now();
    const e = await rejection(loadFromFile(q.vm(), path, 200));
    expect(performance.now() - t0).toBeLessThan(5_000);
    expect(e.message).toContain("did not accept");
  });

  test("QEMU's failure is the error", async () => {
    const dir = vmDir();
    const q = new FakeQemu(dir);
    q.errorDesc = "load of migration failed";
    const path = join(dir, "state");
    writeFileSync(path, "x");
    void qemuReceives(q, { status: "failed" });
    const e = await rejection(loadFromFile(q.vm(), path, 10_000));
    expect(e.message).toContain("load of migration failed");
  });
});

test("the byte cap is guest RAM plus a margin, per pass", () => {
  expect(migrationByteCap(256)).toBeGreaterThan(256 * 1024 ** 2);
  expect(migrationByteCap(256)).toBeLessThan(512 * 1024 ** 2);
  expect(migrationByteCap(256, 2) - migrationByteCap(256)).toBe(256 * 1024 ** 2);
});
