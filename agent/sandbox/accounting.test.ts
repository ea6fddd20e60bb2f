/** What the meter tells the gateway (`onEvent`) as a VM moves through its states. */
import { expect, test } from "bun:test";
import { DISK_EVENT_MIN_BYTES, type MeterEvent, UsageMeter } from "./accounting.ts";

test("events: each phase change after the first, disk growth past the threshold, the end with its reason", () => {
  const events: MeterEvent[] = [];
  const m = new UsageMeter(
    "vm-1",
    "tpl",
    { vcpus: 2, memMib: 512, diskBytes: 0 },
    () => {},
    (e) => events.push(e),
  );
  m.enter("creating", 0); // the gateway learns of a new VM from the create answer
  m.setDisk(5 * DISK_EVENT_MIN_BYTES, 1); // measured before the answer
  m.enter("running", 2); // same phase as creating: nothing new
  m.enter("paused", 10);
  m.setDisk(5 * DISK_EVENT_MIN_BYTES + 1000, 11); // a few KB: not news
  m.enter("busy", 20);
  m.setDisk(7 * DISK_EVENT_MIN_BYTES, 25);
  m.enter("suspending", 30);
  m.memImageBytes = 100;
  m.enter("suspended", 31);
  m.enter("resuming", 40);
  m.enter("running", 41);
  m.enter("failed", 50, "QEMU exited (signal SIGKILL)");
  m.enter("destroying", 60); // already ended: nothing more
  const disk = (n: number) => n * DISK_EVENT_MIN_BYTES;
  expect(events.map((e) => [e.state, e.atMs, e.resources.vcpus, e.resources.diskBytes, e.reason])).toEqual([
    ["running", 1, 2, disk(5), undefined],
    ["paused", 10, 2, disk(5), undefined],
    ["running", 20, 2, disk(5) + 1000, undefined],
    ["running", 25, 2, disk(7), undefined],
    ["suspended", 31, 0, disk(7) + 100, undefined],
    ["running", 40, 2, disk(7), undefined],
    ["failed", 50, 2, disk(7), "QEMU exited (signal SIGKILL)"],
  ]);
  expect(events.every((e) => e.vmId === "vm-1")).toBe(true);
});

test("a destroyed VM ends with `destroyed`; a restarted meter says nothing of its first state", () => {
  const events: MeterEvent[] = [];
  const m = new UsageMeter(
    "vm-2",
    "tpl",
    { vcpus: 1, memMib: 256, diskBytes: 0 },
    () => {},
    (e) => events.push(e),
  );
  m.enter("suspended", 0); // re-read from its record after an agent restart
  m.enter("destroying", 5);
  m.enter("destroyed", 6);
  expect(events.map((e) => [e.state, e.atMs])).toEqual([["destroyed", 5]]);
});
