/**
 * Background processes on the agent's HTTP API (docs/agent-api.md "Background processes"):
 * start, list, logs (whole, or followed as the frames of a streamed exec,
 * contracts/agent/exec-stream.ts, ending with a `result` frame holding the process's info),
 * stdin and kill. The work is agent/sandbox/processes.ts; this file only parses.
 */
import type { Hono, MiddlewareHandler } from "hono";
import type { z } from "zod";
import { ExecFrameKind, encodeExecFrame } from "../../contracts/agent/exec-stream.ts";
import {
  type ProcessInfo,
  ProcessPidParam,
  ProcessStartBody,
  ProcessStdinBody,
} from "../../contracts/agent/processes.ts";
import { VmIdParam } from "../../contracts/agent/schemas.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { streamedAnswer } from "../../contracts/streamed-answer.ts";
import type { SandboxManager } from "../sandbox/manager.ts";
import { startProcess } from "../sandbox/processes.ts";
import { mapAgentError } from "./errors.ts";
import { STREAM_BUFFER_BYTES } from "./exec-stream.ts";

export interface ProcessRouteHelpers {
  json: MiddlewareHandler;
  parse: <T extends z.ZodType>(schema: T, value: unknown) => z.infer<T>;
  body: (req: Request) => Promise<unknown>;
}

const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));

export function processRoutes(r: Hono, manager: SandboxManager, h: ProcessRouteHelpers): void {
  const { json, parse, body } = h;
  const vmId = (c: { req: { param(n: string): string } }) => parse(VmIdParam, c.req.param("id"));
  const pidOf = (c: { req: { param(n: string): string } }) => parse(ProcessPidParam, c.req.param("pid"));

  r.post("/vms/:id/processes", json, async (c) => {
    const req = parse(ProcessStartBody, await body(c.req.raw));
    const { table, vm } = await manager.processTable(vmId(c), true);
    return c.json(await startProcess(table, vm!, req), 201);
  });
  r.get("/vms/:id/processes", async (c) => {
    const { table } = await manager.processTable(vmId(c), false);
    return c.json({ processes: table.list() });
  });
  r.get("/vms/:id/processes/:pid/logs", async (c) => {
    const { table } = await manager.processTable(vmId(c), false);
    const proc = table.get(pidOf(c));
    if (c.req.query("follow") !== "1") {
      return c.json({
        stdoutB64: proc.out.text().toString("base64"),
        stderrB64: proc.err.text().toString("base64"),
        truncated: proc.out.dropped || proc.err.dropped,
        process: proc.info(),
      });
    }
    // Followed: the kept output, then new output, until the process ends; a reader that is
    // behind holds only the body's bound (it skips what the log dropped meanwhile).
    const answer = await streamedAnswer<ProcessInfo>({
      bufferBytes: STREAM_BUFFER_BYTES,
      requestSignal: c.req.raw.signal,
      run: async (out, signal) => {
        // The headers go now, with real bytes (an empty chunk flushes nothing): a quiet process
        // still answers at once.
        out.write(encodeExecFrame(ExecFrameKind.STARTED, new Uint8Array(0)));
        for await (const chunk of proc.follow(signal)) {
          const kind = chunk.stream === "stdout" ? ExecFrameKind.STDOUT : ExecFrameKind.STDERR;
          if (!out.write(encodeExecFrame(kind, chunk.data))) await out.drained();
        }
        return proc.info();
      },
      end: (s) => [
        s.ok
          ? encodeExecFrame(ExecFrameKind.RESULT, enc(s.r))
          : encodeExecFrame(ExecFrameKind.ERROR, enc(mapAgentError(s.err).body)),
      ],
    });
    if ("failed" in answer) throw answer.failed;
    return new Response(answer.body, { headers: { "content-type": "application/octet-stream" } });
  });
  r.post("/vms/:id/processes/:pid/stdin", json, async (c) => {
    const req = parse(ProcessStdinBody, await body(c.req.raw));
    const { table } = await manager.processTable(vmId(c), true);
    const proc = table.get(pidOf(c));
    if (!proc.running) throw new SandboxdError("conflict", `process ${proc.pid} has ended`);
    proc.stdin.push(Buffer.from(req.dataB64, "base64"), req.eof);
    return new Response(null, { status: 204 });
  });
  r.delete("/vms/:id/processes/:pid", async (c) => {
    const { table } = await manager.processTable(vmId(c), true);
    const proc = table.get(pidOf(c));
    proc.abort.abort(); // CANCEL: the guest kills the process group; its answer ends it here
    await proc.done;
    return c.json(proc.info());
  });
}
