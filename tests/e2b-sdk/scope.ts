/**
 * Which of E2B's own JS SDK tests (packages/js-sdk/tests at the tag e2b@2.45.0) run against
 * sandboxd, and why the others do not. tests/e2b-sdk/upstream/ holds the files that run, copied
 * verbatim; a whole file left out is not copied, a single test left out is excluded by name
 * (vitest.config.mts). tests/e2b-sdk/out-of-scope.md is rendered from this list
 * (tests/style/e2b-sdk-scope.test.ts checks it). A test that fails is never left out here: its failure is counted
 * against tests/e2b-sdk/expected.json.
 */

/** The upstream tag the files were copied from, and its commit. */
export const UPSTREAM = { tag: "e2b@2.45.0", commit: "f6014f17ce12609e00304311d75e550dba1bfe7a" } as const;

export interface OutOfScope {
  /** Path under packages/js-sdk/tests/ at the tag. */
  file: string;
  /** One test's full name (describe blocks and title, space-joined); none: the whole file. */
  test?: string;
  reason: string;
}

const SDK_ONLY =
  "tests the SDK's own code: no request reaches a service (a mocked network (msw) or mocked SDK modules)";
const NO_INTERNET = "needs the public internet from inside the sandbox; the CI host has none";
const PORT_HOSTS =
  "fetches `https://<port>-<id>.<domain>` (Sandbox.getHost): needs wildcard DNS and a TLS certificate for the domain, which a CI service on 127.0.0.1 has not";

export const OUT_OF_SCOPE: readonly OutOfScope[] = [
  // SDK unit tests: msw or mocked SDK modules, no service.
  { file: "api/handleApiError.test.ts", reason: SDK_ONLY },
  { file: "api/http2.test.ts", reason: SDK_ONLY },
  { file: "api/inflight.test.ts", reason: SDK_ONLY },
  { file: "api/info.test.ts", reason: SDK_ONLY },
  { file: "api/kill.test.ts", reason: SDK_ONLY },
  { file: "api/list.test.ts", reason: SDK_ONLY },
  { file: "api/snapshot.test.ts", reason: SDK_ONLY },
  { file: "api/validateApiKey.test.ts", reason: SDK_ONLY },
  { file: "client.test.ts", reason: SDK_ONLY },
  { file: "connectionConfig.test.ts", reason: SDK_ONLY },
  { file: "envd/handleEnvdApiError.test.ts", reason: SDK_ONLY },
  { file: "envd/handleRpcError.test.ts", reason: SDK_ONLY },
  { file: "envd/http2.test.ts", reason: SDK_ONLY },
  { file: "is.test.ts", reason: SDK_ONLY },
  { file: "logs.test.ts", reason: SDK_ONLY },
  { file: "paginator.test.ts", reason: SDK_ONLY },
  { file: "runtime.test.ts", reason: SDK_ONLY },
  { file: "stripAnsi.test.ts", reason: SDK_ONLY },
  { file: "undici.test.ts", reason: SDK_ONLY },
  { file: "utils.test.ts", reason: SDK_ONLY },
  { file: "sandbox/abortSignal.test.ts", reason: SDK_ONLY },
  { file: "sandbox/configPropagation.test.ts", reason: SDK_ONLY },
  { file: "sandbox/lifecycleRequest.test.ts", reason: SDK_ONLY },
  { file: "sandbox/networkTransform.test.ts", reason: SDK_ONLY },
  { file: "sandbox/rpcHeaders.test.ts", reason: SDK_ONLY },
  { file: "sandbox/urls.test.ts", reason: `${SDK_ONLY}: URL building and signatures` },
  { file: "sandbox/commands/commandHandle.test.ts", reason: `${SDK_ONLY}: CommandHandle with a fake stream` },
  { file: "sandbox/files/entryInfo.test.ts", reason: `${SDK_ONLY}: the protobuf-to-EntryInfo mapping` },
  { file: "sandbox/files/watchHandle.test.ts", reason: `${SDK_ONLY}: WatchHandle with a fake stream` },
  // E2B features sandboxd does not have, or that need E2B's infrastructure.
  { file: "sandbox/egressProxy.test.ts", reason: `${SDK_ONLY}; and E2B's egress proxy` },
  { file: "sandbox/iam.test.ts", reason: `${SDK_ONLY}; and E2B's IAM tokens` },
  { file: "secret/secret.test.ts", reason: "E2B's secrets API: sandboxd has no secrets store" },
  { file: "volume/file.test.ts", reason: "E2B's volumes API (mocked with msw): sandboxd has no volumes" },
  { file: "volume/volume.test.ts", reason: "E2B's volumes API (mocked with msw): sandboxd has no volumes" },
  {
    file: "template/",
    reason: "E2B's template build service (Template.build from a Dockerfile-like definition)",
  },
  { file: "sandbox/git/", reason: "clones and pushes to public git remotes: needs the internet" },
  { file: "sandbox/internetAccess.test.ts", reason: NO_INTERNET },
  {
    file: "sandbox/network.test.ts",
    reason: `${NO_INTERNET} (1.1.1.1, 8.8.8.8), an \`httpbin\` template, and ports over https hosts`,
  },
  { file: "sandbox/host.test.ts", reason: PORT_HOSTS },
  // Runtimes other than Node.
  { file: "bundle/edgeCompat.test.ts", reason: "checks the SDK's built bundle for edge runtimes" },
  { file: "connectionConfig.browser.test.ts", reason: "runs in a browser (playwright)" },
  {
    file: "runtimes/",
    reason: "browser, Cloudflare Workers and a deployed worker: other runtimes and E2B's cloud",
  },
  // Single tests in files that run.
  {
    file: "sandbox/create.test.ts",
    test: "MCP gateway start failure kills the created sandbox",
    reason: "E2B's MCP gateway (`mcp` option of Sandbox.create): sandboxd has none",
  },
  {
    file: "sandbox/lifecyclePayload.test.ts",
    test: "auto-resume wakes paused sandbox on http request",
    reason: PORT_HOSTS,
  },
  {
    file: "sandbox/snapshot.test.ts",
    test: "pause and resume a sandbox with http server",
    reason: PORT_HOSTS,
  },
];

/** The vitest `--testNamePattern` that leaves out the single tests above (all others match). */
export function testNamePattern(list: readonly OutOfScope[] = OUT_OF_SCOPE): string {
  const names = list.flatMap((e) => (e.test ? [e.test.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")] : []));
  return names.length === 0 ? ".*" : `^(?!.*(?:${names.join("|")})$).*$`;
}

/** out-of-scope.md's text. */
export function renderOutOfScope(list: readonly OutOfScope[] = OUT_OF_SCOPE): string {
  const rows = list.map(
    (e) => `| \`${e.file}\` | ${e.test ? `\`${e.test}\`` : "all"} | ${e.reason.replaceAll("|", "\\|")} |`,
  );
  return [
    `# E2B's SDK tests that do not run against sandboxd`,
    "",
    `<!-- rendered from tests/e2b-sdk/scope.ts; tests/style/e2b-sdk-scope.test.ts checks it -->`,
    "",
    `E2B's own JS SDK tests (\`packages/js-sdk/tests\` at \`${UPSTREAM.tag}\`) run against sandboxd from`,
    "tests/e2b-sdk/upstream/ (tests/e2e/e2b-sdk-suite.test.ts). These are left out, each for its reason;",
    "every other test runs, and a failure counts against tests/e2b-sdk/expected.json.",
    "",
    "| file (under packages/js-sdk/tests/) | test | why not |",
    "|---|---|---|",
    ...rows,
    "",
  ].join("\n");
}
