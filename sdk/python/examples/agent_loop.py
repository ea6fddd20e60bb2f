"""The common agent loop on sandboxd: create a sandbox from a template, write files, run them,
stream a long step, fork to try N candidate fixes at once, keep the best branch, delete the rest.

The task: ``stats.py`` has a broken ``median``; ``check.py`` scores a candidate (tests passed).
Each fork gets one candidate, runs the checks, and the best-scoring fork carries on.

    SANDBOXD_URL=http://127.0.0.1:8080 SANDBOXD_API_KEY=svc_pro_... \\
        python3 examples/agent_loop.py --template python --branches 3
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import List, Tuple

from sandboxd import Sandbox, Sandboxd

BROKEN = '''def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]
'''

CHECK = '''import json
from stats import median

CASES = [([1], 1), ([3, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([5, 5, 1, 9], 5), ([-1, -2], -1.5), ([0.5, 1.5], 1.0)]
passed = 0
for xs, want in CASES:
    try:
        passed += median(list(xs)) == want
    except Exception:
        pass
print(json.dumps({"passed": passed, "total": len(CASES)}))
'''

#: Candidate fixes an agent might propose; only the last handles even lengths correctly.
CANDIDATES = [
    # keeps the bug: the upper middle for even lengths
    BROKEN,
    # averages, but off by one
    '''def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2] + xs[n // 2 + 1 if n > 2 else 0]) / 2
''',
    '''def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
''',
]


def score(sbx: Sandbox) -> int:
    r = sbx.exec("python3 check.py", cwd="/work")
    if r.exit_code != 0:
        return -1
    return int(json.loads(r.stdout)["passed"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--template", default="python")
    ap.add_argument("--branches", type=int, default=3)
    args = ap.parse_args()

    client = Sandboxd()
    with client.sandboxes.create(template=args.template, labels={"example": "agent-loop"}) as sbx:
        print(f"sandbox {sbx.id} from {args.template}")

        # Write the project, run it once as it is.
        sbx.files.write("/work/stats.py", BROKEN)
        sbx.files.write("/work/check.py", CHECK)
        print("files:", ", ".join(e.name for e in sbx.files.list("/work")))
        print("baseline passed:", score(sbx))

        # A longer step, streamed as it runs (a real agent would show this to its model or user).
        step = "for p in numpy-stub lint-stub; do echo preparing $p; sleep 0.3; done; echo ready >&2"
        for ev in sbx.exec_stream(step, cwd="/work"):
            if ev.type == "exit":
                print("prepare exited", ev.exit_code)
            else:
                print(f"  [{ev.type}] {ev.text.rstrip()}")

        # Try N candidates at once, each in its own copy-on-write fork of the prepared sandbox.
        n = max(1, min(args.branches, len(CANDIDATES)))
        branches = sbx.fork(count=n, labels=[f"candidate-{i}" for i in range(n)])

        def attempt(i_b: Tuple[int, Sandbox]) -> Tuple[int, Sandbox]:
            i, b = i_b
            b.files.write("/work/stats.py", CANDIDATES[i])
            return score(b), b

        with ThreadPoolExecutor(max_workers=n) as pool:
            results: List[Tuple[int, Sandbox]] = list(pool.map(attempt, enumerate(branches)))
        for i, (s, b) in enumerate(results):
            print(f"branch {i} {b.id}: passed {s}")

        # Keep the best, delete the rest.
        best_score, best = max(results, key=lambda r: r[0])
        for _, b in results:
            if b is not best:
                b.delete()
        with best:
            print(f"best: {best.id} passed {best_score} of 6")
            print("kept fix:\n" + best.files.read_text("/work/stats.py"))
            # The parent still has the broken file: forks do not share later writes.
            print("parent still passes", score(sbx))
    return 0 if best_score == 6 else 1


if __name__ == "__main__":
    sys.exit(main())
