/**
 * `sandboxd sbx ...`: one handler per subcommand, each a few SDK calls and the printing. Listing
 * and info print a table or `key: value` lines, or the API's objects with `--json`; commands that
 * make or change sandboxes print the ids they touched (one a line), so scripts can capture them;
 * `snapshot` prints the snapshot taken, and `restore`, `timeout` and `egress` one line of what now
 * holds (the API's answer with `--json`).
 */
import {
  MAX_EXEC_TIMEOUT_S,
  MAX_FORK_COUNT,
  MAX_IDLE_TIMEOUT_S,
  MAX_LIST_LIMIT,
  MAX_MEM_MIB,
  MAX_SANDBOX_TIMEOUT_S,
  MAX_VCPUS,
  MIN_MEM_MIB,
  MIN_VCPUS,
} from "../../contracts/api/limits.ts";
import type {
  ExecOptions,
  Sandbox,
  SnapshotInfo,
  SnapshotListOptions,
} from "../../sdk/typescript/src/index.ts";
import { type CommandSpec, flag, intOpt, list, type Parsed, pairs, str, UsageError } from "./args.ts";
import { clientOf } from "./connect.ts";
import type { Ctx, Handler } from "./context.ts";
import { copy } from "./cp.ts";
import { parseCopy } from "./cp-args.ts";
import { bytes, duration, json, keyValues, table } from "./output.ts";
import { shellJoin } from "./shell-words.ts";
import { attach, localSize } from "./terminal.ts";

function idOf(p: Parsed): string {
  return p.positionals[0]!;
}

/** An option that is `suspend` or `delete` (what happens at a deadline), or undefined when absent. */
function actionOpt(p: Parsed, spec: CommandSpec, name: string): "suspend" | "delete" | undefined {
  const v = str(p, name);
  if (v !== undefined && v !== "suspend" && v !== "delete") {
    throw new UsageError(`--${name} is suspend or delete, got ${v}`, spec.name);
  }
  return v;
}

const create: Handler = async (p, spec, ctx) => {
  const template = str(p, "template");
  const snapshot = str(p, "snapshot");
  if (!template && !snapshot) throw new UsageError("missing --template ID or --snapshot SNAP", spec.name);
  if (template && snapshot) throw new UsageError("--template and --snapshot exclude each other", spec.name);
  const action = actionOpt(p, spec, "idle-action");
  const onTimeout = actionOpt(p, spec, "on-timeout");
  const egress = list(p, "egress");
  const idle = intOpt(p, spec, "idle-timeout", 1, MAX_IDLE_TIMEOUT_S);
  const timeout = intOpt(p, spec, "timeout", 1, MAX_SANDBOX_TIMEOUT_S);
  const vcpus = intOpt(p, spec, "vcpus", MIN_VCPUS, MAX_VCPUS);
  const memoryMib = intOpt(p, spec, "memory", MIN_MEM_MIB, MAX_MEM_MIB);
  const sbx = await clientOf(p, spec, ctx).sandboxes.create({
    ...(template ? { template } : { snapshot }),
    labels: pairs(p, spec, "label"),
    ...(egress.length > 0 ? { egress: { allow: egress } } : {}),
    ...(idle !== undefined ? { idleTimeoutSeconds: idle } : {}),
    ...(action !== undefined ? { idleAction: action } : {}),
    ...(timeout !== undefined ? { timeoutSeconds: timeout } : {}),
    ...(onTimeout !== undefined ? { onTimeout } : {}),
    ...(vcpus !== undefined ? { vcpus } : {}),
    ...(memoryMib !== undefined ? { memoryMib } : {}),
  });
  ctx.stdout.write(flag(p, "json") ? `${json(await sbx.info())}\n` : `${sbx.id}\n`);
  return 0;
};

const ls: Handler = async (p, spec, ctx) => {
  const all = await clientOf(p, spec, ctx).sandboxes.list();
  if (flag(p, "json")) {
    ctx.stdout.write(`${json(all)}\n`);
    return 0;
  }
  ctx.stdout.write(
    `${table(
      ["ID", "TEMPLATE", "STATE"],
      all.map((s) => [s.id, s.template, s.state]),
    )}\n`,
  );
  return 0;
};

const info: Handler = async (p, spec, ctx) => {
  const sbx = clientOf(p, spec, ctx).sandboxes.ref(idOf(p));
  const i = await sbx.info();
  if (flag(p, "json")) {
    ctx.stdout.write(`${json(i)}\n`);
    return 0;
  }
  ctx.stdout.write(
    `${keyValues({
      id: i.id,
      template: i.template,
      state: i.suspended_by ? `${i.state} (by ${i.suspended_by})` : i.state,
      age: duration(i.age_secs),
      idle: duration(i.idle_secs),
      size: i.vcpus !== undefined ? `${i.vcpus} vCPU, ${i.memory_mib} MiB` : undefined,
      execs: i.exec_count,
      labels: i.labels,
      endpoints: i.endpoints,
      idle_timeout:
        i.idle_timeout_seconds !== undefined
          ? `${i.idle_timeout_seconds}s, then ${i.idle_action}`
          : undefined,
      timeout:
        i.timeout_seconds !== undefined
          ? `${i.timeout_seconds}s, then ${i.on_timeout}${i.expires_at ? ` at ${i.expires_at}` : ""}`
          : undefined,
    })}\n`,
  );
  return 0;
};

async function readAll(stdin: NodeJS.ReadStream): Promise<Uint8Array> {
  const chunks: Buffer[] = [];
  for await (const c of stdin) chunks.push(Buffer.isBuffer(c) ? c : Buffer.from(c));
  return new Uint8Array(Buffer.concat(chunks));
}

/** Prints a streamed exec's output as it comes; the command's exit code. */
async function streamExec(sbx: Sandbox, command: string, opts: ExecOptions, ctx: Ctx): Promise<number> {
  let exitCode = 1;
  for await (const ev of sbx.execStream(command, opts)) {
    // The bytes as the command wrote them (not the text form, which replaces invalid UTF-8).
    if (ev.type === "stdout") ctx.stdout.write(ev.bytes);
    else if (ev.type === "stderr") ctx.stderr.write(ev.bytes);
    else if (ev.type === "exit") exitCode = ev.exitCode;
  }
  return exitCode;
}

const exec: Handler = async (p, spec, ctx) => {
  const words = p.rest;
  if (words.length === 0) throw new UsageError("missing CMD", spec.name);
  const command = words.length === 1 ? words[0]! : shellJoin(words);
  const timeout = intOpt(p, spec, "timeout", 1, MAX_EXEC_TIMEOUT_S);
  const sbx = clientOf(p, spec, ctx).sandboxes.ref(idOf(p));
  const stdin = flag(p, "stdin") ? await readAll(ctx.stdin) : undefined;
  return streamExec(
    sbx,
    command,
    {
      env: pairs(p, spec, "env"),
      cwd: str(p, "cwd"),
      user: str(p, "user"),
      ...(timeout !== undefined ? { timeoutSeconds: timeout } : {}),
      ...(stdin !== undefined ? { stdin } : {}),
    },
    ctx,
  );
};

const cp: Handler = async (p, spec, ctx) => {
  const plan = parseCopy(p.positionals[0]!, p.positionals[1]!, spec);
  return copy(clientOf(p, spec, ctx), plan, { user: str(p, "user"), spec, ctx });
};

/**
 * The shell a piped `sbx shell` feeds its input to: the one the terminal route starts (bash where
 * the image has it, else sh), reading the script from stdin.
 */
const PIPED_SHELL = "if [ -x /bin/bash ]; then exec /bin/bash -s; else exec /bin/sh -s; fi";

const shell: Handler = async (p, spec, ctx) => {
  const sbx = clientOf(p, spec, ctx).sandboxes.ref(idOf(p));
  if (!ctx.stdin.isTTY) {
    // Input from a pipe or file is a script, not keystrokes: a terminal cannot pass its end on
    // reliably (a Ctrl-D typed ahead is lost when the shell switches its terminal to raw mode), so
    // it runs as an exec with that input, which ends at its end and has a real exit code.
    const script = await readAll(ctx.stdin);
    return streamExec(sbx, PIPED_SHELL, { stdin: script, timeoutSeconds: MAX_EXEC_TIMEOUT_S }, ctx);
  }
  const stdout = ctx.stdout as NodeJS.WriteStream;
  const term = await sbx.terminal(localSize(stdout));
  return attach(term, {
    stdin: ctx.stdin,
    stdout,
    on: (sig, fn) => process.on(sig, fn),
    off: (sig, fn) => process.off(sig, fn),
  });
};

const fork: Handler = async (p, spec, ctx) => {
  const count = intOpt(p, spec, "count", 1, MAX_FORK_COUNT);
  const labels = list(p, "label");
  if (labels.length > (count ?? 1)) throw new UsageError("at most one --label per child", spec.name);
  const sbx = clientOf(p, spec, ctx).sandboxes.ref(idOf(p));
  const kids = await sbx.fork({ count: count ?? 1, ...(labels.length > 0 ? { labels } : {}) });
  ctx.stdout.write(
    flag(p, "json")
      ? `${json(kids.map((k) => ({ id: k.id, endpoints: k.endpoints })))}\n`
      : kids.map((k) => `${k.id}\n`).join(""),
  );
  return 0;
};

function stateChange(which: "suspend" | "resume"): Handler {
  return async (p, spec, ctx) => {
    const sbx = clientOf(p, spec, ctx).sandboxes.ref(idOf(p));
    const r = which === "suspend" ? await sbx.suspend() : await sbx.resume();
    ctx.stdout.write(flag(p, "json") ? `${json(r)}\n` : `${r.id} ${r.state}\n`);
    return 0;
  };
}

/** Deletes each id in turn; the first refusal stops the rest (its id is in the message). */
const rm: Handler = async (p, spec: CommandSpec, ctx) => {
  const client = clientOf(p, spec, ctx);
  for (const id of p.positionals) {
    await client.sandboxes.ref(id).delete();
    ctx.stdout.write(`${id}\n`);
  }
  return 0;
};

/** A snapshot as `key: value` lines (what `sbx snapshot` prints). */
function snapshotText(s: SnapshotInfo): string {
  return keyValues({
    id: s.id,
    state: s.state,
    name: s.name,
    source: s.source_sandbox,
    template: s.template,
    size: bytes(s.size_bytes),
    labels: s.labels,
    created: s.created_at,
    error: s.error,
  });
}

const snapshot: Handler = async (p, spec, ctx) => {
  const name = str(p, "name");
  const labels = pairs(p, spec, "label");
  const snap = await clientOf(p, spec, ctx)
    .sandboxes.ref(idOf(p))
    .snapshot({ ...(name !== undefined ? { name } : {}), ...(labels ? { labels } : {}) });
  ctx.stdout.write(flag(p, "json") ? `${json(snap)}\n` : `${snapshotText(snap)}\n`);
  return 0;
};

type SnapshotState = NonNullable<SnapshotListOptions["state"]>;
/** The states `--state` takes: the SDK's filter type checks this list against the API's. */
const SNAPSHOT_STATES: readonly SnapshotState[] = ["creating", "ready", "failed", "lost"];
/**
 * The most `sbx snapshots --limit` takes: a bound on the rows held in memory, far above a tenant's
 * cap of kept snapshots (500 for enterprise) plus the failed and lost ones it has not deleted.
 */
const MAX_SNAPSHOTS_SHOWN = 100_000;

const snapshots: Handler = async (p, spec, ctx) => {
  const labels: Record<string, string> = {};
  for (const w of list(p, "label")) {
    const colon = w.indexOf(":");
    if (colon <= 0) throw new UsageError(`--label takes KEY:VALUE, got ${w}`, spec.name);
    labels[w.slice(0, colon)] = w.slice(colon + 1);
  }
  const state = str(p, "state");
  if (state !== undefined && !(SNAPSHOT_STATES as readonly string[]).includes(state)) {
    throw new UsageError(`--state is one of ${SNAPSHOT_STATES.join(", ")}, got ${state}`, spec.name);
  }
  const limit = intOpt(p, spec, "limit", 1, MAX_SNAPSHOTS_SHOWN);
  const sandbox = str(p, "sandbox");
  const template = str(p, "template");
  const all: SnapshotInfo[] = [];
  // Every page (the SDK follows next_cursor), or pages until `limit` rows are in.
  for await (const page of clientOf(p, spec, ctx).snapshots.pages({
    labels,
    ...(state !== undefined ? { state: state as SnapshotState } : {}),
    ...(sandbox !== undefined ? { sourceSandbox: sandbox } : {}),
    ...(template !== undefined ? { template } : {}),
    ...(limit !== undefined ? { limit: Math.min(limit, MAX_LIST_LIMIT) } : {}),
  })) {
    all.push(...page.items);
    if (limit !== undefined && all.length >= limit) break;
  }
  const shown = limit === undefined ? all : all.slice(0, limit);
  if (flag(p, "json")) {
    ctx.stdout.write(`${json(shown)}\n`);
    return 0;
  }
  ctx.stdout.write(
    `${table(
      ["ID", "NAME", "STATE", "SIZE", "SOURCE", "TEMPLATE", "CREATED"],
      shown.map((s) => [
        s.id,
        s.name ?? "-",
        s.state,
        bytes(s.size_bytes),
        s.source_sandbox,
        s.template,
        s.created_at,
      ]),
    )}\n`,
  );
  return 0;
};

/** Deletes each snapshot in turn; the first refusal stops the rest (its id is in the message). */
const snapshotRm: Handler = async (p, spec, ctx) => {
  const client = clientOf(p, spec, ctx);
  for (const id of p.positionals) {
    await client.snapshots.delete(id);
    ctx.stdout.write(`${id}\n`);
  }
  return 0;
};

const restore: Handler = async (p, spec, ctx) => {
  const r = await clientOf(p, spec, ctx).sandboxes.ref(idOf(p)).restore(p.positionals[1]!);
  ctx.stdout.write(
    flag(p, "json")
      ? `${json(r)}\n`
      : `${r.id} restored to ${r.snapshot} in ${r.restore_ms} ms (down ${r.down_ms} ms)\n`,
  );
  return 0;
};

const timeout: Handler = async (p, spec, ctx) => {
  const words = p.positionals[1]!;
  const seconds = Number(words);
  if (!/^\d+$/.test(words) || seconds < 1 || seconds > MAX_SANDBOX_TIMEOUT_S) {
    throw new UsageError(
      `SECONDS must be an integer from 1 to ${MAX_SANDBOX_TIMEOUT_S}, got ${words}`,
      spec.name,
    );
  }
  const onTimeout = actionOpt(p, spec, "on-timeout");
  const r = await clientOf(p, spec, ctx).sandboxes.ref(idOf(p)).setTimeout(seconds, onTimeout);
  ctx.stdout.write(
    flag(p, "json")
      ? `${json(r)}\n`
      : `${r.id} ${r.on_timeout} after ${r.timeout_seconds}s${r.expires_at ? ` at ${r.expires_at}` : ""}\n`,
  );
  return 0;
};

const egress: Handler = async (p, spec, ctx) => {
  const r = await clientOf(p, spec, ctx).sandboxes.ref(idOf(p)).setEgress(p.positionals.slice(1));
  ctx.stdout.write(
    flag(p, "json")
      ? `${json(r)}\n`
      : `${r.id} egress ${r.egress.allow.length > 0 ? r.egress.allow.join(" ") : "denied"}\n`,
  );
  return 0;
};

export const SBX: Record<string, Handler> = {
  create,
  ls,
  info,
  exec,
  cp,
  shell,
  fork,
  suspend: stateChange("suspend"),
  resume: stateChange("resume"),
  rm,
  snapshot,
  snapshots,
  "snapshot-rm": snapshotRm,
  restore,
  timeout,
  egress,
};
