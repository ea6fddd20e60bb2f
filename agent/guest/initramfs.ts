/**
 * The guest's initramfs: the static guest agent as /init, the virtio modules under /lib/modules
 * with their load order, and the directories and /dev/console the agent needs before it mounts
 * anything, as a newc cpio (artifacts.ts gzips and caches it).
 */
import type { ResolvedModule } from "./kernel.ts";

// Initramfs (newc cpio, written here so it needs no root: /dev/console is a device node)

interface CpioEntry {
  name: string;
  mode: number;
  data?: Buffer;
  rdevMajor?: number;
  rdevMinor?: number;
}

const S_IFDIR = 0o040000;
const S_IFREG = 0o100000;
const S_IFCHR = 0o020000;

export function buildInitramfs(agent: Buffer, modules: ResolvedModule[]): Buffer {
  const entries: CpioEntry[] = [
    // /dev/console must exist before /init runs: the kernel opens it as init's stdin/out/err, and
    // without it the agent has no console until it mounts devtmpfs (and early errors are lost).
    { name: "dev", mode: S_IFDIR | 0o755 },
    { name: "dev/console", mode: S_IFCHR | 0o600, rdevMajor: 5, rdevMinor: 1 },
    { name: "proc", mode: S_IFDIR | 0o755 },
    { name: "sys", mode: S_IFDIR | 0o755 },
    { name: "newroot", mode: S_IFDIR | 0o755 },
    { name: "etc", mode: S_IFDIR | 0o755 },
    {
      name: "etc/modules.order",
      mode: S_IFREG | 0o644,
      data: Buffer.from(modules.map((m) => `${m.file}\n`).join("")),
    },
    { name: "lib", mode: S_IFDIR | 0o755 },
    { name: "lib/modules", mode: S_IFDIR | 0o755 },
    ...modules.map((m) => ({ name: `lib/modules/${m.file}`, mode: S_IFREG | 0o644, data: m.bytes })),
    { name: "init", mode: S_IFREG | 0o755, data: agent },
  ];
  return writeNewc(entries);
}

/**
 * newc format (the kernel's Documentation/driver-api/early-userspace/buffer-format.rst): a
 * 110-byte ASCII header of 8-hex-digit fields, the NUL-terminated name, padding to 4 bytes, the
 * data, padding to 4 bytes; ends with "TRAILER!!!". mtime 0 and uid/gid 0 keep the output
 * identical for identical inputs.
 */
export function writeNewc(entries: CpioEntry[]): Buffer {
  const parts: Buffer[] = [];
  let offset = 0;
  const push = (b: Buffer) => {
    parts.push(b);
    offset += b.length;
  };
  const pad = () => {
    const n = (4 - (offset % 4)) % 4;
    if (n) push(Buffer.alloc(n));
  };
  const hex = (n: number) => n.toString(16).padStart(8, "0");
  const all: CpioEntry[] = [...entries, { name: "TRAILER!!!", mode: 0 }];
  all.forEach((e, i) => {
    const data = e.data ?? Buffer.alloc(0);
    const name = Buffer.from(`${e.name}\0`);
    const isDir = (e.mode & 0o170000) === S_IFDIR;
    const header =
      "070701" +
      hex(e.name === "TRAILER!!!" ? 0 : i + 1) + // ino
      hex(e.mode) +
      hex(0) + // uid
      hex(0) + // gid
      hex(isDir ? 2 : 1) + // nlink
      hex(0) + // mtime
      hex(data.length) +
      hex(0) + // devmajor
      hex(0) + // devminor
      hex(e.rdevMajor ?? 0) +
      hex(e.rdevMinor ?? 0) +
      hex(name.length) +
      hex(0); // check
    push(Buffer.from(header, "latin1"));
    push(name);
    pad();
    if (data.length) {
      push(data);
      pad();
    }
  });
  return Buffer.concat(parts);
}
