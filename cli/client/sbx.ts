/**
 * `sandboxd sbx ...`: one handler per subcommand, each a few SDK calls and the printing. Listing
 * and info print a table or `key: value` lines, or the API's objects with `--json`; commands that
 * make or change sandboxes print the ids they touched (one a line), so scripts can capture them.
 */
import {
  MAX_EXEC_TIMEOUT_S,
  MAX_FORK_COUNT,
  MAX_IDLE_TIMEOUT_S,
  MAX_MEM_MIB,
  MAX_VCPUS,
  MIN_MEM_MIB,
  MIN_VCPUS,
} from "../../contracts/api/limits.ts";
import type { ExecOptions, Sandbox } from "../../sdk/typescript/src/index.ts";
import { type CommandSpec, flag, intOpt, list, type Parsed, pairs, str, UsageError } from "./args.ts";
import { clientOf } from "./connect.ts";
import type { Ctx, Handler } from "./context.ts";
import { copy } from "./cp.ts";
import { parseCopy } from "./cp-args.ts";
import { duration, json, keyValues, table } from "./output.ts";
import { shellJoin } from "./shell-words.ts";
import { attach, localSize } from "./terminal.ts";

function idOf(p: Parsed): string {
  return p.positionals[0]!;
}

const create: Handler = async (p, spec, ctx) => {
  const template = str(p, "template");
  if (!template) throw new UsageError("missing --template ID", spec.name);
  const action = str(p, "idle-action");
  if (action !== undefined && action !== "suspend" && action !== "delete") {
    throw new UsageError(`--idle-action is suspend or delete, got ${action}`, spec.name);
  }
  const egress = list(p, "egress");
  const idle = intOpt(p, spec, "idle-timeout", 1, MAX_IDLE_TIMEOUT_S);
  const vcpus = intOpt(p, spec, "vcpus", MIN_VCPUS, MAX_VCPUS);
  const memoryMib = intOpt(p, spec, "memory", MIN_MEM_MIB, MAX_MEM_MIB);
  const sbx = await clientOf(p, spec, ctx).sandboxes.create({
    template,
    labels: pairs(p, spec, "label"),
    ...(egress.length > 0 ? { egress: { allow: egress } } : {}),
    ...(idle !== undefined ? { idleTimeoutSeconds: idle } : {}),
    ...(action !== undefined ? { idleAction: action } : {}),
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
};
