/**
 * `POST /v1/vms/{id}/exec?stream=1` (docs/agent-api.md "Streamed exec"): the exec's output as
 * frames (contracts/agent/exec-stream.ts) while the command runs, then its result. The answer's
 * status and headers go once the guest has started the command (its STARTED frame), before any
 * output: an exec refused before that (busy, a missing cwd, an unknown user, a VM that is gone)
 * is an ordinary JSON error, and once the body has begun a failure is its last frame.
 *
 * Back-pressure: the body is a pull stream holding at most `STREAM_BUFFER_BYTES`; past that the
 * sink says "full" and the exec stops reading the guest (exec-run.ts) until the gateway has read
 * the body down. The request's end (the gateway gone, or its client) cancels the command.
 */

import type { ExecResult } from "../../contracts/agent/api.ts";
import { ExecFrameKind, encodeExecFrame } from "../../contracts/agent/exec-stream.ts";
import { streamedAnswer } from "../../contracts/streamed-answer.ts";
import type { ExecRequest } from "../sandbox/exec.ts";
import type { OutputSink } from "../sandbox/exec-run.ts";
import type { SandboxManager } from "../sandbox/manager.ts";
import { mapAgentError } from "./errors.ts";

/**
 * Bytes of output the agent holds for one streamed exec before it stops reading the guest. 1 MiB
 * is a few guest frames: enough that a reader keeping up never stalls the guest, small enough that
 * a thousand slow streams cost the host a bounded 1 GiB at most.
 */
export const STREAM_BUFFER_BYTES = 1024 * 1024;

const json = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));

export async function streamExec(
  manager: Pick<SandboxManager, "exec">,
  vmId: string,
  action: ExecRequest,
  requestSignal: AbortSignal,
): Promise<Response> {
  const answer = await streamedAnswer<ExecResult>({
    bufferBytes: STREAM_BUFFER_BYTES,
    requestSignal,
    run: (out, signal) => {
      const sink: OutputSink = {
        write: (stream, chunk) =>
          out.write(
            encodeExecFrame(stream === "stdout" ? ExecFrameKind.STDOUT : ExecFrameKind.STDERR, chunk),
          ),
        drained: () => out.drained(),
        // The answer's first bytes: its status and headers go with them, before any output.
        started: () => void out.write(encodeExecFrame(ExecFrameKind.STARTED, new Uint8Array(0))),
      };
      return manager.exec(vmId, action, { sink, signal });
    },
    end: (s) => [
      s.ok
        ? encodeExecFrame(ExecFrameKind.RESULT, json(s.r))
        : encodeExecFrame(ExecFrameKind.ERROR, json(mapAgentError(s.err).body)),
    ],
  });
  if ("failed" in answer) {
    const { status, body } = mapAgentError(answer.failed);
    return Response.json(body, { status });
  }
  return new Response(answer.body, { headers: { "content-type": "application/octet-stream" } });
}
