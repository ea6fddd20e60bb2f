/**
 * The common agent loop with sandboxd: create a sandbox from a template, write the task's files,
 * run and stream a first attempt, then fork the sandbox into N branches that each try another
 * approach from the same state, keep the branch that scored best and delete the rest.
 *
 * The "task" is small so the example stays readable: make `solve.py` print the largest sum of a
 * contiguous run of numbers in `data.txt`; `score.py` checks an attempt and prints its score.
 * An agent would have a model write each attempt; here they are three fixed strategies.
 *
 *   SANDBOXD_URL=... SANDBOXD_API_KEY=... bun sdk/typescript/examples/agent-loop.ts
 *
 * Environment: SANDBOXD_TEMPLATE (default `python`), AGENT_BRANCHES (default 3).
 */
import { type Sandbox, Sandboxd } from "@sandboxd/sdk";

const template = process.env.SANDBOXD_TEMPLATE ?? "python";
const branches = Number(process.env.AGENT_BRANCHES ?? 3);

const TASK_FILES: Record<string, string> = {
  "/work/data.txt": "3 -4 5 -1 6 -9 2 8 -3 4\n",
  "/work/score.py": [
    "import subprocess, sys, time",
    "nums = [int(x) for x in open('/work/data.txt').read().split()]",
    "best = max(sum(nums[i:j]) for i in range(len(nums)) for j in range(i + 1, len(nums) + 1))",
    "t = time.time()",
    "out = subprocess.run([sys.executable, '/work/solve.py'], capture_output=True, text=True).stdout.strip()",
    "ms = (time.time() - t) * 1000",
    "ok = out == str(best)",
    "print(f'answer={out} expected={best} ok={ok}')",
    "print(f'score={100 if ok else 0}')",
    "",
  ].join("\n"),
};

/** The attempts a model would propose, one per branch (the first is also the initial try). */
const ATTEMPTS = [
  // wrong: the largest single number
  "nums = [int(x) for x in open('/work/data.txt').read().split()]\nprint(max(nums))\n",
  // right, O(n^2)
  "nums = [int(x) for x in open('/work/data.txt').read().split()]\n" +
    "print(max(sum(nums[i:j]) for i in range(len(nums)) for j in range(i + 1, len(nums) + 1)))\n",
  // right, Kadane
  "nums = [int(x) for x in open('/work/data.txt').read().split()]\n" +
    "best = cur = nums[0]\nfor x in nums[1:]:\n    cur = max(x, cur + x)\n    best = max(best, cur)\nprint(best)\n",
  // wrong: the sum of everything
  "nums = [int(x) for x in open('/work/data.txt').read().split()]\nprint(sum(nums))\n",
];

/** Writes an attempt into `sbx` and scores it, streaming the scorer's output as it comes. */
async function tryAttempt(sbx: Sandbox, name: string, code: string): Promise<number> {
  await sbx.files.write("/work/solve.py", code);
  let score = 0;
  for await (const ev of sbx.execStream("python3 /work/score.py")) {
    if (ev.type === "exit") continue;
    for (const line of ev.data.split("\n").filter(Boolean)) {
      console.log(`[${name}] ${ev.type}: ${line}`);
      const m = /^score=(\d+)$/.exec(line);
      if (m) score = Number(m[1]);
    }
  }
  return score;
}

const client = new Sandboxd();
const root = await client.sandboxes.create({ template, labels: { example: "agent-loop" } });
const made: Sandbox[] = [root];
try {
  // The task's files go in once; every branch forked later starts with them.
  for (const [path, content] of Object.entries(TASK_FILES)) await root.files.write(path, content);
  const first = await root.exec("python3 --version && ls /work");
  console.log(`root ${root.id}: ${first.stdout.trim().replaceAll("\n", " ")}`);
  const rootScore = await tryAttempt(root, "root", ATTEMPTS[0]!);
  console.log(`root attempt scored ${rootScore}`);

  // Fork: each child is a copy-on-write copy of the root as it is now (files, memory).
  const kids = await root.fork({ count: branches });
  made.push(...kids);
  const scores = await Promise.all(
    kids.map((kid, i) => tryAttempt(kid, `branch ${i + 1}`, ATTEMPTS[(i + 1) % ATTEMPTS.length]!)),
  );
  const bestIndex = scores.indexOf(Math.max(...scores));
  const best = kids[bestIndex]!;
  console.log(`scores: ${scores.join(", ")}; best: branch ${bestIndex + 1} (${best.id})`);

  // Keep the best branch, delete the rest (and the root, whose attempt lost).
  for (const sbx of made.filter((s) => s !== best)) await sbx.delete();
  made.splice(0, made.length, best);
  const kept = await best.files.readText("/work/solve.py");
  console.log(`kept ${best.id}; its solve.py has ${kept.split("\n").length - 1} lines`);
  const check = await best.exec("python3 /work/solve.py");
  console.log(`kept branch answers ${check.stdout.trim()}`);
} finally {
  // An example cleans up after itself; an agent would go on working in `best`.
  for (const sbx of made) await sbx.delete().catch(() => undefined);
}
console.log("done");
