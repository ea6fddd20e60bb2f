/*
 * sandboxd: preloaded into every jailed QEMU (the jail's /etc/ld.so.preload names this library).
 *
 * A RAM file that other sandboxes start from (a template's, a fork point's) is mapped by each
 * child privately (`memory-backend-file,share=off`): the child's writes never reach the file.
 * QEMU 7.2 (Debian 12's) still opens that file O_RDWR; the `readonly=on,rom=off` pair that opens
 * it read-only and maps it writable-private arrived in QEMU 8.2. Holding it writable would let a
 * guest that escaped into its QEMU rewrite what every later child of that template (any tenant's,
 * for a catalog template) starts from.
 *
 * So this library turns QEMU's read-write open of exactly that one path, named by the agent in the
 * jail's /etc/sandboxd/readonly-ram (root's, on the jail's read-only root), into a read-only
 * open. A private mapping needs no write access to the file, so QEMU maps it as before. The shim
 * is not the fence: on the host the file is root's, mode 0444, and bound read-only into the jail,
 * so the read-write open would fail (EACCES, EROFS) without it; it only lets QEMU 7.2 start.
 * Every other open passes through unchanged.
 *
 * KSM of QEMU's own memory (the operator's SANDBOXD_KSM=qemu; the agent then writes the guest's
 * RAM size into the jail's /etc/sandboxd/ksm): the process asks the kernel to offer every
 * anonymous private mapping to KSM (PR_SET_MEMORY_MERGE, Linux 6.4+), and each mapping at least
 * as large as the guest's RAM (guest RAM itself, and its reservation) is taken back out at once
 * (MADV_UNMERGEABLE), before the guest runs: tenants' guest pages are never merged (QEMU runs
 * with mem-merge=off, so it never marks them again). tests/vm/ksm.test.ts shows both from
 * /proc/PID/smaps.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define READONLY_LIST "/etc/sandboxd/readonly-ram"
#define KSM_SETTING "/etc/sandboxd/ksm"
/* One absolute path: the jail's paths are the host's, which the agent keeps under PATH_MAX. */
#define PATH_BYTES 4096
/* Linux 6.4's prctl (older headers lack the name): every anonymous mapping of the process may merge. */
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif

static char readonly_path[PATH_BYTES];
/* With KSM on: the guest's RAM size; a mapping this large or larger is never offered to KSM. */
static size_t ksm_guard_bytes;

/* With SANDBOXD_KSM=qemu the agent wrote the guest's RAM size (a decimal byte count) there. */
static void load_ksm_setting(void) {
  char text[32];
  int fd = (int)syscall(SYS_openat, AT_FDCWD, KSM_SETTING, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ssize_t n = syscall(SYS_read, fd, text, sizeof text - 1);
  syscall(SYS_close, fd);
  if (n <= 0) return;
  text[n] = '\0';
  char *end;
  unsigned long long bytes = strtoull(text, &end, 10);
  if (end == text || bytes == 0) return;
  /* A kernel without it (before 6.4) refuses: nothing is then offered to KSM at all. */
  if (prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) == 0) ksm_guard_bytes = (size_t)bytes;
}

/* Read once, before QEMU's main (and its seccomp filter) runs. */
__attribute__((constructor)) static void load_readonly_path(void) {
  load_ksm_setting();
  int fd = (int)syscall(SYS_openat, AT_FDCWD, READONLY_LIST, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ssize_t n = syscall(SYS_read, fd, readonly_path, sizeof readonly_path - 1);
  syscall(SYS_close, fd);
  if (n <= 0 || readonly_path[0] != '/') {
    readonly_path[0] = '\0';
    return;
  }
  readonly_path[n] = '\0';
  char *nl = strchr(readonly_path, '\n');
  if (nl) *nl = '\0';
}

static int adjust(const char *path, int flags) {
  if (readonly_path[0] && path && (flags & O_ACCMODE) == O_RDWR && !(flags & O_CREAT) &&
      strcmp(path, readonly_path) == 0)
    return (flags & ~O_ACCMODE) | O_RDONLY;
  return flags;
}

static int do_openat(int dirfd, const char *path, int flags, mode_t mode) {
  return (int)syscall(SYS_openat, dirfd, path, adjust(path, flags), mode);
}

/* The mode argument is read only when the flags ask for one (O_CREAT, O_TMPFILE). */
#define MODE_ARG(flags, mode)                                                    \
  do {                                                                           \
    if ((flags) & (O_CREAT | __O_TMPFILE)) {                                     \
      va_list ap;                                                                \
      va_start(ap, flags);                                                       \
      mode = va_arg(ap, mode_t);                                                 \
      va_end(ap);                                                                \
    }                                                                            \
  } while (0)

int open(const char *path, int flags, ...) {
  mode_t mode = 0;
  MODE_ARG(flags, mode);
  return do_openat(AT_FDCWD, path, flags, mode);
}

int open64(const char *path, int flags, ...) {
  mode_t mode = 0;
  MODE_ARG(flags, mode);
  return do_openat(AT_FDCWD, path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...) {
  mode_t mode = 0;
  MODE_ARG(flags, mode);
  return do_openat(dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...) {
  mode_t mode = 0;
  MODE_ARG(flags, mode);
  return do_openat(dirfd, path, flags, mode);
}

/* _FORTIFY_SOURCE's checked entry points (QEMU calls __open64_2 where its flags are not constant). */
int __open_2(const char *path, int flags) { return do_openat(AT_FDCWD, path, flags, 0); }
int __open64_2(const char *path, int flags) { return do_openat(AT_FDCWD, path, flags, 0); }
int __openat_2(int dirfd, const char *path, int flags) { return do_openat(dirfd, path, flags, 0); }
int __openat64_2(int dirfd, const char *path, int flags) { return do_openat(dirfd, path, flags, 0); }

/*
 * With KSM on, every new mapping is offered to KSM (the prctl above); guest RAM is taken back out
 * here, right after QEMU maps it: the one mapping (and its reservation) at least the guest's size.
 * QEMU's other mappings (its heap arenas, thread stacks, TCG's buffer below the guest's size) stay
 * offered. A failed madvise fails the mmap: QEMU then exits rather than run a guest whose pages
 * could merge with another tenant's.
 */
static void *guarded(void *p, size_t len) {
  if (p == MAP_FAILED || ksm_guard_bytes == 0 || len < ksm_guard_bytes) return p;
  if (syscall(SYS_madvise, p, len, MADV_UNMERGEABLE) != 0) {
    syscall(SYS_munmap, p, len);
    return MAP_FAILED;
  }
  return p;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
  return guarded((void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off), len);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
  return mmap(addr, len, prot, flags, fd, off);
}
