/**
 * The skips `sandboxd test` accepts (cli/testing/run.ts): any other skipped test fails the run.
 * Each entry says why the test may skip and where. CI's machines (root, TCG, every package that
 * bin/sandboxd installs for the tests) skip none of them; a host without what an entry names does.
 */
import type { AllowedSkip } from "../cli/testing/plan.ts";

export const ALLOWED_SKIPS: AllowedSkip[] = [];
