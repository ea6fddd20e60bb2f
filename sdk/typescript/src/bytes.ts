/**
 * Bytes without Node's Buffer (Deno has it only under node:buffer): UTF-8 through
 * TextEncoder/TextDecoder, base64 through atob/btoa, which all three runtimes give.
 */

const encoder = new TextEncoder();

export function utf8(s: string): Uint8Array<ArrayBuffer> {
  return encoder.encode(s);
}

/** UTF-8 text of `b`; bytes that are not UTF-8 become U+FFFD. */
export function text(b: Uint8Array): string {
  return new TextDecoder().decode(b);
}

/** btoa takes a "binary string"; built in slices so a large input does not overflow the stack. */
export function toBase64(b: Uint8Array): string {
  let s = "";
  const SLICE = 0x8000;
  for (let i = 0; i < b.length; i += SLICE) s += String.fromCharCode(...b.subarray(i, i + SLICE));
  return btoa(s);
}

export function fromBase64(s: string): Uint8Array {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
