/**
 * The bounded log of a background process (processes.ts) without a VM: the bound holds (counting
 * each chunk's overhead, so one-byte writes cannot grow it), `dropped` says older output went, and
 * a follower gets the kept output then new output in the order it was written across both streams,
 * skips what was dropped before it got there, and ends once the process has ended.
 */
import { expect, test } from "bun:test";
import { BackgroundProcess, PROCESS_LOG_BYTES } from "./processes.ts";

const proc = () =>
  new BackgroundProcess(1, {
    argv: ["x"],
    command: "x",
    env: [],
    cwd: "/",
    uid: 0,
    gid: 0,
    keepAwake: false,
  });

test("the log keeps the newest output within its bound, even for one-byte writes", () => {
  const p = proc();
  p.output("stdout", Buffer.from("first\n"));
  expect(p.out.text().toString()).toBe("first\n");
  expect(p.out.dropped).toBe(false);
  for (let i = 0; i < 20_000; i++) p.output("stdout", Buffer.from("y"));
  const kept = p.out.text();
  expect(p.out.dropped).toBe(true);
  expect(kept.toString()).not.toContain("first");
  // 128 bytes of overhead per chunk: far fewer than 20,000 one-byte chunks are kept.
  expect(kept.length).toBeLessThan(PROCESS_LOG_BYTES / 100);
  expect(kept.length).toBeGreaterThan(0);
  // A chunk larger than the bound keeps its tail.
  p.output("stderr", Buffer.alloc(PROCESS_LOG_BYTES * 2, 0x61));
  expect(p.err.text().length).toBeLessThanOrEqual(PROCESS_LOG_BYTES);
  expect(p.err.dropped).toBe(true);
});

test("a follower gets kept then new output in write order across streams, and ends with the process", async () => {
  const p = proc();
  p.output("stdout", Buffer.from("a"));
  p.output("stderr", Buffer.from("b"));
  p.output("stdout", Buffer.from("c"));
  const got: string[] = [];
  const done = (async () => {
    for await (const c of p.follow(new AbortController().signal)) got.push(`${c.stream}:${c.data}`);
  })();
  await Bun.sleep(5);
  p.output("stderr", Buffer.from("d"));
  await Bun.sleep(5);
  p.output("stdout", Buffer.from("e"));
  p.ended(0);
  await done;
  expect(got).toEqual(["stdout:a", "stderr:b", "stdout:c", "stderr:d", "stdout:e"]);
});

test("a slow follower skips what was dropped; aborting stops following", async () => {
  const p = proc();
  const ctl = new AbortController();
  const it = p.follow(ctl.signal);
  p.output("stdout", Buffer.from("old"));
  const first = await it.next();
  expect(first.value?.data.toString()).toBe("old");
  // While the follower is away, enough output to push its next chunks out of the log.
  p.output("stdout", Buffer.from("gone"));
  p.output("stdout", Buffer.alloc(PROCESS_LOG_BYTES, 0x7a));
  const next = await it.next();
  expect(next.value?.data.toString()).not.toBe("gone");
  expect(next.value?.data[0]).toBe(0x7a);
  const pending = it.next();
  ctl.abort();
  expect((await pending).done).toBe(true);
});
