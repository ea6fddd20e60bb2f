/** planExec and its helpers without a VM: every decision an exec makes before the guest is called. */
import { describe, expect, test } from "bun:test";
import { SandboxdError } from "../../contracts/errors.ts";
import { EXEC_OUTPUT_MAX } from "../../contracts/guest-protocol.ts";
import {
  capOutput,
  DEFAULT_EXEC_TIMEOUT_MS,
  EGRESS_PROXY_ENV,
  type ExecImage,
  type ExecRequest,
  exitCodeOf,
  mergeEnv,
  planExec,
  seedBytes,
  TIMEOUT_EXIT_CODE,
} from "./exec.ts";

const image = (o: Partial<ExecImage> = {}): ExecImage => ({
  env: ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
  workingDir: "/app",
  entrypoint: ["python3"],
  cmd: ["-u"],
  user: { uid: 1000, gid: 1001, name: "app" },
  ...o,
});

const req = (o: Partial<ExecRequest> = {}): ExecRequest => ({
  files: [],
  run: { kind: "shell", command: "true" },
  ...o,
});

const envOf = (env: string[]) =>
  Object.fromEntries(env.map((kv) => [kv.slice(0, kv.indexOf("=")), kv.slice(kv.indexOf("=") + 1)]));

describe("planExec: what runs", () => {
  test("the sandboxes API `command` is one /bin/sh -c line, nothing on stdin", () => {
    const p = planExec(req({ run: { kind: "shell", command: "echo hi && ls" } }), image());
    expect(p.commands).toEqual([{ argv: ["/bin/sh", "-c", "echo hi && ls"] }]);
    expect(p.entropy).toBeUndefined();
  });

  test("the sessions API `code` goes on stdin to the image's Entrypoint + Cmd", () => {
    const p = planExec(req({ run: { kind: "code", code: "print(1)" } }), image());
    expect(p.commands).toEqual([{ argv: ["python3", "-u"], stdin: "print(1)" }]);
  });

  test("`code` with only an Entrypoint, or only a Cmd, runs what there is", () => {
    const code = req({ run: { kind: "code", code: "echo x" } });
    expect(planExec(code, image({ entrypoint: ["/bin/sh"], cmd: [] })).commands[0]?.argv).toEqual([
      "/bin/sh",
    ]);
    expect(planExec(code, image({ entrypoint: [], cmd: ["sh", "-s"] })).commands[0]?.argv).toEqual([
      "sh",
      "-s",
    ]);
  });

  test("`code` on an image with neither Entrypoint nor Cmd is refused before anything runs", () => {
    const code = req({ run: { kind: "code", code: "x" }, files: [{ path: "a", content: "b" }] });
    let err: unknown;
    try {
      planExec(code, image({ entrypoint: [], cmd: [] }));
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(SandboxdError);
    expect((err as SandboxdError).code).toBe("image_no_command");
  });

  test("`commands` are argv arrays in order, no shell, no stdin", () => {
    const p = planExec(
      req({
        run: {
          kind: "argv",
          commands: [
            ["mkdir", "-p", "out"],
            ["touch", "out/x y"],
          ],
        },
      }),
      image(),
    );
    expect(p.commands).toEqual([{ argv: ["mkdir", "-p", "out"] }, { argv: ["touch", "out/x y"] }]);
  });

  test("`none` runs nothing: only the files are written", () => {
    const files = [{ path: "a.txt", content: "1" }];
    const p = planExec(req({ run: { kind: "none" }, files }), image());
    expect(p.commands).toEqual([]);
    expect(p.entropy).toBeUndefined();
    expect(p.seeded).toBe(false);
    expect(p.files).toEqual(files);
  });

  test("files are written in the order given, before anything runs", () => {
    const files = [
      { path: "b", content: "2" },
      { path: "a", content: "1" },
      { path: "b", content: "3" },
    ];
    expect(planExec(req({ files }), image()).files).toEqual(files);
  });
});

describe("planExec: the seed", () => {
  test("no seed: nothing carries one and the result will not report one", () => {
    const p = planExec(req(), image());
    expect(p.seeded).toBe(false);
    expect(p.commands[0]?.seed).toBeUndefined();
  });

  test("a shell or code exec hands the seed with its one command", () => {
    for (const run of [
      { kind: "shell", command: "true" },
      { kind: "code", code: "pass" },
    ] as const) {
      const p = planExec(req({ run, seed: "00ff" }), image());
      expect(p.seeded).toBe(true);
      expect(p.commands[0]?.seed).toEqual(new Uint8Array([0x00, 0xff]));
      expect(p.entropy).toBeUndefined();
    }
  });

  test("`commands`: only the first command carries the seed", () => {
    const p = planExec(req({ run: { kind: "argv", commands: [["a"], ["b"], ["c"]] }, seed: "s" }), image());
    expect(p.commands.map((c) => c.seed)).toEqual([new Uint8Array(Buffer.from("s")), undefined, undefined]);
  });

  test("`commands` with none to run: the seed goes nowhere and the result says unverified", () => {
    const p = planExec(req({ run: { kind: "argv", commands: [] }, seed: "abcd" }), image());
    expect(p.commands).toEqual([]);
    expect(p.entropy).toBeUndefined();
    expect(p.seeded).toBe(true);
  });

  test("`none` with a seed: the seed goes alone to the entropy pool", () => {
    const p = planExec(req({ run: { kind: "none" }, seed: "abcd" }), image());
    expect(p.commands).toEqual([]);
    expect(p.entropy).toEqual(new Uint8Array([0xab, 0xcd]));
    expect(p.seeded).toBe(true);
  });

  test("seedBytes: hex when it is hex of whole bytes, else the UTF-8 of the string", () => {
    expect(seedBytes("DeadBeef")).toEqual(new Uint8Array(Buffer.from([0xde, 0xad, 0xbe, 0xef])));
    expect(seedBytes("abc")).toEqual(new Uint8Array(Buffer.from("abc", "utf8"))); // odd length
    expect(seedBytes("zz")).toEqual(new Uint8Array(Buffer.from("zz", "utf8"))); // not hex
    expect(seedBytes("42 ")).toEqual(new Uint8Array(Buffer.from("42 ", "utf8")));
    expect(seedBytes("é")).toEqual(new Uint8Array(Buffer.from("é", "utf8")));
    expect(seedBytes("")).toEqual(new Uint8Array(0));
  });
});

describe("planExec: where, as whom, with what, for how long", () => {
  test("cwd is the image's WorkingDir, else /", () => {
    expect(planExec(req(), image()).cwd).toBe("/app");
    expect(planExec(req(), image({ workingDir: "" })).cwd).toBe("/");
  });

  test("uid and gid are the image's User", () => {
    const p = planExec(req(), image({ user: { uid: 0, gid: 0, name: "root" } }));
    expect([p.uid, p.gid]).toEqual([0, 0]);
    const q = planExec(req(), image());
    expect([q.uid, q.gid]).toEqual([1000, 1001]);
  });

  test("env: the image's Env, then the egress proxy over it, then the request's env over both", () => {
    const img = image({ env: ["PATH=/bin", "http_proxy=http://image-proxy", "KEEP=1", "NO_PROXY=x"] });
    const plain = planExec(req(), img);
    expect(envOf(plain.env)).toEqual({ PATH: "/bin", KEEP: "1", ...EGRESS_PROXY_ENV });
    // Every name appears once.
    expect(new Set(plain.env.map((kv) => kv.split("=")[0])).size).toBe(plain.env.length);

    const own = planExec(req({ env: { KEEP: "2", http_proxy: "http://mine", NEW: "a=b" } }), img);
    expect(envOf(own.env)).toEqual({
      PATH: "/bin",
      ...EGRESS_PROXY_ENV,
      KEEP: "2",
      http_proxy: "http://mine",
      NEW: "a=b",
    });
    // The image's config is not changed by planning.
    expect(img.env).toEqual(["PATH=/bin", "http_proxy=http://image-proxy", "KEEP=1", "NO_PROXY=x"]);
  });

  test("the egress proxy points at the guest agent's proxy port on loopback; local stays direct", () => {
    for (const k of ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"]) {
      expect(EGRESS_PROXY_ENV[k]).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    }
    expect(EGRESS_PROXY_ENV.no_proxy).toBe("localhost,127.0.0.1,::1");
    expect(EGRESS_PROXY_ENV.NO_PROXY).toBe("localhost,127.0.0.1,::1");
  });

  test("the budget is the request's timeout, 30 s when it gives none; no other bound here", () => {
    expect(DEFAULT_EXEC_TIMEOUT_MS).toBe(30_000);
    expect(planExec(req(), image()).timeoutMs).toBe(DEFAULT_EXEC_TIMEOUT_MS);
    expect(planExec(req({ timeoutMs: 1 }), image()).timeoutMs).toBe(1);
    expect(planExec(req({ timeoutMs: 3_600_000 }), image()).timeoutMs).toBe(3_600_000);
  });
});

describe("mergeEnv", () => {
  test("no extra: a copy of the base", () => {
    const base = ["A=1"];
    const out = mergeEnv(base, undefined);
    expect(out).toEqual(["A=1"]);
    expect(out).not.toBe(base);
  });

  test("a name in both takes extra's value, placed after the base's others", () => {
    expect(mergeEnv(["A=1", "B=2", "C=3"], { B: "x", D: "4" })).toEqual(["A=1", "C=3", "B=x", "D=4"]);
  });

  test("a name matches whole, not as a prefix; entries without = are kept", () => {
    expect(mergeEnv(["AB=1", "A=2", "ODD"], { A: "3" })).toEqual(["AB=1", "ODD", "A=3"]);
  });
});

describe("exitCodeOf", () => {
  test("a timeout is 124, whatever the process ended with", () => {
    expect(TIMEOUT_EXIT_CODE).toBe(124);
    expect(exitCodeOf({ exitCode: null, signal: 9, timedOut: true })).toBe(124);
    expect(exitCodeOf({ exitCode: 0, signal: null, timedOut: true })).toBe(124);
  });

  test("an exit is its status; a signal is 128 + its number", () => {
    expect(exitCodeOf({ exitCode: 0, signal: null, timedOut: false })).toBe(0);
    expect(exitCodeOf({ exitCode: 3, signal: null, timedOut: false })).toBe(3);
    expect(exitCodeOf({ exitCode: null, signal: 9, timedOut: false })).toBe(137);
    expect(exitCodeOf({ exitCode: null, signal: 15, timedOut: false })).toBe(143);
    expect(exitCodeOf({ exitCode: null, signal: null, timedOut: false })).toBe(128);
  });
});

describe("capOutput", () => {
  const out = (stdout: string, stderr: string, flags: Partial<Record<"o" | "e", boolean>> = {}) => ({
    stdout: Buffer.from(stdout),
    stderr: Buffer.from(stderr),
    stdoutTruncated: flags.o ?? false,
    stderrTruncated: flags.e ?? false,
  });

  test("output within the cap is returned as it is, not truncated", () => {
    const r = out("hello", "warn");
    const c = capOutput(r, 9);
    expect(c.stdout).toBe(r.stdout);
    expect(c.stderr).toBe(r.stderr);
    expect(c.truncated).toBe(false);
  });

  test("the guest's own flags make it truncated even when the bytes fit", () => {
    expect(capOutput(out("a", ""), 10).truncated).toBe(false);
    expect(capOutput(out("a", "", { o: true }), 10).truncated).toBe(true);
    expect(capOutput(out("a", "", { e: true }), 10).truncated).toBe(true);
  });

  test("over the cap: the shorter keeps what it has up to half, the longer gets the rest", () => {
    let c = capOutput(out("abcdefghij", "xy"), 8);
    expect([c.stdout.toString(), c.stderr.toString(), c.truncated]).toEqual(["abcdef", "xy", true]);
    c = capOutput(out("ab", "0123456789"), 8);
    expect([c.stdout.toString(), c.stderr.toString(), c.truncated]).toEqual(["ab", "012345", true]);
    c = capOutput(out("abcdefghij", "0123456789"), 8);
    expect([c.stdout.toString(), c.stderr.toString(), c.truncated]).toEqual(["abcd", "0123", true]);
  });

  test("the default cap is EXEC_OUTPUT_MAX, stdout and stderr together", () => {
    const c = capOutput(out("a".repeat(EXEC_OUTPUT_MAX), "b".repeat(10)));
    expect(c.stdout.length + c.stderr.length).toBe(EXEC_OUTPUT_MAX);
    expect(c.stderr.toString()).toBe("b".repeat(10));
    expect(c.truncated).toBe(true);
  });
});

describe("planExec: the request's own cwd, user and stdin", () => {
  test("cwd and user replace the image's; the user's HOME/USER/LOGNAME yield to the request's env", () => {
    const img = image({ workingDir: "/app", env: ["HOME=/root", "PATH=/bin"] });
    const user = { uid: 65534, gid: 65534, name: "nobody", home: "/nonexistent" };
    const p = planExec(req({ cwd: "/tmp", env: { LOGNAME: "mine" } }), img, user);
    expect([p.cwd, p.uid, p.gid]).toEqual(["/tmp", 65534, 65534]);
    expect(envOf(p.env)).toMatchObject({
      HOME: "/nonexistent",
      USER: "nobody",
      LOGNAME: "mine",
      PATH: "/bin",
    });
    const dflt = planExec(req(), img);
    expect(dflt.cwd).toBe("/app");
    expect(envOf(dflt.env).HOME).toBe("/root");
  });

  test("stdin goes to the first command only, and never replaces code's", () => {
    const stdinB64 = Buffer.from([0, 255]).toString("base64");
    const argv = planExec(req({ run: { kind: "argv", commands: [["cat"], ["true"]] }, stdinB64 }), image());
    expect(Buffer.from(argv.commands[0]!.stdin as Uint8Array)).toEqual(Buffer.from([0, 255]));
    expect(argv.commands[1]!.stdin).toBeUndefined();
    const code = planExec(req({ run: { kind: "code", code: "print(1)" }, stdinB64 }), image());
    expect(code.commands[0]!.stdin).toBe("print(1)");
  });
});
