/**
 * `sandboxd sbx cp SRC DST`: one file between here and a sandbox, streamed both ways (a file
 * larger than memory passes through in chunks), `-` for stdin or stdout. A sandbox side is
 * `ID:/absolute/path`; anything else is a local path. Progress shows on a terminal.
 */
import { createWriteStream, statSync } from "node:fs";
import { unlink } from "node:fs/promises";
import { basename } from "node:path";
import { Readable, Writable } from "node:stream";
import { settled } from "../../contracts/best-effort.ts";
import type { Sandboxd } from "../../sdk/typescript/src/index.ts";
import type { CommandSpec } from "./args.ts";
import type { Ctx } from "./context.ts";
import type { CopyPlan, Endpoint } from "./cp-args.ts";
import { landing } from "./cp-args.ts";
import { bytes } from "./output.ts";
import { counted, Progress } from "./progress.ts";

function isLocalDir(p: string): boolean {
  try {
    return statSync(p).isDirectory();
  } catch {
    return false;
  }
}

interface CopyOpts {
  user?: string;
  spec: CommandSpec;
  ctx: Ctx;
}

/** Runs a copy checked by `parseCopy` (usage errors come before any connection). */
export async function copy(client: Sandboxd, plan: CopyPlan, opts: CopyOpts): Promise<number> {
  const { from, to, upload } = plan;
  const user = opts.user !== undefined ? { user: opts.user } : {};
  if (upload) {
    const target = to as Extract<Endpoint, { kind: "sandbox" }>;
    const path = target.path;
    const total = from.kind === "local" ? statSync(from.path).size : undefined;
    const raw =
      from.kind === "local"
        ? Bun.file(from.path).stream()
        : (Readable.toWeb(opts.ctx.stdin) as ReadableStream<Uint8Array>);
    const progress = new Progress(opts.ctx.stderr, `upload ${path}`);
    const body = counted(raw, (n) => progress.bytes(n, total));
    const sbx = client.sandboxes.ref(target.id);
    const r = await sbx.files.write(path, body, user);
    progress.done(`${bytes(r.size)}`);
    return 0;
  }
  const source = from as Extract<Endpoint, { kind: "sandbox" }>;
  const sbx = client.sandboxes.ref(source.id);
  // The download starts (and a missing file is refused) before any local file is opened.
  const stream = await sbx.files.readStream(source.path, user);
  const out = to.kind === "local" ? landing(to.path, basename(source.path), isLocalDir) : undefined;
  const progress = new Progress(
    opts.ctx.stderr,
    `download ${source.path}`,
    out !== undefined && opts.ctx.stderr.isTTY === true,
  );
  let n = 0;
  const body = counted(stream, (got) => {
    n = got;
    progress.bytes(got);
  });
  const sink = out === undefined ? opts.ctx.stdout : createWriteStream(out);
  try {
    await body.pipeTo(Writable.toWeb(sink as Writable) as WritableStream<Uint8Array>, {
      preventClose: out === undefined,
    });
  } catch (err) {
    // A download cut short leaves no half file behind under the name asked for.
    // The download's own error is the one to report; a failed unlink must not replace it.
    if (out !== undefined) await settled(unlink(out));
    throw err;
  }
  progress.done(bytes(n));
  return 0;
}
