/**
 * `sandboxd template ...`: list, bake (Pro keys: a template from an OCI image reference, waited
 * on phase by phase) and delete templates.
 */
import {
  MAX_MEM_MIB,
  MAX_PORT,
  MAX_VCPUS,
  MIN_MEM_MIB,
  MIN_PORT,
  MIN_VCPUS,
} from "../../contracts/api/limits.ts";
import { flag, list, type Parsed, str, UsageError } from "./args.ts";
import { clientOf } from "./connect.ts";
import type { Ctx, Handler } from "./context.ts";
import { json, table } from "./output.ts";
import { Progress } from "./progress.ts";

/**
 * How long `bake` waits for Live: a bake pulls, imports, boots and snapshots, minutes on a busy
 * host without hardware virtualisation; past this the command gives up (the bake goes on).
 */
const BAKE_WAIT_MS = 30 * 60_000;

const ls: Handler = async (p, spec, ctx) => {
  const all = await clientOf(p, spec, ctx).templates.list();
  if (flag(p, "json")) {
    ctx.stdout.write(`${json(all)}\n`);
    return 0;
  }
  // A Pro key sees the catalog (visibility, description); a sessions API key ids and readiness.
  const rows = all.map((t) =>
    "ready" in t
      ? [t.id, t.ready ? "ready" : "building", ""]
      : [t.id, t.visibility ?? "", t.description ?? ""],
  );
  const headers = all.some((t) => "ready" in t) ? ["ID", "STATUS", ""] : ["ID", "VISIBILITY", "DESCRIPTION"];
  ctx.stdout.write(`${table(headers, rows)}\n`);
  return 0;
};

async function readPassword(ctx: Ctx): Promise<string> {
  let s = "";
  for await (const c of ctx.stdin) s += Buffer.isBuffer(c) ? c.toString("utf8") : String(c);
  return s.replace(/\r?\n$/, "");
}

function ports(p: Parsed, specName: string): number[] | undefined {
  const words = list(p, "port");
  if (words.length === 0) return undefined;
  return words.map((w) => {
    const n = Number(w);
    if (!/^\d+$/.test(w) || n < MIN_PORT || n > MAX_PORT) {
      throw new UsageError(`--port must be from ${MIN_PORT} to ${MAX_PORT}, got ${w}`, specName);
    }
    return n;
  });
}

/** `--size VCPUSxMIB`, repeated: the bake's size classes (bounds checked by the service too). */
function sizes(p: Parsed, specName: string): { vcpus: number; memory_mib: number }[] | undefined {
  const words = list(p, "size");
  if (words.length === 0) return undefined;
  return words.map((w) => {
    const m = /^(\d+)x(\d+)$/.exec(w);
    const vcpus = Number(m?.[1]);
    const mem = Number(m?.[2]);
    if (!m || vcpus < MIN_VCPUS || vcpus > MAX_VCPUS || mem < MIN_MEM_MIB || mem > MAX_MEM_MIB) {
      throw new UsageError(
        `--size is VCPUSxMIB (vCPUs ${MIN_VCPUS}-${MAX_VCPUS}, MiB ${MIN_MEM_MIB}-${MAX_MEM_MIB}), got ${w}`,
        specName,
      );
    }
    return { vcpus, memory_mib: mem };
  });
}

const bake: Handler = async (p, spec, ctx) => {
  const [name, image] = p.positionals as [string, string];
  const readyCmd = str(p, "ready-cmd");
  const exposed = ports(p, spec.name);
  const classes = sizes(p, spec.name);
  const user = str(p, "registry-user");
  const client = clientOf(p, spec, ctx);
  const ready =
    readyCmd !== undefined || exposed !== undefined
      ? { ...(readyCmd !== undefined ? { cmd: readyCmd } : {}), ...(exposed ? { ports: exposed } : {}) }
      : undefined;
  const registryAuth = user !== undefined ? { username: user, password: await readPassword(ctx) } : undefined;
  const accepted = await client.templates.bake({
    name,
    image,
    ...(ready ? { ready } : {}),
    ...(registryAuth ? { registryAuth } : {}),
    ...(classes ? { sizes: classes } : {}),
  });
  if (flag(p, "no-wait")) {
    ctx.stdout.write(flag(p, "json") ? `${json(accepted)}\n` : `${accepted.id} ${accepted.phase}\n`);
    return 0;
  }
  const progress = new Progress(ctx.stderr, `bake ${name}`);
  progress.phase(accepted.phase);
  try {
    // A failed bake throws template_failed with the service's reason (printed as code: message).
    const live = await client.templates.wait(name, {
      timeoutMs: BAKE_WAIT_MS,
      onProgress: (t) => progress.phase("phase" in t ? t.phase : t.status),
    });
    progress.done("Live");
    ctx.stdout.write(flag(p, "json") ? `${json(live)}\n` : `${live.id} Live\n`);
    return 0;
  } finally {
    progress.done();
  }
};

/** Deletes each id in turn; the first refusal stops the rest. */
const rm: Handler = async (p, spec, ctx) => {
  const client = clientOf(p, spec, ctx);
  for (const id of p.positionals) {
    await client.templates.delete(id);
    ctx.stdout.write(`${id}\n`);
  }
  return 0;
};

export const TEMPLATE: Record<string, Handler> = { ls, bake, rm };
