/**
 * The operator's settings that every VM launch and every large write of the agent obeys: the
 * jail's uid range and `unshare`, and the disk space kept free. They come from cli/settings/
 * (the serving commands, `run`, `bench`) and travel with a VM's shape, a template build's and a
 * boot's options; a caller that passes none gets the defaults, the settings' own defaults.
 */
import { DEFAULT_DISK_RESERVE_BYTES } from "../../contracts/disk-space.ts";
import { DEFAULT_JAIL, type JailSettings } from "../qemu/jail-setup.ts";

export interface VmHostSettings {
  jail: JailSettings;
  /** Free space every upload, pull, import, suspend, fork and template build leaves (bytes). */
  diskReserveBytes: number;
}

export const DEFAULT_VM_HOST: VmHostSettings = {
  jail: DEFAULT_JAIL,
  diskReserveBytes: DEFAULT_DISK_RESERVE_BYTES,
};
