/**
 * The README's table of the settings, rendered from the declarations (a test checks README.md
 * carries it as written here, between its `settings-table` markers).
 */
import { SETTINGS, type SettingSpec } from "./table.ts";

/** Bytes as the README writes them: whole GiB or MiB where they are, else the count. */
function bytesText(n: number): string {
  if (n > 0 && n % 1024 ** 3 === 0) return `${n / 1024 ** 3} GiB`;
  if (n > 0 && n % 1024 ** 2 === 0) return `${n / 1024 ** 2} MiB`;
  return String(n);
}

function defaultAndRange(s: SettingSpec): [string, string] {
  switch (s.unit) {
    case "text":
      return [s.defText, s.rangeText];
    case "choice":
      return [s.def, s.choices.join(", ")];
    case "bytes":
      return [
        bytesText(s.def),
        s.max === Number.MAX_SAFE_INTEGER ? `${s.min}-2^53-1 bytes` : `${s.min}-${s.max}`,
      ];
    case "count":
      return [String(s.def), `${s.min}-${s.max}`];
    default:
      return [`${s.def} ${s.unit === "seconds" ? "s" : "ms"}`, `${s.min}-${s.max}`];
  }
}

export function settingsTable(): string {
  const rows = SETTINGS.map((s) => {
    const [def, range] = defaultAndRange(s);
    const flag = s.flag ? `\`--${s.flag}\`` : "none";
    return `| \`${s.env}\` | ${flag} | ${s.scope} | ${def} | ${range} | ${s.doc} |`;
  });
  return [
    "| environment variable and `--config` key | flag | used by | default | range | what |",
    "|---|---|---|---|---|---|",
    ...rows,
  ].join("\n");
}
