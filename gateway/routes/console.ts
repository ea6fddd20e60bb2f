/**
 * The web console (docs/console.md "The web console"): static files under `/console`, no key (the page
 * asks for one and sends it with every API call it makes). The console's own files are
 * gateway/console/ (plain ES modules and CSS, served as they are: no build step), xterm.js and its
 * fit addon come from node_modules at the fixed `/console/vendor/` paths. Only the files named
 * here are served (no path from the request reaches the file system). Every answer carries a
 * strict Content-Security-Policy: scripts only from this origin (no inline script, no eval),
 * connections only to this origin (the API and its WebSockets), no frames, no forms, no plugins.
 * Styles also allow inline `<style>` because xterm.js's DOM renderer writes the terminal's cell
 * sizes and theme into `<style>` elements it creates, with no nonce hook (docs/console.md "The web console: choices").
 */
import { readFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { Hono } from "hono";
import type { HonoEnv } from "../deps.ts";

export const CONSOLE_CSP = [
  "default-src 'none'",
  "script-src 'self'",
  "style-src 'self' 'unsafe-inline'",
  "connect-src 'self'",
  "img-src 'self'",
  "font-src 'self'",
  "base-uri 'none'",
  "form-action 'none'",
  "frame-ancestors 'none'",
].join("; ");

const TYPES = {
  html: "text/html; charset=utf-8",
  js: "text/javascript; charset=utf-8",
  css: "text/css; charset=utf-8",
  svg: "image/svg+xml",
} as const;

const CONSOLE_DIR = join(import.meta.dirname, "..", "console");

/** Where an npm package's files are, found as Node resolves it (Bun, Node and Deno alike). */
function packageDir(name: string): string {
  return dirname(createRequire(import.meta.url).resolve(`${name}/package.json`));
}

/** URL path (under /console) -> file and type. The console's modules are listed by name. */
function consoleFiles(): Map<string, { file: () => string; type: keyof typeof TYPES }> {
  const own = (name: string, type: keyof typeof TYPES) => ({ file: () => join(CONSOLE_DIR, name), type });
  const dep = (pkg: string, rel: string, type: keyof typeof TYPES) => ({
    file: () => join(packageDir(pkg), rel),
    type,
  });
  return new Map([
    ["", own("index.html", "html")],
    ["/", own("index.html", "html")],
    ["/console.css", own("console.css", "css")],
    ["/favicon.svg", own("favicon.svg", "svg")],
    ["/app.js", own("app.js", "js")],
    ["/api.js", own("api.js", "js")],
    ["/dom.js", own("dom.js", "js")],
    ["/chart.js", own("chart.js", "js")],
    ["/terminal.js", own("terminal.js", "js")],
    ["/vendor/xterm.mjs", dep("@xterm/xterm", "lib/xterm.mjs", "js")],
    ["/vendor/xterm.css", dep("@xterm/xterm", "css/xterm.css", "css")],
    ["/vendor/addon-fit.mjs", dep("@xterm/addon-fit", "lib/addon-fit.mjs", "js")],
  ]);
}

/** Headers of every console answer, found or not. */
function consoleHeaders(type?: string): Record<string, string> {
  return {
    "Content-Security-Policy": CONSOLE_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    // Served from the working tree: a reload picks up a new version (ETag-less, small files).
    "Cache-Control": "no-cache",
    ...(type ? { "Content-Type": type } : {}),
  };
}

/** Mounted before the key middleware: the page and its files are public, like the API's description. */
export function consoleRoutes(): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const files = consoleFiles();
  // Read once per file and kept: a few hundred KiB in all (xterm.js is the bulk).
  const cache = new Map<string, Promise<string>>();
  app.get("/console/*", (c) => serve(c.req.path.slice("/console".length)));
  app.get("/console", () => serve(""));

  async function serve(sub: string): Promise<Response> {
    const entry = files.get(sub);
    if (!entry) {
      const body = JSON.stringify({ code: "not_found", message: "no such console file" });
      return new Response(body, { status: 404, headers: consoleHeaders("application/json") });
    }
    let text = cache.get(sub);
    if (!text) {
      text = readFile(entry.file(), "utf8");
      cache.set(sub, text);
      text.catch(() => cache.delete(sub)); // a later request tries again
    }
    return new Response(await text, { status: 200, headers: consoleHeaders(TYPES[entry.type]) });
  }
  return app;
}
