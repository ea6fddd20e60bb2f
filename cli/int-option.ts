import { SandboxdError } from "../contracts/errors.ts";

/** An integer option of `min..max`, `def` when absent; anything else is `bad_request`. */
export function intOption(
  value: string | undefined,
  name: string,
  def: number,
  min: number,
  max: number,
): number {
  if (value === undefined) return def;
  const n = Number(value);
  if (!Number.isInteger(n) || n < min || n > max)
    throw new SandboxdError(
      "bad_request",
      `--${name} must be an integer from ${min} to ${max}, got ${value}`,
    );
  return n;
}
