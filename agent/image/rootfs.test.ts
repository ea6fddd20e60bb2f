import { afterEach, expect, test } from "bun:test";
import { spawn, spawnSync } from "node:child_process";
import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { readImageUsers } from "./rootfs.ts";

const dirs: string[] = [];
afterEach(async () => {
  for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
});

async function rootfs(): Promise<string> {
  const d = await mkdtemp(join(tmpdir(), "sbx-rootfs-"));
  dirs.push(d);
  await mkdir(join(d, "etc"));
  return d;
}

test("the image's /etc/passwd and /etc/group are read when they are regular files", async () => {
  const r = await rootfs();
  await writeFile(join(r, "etc/passwd"), "root:x:0:0::/root:/bin/sh\n");
  expect(await readImageUsers(r, 65536)).toEqual({ passwd: "root:x:0:0::/root:/bin/sh\n", group: "" });
});

test("a FIFO the image planted at /etc/passwd is never opened: a writer waiting on it stays blocked", async () => {
  const r = await rootfs();
  const fifo = join(r, "etc/passwd");
  expect(spawnSync("mkfifo", [fifo]).status).toBe(0);
  // A writer's open blocks until someone opens the FIFO for reading: if the import opened it, the
  // writer would get through and exit.
  const writer = spawn("sh", ["-c", `echo planted > '${fifo}'`], { stdio: "ignore" });
  let exited = false;
  writer.once("exit", () => {
    exited = true;
  });
  try {
    await Bun.sleep(300); // the writer is blocked in its open by now
    expect(await readImageUsers(r, 65536)).toEqual({ passwd: "", group: "" });
    await Bun.sleep(200);
    expect(exited).toBe(false);
  } finally {
    writer.kill("SIGKILL");
  }
});
