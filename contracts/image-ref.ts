/**
 * OCI image references (sandboxes API bake, docs/sandboxes.md "Rules of the sandboxes API" `image`), parsed strictly before anything hands
 * them to a tool: the gateway refuses a bad one with 400, the agent checks again before it runs
 * skopeo (agent/image/pull.ts). The grammar is the Docker/distribution one,
 *
 *   [domain[:port]/]path-component(/path-component)*[:tag][@digest]
 *
 * with two narrowings that keep a reference from ever reading as something else on a command
 * line: no character outside the grammar (so no leading `-`, no whitespace, no `://` scheme, no
 * transport prefix), and digests limited to sha256 / sha512 in lower-case hex.
 */

export interface ImageReference {
  /** `host[:port]` of the registry, as written; undefined: the tool's default registry. */
  domain?: string;
  /** Host part of `domain` (brackets of an IPv6 literal removed), lower-cased. */
  host?: string;
  port?: number;
  /** Repository path, e.g. `library/busybox` or `team/app`. */
  path: string;
  /** Tag; `latest` when neither a tag nor a digest is given (what Docker assumes). */
  tag?: string;
  /** `sha256:<hex>` when the reference pins one. */
  digest?: string;
  /** The reference rebuilt from its parts (what the agent passes on). */
  canonical: string;
  /** The reference without tag and digest: `[domain/]path`. */
  name: string;
}

/** distribution/reference: the whole name (domain + path) is at most 255 characters. */
const MAX_NAME_LENGTH = 255;
const PATH_COMPONENT = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;
const DOMAIN_COMPONENT = /^(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])$/;
const TAG = /^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$/;
const DIGEST = /^(?:sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})$/;
const IPV6_LITERAL = /^\[([0-9A-Fa-f:.]+)\]$/;

export class ImageReferenceError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "ImageReferenceError";
  }
}

function bad(ref: string, why: string): never {
  throw new ImageReferenceError(`invalid image reference ${JSON.stringify(ref.slice(0, 300))}: ${why}`);
}

/** Parses `ref` or throws `ImageReferenceError` with a readable reason. */
export function parseImageReference(ref: string): ImageReference {
  if (ref.length === 0) bad(ref, "it is empty");
  if (ref.length > MAX_NAME_LENGTH + 1 + 128 + 1 + 7 + 128) bad(ref, "it is too long");
  // Nothing outside the grammar's alphabet: no leading '-', no spaces, no control characters.
  if (!/^[A-Za-z0-9[\]]/.test(ref)) bad(ref, "it must start with a letter, a digit or '['");
  if (!/^[A-Za-z0-9._:/@[\]-]+$/.test(ref)) bad(ref, "it holds a character outside [A-Za-z0-9._:/@[]-]");
  if (ref.includes("://")) bad(ref, "a reference has no scheme (write host/path:tag)");

  let rest = ref;
  let digest: string | undefined;
  const at = rest.indexOf("@");
  if (at >= 0) {
    digest = rest.slice(at + 1);
    rest = rest.slice(0, at);
    if (!DIGEST.test(digest)) bad(ref, "the digest must be sha256:<64 hex> or sha512:<128 hex>");
  }
  let tag: string | undefined;
  const colon = rest.lastIndexOf(":");
  if (colon > rest.lastIndexOf("/") && !rest.slice(colon).includes("]")) {
    tag = rest.slice(colon + 1);
    rest = rest.slice(0, colon);
    if (!TAG.test(tag)) bad(ref, "the tag must match [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}");
  }
  if (rest.length === 0) bad(ref, "it names no repository");
  if (rest.length > MAX_NAME_LENGTH) bad(ref, `the name is over ${MAX_NAME_LENGTH} characters`);

  const parts = rest.split("/");
  let domain: string | undefined;
  let host: string | undefined;
  let port: number | undefined;
  const first = parts[0] ?? "";
  // Docker's rule: the first component is a registry when it has a '.' or a ':', is
  // `localhost`, or is an IPv6 literal; otherwise the whole is a path on the default registry.
  if (parts.length > 1 && (/[.:]/.test(first) || first === "localhost" || first.startsWith("["))) {
    domain = first;
    parts.shift();
    let hostPart = first;
    const v6 = /^(\[[^\]]*\])(?::(.*))?$/.exec(first);
    let portText: string | undefined;
    if (v6) {
      hostPart = v6[1] ?? "";
      portText = v6[2];
      const inner = IPV6_LITERAL.exec(hostPart)?.[1];
      if (!inner || !isIpv6(inner)) bad(ref, "the registry's IPv6 address is malformed");
      host = inner.toLowerCase();
    } else {
      const c = first.indexOf(":");
      if (c >= 0) {
        hostPart = first.slice(0, c);
        portText = first.slice(c + 1);
      }
      if (!hostPart.split(".").every((p) => DOMAIN_COMPONENT.test(p)))
        bad(ref, "the registry host is not a valid host name");
      host = hostPart.toLowerCase();
    }
    if (portText !== undefined) {
      if (!/^[0-9]{1,5}$/.test(portText)) bad(ref, "the registry port is not a number");
      port = Number(portText);
      if (port < 1 || port > 65535) bad(ref, "the registry port is out of range");
    }
  } else if (first.includes("[")) {
    bad(ref, "brackets are only allowed around a registry's IPv6 address");
  }
  if (parts.length === 0) bad(ref, "it names no repository");
  for (const p of parts) {
    if (!PATH_COMPONENT.test(p))
      bad(
        ref,
        `path component ${JSON.stringify(p)} must be lower-case [a-z0-9] separated by '.', '_', '__' or '-'`,
      );
  }
  const path = parts.join("/");
  if (tag === undefined && digest === undefined) tag = "latest";
  const name = domain ? `${domain}/${path}` : path;
  const canonical = `${name}${tag !== undefined ? `:${tag}` : ""}${digest !== undefined ? `@${digest}` : ""}`;
  const out: ImageReference = { path, canonical, name };
  if (domain !== undefined) out.domain = domain;
  if (host !== undefined) out.host = host;
  if (port !== undefined) out.port = port;
  if (tag !== undefined) out.tag = tag;
  if (digest !== undefined) out.digest = digest;
  return out;
}

function isIpv6(s: string): boolean {
  if (!/^[0-9A-Fa-f:.]+$/.test(s) || !s.includes(":")) return false;
  try {
    return new URL(`http://[${s}]/`).hostname.length > 0;
  } catch {
    return false;
  }
}
