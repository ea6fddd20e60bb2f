/**
 * A terminal into a sandbox: xterm.js (served from node_modules at /console/vendor/) on the pty
 * WebSocket (docs/processes-and-pty.md "Terminal"). A browser cannot set `Authorization` on a WebSocket, so
 * the key goes as the second subprotocol after the `sandboxd` marker, which is what the server
 * answers with (docs/console.md "The web console"); never in the URL.
 */
import { FitAddon } from "/console/vendor/addon-fit.mjs";
import { Terminal } from "/console/vendor/xterm.mjs";

/** Opens a terminal in `container`; `onEnd(text)` runs once when the WebSocket closes. */
export function openTerminal(container, { sandboxId, key, onEnd }) {
  const term = new Terminal({ cursorBlink: true, fontSize: 14, scrollback: 2000 });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(container);
  fit.fit();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = `${scheme}//${location.host}/v1/sandboxes/${encodeURIComponent(sandboxId)}/pty?cols=${term.cols}&rows=${term.rows}`;
  const ws = new WebSocket(url, ["sandboxd", `sandboxd.key.${key}`]);
  ws.binaryType = "arraybuffer";
  const encoder = new TextEncoder();
  let ended = false;

  ws.onopen = () => term.focus();
  ws.onmessage = (e) => term.write(typeof e.data === "string" ? e.data : new Uint8Array(e.data));
  // Keystrokes go as binary (terminal bytes); text messages are the resize messages.
  const input = term.onData((data) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(data));
  });
  const resize = term.onResize(({ cols, rows }) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", cols, rows }));
  });
  const onWindowResize = () => fit.fit();
  window.addEventListener("resize", onWindowResize);
  ws.onclose = (e) => {
    if (ended) return;
    ended = true;
    term.write(`\r\n[terminal closed: ${e.code}${e.reason ? ` ${e.reason}` : ""}]\r\n`);
    onEnd?.(e.code);
  };

  return {
    close() {
      window.removeEventListener("resize", onWindowResize);
      input.dispose();
      resize.dispose();
      ended = true;
      if (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING) ws.close(1000);
      term.dispose();
    },
  };
}
