/**
 * Where the agent keeps what it records about one VM (`owner.json`, the snapshot driver's
 * `snapshot-vm.json`): `<stateDir>/records/vms/<id>/` for the VM directory `<stateDir>/vms/<id>`.
 * Not in the VM directory: that one is bound into the VM's jail, and a guest that escaped into its
 * QEMU writes what the jail uid can write there. The records directory is root's, mode 0700, never
 * bound into a jail; its files are root's, mode 0600, written as new files renamed into place.
 */
import { randomBytes } from "node:crypto";
import { constants } from "node:fs";
import { mkdir, open, rename, rm, writeFile } from "node:fs/promises";
import { basename, dirname, join } from "node:path";

/** The records directory of the VM directory `vmDir` (`<stateDir>/vms/<id>`). */
export function vmRecordsDir(vmDir: string): string {
  const d = vmDir.replace(/\/+$/, "");
  return join(dirname(dirname(d)), "records", "vms", basename(d));
}

/** Writes `text` as the record `name` of `vmDir` atomically (the old record or the new one). */
export async function writeVmRecordFile(vmDir: string, name: string, text: string): Promise<void> {
  const dir = vmRecordsDir(vmDir);
  await mkdir(dir, { recursive: true, mode: 0o700 });
  const tmp = join(dir, `.${name}.${randomBytes(6).toString("hex")}`);
  await writeFile(tmp, text, { flag: "wx", mode: 0o600 });
  await rename(tmp, join(dir, name));
}

/** The record `name` of `vmDir`; undefined when there is none (ENOENT). A symlink is refused. */
export async function readVmRecordFile(vmDir: string, name: string): Promise<string | undefined> {
  let fh: Awaited<ReturnType<typeof open>>;
  try {
    fh = await open(join(vmRecordsDir(vmDir), name), constants.O_RDONLY | constants.O_NOFOLLOW);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return undefined;
    throw err;
  }
  try {
    return await fh.readFile("utf8");
  } finally {
    await fh.close();
  }
}

/** Removes the records of `vmDir` (its VM is gone). */
export function removeVmRecords(vmDir: string): Promise<void> {
  return rm(vmRecordsDir(vmDir), { recursive: true, force: true });
}
