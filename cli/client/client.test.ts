/**
 * The client commands' command lines, without a server: every subcommand's `--help`, usage
 * errors (exit 2, one short line naming the help), the exec word split, the cp sides, tables and
 * the progress line (drawn on a terminal only). Commands run in-process through `runClient`, the
 * same function `bin/sandboxd sbx|template` calls, and once through `bin/sandboxd` itself.
 * Calls that reach a server are in tests/e2e/cli-client.test.ts.
 */
import { describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { PassThrough } from "node:stream";
import { parseCommand, UsageError } from "./args.ts";
import type { Ctx } from "./context.ts";
import { landing, parseCopy } from "./cp-args.ts";
import { runClient } from "./index.ts";
import { bytes, duration, table } from "./output.ts";
import { Progress } from "./progress.ts";
import { shellJoin } from "./shell-words.ts";
import { GROUPS, type Group, SBX_SPECS } from "./specs.ts";

const REPO = join(import.meta.dir, "../..");

function buffers(env: NodeJS.ProcessEnv = {}) {
  let out = "";
  let err = "";
  const ctx: Ctx = {
    stdout: {
      write: (s: string) => {
        out += s;
        return true;
      },
    } as unknown as Ctx["stdout"],
    stderr: {
      write: (s: string) => {
        err += s;
        return true;
      },
    } as unknown as Ctx["stderr"],
    stdin: new PassThrough() as unknown as NodeJS.ReadStream,
    env,
  };
  return { ctx, out: () => out, err: () => err };
}

async function run(words: string, env: NodeJS.ProcessEnv = {}) {
  const [group, ...args] = words.split(" ");
  const b = buffers(env);
  const code = await runClient(group as Group, args, b.ctx);
  return { code, stdout: b.out(), stderr: b.err() };
}

describe("help", () => {
  for (const group of Object.keys(GROUPS) as Group[]) {
    for (const [sub, spec] of Object.entries(GROUPS[group].specs)) {
      test(`${group} ${sub} --help prints its usage and every option, exit 0`, async () => {
        const r = await run(`${group} ${sub} --help`);
        expect(r.code).toBe(0);
        expect(r.stderr).toBe("");
        expect(r.stdout).toStartWith(`usage: sandboxd ${group} ${sub}`);
        for (const name of [...Object.keys(spec.options), "url", "api-key", "help"]) {
          expect(r.stdout).toContain(`--${name}`);
        }
      });
    }
    test(`${group} --help lists every subcommand; bare ${group} is a usage error`, async () => {
      const r = await run(`${group} --help`);
      expect(r.code).toBe(0);
      for (const sub of Object.keys(GROUPS[group].specs)) expect(r.stdout).toContain(`${group} ${sub} `);
      const bare = await runClient(group, [], buffers().ctx);
      expect(bare).toBe(2);
    });
  }

  test("-h works as --help, even with other arguments missing", async () => {
    const r = await run("sbx exec -h");
    expect(r.code).toBe(0);
    expect(r.stdout).toStartWith("usage: sandboxd sbx exec");
  });
});

describe("usage errors exit 2 with one short line, before any server is asked", () => {
  // No server at this URL: a command that got past its usage checks would fail with exit 1.
  const env = { SANDBOXD_URL: "http://127.0.0.1:9", SANDBOXD_API_KEY: "svc_pro_x_y" };
  const cases: [string, RegExp][] = [
    ["sbx frob", /unknown command sbx frob/],
    ["sbx ls --bogus", /unknown option '--bogus'/],
    ["sbx create", /missing --template ID/],
    ["sbx create --template", /--template/],
    ["sbx create -t py --idle-action nap", /--idle-action is suspend or delete/],
    ["sbx create -t py --idle-timeout 0", /--idle-timeout must be an integer/],
    ["sbx create -t py --label novalue", /--label takes KEY=VALUE/],
    ["sbx create -t py --vcpus 0", /--vcpus must be an integer from 1 to 64/],
    ["sbx create -t py --memory 32", /--memory must be an integer from 64 to 65536/],
    ["sbx create -t py --snapshot snap_a", /--template and --snapshot exclude each other/],
    ["sbx create -t py --timeout 0", /--timeout must be an integer from 1 to 2592000/],
    ["sbx create -t py --on-timeout nap", /--on-timeout is suspend or delete/],
    ["sbx snapshot", /missing ID/],
    ["sbx snapshot sbx_a --label novalue", /--label takes KEY=VALUE/],
    ["sbx snapshots --label k=v", /--label takes KEY:VALUE, got k=v/],
    ["sbx snapshots --state gone", /--state is one of creating, ready, failed, lost, got gone/],
    ["sbx snapshots --limit 0", /--limit must be an integer from 1/],
    ["sbx snapshots extra", /unexpected argument extra/],
    ["sbx snapshot-rm", /missing SNAP/],
    ["sbx restore sbx_a", /missing SNAP/],
    ["sbx restore sbx_a snap_a snap_b", /unexpected argument snap_b/],
    ["sbx timeout sbx_a", /missing SECONDS/],
    ["sbx timeout sbx_a 1h", /SECONDS must be an integer from 1 to 2592000, got 1h/],
    ["sbx timeout sbx_a 2592001", /SECONDS must be an integer/],
    ["sbx timeout sbx_a 60 --on-timeout nap", /--on-timeout is suspend or delete/],
    ["sbx egress", /missing ID/],
    ["template bake web reg/web:1 --size 2", /--size is VCPUSxMIB/],
    ["template bake web reg/web:1 --size 0x512", /--size is VCPUSxMIB/],
    ["sbx info", /missing ID/],
    ["sbx info sbx_a sbx_b", /unexpected argument sbx_b/],
    ["sbx exec", /missing ID/],
    ["sbx exec sbx_a", /missing CMD/],
    ["sbx exec sbx_a --timeout 99999 ls", /--timeout must be an integer from 1 to 600/],
    ["sbx cp a b", /one side must be in a sandbox/],
    ["sbx cp sbx_a:/x sbx_b:/y", /both sides are in sandboxes/],
    ["sbx cp ./f sbx_a:tmp/f", /must be absolute/],
    ["sbx cp - sbx_a:/tmp/", /stdin has no file name/],
    ["sbx cp onlyone", /missing DST/],
    ["sbx fork sbx_a --count 0", /--count must be an integer/],
    ["sbx fork sbx_a --label a --label b", /at most one --label per child/],
    ["sbx rm", /missing ID/],
    ["sbx shell", /missing ID/],
    ["template bake web", /missing IMAGE/],
    ["template bake web img --port 70000", /--port must be from 1 to 65535/],
    ["template rm", /missing ID/],
  ];
  for (const [words, msg] of cases) {
    test(words, async () => {
      const r = await run(words, env);
      expect(r.code).toBe(2);
      expect(r.stdout).toBe("");
      expect(r.stderr).toMatch(msg);
      expect(r.stderr).toMatch(/\(see sandboxd (sbx|template)( [\w-]+)? --help\)\n$/);
      expect(r.stderr.split("\n").length).toBe(2);
    });
  }

  test("no API key, or a URL that is not http(s), is a usage error", async () => {
    const noKey = await run("sbx ls", { SANDBOXD_URL: "http://127.0.0.1:9" });
    expect(noKey.code).toBe(2);
    expect(noKey.stderr).toContain("no API key: set SANDBOXD_API_KEY or pass --api-key");
    const badUrl = await run("sbx ls --url ftp://x --api-key k");
    expect(badUrl.code).toBe(2);
    expect(badUrl.stderr).toContain("must be http:// or https://");
  });

  test("a server that cannot be reached is exit 1 with one line", async () => {
    const r = await run("sbx ls", env);
    expect(r.code).toBe(1);
    expect(r.stderr.trim().split("\n")).toHaveLength(1);
  });

  test("through bin/sandboxd: help exit 0, usage error exit 2", () => {
    const bin = join(REPO, "bin/sandboxd");
    const help = spawnSync(bin, ["sbx", "cp", "--help"], { encoding: "utf8" });
    expect(help.status).toBe(0);
    expect(help.stdout).toContain("usage: sandboxd sbx cp SRC DST");
    const bad = spawnSync(bin, ["template", "ls", "--nope"], { encoding: "utf8" });
    expect(bad.status).toBe(2);
    expect(bad.stderr).toContain("sandboxd template ls: unknown option '--nope'");
    const top = spawnSync(bin, ["help"], { encoding: "utf8" });
    expect(top.stdout).toContain(
      "sbx create|ls|info|exec|cp|shell|fork|suspend|resume|rm|snapshot|snapshots|",
    );
  });
});

describe("parsing", () => {
  const exec = SBX_SPECS.exec!;
  test("exec: everything from CMD on is the command's, options included", () => {
    expect(parseCommand(exec, ["sbx_a", "ls", "-la", "--json"]).rest).toEqual(["ls", "-la", "--json"]);
    const p = parseCommand(exec, ["--env", "A=1", "sbx_a", "-u", "root", "env"]);
    expect(p.positionals).toEqual(["sbx_a"]);
    expect(p.values.env).toEqual(["A=1"]);
    expect(p.rest).toEqual(["env"]);
    expect(parseCommand(exec, ["sbx_a", "--timeout=5", "--", "echo", "--x"]).rest).toEqual(["echo", "--x"]);
    expect(parseCommand(exec, ["--", "sbx_a", "echo", "hi"])).toMatchObject({
      positionals: ["sbx_a"],
      rest: ["echo", "hi"],
    });
  });

  test("shellJoin quotes what the shell would split or expand", () => {
    expect(shellJoin(["ls", "-la", "/tmp"])).toBe("ls -la /tmp");
    expect(shellJoin(["echo", "a b", "it's", "$HOME", ""])).toBe(`echo 'a b' 'it'\\''s' '$HOME' ''`);
  });

  test("cp sides: ID:/path, -, local; a trailing slash or a directory takes the file name", () => {
    const spec = SBX_SPECS.cp!;
    expect(parseCopy("./a.txt", "sbx_Q1:/tmp/", spec)).toEqual({
      from: { kind: "local", path: "./a.txt" },
      to: { kind: "sandbox", id: "sbx_Q1", path: "/tmp/a.txt" },
      upload: true,
    });
    expect(parseCopy("sbx_Q1:/etc/hosts", "-", spec)).toEqual({
      from: { kind: "sandbox", id: "sbx_Q1", path: "/etc/hosts" },
      to: { kind: "stdio" },
      upload: false,
    });
    // A colon in a local name is not a sandbox side unless it starts with a sandbox id.
    expect(parseCopy("c:/x", "sbx_a:/y", spec).from).toEqual({ kind: "local", path: "c:/x" });
    expect(landing("out", "f.bin", () => true)).toBe("out/f.bin");
    expect(landing("out", "f.bin", () => false)).toBe("out");
    expect(() => parseCopy("", "sbx_a:/y", spec)).toThrow(UsageError);
  });
});

describe("output", () => {
  test("tables pad every column but the last", () => {
    expect(
      table(
        ["ID", "STATE"],
        [
          ["sbx_long", "running"],
          ["sbx_a", "suspended"],
        ],
      ),
    ).toBe("ID        STATE\nsbx_long  running\nsbx_a     suspended");
  });

  test("durations and sizes", () => {
    expect([duration(5), duration(192), duration(3 * 3600 + 120), duration(2 * 86400 + 3600)]).toEqual([
      "5s",
      "3m12s",
      "3h02m",
      "2d01h",
    ]);
    expect([bytes(512), bytes(1536), bytes(20 * 1024 * 1024)]).toEqual(["512 B", "1.5 KiB", "20.0 MiB"]);
  });

  test("progress draws on a terminal and writes nothing when piped", () => {
    let tty = "";
    const onTty = new Progress({ write: (s) => (tty += s), isTTY: true }, "upload /tmp/f");
    onTty.bytes(1024, 4096);
    onTty.phase("Converting");
    onTty.done("4.0 KiB");
    expect(tty).toContain("upload /tmp/f: 1.0 KiB / 4.0 KiB 25%");
    expect(tty).toContain("Converting (");
    expect(tty).toMatch(/upload \/tmp\/f: 4\.0 KiB \(\d+\.\d s\)\n$/);
    let piped = "";
    const off = new Progress({ write: (s) => (piped += s), isTTY: false }, "upload /tmp/f");
    off.bytes(1, 2);
    off.phase("Live");
    off.done("done");
    expect(piped).toBe("");
  });
});
