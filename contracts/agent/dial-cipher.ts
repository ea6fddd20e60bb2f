/**
 * The encryption of a dial-out connection (docs/regions.md "BYOC agents: who dials whom"): every
 * message after the greeting is sealed with AES-256-GCM under a key of its direction, derived
 * with HKDF-SHA256 from the agent's own key (which only that agent and the gateways hold) and
 * both ends' fresh nonces. So the link is private and tamper-evident whatever carries it (plain
 * HTTP, an edge that terminates TLS), a gateway that does not hold the agent's key cannot speak
 * for one (it cannot seal what the agent opens), and a recorded session cannot be replayed into
 * another (new nonces, new keys). Each direction counts its messages: the GCM nonce is the count,
 * so a message dropped, repeated or reordered fails to open and ends the connection.
 */
import { createCipheriv, createDecipheriv, hkdfSync, randomBytes } from "node:crypto";
import { SandboxdError } from "../errors.ts";

/** Bytes of each end's greeting nonce. */
export const DIAL_NONCE_BYTES = 16;
const TAG_BYTES = 16;
const IV_BYTES = 12;

export type DialSide = "agent" | "gateway";

export function dialNonce(): Uint8Array {
  return randomBytes(DIAL_NONCE_BYTES);
}

function directionKey(agentKey: Uint8Array, salt: Uint8Array, from: DialSide): Buffer {
  return Buffer.from(hkdfSync("sha256", agentKey, salt, `sandboxd-dial ${from}->`, 32));
}

function iv(counter: bigint): Buffer {
  const b = Buffer.alloc(IV_BYTES);
  b.writeBigUInt64BE(counter, IV_BYTES - 8);
  return b;
}

export class DialCipher {
  private readonly sendKey: Buffer;
  private readonly recvKey: Buffer;
  private sent = 0n;
  private received = 0n;

  /** `self`: which end this is; the nonces are the agent's and the gateway's greeting nonces. */
  constructor(agentKey: Uint8Array, agentNonce: Uint8Array, gatewayNonce: Uint8Array, self: DialSide) {
    if (agentNonce.length !== DIAL_NONCE_BYTES || gatewayNonce.length !== DIAL_NONCE_BYTES)
      throw new SandboxdError("bad_request", `a dial nonce is ${DIAL_NONCE_BYTES} bytes`);
    const salt = Buffer.concat([agentNonce, gatewayNonce]);
    const peer: DialSide = self === "agent" ? "gateway" : "agent";
    this.sendKey = directionKey(agentKey, salt, self);
    this.recvKey = directionKey(agentKey, salt, peer);
  }

  seal(plain: Uint8Array): Buffer {
    const c = createCipheriv("aes-256-gcm", this.sendKey, iv(this.sent++));
    return Buffer.concat([c.update(plain), c.final(), c.getAuthTag()]);
  }

  /** The plain message, or a `bad_request` error when it was not sealed by the peer as the next one. */
  open(sealed: Uint8Array): Buffer {
    if (sealed.length < TAG_BYTES)
      throw new SandboxdError("bad_request", "a dial message shorter than its tag");
    const d = createDecipheriv("aes-256-gcm", this.recvKey, iv(this.received));
    d.setAuthTag(sealed.subarray(sealed.length - TAG_BYTES));
    try {
      const out = Buffer.concat([d.update(sealed.subarray(0, sealed.length - TAG_BYTES)), d.final()]);
      this.received++;
      return out;
    } catch (err) {
      throw new SandboxdError("bad_request", "a dial message failed authentication", { cause: err });
    }
  }
}
