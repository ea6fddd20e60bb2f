/**
 * The bounds on what an imported image may cost the host, and the running count (the Budget)
 * that the scan charges while it streams, so a limit stops the read as soon as it is crossed.
 */
import { SandboxdError } from "../../contracts/errors.ts";
import { ImageError } from "./errors.ts";

export interface ImportLimits {
  /**
   * Total bytes of decompressed layer streams. 8 GiB: larger than any image we mean to run as a
   * sandbox template (a full CUDA/PyTorch image is ~6-8 GiB unpacked), small enough that a gzip
   * bomb (1000:1 for zeros) is stopped before it fills the host's disk; counted while streaming,
   * so the scan aborts as soon as the limit is crossed.
   */
  maxUnpackedBytes: number;
  /** Tar entries over the archive and all layers: bounds the scan's time and the rootfs' inodes. */
  maxEntries: number;
  /** Layers per image: overlay-based runtimes stop at 127-128; more is abuse, not an image. */
  maxLayers: number;
  /** manifest.json / index.json / manifests / configs are held in memory: 4 MiB is 100x a real one. */
  maxMetadataBytes: number;
  /** One entry name or link target: Linux PATH_MAX. */
  maxPathBytes: number;
}

export const DEFAULT_IMPORT_LIMITS: ImportLimits = {
  maxUnpackedBytes: 8 * 1024 ** 3,
  maxEntries: 1_000_000,
  maxLayers: 128,
  maxMetadataBytes: 4 * 1024 ** 2,
  maxPathBytes: 4096,
};

/** What the scan has used so far, against the limits (layers and archive together). */
export interface Budget {
  limits: ImportLimits;
  bytes: number;
  entries: number;
  /** The import's cancel (its template deleted): every charge checks it. */
  signal?: AbortSignal | undefined;
}

/**
 * Throws `gone` once `signal` has aborted. The in-process stages call it per chunk read and per
 * entry or directory walked (through the Budget's charges), and the pipeline between stages, so a
 * cancelled import stops within one chunk (256 KiB) instead of running to its end.
 */
export function stopIfCancelled(signal: AbortSignal | undefined): void {
  if (signal?.aborted) throw new SandboxdError("gone", "the image import was cancelled");
}

export function chargeBytes(b: Budget, n: number): void {
  stopIfCancelled(b.signal);
  b.bytes += n;
  if (b.bytes > b.limits.maxUnpackedBytes) {
    throw new ImageError(
      "image_too_large",
      `image unpacks to more than ${b.limits.maxUnpackedBytes} bytes (the import limit); stopped reading`,
      { details: { limit: "maxUnpackedBytes", value: b.limits.maxUnpackedBytes } },
    );
  }
}

export function chargeEntry(b: Budget): void {
  stopIfCancelled(b.signal);
  b.entries += 1;
  if (b.entries > b.limits.maxEntries) {
    throw new ImageError(
      "image_too_large",
      `image has more than ${b.limits.maxEntries} tar entries (the import limit)`,
      {
        details: { limit: "maxEntries", value: b.limits.maxEntries },
      },
    );
  }
}
