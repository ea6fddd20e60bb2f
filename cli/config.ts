import { resolve } from "node:path";

export { defaultDataDir } from "./settings/environment.ts";

export const REPO_ROOT = resolve(import.meta.dir, "..");
