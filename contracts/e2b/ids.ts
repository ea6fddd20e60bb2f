/**
 * How E2B's names map onto sandboxd's (docs/e2b.md "Names"). E2B's SDK parses a sandbox id out of
 * hosts like `49983-<id>.<domain>`, so its ids are `[a-z0-9]+`; sandboxd's are `sbx_` plus 20
 * base36 characters. The E2B id is that base36 part, so the mapping is one-to-one and needs no
 * table: `sbx_abc` is `abc` to an E2B client and back.
 *
 * Keys: the SDK refuses an `X-API-KEY` not matching `^e2b_[0-9a-f]+$` (unless
 * `E2B_VALIDATE_API_KEY=false`). A sandboxd key in E2B form is `e2b_` and the hex of the key's
 * bytes: the same key, so its hash, tier, tenant and revocation are those of the native key and
 * nothing new is stored. `sandboxd key create --e2b` prints both forms.
 *
 * Imports nothing at run time but api-key.ts (no Buffer): the edge (edge/app.ts) reads an E2B-form
 * key's region with it, in an isolate.
 */
import { MAX_API_KEY_CHARS } from "../api/api-key.ts";

/** envd's port in E2B's SDK: a data-plane request for it goes to the E2B data plane, not the guest. */
export const E2B_ENVD_PORT = 49983;

const SANDBOX_PREFIX = "sbx_";
/** An E2B sandbox id: what ours carry after `sbx_` (base36, 20 characters today; up to 64 accepted). */
const E2B_SANDBOX_ID = /^[a-z0-9]{1,64}$/;

/** `sbx_<x>` as E2B names it: `<x>`. */
export function e2bSandboxId(sandboxId: string): string {
  return sandboxId.startsWith(SANDBOX_PREFIX) ? sandboxId.slice(SANDBOX_PREFIX.length) : sandboxId;
}

/**
 * The sandboxd id an E2B id names, or undefined when it cannot name one. An E2B id may carry a
 * `-<client id>` suffix (older SDKs send `<id>-<clientID>`); only the part before the first `-`
 * is the id.
 */
export function sandboxIdOfE2b(e2bId: string): string | undefined {
  const id = e2bId.split("-", 1)[0] ?? "";
  return E2B_SANDBOX_ID.test(id) ? `${SANDBOX_PREFIX}${id}` : undefined;
}

const E2B_KEY = /^e2b_([0-9a-f]+)$/;
/** The longest E2B-form key read: `e2b_` and the hex of the longest native key. */
export const MAX_E2B_KEY_CHARS = 4 + 2 * MAX_API_KEY_CHARS;

/** A native key in the form E2B's SDK accepts. */
export function e2bKeyOf(key: string): string {
  let hex = "";
  for (const b of new TextEncoder().encode(key)) hex += b.toString(16).padStart(2, "0");
  return `e2b_${hex}`;
}

/**
 * The native key a presented `X-API-KEY` stands for: an `e2b_<hex>` key decoded, any other string
 * as it is (the SDK sends a native key when its validation is off). Undefined for an E2B-form key
 * that decodes to nothing.
 */
export function nativeKeyOf(presented: string): string | undefined {
  if (presented.length > MAX_E2B_KEY_CHARS) return undefined;
  const m = E2B_KEY.exec(presented);
  if (!m) return presented;
  const hex = m[1]!;
  if (hex.length % 2 !== 0) return undefined;
  const bytes = new Uint8Array(hex.length / 2);
  for (let i = 0; i < bytes.length; i++) bytes[i] = Number.parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  // Invalid UTF-8 becomes U+FFFD, as a key no hash matches: refused by the caller's lookup.
  const key = new TextDecoder().decode(bytes);
  return key.length > 0 ? key : undefined;
}

/**
 * The envd version the control plane reports (`envdVersion`). E2B's SDK turns features on by it
 * (2.45.0: default user 0.4.0, stdin 0.3.0, `envd` close 0.5.2, octet-stream upload 0.5.7, file
 * metadata 0.6.2, entry info in watch events 0.6.3); the data plane serves what this version
 * promises (docs/e2b.md "Data plane").
 */
export const E2B_ENVD_VERSION = "0.6.4";
