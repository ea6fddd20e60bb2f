// E2B's SDK (the unmodified `e2b` package from npm) against sandboxd. Run it with:
//
//   E2B_API_URL=http://localhost:8080/e2b \
//   E2B_SANDBOX_URL=http://localhost:8080/e2b/envd \
//   E2B_API_KEY=<an E2B-form key: bin/sandboxd key create ... then e2b_ + its hex> \
//   node examples/e2b-quickstart.mjs
//
// It creates a sandbox from the `base` template (E2B's default) with metadata, streams a
// command's output, writes and reads a file, finds the sandbox by its metadata, pauses it,
// connects (which resumes it), and kills it. It prints `ok` at the end and exits 1 on any error.
import { Sandbox } from "e2b";

const run = `quickstart-${Date.now()}`;
const sbx = await Sandbox.create({ metadata: { run } });
try {
  console.log("created", sbx.sandboxId);

  const lines = [];
  const result = await sbx.commands.run("for i in 1 2 3; do echo line $i; done; whoami", {
    onStdout: (data) => lines.push(data),
  });
  console.log("streamed:", JSON.stringify(lines.join("")));
  if (result.exitCode !== 0 || !result.stdout.includes("line 3")) throw new Error(`command: ${JSON.stringify(result)}`);

  await sbx.files.write("/home/user/hello.txt", "hello from e2b's sdk");
  const text = await sbx.files.read("/home/user/hello.txt");
  console.log("read back:", text);
  if (text !== "hello from e2b's sdk") throw new Error(`read ${JSON.stringify(text)}`);

  const found = await Sandbox.list({ query: { metadata: { run } } }).nextItems();
  console.log("listed by metadata:", found.map((s) => s.sandboxId).join(", "));
  if (!found.some((s) => s.sandboxId === sbx.sandboxId)) throw new Error("not listed by its metadata");

  await sbx.pause();
  console.log("paused; running:", await sbx.isRunning());
  const again = await Sandbox.connect(sbx.sandboxId);
  const after = await again.files.read("/home/user/hello.txt");
  console.log("connected (resumed); file still there:", after === text);
  if (after !== text) throw new Error("the file did not survive the pause");
} finally {
  await sbx.kill();
  console.log("killed");
}
console.log("ok");
