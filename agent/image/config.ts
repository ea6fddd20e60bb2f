/**
 * The image config: parsing the raw OCI/Docker config blob (its shape, its layer count), and
 * normalising it into what the guest runs, with Docker's defaults filled in (PATH, HOME,
 * WorkingDir, the user from the image's own /etc/passwd and /etc/group, Docker's argv rule).
 * Pure: the caller reads passwd and group out of the rootfs.
 */
import { createHash } from "node:crypto";
import { z } from "zod";
import { ImageError, parseJson } from "./errors.ts";
import type { ImportLimits } from "./limits.ts";

export interface ImageUser {
  uid: number;
  gid: number;
  name: string;
}

/** The image config as the guest needs it to start the process the way Docker would. */
export interface ImageConfig {
  env: string[];
  workingDir: string;
  entrypoint: string[];
  cmd: string[];
  user: ImageUser;
  /** `sha256:<hex>` of the source image's config blob (Docker's image id). */
  digest: string;
  /** TCP ports from ExposedPorts (the only protocol the connect tunnel carries). */
  exposedPorts: number[];
}

/**
 * `ImageConfig` as the agent writes it to disk (the image cache's config.json, template and VM
 * records) and checks it when reading it back: a torn or foreign file is refused, not trusted.
 */
export const StoredImageConfig = z.object({
  env: z.array(z.string()),
  workingDir: z.string(),
  entrypoint: z.array(z.string()),
  cmd: z.array(z.string()),
  user: z.object({ uid: z.int(), gid: z.int(), name: z.string() }),
  digest: z.string(),
  exposedPorts: z.array(z.int()),
}) satisfies z.ZodType<ImageConfig>;

/** Docker's PATH for images whose Env lacks one (moby `oci.DefaultPathEnv` on Linux). */
export const DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

const StrList = z.array(z.string()).nullish();
export const RawImageConfig = z.object({
  architecture: z.string().optional(),
  os: z.string().optional(),
  config: z
    .object({
      Env: StrList,
      WorkingDir: z.string().nullish(),
      Entrypoint: StrList,
      Cmd: StrList,
      User: z.string().nullish(),
      ExposedPorts: z.record(z.string(), z.unknown()).nullish(),
    })
    .nullish(),
  rootfs: z.object({ type: z.string().optional(), diff_ids: z.array(z.string()) }),
});
export type RawImageConfig = z.infer<typeof RawImageConfig>;

/** Parses the config blob; its digest (Docker's image id) is the cache key of the import. */
export function parseConfig(bytes: Buffer, limits: ImportLimits): { config: RawImageConfig; digest: string } {
  const config = parseJson(bytes, RawImageConfig, "image_bad_config", "image config");
  if (config.rootfs.diff_ids.length > limits.maxLayers) {
    throw new ImageError(
      "image_too_large",
      `image has ${config.rootfs.diff_ids.length} layers (limit ${limits.maxLayers})`,
      {
        details: { limit: "maxLayers", value: limits.maxLayers },
      },
    );
  }
  return { config, digest: `sha256:${createHash("sha256").update(bytes).digest("hex")}` };
}

interface PasswdEntry {
  name: string;
  uid: number;
  gid: number;
  home: string;
}

interface GroupEntry {
  name: string;
  gid: number;
}

const MAX_ID = 2 ** 32 - 2; // (uid_t)-1 means "no change" to the kernel; ids stop below it

function parseId(s: string): number | undefined {
  if (!/^[0-9]{1,10}$/.test(s)) return undefined;
  const n = Number(s);
  return n <= MAX_ID ? n : undefined;
}

export function parsePasswd(text: string): PasswdEntry[] {
  const out: PasswdEntry[] = [];
  for (const line of text.split("\n")) {
    if (line.startsWith("#")) continue;
    const f = line.split(":");
    if (f.length < 4) continue;
    const uid = parseId(f[2] as string);
    const gid = parseId(f[3] as string);
    if (uid === undefined || gid === undefined || !f[0]) continue;
    out.push({ name: f[0], uid, gid, home: f[5] ?? "" });
  }
  return out;
}

export function parseGroup(text: string): GroupEntry[] {
  const out: GroupEntry[] = [];
  for (const line of text.split("\n")) {
    if (line.startsWith("#")) continue;
    const f = line.split(":");
    if (f.length < 3) continue;
    const gid = parseId(f[2] as string);
    if (gid === undefined || !f[0]) continue;
    out.push({ name: f[0], gid });
  }
  return out;
}

/**
 * Resolves config User the way runc does: `user`, `uid`, `user:group`, `uid:gid` (and mixes).
 * A name is looked up in the image's own /etc/passwd (/etc/group); a numeric id needs no entry
 * (gid then defaults to the passwd entry's, or 0). An unknown name is an error, not root.
 */
export function resolveUser(
  spec: string,
  passwdText: string,
  groupText: string,
): ImageUser & { home: string } {
  const passwd = parsePasswd(passwdText);
  const groups = parseGroup(groupText);
  const [userPart = "", groupPart] = spec.split(":", 2);
  let entry: PasswdEntry | undefined;
  let uid: number;
  let name: string;
  if (userPart === "") {
    uid = 0;
    entry = passwd.find((p) => p.uid === 0);
    name = entry?.name ?? "root";
  } else {
    entry = passwd.find((p) => p.name === userPart);
    const numeric = parseId(userPart);
    if (!entry && numeric !== undefined) entry = passwd.find((p) => p.uid === numeric);
    if (entry) {
      uid = entry.uid;
      name = entry.name;
    } else if (numeric !== undefined) {
      uid = numeric;
      name = userPart;
    } else {
      throw new ImageError(
        "image_user_unknown",
        `config User ${JSON.stringify(spec)}: no user ${JSON.stringify(userPart)} in the image's /etc/passwd`,
        {
          details: { user: spec },
        },
      );
    }
  }
  let gid = entry?.gid ?? 0;
  if (groupPart !== undefined && groupPart !== "") {
    const g = groups.find((x) => x.name === groupPart);
    const numeric = parseId(groupPart);
    if (g) gid = g.gid;
    else if (numeric !== undefined) gid = numeric;
    else {
      throw new ImageError(
        "image_user_unknown",
        `config User ${JSON.stringify(spec)}: no group ${JSON.stringify(groupPart)} in the image's /etc/group`,
        {
          details: { user: spec },
        },
      );
    }
  }
  // runc sets HOME from the passwd entry, "/" when there is none.
  return { uid, gid, name, home: entry?.home || "/" };
}

/** Normalises a raw image config into what the guest runs (Docker's defaults filled in). */
export function normalizeConfig(
  raw: RawImageConfig,
  digest: string,
  passwdText: string,
  groupText: string,
): ImageConfig {
  const c = raw.config ?? {};
  const env = [...(c.Env ?? [])];
  const has = (k: string) => env.some((e) => e.startsWith(`${k}=`));
  if (!has("PATH")) env.push(`PATH=${DEFAULT_PATH}`);
  const user = resolveUser(c.User ?? "", passwdText, groupText);
  if (!has("HOME")) env.push(`HOME=${user.home}`);
  let workingDir = c.WorkingDir || "/";
  if (!workingDir.startsWith("/")) {
    // Docker refuses to create a container whose working dir is relative; so do we, up front.
    throw new ImageError("image_bad_config", `WorkingDir ${JSON.stringify(workingDir)} is not absolute`);
  }
  workingDir = `/${workingDir
    .split("/")
    .filter((p) => p !== "" && p !== ".")
    .join("/")}`;
  const ports = new Set<number>();
  for (const key of Object.keys(c.ExposedPorts ?? {})) {
    const m = /^([0-9]{1,5})(?:\/(tcp|udp|sctp))?$/i.exec(key);
    if (!m) continue;
    const port = Number(m[1]);
    if ((m[2] ?? "tcp").toLowerCase() === "tcp" && port >= 1 && port <= 65535) ports.add(port);
  }
  return {
    env,
    workingDir,
    entrypoint: [...(c.Entrypoint ?? [])],
    cmd: [...(c.Cmd ?? [])],
    user: { uid: user.uid, gid: user.gid, name: user.name },
    digest,
    exposedPorts: [...ports].sort((a, b) => a - b),
  };
}

/**
 * Docker's rule for the argv: a given CMD replaces the image's Cmd; the image's Entrypoint is
 * prepended to whichever Cmd is used; nothing at all is an error.
 */
export function resolveCommand(config: Pick<ImageConfig, "entrypoint" | "cmd">, cmd?: string[]): string[] {
  const argv = [...config.entrypoint, ...(cmd && cmd.length > 0 ? cmd : config.cmd)];
  if (argv.length === 0) {
    throw new ImageError("image_no_command", "the image has no Entrypoint or Cmd and no command was given");
  }
  return argv;
}
