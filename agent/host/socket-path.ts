/**
 * A unix socket the agent (root) connects to in a VM's directory, where the VM's jailed QEMU makes
 * its sockets: an escaped QEMU could put a symlink at the name, and `connect()` follows symlinks,
 * to another process's socket on the host (a root agent may connect anywhere). A look first
 * (lstat) and a connect by name after would leave the QEMU the time between the two to swap the
 * name. So the name is opened once, without following it (`O_PATH | O_NOFOLLOW`: a symlink opens
 * as the link itself), the handle is checked to be a socket, and the connect goes through that
 * handle (`/proc/self/fd/N`, which names the inode the handle holds, whatever the name is now).
 */
import { closeSync, constants, fstatSync, openSync } from "node:fs";
import { createConnection, type Socket } from "node:net";

/** Linux's O_PATH (x86-64, arm64): a handle on the name's inode that neither reads nor writes. */
const O_PATH = 0o10000000;

/** What a connect gave: the connected socket, its error, or what is at the name instead. */
export type SocketConnect =
  | { socket: Socket }
  | { error: NodeJS.ErrnoException }
  | { found: "missing" | "a symlink" | "not a socket" | `unreadable (${string})` };

/**
 * Connects to the socket at `path` through a handle on the name (see the header); settles once the
 * connect does (a unix connect does not wait on its peer: it succeeds, or fails at once with
 * ECONNREFUSED or EAGAIN), with the handle closed. The socket is the caller's from then on.
 */
export function connectSocketAt(path: string): Promise<SocketConnect> {
  let fd: number;
  try {
    fd = openSync(path, O_PATH | constants.O_NOFOLLOW);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    return Promise.resolve({ found: code === "ENOENT" ? "missing" : `unreadable (${code ?? "error"})` });
  }
  try {
    const st = fstatSync(fd);
    if (!st.isSocket()) {
      closeSync(fd);
      return Promise.resolve({ found: st.isSymbolicLink() ? "a symlink" : "not a socket" });
    }
  } catch (err) {
    closeSync(fd);
    return Promise.resolve({ error: err as NodeJS.ErrnoException });
  }
  return new Promise((resolve) => {
    const s = createConnection({ path: `/proc/self/fd/${fd}` });
    const settle = (r: SocketConnect) => {
      s.off("connect", onConnect);
      s.off("error", onError);
      closeSync(fd);
      resolve(r);
    };
    const onConnect = () => settle({ socket: s });
    const onError = (error: NodeJS.ErrnoException) => {
      s.destroy();
      settle({ error });
    };
    s.once("connect", onConnect);
    s.once("error", onError);
  });
}
