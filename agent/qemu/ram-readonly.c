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
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define READONLY_LIST "/etc/sandboxd/readonly-ram"
/* One absolute path: the jail's paths are the host's, which the agent keeps under PATH_MAX. */
#define PATH_BYTES 4096

static char readonly_path[PATH_BYTES];

/* Read once, before QEMU's main (and its seccomp filter) runs. */
__attribute__((constructor)) static void load_readonly_path(void) {
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
