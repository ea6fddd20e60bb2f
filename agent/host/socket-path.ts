/**
 * A unix socket the agent (root) connects to in a VM's directory, where the VM's jailed QEMU makes
 * its sockets: an escaped QEMU could put a symlink at the name, and `connect()` follows symlinks,
 * to another process's socket on the host (a root agent may connect anywhere). So the name is
 * looked at first without following it (lstat), and only a socket is connected to. The QEMU could
 * still swap the name between the look and the connect; it then reaches only a socket it made or
 * one whose name a symlink of its own points at — the window is the two syscalls, and the agent's
 * protocols (QMP greeting, guest HELLO) refuse a peer that does not speak them.
 */
import { lstatSync } from "node:fs";

/**
 * "socket" when `path` is a socket (not a symlink to one), "missing" when nothing is there yet,
 * else what is there instead (a symlink, a regular file…), to put in an error.
 */
export function socketAt(path: string): "socket" | "missing" | string {
  try {
    const st = lstatSync(path);
    if (st.isSocket()) return "socket";
    return st.isSymbolicLink() ? "a symlink" : "not a socket";
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return "missing";
    return `unreadable (${(err as NodeJS.ErrnoException).code ?? "error"})`;
  }
}
