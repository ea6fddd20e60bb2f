/** Random ids and key material. Base36/base62 only: `_` separates key segments (docs/keys-and-auth.md "Rules of authentication"). */
import { randomBytes } from "node:crypto";
import { OPAQUE_ID_CHARS } from "../contracts/api/common.ts";

const BASE36 = "abcdefghijklmnopqrstuvwxyz0123456789";
const BASE62 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/** Unbiased: bytes >= the largest multiple of the alphabet size are discarded. */
export function randomString(alphabet: string, length: number): string {
  const limit = 256 - (256 % alphabet.length);
  let out = "";
  while (out.length < length) {
    for (const b of randomBytes(length * 2)) {
      if (b < limit) out += alphabet[b % alphabet.length];
      if (out.length === length) break;
    }
  }
  return out;
}

export const base36 = (n: number) => randomString(BASE36, n);
export const base62 = (n: number) => randomString(BASE62, n);
export const newSessionId = () => `sess_${base36(OPAQUE_ID_CHARS)}`;
export const newSandboxId = () => `sbx_${base36(OPAQUE_ID_CHARS)}`;
/** A kept snapshot (docs/snapshots.md); also the name the agent keeps its files under. */
export const newSnapshotId = () => `snap_${base36(OPAQUE_ID_CHARS)}`;
/** A one-shot exec's record (metering and the tenant's concurrency); never shown to clients. */
export const newExecId = () => `exec_${base36(OPAQUE_ID_CHARS)}`;
export const newTenantId = () => `ten_${base36(OPAQUE_ID_CHARS)}`;
export const newTemplatePk = () => `tpl_${base36(OPAQUE_ID_CHARS)}`;
