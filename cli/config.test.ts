import { expect, test } from "bun:test";
import { publicUrlOption } from "./config.ts";

test("--public-url wins over SANDBOXD_PUBLIC_URL; neither: none (connect URLs follow the request)", () => {
  const env = { SANDBOXD_PUBLIC_URL: "https://env.example.test" };
  expect(publicUrlOption("https://flag.example.test:8443/ignored/path", env)).toEqual({
    publicBaseUrl: "https://flag.example.test:8443",
  });
  expect(publicUrlOption(undefined, env)).toEqual({ publicBaseUrl: "https://env.example.test" });
  expect(publicUrlOption(undefined, {})).toEqual({});
  expect(publicUrlOption(undefined, { SANDBOXD_PUBLIC_URL: "" })).toEqual({});
});

test("a public URL that is not an http(s) or ws(s) URL is refused at start", () => {
  expect(() => publicUrlOption("not a url", {})).toThrow(/not a URL/);
  expect(() => publicUrlOption("ftp://x.example.test", {})).toThrow(/http\(s\)/);
});
