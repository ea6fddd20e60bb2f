/**
 * Every client command's options, positionals and help text (`sandboxd sbx`, `sandboxd template`).
 * The handlers (sbx.ts, template.ts, cp.ts) parse with these specs, so a command's `--help` is
 * always what its parser accepts.
 */
import {
  DEFAULT_EXEC_TIMEOUT_S,
  MAX_EXEC_TIMEOUT_S,
  MAX_SANDBOX_TIMEOUT_S,
} from "../../contracts/api/limits.ts";
import type { CommandSpec, OptionSpec } from "./args.ts";

const JSON_OPT: OptionSpec = { type: "boolean", help: "print the API's JSON instead of text" };

export const SBX_SPECS: Record<string, CommandSpec> = {
  create: {
    name: "sbx create",
    usage: "--template ID | --snapshot SNAP [options]",
    summary: "Create a sandbox from a template or a snapshot and print its id.",
    options: {
      template: { type: "string", short: "t", arg: "ID", help: "the template to start from" },
      snapshot: {
        type: "string",
        arg: "SNAP",
        help: "a ready snapshot to start from instead (its processes, memory and files)",
      },
      label: { type: "string", multiple: true, arg: "K=V", help: "a label on the sandbox" },
      egress: {
        type: "string",
        multiple: true,
        arg: "HOST",
        help: "a host name the sandbox may reach (default: none)",
      },
      "idle-timeout": {
        type: "string",
        arg: "SECONDS",
        help: "act on the sandbox after this long without use",
      },
      "idle-action": { type: "string", arg: "ACTION", help: "suspend (default) or delete" },
      timeout: {
        type: "string",
        arg: "SECONDS",
        help: `an absolute lifetime from now (at most ${MAX_SANDBOX_TIMEOUT_S})`,
      },
      "on-timeout": { type: "string", arg: "ACTION", help: "at --timeout: delete (default) or suspend" },
      vcpus: { type: "string", arg: "N", help: "vCPUs: one of the template's size classes" },
      memory: { type: "string", arg: "MIB", help: "guest RAM in MiB: one of the template's size classes" },
      json: JSON_OPT,
    },
    positionals: [],
  },
  ls: {
    name: "sbx ls",
    usage: "[--json]",
    summary: "List your sandboxes: id, template and state.",
    options: { json: JSON_OPT },
    positionals: [],
  },
  info: {
    name: "sbx info",
    usage: "ID [--json]",
    summary:
      "Show one sandbox: state, template, age, idle time, size, exec count, labels, endpoints, lifetimes.",
    options: { json: JSON_OPT },
    positionals: ["ID"],
  },
  exec: {
    name: "sbx exec",
    usage: "ID [options] [--] CMD [ARG...]",
    summary: "Run a command in the sandbox, printing its output as it comes, and exit with its exit code.",
    details: [
      "One word is a shell command line (run by /bin/sh -c): sandboxd sbx exec ID 'ls /tmp | wc -l'.",
      "Several words are quoted for the shell as they are: sandboxd sbx exec ID ls -la /tmp.",
      "Options go before CMD; everything from CMD on is the command's own.",
    ].join("\n"),
    options: {
      env: { type: "string", multiple: true, arg: "K=V", help: "an environment variable for the command" },
      cwd: { type: "string", arg: "DIR", help: "the working directory (absolute)" },
      user: { type: "string", short: "u", arg: "USER", help: "run as this user name or uid" },
      timeout: {
        type: "string",
        arg: "SECONDS",
        help: `kill the command after this long (default ${DEFAULT_EXEC_TIMEOUT_S}, at most ${MAX_EXEC_TIMEOUT_S})`,
      },
      stdin: { type: "boolean", short: "i", help: "pass our stdin to the command" },
    },
    positionals: ["ID", "CMD..."],
    minPositionals: 2,
    restFrom: 1,
  },
  cp: {
    name: "sbx cp",
    usage: "SRC DST",
    summary: "Copy a file between here and a sandbox, streamed; one side is ID:/PATH.",
    details: [
      "  sandboxd sbx cp ./data.csv sbx_123:/tmp/data.csv     upload",
      "  sandboxd sbx cp sbx_123:/tmp/out.png ./out.png       download",
      "  sandboxd sbx cp - sbx_123:/tmp/in.txt < in.txt       from stdin",
      "  sandboxd sbx cp sbx_123:/etc/os-release -            to stdout",
      "A destination ending in / (or an existing local directory) gets the source's file name.",
      "Progress is shown on a terminal.",
    ].join("\n"),
    options: {
      user: { type: "string", short: "u", arg: "USER", help: "read or write as this user name or uid" },
    },
    positionals: ["SRC", "DST"],
  },
  shell: {
    name: "sbx shell",
    usage: "ID",
    summary: "Open an interactive shell in the sandbox (exit or Ctrl-D ends it).",
    details: [
      "On a terminal, keys go to the shell as typed and a resize of the window resizes the shell's.",
      "Piped input is a script: echo 'ls /tmp' | sandboxd sbx shell ID runs it (through exec, for",
      `at most ${MAX_EXEC_TIMEOUT_S} s) and exits with its exit code.`,
    ].join("\n"),
    options: {},
    positionals: ["ID"],
  },
  fork: {
    name: "sbx fork",
    usage: "ID [--count N] [--json]",
    summary: "Fork a running sandbox into copy-on-write children; prints their ids.",
    options: {
      count: { type: "string", short: "n", arg: "N", help: "how many children (default 1)" },
      label: { type: "string", multiple: true, arg: "LABEL", help: "one label per child, in order" },
      json: JSON_OPT,
    },
    positionals: ["ID"],
  },
  suspend: {
    name: "sbx suspend",
    usage: "ID [--json]",
    summary: "Snapshot the sandbox to disk and stop it (metering stops); resume brings it back.",
    options: { json: JSON_OPT },
    positionals: ["ID"],
  },
  resume: {
    name: "sbx resume",
    usage: "ID [--json]",
    summary: "Restore a suspended sandbox from its snapshot.",
    options: { json: JSON_OPT },
    positionals: ["ID"],
  },
  rm: {
    name: "sbx rm",
    usage: "ID...",
    summary: "Destroy sandboxes; prints each id as it goes.",
    options: {},
    positionals: ["ID..."],
    minPositionals: 1,
  },
  snapshot: {
    name: "sbx snapshot",
    usage: "ID [--name N] [--label K=V]... [--json]",
    summary: "Keep a running sandbox's memory and disk as a snapshot (it runs on); prints the snapshot.",
    options: {
      name: { type: "string", arg: "NAME", help: "a name for the snapshot" },
      label: { type: "string", multiple: true, arg: "K=V", help: "a label on the snapshot" },
      json: JSON_OPT,
    },
    positionals: ["ID"],
  },
  snapshots: {
    name: "sbx snapshots",
    usage: "[--label K:V]... [--state S] [--sandbox ID] [--template T] [--limit N] [--json]",
    summary: "List your snapshots, newest first: every page, or the first N.",
    options: {
      label: { type: "string", multiple: true, arg: "K:V", help: "only snapshots with this label" },
      state: { type: "string", arg: "STATE", help: "only creating, ready, failed or lost ones" },
      sandbox: { type: "string", arg: "ID", help: "only snapshots taken of this sandbox" },
      template: { type: "string", arg: "ID", help: "only snapshots of this template" },
      limit: { type: "string", arg: "N", help: "at most N snapshots (default: all)" },
      json: JSON_OPT,
    },
    positionals: [],
  },
  "snapshot-rm": {
    name: "sbx snapshot-rm",
    usage: "SNAP...",
    summary: "Delete snapshots (sandboxes started from them run on); prints each id as it goes.",
    options: {},
    positionals: ["SNAP..."],
    minPositionals: 1,
  },
  restore: {
    name: "sbx restore",
    usage: "ID SNAP [--json]",
    summary: "Roll a running sandbox back to a snapshot in place (same id); prints the times it took.",
    details: [
      "The snapshot must be of the sandbox's template and size and kept on its host. Open terminals,",
      "connect URLs and background processes end: they lived in the memory replaced.",
    ].join("\n"),
    options: { json: JSON_OPT },
    positionals: ["ID", "SNAP"],
  },
  timeout: {
    name: "sbx timeout",
    usage: "ID SECONDS [--on-timeout ACTION] [--json]",
    summary: "Give a sandbox a new absolute lifetime, counted from now.",
    options: {
      "on-timeout": {
        type: "string",
        arg: "ACTION",
        help: "delete or suspend (default: the sandbox's own, else delete)",
      },
      json: JSON_OPT,
    },
    positionals: ["ID", "SECONDS"],
  },
  egress: {
    name: "sbx egress",
    usage: "ID [HOST...] [--json]",
    summary: "Replace a sandbox's egress allow-list; no HOST denies all.",
    details: "Open connections the new list no longer allows are closed.",
    options: { json: JSON_OPT },
    positionals: ["ID", "HOST..."],
    minPositionals: 1,
  },
};

export const TEMPLATE_SPECS: Record<string, CommandSpec> = {
  ls: {
    name: "template ls",
    usage: "[--json]",
    summary: "List the templates you can create sandboxes from.",
    options: { json: JSON_OPT },
    positionals: [],
  },
  bake: {
    name: "template bake",
    usage: "NAME IMAGE [options]",
    summary:
      "Bake a template from an OCI image reference and wait until it is Live (Pro keys); shows the phase on a terminal.",
    details:
      "  sandboxd template bake web registry.example.com/team/web:1 --ready-cmd 'httpd -p 8080' --port 8080",
    options: {
      "ready-cmd": {
        type: "string",
        arg: "CMD",
        help: "starts the service detached; exits 0 once it is healthy",
      },
      port: { type: "string", multiple: true, arg: "PORT", help: "a guest port connect URLs may reach" },
      "registry-user": { type: "string", arg: "USER", help: "registry user name (password from stdin)" },
      size: {
        type: "string",
        multiple: true,
        arg: "VCPUSxMIB",
        help: "a size class creates may pick, e.g. 2x512; the first is the default",
      },
      "no-wait": { type: "boolean", help: "return once the bake is accepted" },
      json: JSON_OPT,
    },
    positionals: ["NAME", "IMAGE"],
  },
  rm: {
    name: "template rm",
    usage: "ID...",
    summary: "Delete your templates (a build in progress is cancelled).",
    options: {},
    positionals: ["ID..."],
    minPositionals: 1,
  },
};

export const GROUPS = {
  sbx: { specs: SBX_SPECS, summary: "sandboxes on a sandboxd server" },
  template: { specs: TEMPLATE_SPECS, summary: "templates on a sandboxd server" },
} as const;
export type Group = keyof typeof GROUPS;

/** The help of a group: its commands, one line each. */
export function groupHelp(group: Group): string {
  const { specs, summary } = GROUPS[group];
  const lines = [`usage: sandboxd ${group} <command> [options]`, "", `${summary}; commands:`];
  for (const spec of Object.values(specs)) {
    lines.push(`  ${spec.name} ${spec.usage}`, `        ${spec.summary}`);
  }
  lines.push(
    "",
    "The server is $SANDBOXD_URL (or --url), the key $SANDBOXD_API_KEY (or --api-key).",
    `Each command has --help. Exit codes: 0 ok, 1 the server refused (printed as code: message), 2 usage.`,
  );
  return lines.join("\n");
}
