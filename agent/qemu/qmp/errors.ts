import { type QmpErrorCode, SandboxdError } from "../../../contracts/errors.ts";

/**
 * The QMP layer's errors, all in one place (after QEMU's
 * `python/qemu/qmp/error.py`). Callers branch on `code` (or `instanceof`), never on message
 * text, and never on QEMU's `desc`, which is human text that changes between QEMU versions.
 *
 * | code               | meaning                                                             |
 * |--------------------|---------------------------------------------------------------------|
 * | `qmp_error`        | QEMU answered the command with `{"error": {class, desc}}`           |
 * | `qmp_timeout`      | no answer within the deadline; QEMU may still be running it          |
 * | `qmp_disconnected` | the socket closed (QEMU died, or we closed) before the answer came  |
 * | `qmp_protocol`     | QEMU sent something that is not QMP (bad JSON, missing greeting...) |
 */
export type { QmpErrorCode };

export abstract class QmpError extends SandboxdError {
  declare readonly code: QmpErrorCode;
  constructor(
    code: QmpErrorCode,
    message: string,
    opts?: { cause?: unknown; details?: Record<string, unknown> },
  ) {
    super(code, message, opts);
    this.name = new.target.name;
  }
}

/** QEMU refused or failed a command. `errorClass` is QEMU's stable class (e.g. `GenericError`). */
export class QmpCommandError extends QmpError {
  readonly command: string;
  readonly errorClass: string;
  /** QEMU's human-readable text: for logs only, never branch on it. */
  readonly desc: string;
  constructor(command: string, errorClass: string, desc: string) {
    super("qmp_error", `QMP ${command} failed: ${errorClass}: ${desc}`, {
      details: { command, class: errorClass, desc },
    });
    this.command = command;
    this.errorClass = errorClass;
    this.desc = desc;
  }
}

/**
 * No answer in time. QEMU runs in-band commands one at a time, so the command may still be
 * running and every command queued behind it is stuck too: the caller should kill the VM rather
 * than retry.
 */
export class QmpTimeoutError extends QmpError {
  readonly command: string;
  readonly timeoutMs: number;
  constructor(command: string, timeoutMs: number, what = "command") {
    super("qmp_timeout", `QMP ${what} ${command} got no answer within ${timeoutMs} ms`, {
      details: { command, timeoutMs },
    });
    this.command = command;
    this.timeoutMs = timeoutMs;
  }
}

export class QmpDisconnectedError extends QmpError {
  constructor(message: string, opts?: { cause?: unknown }) {
    super("qmp_disconnected", message, opts);
  }
}

export class QmpProtocolError extends QmpError {
  constructor(message: string, opts?: { cause?: unknown; details?: Record<string, unknown> }) {
    super("qmp_protocol", message, opts);
  }
}
