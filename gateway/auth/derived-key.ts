/**
 * Signing keys derived from a server secret: HMAC-SHA256(secret, label). Each use has its own
 * label, so a token of one kind (connect URLs, E2B's envd tokens) never verifies as another, and
 * each key is 256 bits whatever the secret's length (RFC 7518 3.2). Kept per (label, secret):
 * a process has one secret per use, so the map holds a handful of keys.
 */
import { createHmac } from "node:crypto";

const keys = new Map<string, Uint8Array>();

export function derivedKey(secret: string, label: string): Uint8Array {
  const id = `${label}\0${secret}`;
  let key = keys.get(id);
  if (!key) {
    key = new Uint8Array(createHmac("sha256", secret).update(label).digest());
    keys.set(id, key);
  }
  return key;
}
