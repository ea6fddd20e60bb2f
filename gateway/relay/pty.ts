/**
 * A terminal (`GET .../pty`, docs/processes-and-pty.md "Terminal"): the tcp relay's byte stream (tcp.ts, with
 * its back-pressure and message limit) to a shell's pseudo-terminal, plus resize requests.
 * Binary messages are typed input; a text message `{"type":"resize","cols":N,"rows":M}` resizes
 * the terminal; any other text message is typed input too (its UTF-8 bytes), because xterm.js's
 * attach addon sends keystrokes as text. With `lines` (the route's `lines=true`, for line-based
 * clients like wscat, which send a typed line without its newline) each such text message is
 * followed by the Enter key, CR. The guest's output comes back as binary messages.
 */
import type { PtyTunnel } from "../../contracts/agent/api.ts";
import { parsePtyResize } from "../../contracts/api/common.ts";
import { TcpRelay } from "./tcp.ts";

export class PtyRelay extends TcpRelay {
  constructor(
    private readonly pty: PtyTunnel,
    private readonly lines = false,
  ) {
    super(pty);
  }

  override message(data: Uint8Array | string): void {
    if (typeof data === "string" && !this.ended && !this.tooBig(data)) {
      const size = parsePtyResize(data);
      if (size) {
        this.pty.resize(size.cols, size.rows);
        return;
      }
      if (this.lines) {
        super.message(`${data}\r`);
        return;
      }
    }
    super.message(data);
  }
}
